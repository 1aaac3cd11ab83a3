"""Aliased operands (one tensor passed twice, or a view of another operand) under tfun.jit.

JAX programs pass the same array in two places freely (`scan(cell, (h0, h0), xs)`, an LSTM's
zero state); torch's HOPs refuse aliased operands. Every op must give eager's outputs and
gradients (the float64 eager result is the oracle), with aot_eager and with Inductor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import tfun
from tfun import lax
from tfun.tree import tree_leaves


def _scan_pair(x: torch.Tensor) -> Any:
    def cell(c: Any, xx: torch.Tensor) -> Any:
        h, s = c
        s = torch.tanh(xx + h) + 0.5 * s
        h = torch.sigmoid(s)
        return (h, s), h

    return lax.scan(cell, (x[0], x[0]), x)


def _scan_view_of_xs(x: torch.Tensor) -> Any:
    return lax.scan(lambda c, xx: (torch.sin(c) + xx, c * xx), x[0], x, reverse=True)


def _fori_pair(x: torch.Tensor) -> Any:
    return lax.fori_loop(0, 3, lambda i, c: (torch.sin(c[0]) + c[1], c[1] * 0.5), (x, x))


def _while_pair(x: torch.Tensor) -> Any:
    return lax.while_loop(lambda c: c[2] < 3, lambda c: (c[0] * 0.5 + c[1], torch.cos(c[1]), c[2] + 1), (x, x, torch.tensor(0)))


def _map_pair(x: torch.Tensor) -> Any:
    return lax.map(lambda p: p[0] * torch.sin(p[1]), (x, x))


def _assoc_pair(x: torch.Tensor) -> Any:
    a = torch.sigmoid(x)
    return lax.associative_scan(lambda p, q: (p[0] * q[0], p[1] * q[0] + q[1]), (a, a))


def _cond_pair(x: torch.Tensor) -> Any:
    return lax.cond(x.sum() > 0, lambda a, b: (a * b, b), lambda a, b: (a, torch.sin(b)), x, x)


OPS: list[Callable[[torch.Tensor], Any]] = [_scan_pair, _scan_view_of_xs, _fori_pair, _while_pair, _map_pair, _assoc_pair, _cond_pair]
GRAD = {_scan_pair, _scan_view_of_xs, _fori_pair, _map_pair, _assoc_pair, _cond_pair}  # while_loop: forward only (as in JAX)


def _loss(out: Any) -> torch.Tensor:
    return sum((t.float() ** 2).sum() for t in tree_leaves(out) if t.is_floating_point())  # type: ignore[return-value]


# CI's second torch phase keeps every op on aot_eager and a scan and a cond on Inductor (`heavy`)
_HEAVY_INDUCTOR = {"_assoc_pair", "_fori_pair", "_map_pair", "_scan_view_of_xs"}


@pytest.mark.parametrize(
    ("fn", "backend"),
    [
        pytest.param(
            f, b, id=f"{f.__name__.lstrip('_')}-{b}",
            marks=[pytest.mark.heavy] if (b == "inductor" and f.__name__ in _HEAVY_INDUCTOR) else [],
        )
        for f in OPS
        for b in ["aot_eager", "inductor"]
    ],
)
def test_aliased_operands_match_eager_float64(fn: Callable[[torch.Tensor], Any], backend: str) -> None:
    x64 = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    want_x = x64.clone().requires_grad_(True)
    want = fn(want_x)
    x = x64.float().requires_grad_(True)
    got = tfun.jit(fn, backend=backend)(x)
    for g, w in zip(tree_leaves(got), tree_leaves(want)):
        torch.testing.assert_close(g, w.detach().to(g.dtype), rtol=1e-4, atol=1e-5)
    if fn in GRAD:
        (want_g,) = torch.autograd.grad(_loss(want), want_x)
        (got_g,) = torch.autograd.grad(_loss(got), x)
        torch.testing.assert_close(got_g, want_g.float(), rtol=1e-4, atol=1e-5)


def test_lstm_style_training_step_with_a_shared_zero_state() -> None:
    # the pattern that failed: tfun.jit(tfun.grad(loss)) with scan(cell, (h0, h0), xs)
    g = torch.Generator().manual_seed(1)
    W = torch.randn(4, 4, generator=g, dtype=torch.float64)
    xs = torch.randn(6, 2, 4, generator=g, dtype=torch.float64)
    h0 = torch.zeros(2, 4, dtype=torch.float64)

    def loss(W: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        def cell(c: Any, x: torch.Tensor) -> Any:
            h, s = c
            s = torch.tanh(x @ W + h) + s
            h = torch.sigmoid(s)
            return (h, s), h

        return (lax.scan(cell, (h0, h0), xs)[1] ** 2).mean()

    want = tfun.grad(loss)(W, xs)
    for backend in ("aot_eager", "inductor"):
        torch.testing.assert_close(tfun.jit(tfun.grad(loss), backend=backend)(W, xs), want)
