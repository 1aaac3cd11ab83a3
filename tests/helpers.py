"""Shared test helpers: tree comparison, and a corpus of sample pytrees."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any, Callable

import numpy as np
import torch
from hypothesis import strategies as st

import tfun
from tfun.tree import (
    keystr,
    register_dataclass,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_structure,
)


def tree_allclose(x: Any, y: Any, *, rtol: float = 1e-5, atol: float = 1e-6, equal_nan: bool = True) -> bool:
    """Same structure, and every pair of leaves close (tensors) or equal (anything else)."""
    if tree_structure(x) != tree_structure(y):
        return False
    for a, b in zip(tree_leaves(x), tree_leaves(y)):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            a = torch.as_tensor(a)
            b = torch.as_tensor(b)
            if a.shape != b.shape or a.dtype != b.dtype:
                return False
            if a.dtype == torch.bool or not (a.is_floating_point() or a.is_complex()):
                if not torch.equal(a, b):
                    return False
            elif not torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan):
                return False
        elif a != b:
            return False
    return True


def assert_tree_allclose(x: Any, y: Any, **kw: Any) -> None:
    if tree_structure(x) != tree_structure(y):
        raise AssertionError(f"structures differ:\n  {tree_structure(x)}\n  {tree_structure(y)}")
    for i, (a, b) in enumerate(zip(tree_leaves(x), tree_leaves(y))):
        if not tree_allclose(a, b, **kw):
            raise AssertionError(f"leaf {i} differs:\n{a}\n{b}")


Point = collections.namedtuple("Point", ["x", "y"])


@register_dataclass
@dataclasses.dataclass
class State:
    h: Any
    c: Any
    tag: str = dataclasses.field(default="s", metadata={"static": True})


def sample_trees(make: Any) -> list[Any]:
    """Sample pytree structures with leaves made by `make(i)` (the shared corpus)."""
    return [
        make(0),
        (make(0),),
        [make(0), make(1)],
        {"a": make(0), "b": (make(1), [make(2)])},
        Point(make(0), make(1)),
        State(make(0), {"k": make(1)}),
        {"h": (make(0), None), "n": Point(make(1), [make(2), make(3)])},
    ]


def to_numpy_tree(x: Any) -> Any:
    return tfun.tree.tree_map(lambda t: t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t, x)


def assert_grads_close(got: Any, want: Any, *, rtol: float, atol: float) -> None:
    """Two tuples of gradients (as torch.autograd.grad returns them): the same length,
    None in the same places (allow_unused=True), and the rest close."""
    assert len(got) == len(want), (len(got), len(want))
    for u, v in zip(got, want):
        assert (u is None) == (v is None)
        if u is not None:
            torch.testing.assert_close(u, v, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------------------
# Random pytree structures for hypothesis: templates whose leaves say what to put there
# ("t": a tensor, "i": a Python int, "f": a Python float), made concrete by `materialize`.
# ----------------------------------------------------------------------------------------


def structures(leaf: st.SearchStrategy[str] = st.just("t"), max_leaves: int = 4) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaf,
        lambda kids: st.one_of(
            st.tuples(kids),
            st.lists(kids, min_size=0, max_size=2),
            st.dictionaries(st.sampled_from("abc"), kids, max_size=2),
            st.builds(Point, kids, kids),
            st.builds(State, kids, kids),
            st.tuples(kids, st.none()),
        ),
        max_leaves=max_leaves,
    )


_TRAILING = [(), (2,), (1, 3)]

DTYPES = st.sampled_from([torch.float32, torch.float64, torch.int64])


def materialize(
    template: Any,
    dtype: torch.dtype,
    seed: int,
    *,
    lead: tuple[int, ...] = (),
    shape: tuple[int, ...] | Callable[[int], Any] | None = None,
    int_range: tuple[int, int] = (-3, 4),
) -> Any:
    """The leaves of a `structures()` template, drawn from a generator seeded with `seed`.

    The k-th tensor leaf ("t") has shape `(*lead, *_TRAILING[k % 3])`, or `shape` where
    given (one shape for every leaf, or a function of k); integer tensors are drawn from
    `int_range` (low inclusive, high exclusive). "i" and "f" leaves are Python scalars.
    """
    g = torch.Generator().manual_seed(seed)
    counter = itertools.count()

    def make(kind: str) -> Any:
        k = next(counter)
        if kind == "i":
            return int(torch.randint(-3, 4, (), generator=g))
        if kind == "f":
            return float(torch.randn((), generator=g))
        if shape is None:
            s = (*lead, *_TRAILING[k % 3])
        else:
            s = shape(k) if callable(shape) else shape
        if dtype.is_floating_point:
            return torch.randn(s, generator=g, dtype=dtype)
        return torch.randint(*int_range, s, generator=g, dtype=dtype)

    return tree_map(make, template)


def as_tensor(v: Any) -> torch.Tensor:
    """The documented rule for Python scalars in carries and operands: int -> int64, float -> float32."""
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    return torch.tensor(v, dtype=torch.float32)


# ----------------------------------------------------------------------------------------
# JAX as a differential oracle (the `jax` fixture is in tests/lax/conftest.py)
# ----------------------------------------------------------------------------------------


def assert_matches_jax(ours: Any, theirs: Any, *, rtol: float = 1e-12, atol: float = 1e-12) -> None:
    """Same leaves at the same key paths (keystr), with the same dtypes and shapes and close values."""
    import jax

    ours_p, _ = tree_flatten_with_path(ours)
    theirs_p, _ = jax.tree_util.tree_flatten_with_path(theirs)
    assert [keystr(p) for p, _ in ours_p] == [jax.tree_util.keystr(p) for p, _ in theirs_p]
    for (p, a), (_, b) in zip(ours_p, theirs_p):
        a = a.detach().numpy()
        b = np.asarray(b)
        assert a.dtype == b.dtype, (keystr(p), a.dtype, b.dtype)
        assert a.shape == b.shape, (keystr(p), a.shape, b.shape)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=keystr(p))


__all__ = [
    "tree_allclose",
    "assert_tree_allclose",
    "assert_grads_close",
    "Point",
    "State",
    "sample_trees",
    "to_numpy_tree",
    "tree_flatten",
    "structures",
    "DTYPES",
    "materialize",
    "as_tensor",
    "assert_matches_jax",
]


def assert_jit_value_and_grad_match_eager(f: Any, args: tuple[Any, ...], wrt: Any, backend: str = "aot_eager") -> None:
    """`tfun.jit(f, backend=backend)(*args)` ("inductor": tfun.jit's default) and the gradient of
    its sum in `wrt` (a tensor or a list of them) equal `f`'s run eagerly."""
    import tfun

    wrt = list(wrt) if isinstance(wrt, (list, tuple)) else [wrt]
    want = f(*args)
    want_g = torch.autograd.grad(want.sum(), wrt)
    got = (tfun.jit(f) if backend == "inductor" else tfun.jit(f, backend=backend))(*args)
    got_g = torch.autograd.grad(got.sum(), wrt)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)
