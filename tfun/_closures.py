"""Tensors a function reads through its closure cells, and rebinding those cells for a call.

Two tfun ops need to hand a user function other versions of the tensors it closes over
than the ones in its cells: `custom_jvp`/`custom_vjp` under `torch.func` (the tensors must
be inputs of the `autograd.Function`, see `_custom_derivatives._Captures`) and `cond` /
`switch` with a batched predicate (each branch sees its closed-over tensors with their
gradient stopped for the examples that do not take it, see `lax._cond`). Only cells are
seen: a cell holding a tensor, or a tuple/list/dict of tensors, of the function or of the
plain functions (and `functools.partial`s, bound methods) it closes over, recursively. No
tfun imports beyond the pytree layer: every layer may use it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._tree import tree_flatten, tree_unflatten

__all__ = ["ClosureCells", "Rebound"]

_MAX_DEPTH = 8


class ClosureCells:
    """The cells reachable from `roots` that hold tensors `want` selects.

    `tensors`: those tensors, each once (by identity). `cells`: one entry per cell, to
    rebuild its value with other tensors in their place (`Rebound`). `expand(obj)` may
    return further functions to look into for an object that is not a plain function (or
    None).
    """

    def __init__(
        self,
        roots: Sequence[Any],
        want: Callable[[torch.Tensor], bool],
        expand: Callable[[Any], Sequence[Any] | None] | None = None,
    ) -> None:
        self.want = want
        self.expand = expand
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        # (cell, treedef or None for a bare tensor, leaves, [(leaf position, tensor index)])
        self.cells: list[tuple[Any, Any, list[Any], list[tuple[int, int]]]] = []
        seen: set[int] = set()
        for r in roots:
            self._scan(r, seen, 0)

    def leaves(self, value: Any) -> tuple[Any, list[Any], list[tuple[int, int]]] | None:
        """`value`'s wanted tensors, registered in `tensors`: (treedef, leaves, positions),
        or None where it holds none."""
        if isinstance(value, torch.Tensor):
            leaves, td = [value], None
        elif isinstance(value, (tuple, list, dict)):
            leaves, td = tree_flatten(value)
        else:
            return None
        pos = []
        for k, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and self.want(x):
                if id(x) not in self._index:
                    self._index[id(x)] = len(self.tensors)
                    self.tensors.append(x)
                pos.append((k, self._index[id(x)]))
        return (td, leaves, pos) if pos else None

    def _scan(self, fn: Any, seen: set[int], depth: int) -> None:
        if fn is None or id(fn) in seen or depth > _MAX_DEPTH:
            return
        seen.add(id(fn))
        more = self.expand(fn) if self.expand is not None else None
        if more is not None:
            for f in more:
                self._scan(f, seen, depth + 1)
            return
        if isinstance(fn, functools.partial):
            self._scan(fn.func, seen, depth + 1)
            return
        fn = getattr(fn, "__func__", fn)  # bound methods
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            found = self.leaves(value)
            if found is not None:
                self.cells.append((cell, *found))
            elif callable(value):
                self._scan(value, seen, depth + 1)


def rebuild(td: Any, leaves: list[Any], pos: list[tuple[int, int]], values: Sequence[Any]) -> Any:
    """A cell's (or argument's) value with `values[i]` in place of its i-th found tensor."""
    new = list(leaves)
    for k, i in pos:
        new[k] = values[i]
    return new[0] if td is None else tree_unflatten(td, new)


class Rebound:
    """While inside: each cell of `found` holds its value with `values` in place of
    `found.tensors`; the old values are restored on exit. Cells are shared objects: another
    thread running a function with such a cell at that moment sees the rebound value."""

    def __init__(self, found: ClosureCells | None, values: Sequence[Any]) -> None:
        self.found, self.values = found, values

    def __enter__(self) -> None:
        if self.found is None:
            return
        self.old = [c.cell_contents for c, *_ in self.found.cells]
        for cell, td, leaves, pos in self.found.cells:
            cell.cell_contents = rebuild(td, leaves, pos, self.values)

    def __exit__(self, *exc: object) -> None:
        if self.found is None:
            return
        for (cell, *_), old in zip(self.found.cells, self.old):
            cell.cell_contents = old
