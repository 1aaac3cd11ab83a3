"""Every `tfun.nn` layer under the functorch transforms, against a plain per-example loop.

Per-example gradients (`tfun.vmap(tfun.grad(loss))` over a batch, the parameters shared through
`torch.func.functional_call`) must equal the gradient of each example's loss taken alone, and
forward mode (`tfun.jvp` in the parameters) must equal the directional derivative computed by
reverse mode. float64, so any difference beyond rounding is a bug.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import tfun

from .test_nn_jit import LAYERS

DT = torch.float64
F = 3


def _loss_of(layer):
    def loss(params, x):
        out = functional_call(layer, params, (x,))
        y = out[0] if isinstance(out, tuple) else out
        y = tfun.tree.tree_leaves(y)[0] if not isinstance(y, torch.Tensor) else y
        return (y * torch.linspace(-1, 1, y.numel(), dtype=DT).reshape(y.shape)).sum()

    return loss


def _setup(name):
    torch.manual_seed(0)
    layer = LAYERS[name]()
    params = {k: v.detach() for k, v in layer.named_parameters()}
    xs = torch.randn(3, 2, 5, F, dtype=DT, generator=torch.Generator().manual_seed(1))
    return layer, params, xs


@pytest.mark.parametrize("name", [n for n in LAYERS if n != "cells"])
def test_per_example_gradients_match_a_loop(name):
    layer, params, xs = _setup(name)
    loss = _loss_of(layer)
    got = tfun.vmap(tfun.grad(loss), in_axes=(None, 0))(params, xs)
    for k in range(xs.shape[0]):
        want = tfun.grad(loss)(params, xs[k])
        for n in params:
            torch.testing.assert_close(got[n][k], want[n], rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}.{n} example {k}: {m}")


@pytest.mark.parametrize("name", [n for n in LAYERS if n != "cells"])
def test_forward_mode_in_the_parameters_matches_reverse_mode(name):
    layer, params, xs = _setup(name)
    loss = _loss_of(layer)
    g = torch.Generator().manual_seed(2)
    tangent = {n: torch.randn(p.shape, dtype=DT, generator=g) for n, p in params.items()}
    _, directional = tfun.jvp(lambda p: loss(p, xs[0]), (params,), (tangent,))
    grads = tfun.grad(loss)(params, xs[0])
    want = sum((grads[n] * tangent[n]).sum() for n in params)
    torch.testing.assert_close(directional, want, rtol=1e-9, atol=1e-12)
