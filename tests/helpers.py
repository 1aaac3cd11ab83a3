"""Shared test helpers: tree comparison, and a corpus of sample pytrees."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch

import tfun
from tfun.tree import register_dataclass, tree_flatten, tree_leaves, tree_structure


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


__all__ = ["tree_allclose", "assert_tree_allclose", "Point", "State", "sample_trees", "to_numpy_tree", "tree_flatten"]
