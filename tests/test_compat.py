"""tfun/_compat.py: the answers its helpers give in code that Dynamo traces match plain Python's."""

from __future__ import annotations

import collections

import pytest
import torch

from tfun import _compat
from tfun._tree import tree_structure

_Pair = collections.namedtuple("_Pair", "a b")


def _trees(x: torch.Tensor) -> list[object]:
    return [
        x,
        (x, x),
        [x, x],
        {"a": x, "b": (x, None)},
        {"a": x, "c": (x, None)},
        {"a": x, "b": [x, None]},
        _Pair(x, {"h": x}),
        _Pair(x, {"h": (x,)}),
        (x, {"a": x, "b": [x, None]}, _Pair(x, x)),
    ]


def test_same_treedef_under_dynamo_answers_as_eq_does():
    # Dynamo 2.11 cannot trace `==` between two treedefs (a polyfill for the functions its
    # stand-in treedef holds); `same_treedef` must answer as `==` does, traced or not
    n = len(_trees(torch.ones(1)))

    def table(x: torch.Tensor) -> list[bool]:
        specs = [tree_structure(t) for t in _trees(x)]
        return [_compat.same_treedef(a, b) for a in specs for b in specs]

    expected = [a == b for a in map(tree_structure, _trees(torch.ones(1))) for b in map(tree_structure, _trees(torch.ones(1)))]
    assert expected.count(True) == n  # the trees are pairwise different
    traced = torch.compile(table, backend="eager", fullgraph=True)(torch.ones(1))
    assert traced == expected
    assert table(torch.ones(1)) == expected


def test_dynamo_code_name_is_the_name_where_dynamo_keys_by_closure():
    import torch._dynamo.pgo as pgo

    name = _compat.dynamo_code_name("tfun_jit_call")
    if "closure_hash" in pgo.CodeId.__dataclass_fields__:
        assert name == "tfun_jit_call"
    else:
        assert name.startswith("tfun_jit_call") and name != "tfun_jit_call"
        assert _compat.dynamo_code_name("tfun_jit_call") != name


def test_one_jit_functions_shapes_do_not_make_anothers_sizes_symbolic():
    # torch 2.11 kept Dynamo's automatic-dynamic state per (file, line, name) of tfun.jit's
    # frame, shared by every tfun.jit function: after `a` saw (3,), `b`'s first compile at (2,)
    # had symbolic sizes and its carry mismatch failed to compile instead of raising tfun's
    # error (see `_compat.dynamo_code_name`)
    import tfun
    from tfun import lax
    from tfun.errors import StructureMismatchError

    def a(x):
        return lax.scan(lambda c, x: (c + x, x), x[0], x)

    def b(x):
        return lax.while_loop(lambda c: c.sum() < 10, lambda c: (c, c), x)

    tfun.jit(a, backend="eager")(torch.ones(3))
    with pytest.raises(StructureMismatchError, match=r"carry: input is a leaf, output is a tuple of 2"):
        tfun.jit(b, backend="eager")(torch.ones(2))


def test_cond_autograd_fixes_is_idempotent_and_keeps_values():
    """The wrapped `CondAutogradOp.backward` is installed once, and eager cond gradients are
    unchanged by it (the branch gradients are only made contiguous)."""
    from torch._higher_order_ops.cond import CondAutogradOp

    _compat.cond_autograd_fixes()
    first = CondAutogradOp.backward
    _compat.cond_autograd_fixes()
    assert CondAutogradOp.backward is first
    x = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([2.0, 3.0], dtype=torch.float64, requires_grad=True)
    y = torch.cond(torch.tensor(False), lambda x, w: torch.sin(x), lambda x, w: x * w.sum(), (x, w))
    gx, gw = torch.autograd.grad((y * torch.tensor([1.0, 2.0], dtype=y.dtype)).sum(), (x, w))
    torch.testing.assert_close(gx, torch.tensor([5.0, 10.0], dtype=torch.float64))
    torch.testing.assert_close(gw, torch.full((2,), 0.5 * 1 + -1.0 * 2, dtype=torch.float64))
