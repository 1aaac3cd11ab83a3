"""What a compiled scan's backward saves of the tensors its body closes over.

torch's scan autograd partitions the body and stacks, step by step, what the backward step
reads. For `h @ W` the backward reads `W.t()`, which torch's partitioner saved as a per-step
intermediate: a `(length, *W.shape)` stack of identical copies, written by the forward and
flipped by the backward (tfun.jit of an RNN's gradient ran slower than eager). tfun recomputes
such view-like intermediates in the backward step (`_compat.scan_autograd_fixes`, fix 3). The
gradients must stay eager's (the float64 eager result is the oracle).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tfun
from tfun import lax

T, B, H, I = (
    7,
    3,
    5,
    4,
)  # distinct sizes, so a (T, H, H) or (T, H, I) stack is recognisable


def _graph_shapes(backend_graphs: list[torch.fx.GraphModule]) -> set[tuple[int, ...]]:
    shapes = set()
    for gm in backend_graphs:
        for mod in gm.modules():
            if not isinstance(mod, torch.fx.GraphModule):
                continue
            for node in mod.graph.nodes:
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor):
                    shapes.add(tuple(val.shape))
    return shapes


def _capturing_backend(graphs: list[torch.fx.GraphModule]) -> Any:
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=capture, bw_compiler=capture)


def _rnn_loss(
    W: torch.Tensor, U: torch.Tensor, xs: torch.Tensor, h0: torch.Tensor
) -> torch.Tensor:
    def cell(h: torch.Tensor, x: torch.Tensor) -> Any:
        n = torch.tanh(
            h @ W + x @ U.t()
        )  # W closed over as (H, H), U as (H, I), x a (B, I) slice
        return n, n

    h, ys = lax.scan(cell, h0, xs)
    return ys.sum() + (h * h).sum()


def _data(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    W = torch.randn(H, H, generator=g, dtype=torch.float64) / H**0.5
    U = torch.randn(H, I, generator=g, dtype=torch.float64)
    xs = torch.randn(T, B, I, generator=g, dtype=torch.float64)
    h0 = torch.randn(B, H, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (W, U, xs, h0))


@pytest.mark.parametrize("how", ["tfun.grad", "backward"])
def test_no_per_step_copy_of_closed_over_weights_and_gradients_are_eager(
    how: str,
) -> None:
    graphs: list[torch.fx.GraphModule] = []
    backend = _capturing_backend(graphs)
    oracle = tfun.grad(_rnn_loss, argnums=(0, 1, 2, 3))(*_data(torch.float64))
    args = _data(torch.float32)
    if how == "tfun.grad":
        got = tfun.jit(tfun.grad(_rnn_loss, argnums=(0, 1, 2, 3)), backend=backend)(
            *args
        )
    else:
        leaves = [a.clone().requires_grad_(True) for a in args]
        tfun.jit(_rnn_loss, backend=backend)(*leaves).backward()
        got = tuple(a.grad for a in leaves)
    for g, o in zip(got, oracle):
        torch.testing.assert_close(g, o.to(torch.float32), rtol=1e-4, atol=1e-5)
    shapes = _graph_shapes(graphs)
    assert (T, B, H) in shapes  # the per-step stacks the backward needs are there
    assert (
        (T, H, H) not in shapes and (T, I, H) not in shapes and (T, H, I) not in shapes
    )
