"""Gradients under tfun.jit where a control-flow op's input does not require grad.

These are the cases torch 2.11's HOP autograd got wrong and `tfun/_compat.py` absorbs
(`scan_autograd_fixes`, `while_loop_autograd_fixes`, `is_exporting`): an integer or constant
`xs` (fori_loop's index), a constant `init`, an integer carry, and the expanded (stride-0)
gradient of `out.sum()` reaching a while_loop's backward. Each is checked against eager, by
`tfun.grad` inside the jitted function and by `.backward()` after a jitted forward.
"""

from __future__ import annotations

import pytest
import torch

import tfun
from tfun import _compat, lax

pytestmark = [pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")]

_C = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(4, 3)


def _scan_constant_xs(x):
    return lax.scan(lambda c, xt: (torch.tanh(c + xt), c.sum()), x[0], _C)


def _scan_integer_xs(x):
    return lax.scan(lambda c, i: (torch.tanh(c * 1.1 + i), c.sum()), x[0], torch.arange(4))


def _scan_constant_init(x):
    return lax.scan(lambda c, xt: (torch.tanh(c + xt), c.sum()), _C[0], x)


def _scan_integer_carry(x):
    return lax.scan(lambda c, xt: ((c[0] + 1, torch.tanh(c[1] + xt * c[0])), c[1].sum()), (torch.tensor(0), x[0]), x)


def _fori_static(x):
    return lax.fori_loop(0, 3, lambda i, c: torch.tanh(c * 1.1 + i), x)


def _fori_traced_bound(x):
    return lax.fori_loop(0, (x.sum() > 0).long() + 3, lambda i, c: torch.tanh(c * 1.1 + i), x)


def _while(x):
    return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, torch.tanh(c[1] * 1.1)), (torch.tensor(0), x))[1]


CASES = {
    "scan-constant-xs": _scan_constant_xs,
    "scan-integer-xs": _scan_integer_xs,
    "scan-constant-init": _scan_constant_init,
    "scan-integer-carry": _scan_integer_carry,
    "fori_loop": _fori_static,
    "fori_loop-traced-bound": _fori_traced_bound,
    "while_loop": _while,
}


def _total(out):
    return sum(t.sum() for t in tfun.tree.tree_leaves(out))


@pytest.mark.parametrize("mode", ["tfun.grad", "backward"])
@pytest.mark.parametrize("name", list(CASES))
def test_jit_gradient_matches_eager(name, mode):
    op = CASES[name]
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = tfun.grad(lambda y: _total(op(y)))(x)
    if mode == "tfun.grad":
        got = tfun.jit(lambda y: tfun.grad(lambda z: _total(op(z)))(y), backend="aot_eager")(x)
    else:
        xx = x.clone().requires_grad_()
        _total(tfun.jit(op, backend="aot_eager")(xx)).backward()
        got = xx.grad
    torch.testing.assert_close(got, want)


def test_is_exporting_is_false_under_jit_and_true_under_export():
    seen = []

    def f(x):
        seen.append(_compat.is_exporting())
        return x + 1

    tfun.jit(f, backend="aot_eager")(torch.ones(2))
    assert seen == [False]

    class M(torch.nn.Module):
        def forward(self, x):
            return f(x)

    seen.clear()
    torch.export.export(M(), (torch.ones(2),), strict=False)
    assert seen and all(seen)
