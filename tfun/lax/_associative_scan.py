"""`associative_scan`: an inclusive prefix scan with an associative operator, in log depth."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .. import _funcinfo, _rules
from .._errors import ArgumentValueError, format_message
from .._tree import PyTreeSpec, tree_flatten, tree_unflatten
from . import _hop
from ._scan import xs_leaves

T = TypeVar("T")


def associative_scan(fn: Callable[[T, T], T], elems: T, reverse: bool = False, axis: int = 0) -> T:
    """Inclusive scan of `elems` along `axis` with the associative operator `fn`.

    Semantics, as a Python function (JAX's `lax.associative_scan`; `fn` need not be
    commutative, and the order of its arguments is JAX's):

    ```python
    def associative_scan(fn, elems, reverse=False, axis=0):
        # along `axis`, for every leaf of the pytree `elems` at once:
        if not reverse:
            out[0] = elems[0]
            for i in range(1, n):
                out[i] = fn(out[i - 1], elems[i])
        else:
            out[n - 1] = elems[n - 1]
            for i in reversed(range(n - 1)):
                out[i] = fn(out[i + 1], elems[i])
        return out
    ```

    Type: `(a -> a -> a) -> [a] -> [a]`.

    It is computed in parallel form, with O(log n) sequential calls of `fn` on slices of
    `elems` (each call combines many pairs at once), which is why `fn` must be
    associative, and must work elementwise on a batch of pairs: it receives pytrees whose
    leaves are slices of `elems` along `axis`, and must return a pytree of the same
    structure and leaf shapes. For the linear recurrence `h = a * h + b`, prefer
    `tfun.lax.linear_scan`, which has a fused kernel.

    **Arguments:**

    - `fn`: the associative operator, `fn(a, b) -> c` on pytrees of `elems`'s structure.
    - `elems`: a pytree of tensors sharing the size of `axis`.
    - `reverse`: scan from the end of `axis` to its start.
    - `axis`: the axis to scan along (negative counts from the end).

    **Returns:** a pytree like `elems` holding the scan.
    """
    op = "tfun.lax.associative_scan"
    _rules.check_callable(op, "fn", fn)
    leaves, treedef = xs_leaves(op, elems, "elems")
    if not leaves:
        raise ArgumentValueError(f"{op}: elems must have at least one tensor leaf.")
    # As in JAX, `axis` is resolved against the first leaf and used for every leaf.
    ax = _rules.canonical_axis(op, axis, leaves[0].dim())
    axes = [ax] * len(leaves)
    for p, x in zip(treedef.accessors(), leaves):
        if x.dim() <= ax:
            raise ArgumentValueError(
                f"{op}: axis={axis} (axis {ax} of the first leaf) is out of range for "
                f"elems{p.codify('')}, which is {_rules.describe_leaf(x)}."
            )
    sizes = {x.shape[a] for a, x in zip(axes, leaves)}
    if len(sizes) > 1:
        bullets = [f"elems{p.codify('')}: {_rules.describe_leaf(x)} (size {x.shape[a]})" for p, x, a in zip(treedef.accessors(), leaves, axes)]
        raise ArgumentValueError(
            format_message(
                f"{op}: every leaf of elems must have the same size along axis {axis}, but they do not:",
                bullets,
                revise="Make the leaves the same length along the scan axis.",
            )
        )
    elems = tree_unflatten(treedef, leaves)
    if _hop.is_tracing():
        _hop.check_side_effects(op, "combine function", fn)
        return _hop.associative_scan(fn, elems, bool(reverse), axis)
    return _assoc_eager(op, fn, leaves, treedef, axes, bool(reverse))


def _take(x: torch.Tensor, axis: int, start: int | None, stop: int | None, step: int | None = None) -> torch.Tensor:
    idx: list[Any] = [slice(None)] * axis
    idx.append(slice(start, stop, step))
    return x[tuple(idx)]


def _assoc_eager(
    op: str, fn: Callable[..., Any], leaves: list[torch.Tensor], treedef: PyTreeSpec, axes: list[int], reverse: bool
) -> Any:
    key = (op, _rules.fn_key(fn), treedef, _rules.leaf_signature(leaves), tuple(axes))
    state = {"checking": _rules.seen(key) is None}

    def combine(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
        ta = tree_unflatten(treedef, a)
        tb = tree_unflatten(treedef, b)
        if state["checking"]:
            out = _rules.checked_call(op, "combine function", fn, (ta, tb))
            out_leaves, out_def = tree_flatten(out)
            revise = f"Revise `{_funcinfo.short_name(fn)}` to return a pytree like its inputs, combining them elementwise."
            _rules.check_structure(op, "combine function input and output", treedef, out_def, root="elems",
                                   names=("input", "output"), fn=fn, revise=revise)
            _rules.check_tensors(op, "combine function input and output", a, out_leaves, treedef, root="elems",
                                 names=("input", "output"), fn=fn, revise=revise)
            state["checking"] = False
            _rules.remember(key)
            return out_leaves
        out_leaves, out_def = tree_flatten(fn(ta, tb))
        if out_def != treedef:
            _rules.check_structure(op, "combine function input and output", treedef, out_def, root="elems",
                                   names=("input", "output"), fn=fn, revise="Return a pytree like the inputs.")
        return out_leaves

    if reverse:
        leaves = [x.flip(a) for x, a in zip(leaves, axes)]

    def scan_rec(elems: list[torch.Tensor]) -> list[torch.Tensor]:
        n = elems[0].shape[axes[0]]
        if n < 2:
            return elems
        # Combine adjacent pairs (0,1), (2,3), ...; scan the half-length result recursively;
        # then fix up the even positions from the odd prefix results.
        pairs = combine(
            [_take(x, a, 0, n - 1, 2) for x, a in zip(elems, axes)],
            [_take(x, a, 1, None, 2) for x, a in zip(elems, axes)],
        )
        odd = scan_rec(pairs)
        if n % 2 == 0:
            even = combine([_take(x, a, 0, -1) for x, a in zip(odd, axes)], [_take(x, a, 2, None, 2) for x, a in zip(elems, axes)])
        else:
            even = combine(odd, [_take(x, a, 2, None, 2) for x, a in zip(elems, axes)])
        even = [torch.cat([_take(x, a, 0, 1), e], dim=a) for x, e, a in zip(elems, even, axes)]
        return [_interleave(e, o, a) for e, o, a in zip(even, odd, axes)]

    out = scan_rec(leaves)
    if reverse:
        out = [x.flip(a) for x, a in zip(out, axes)]
    return tree_unflatten(treedef, out)


def _interleave(even: torch.Tensor, odd: torch.Tensor, axis: int) -> torch.Tensor:
    """Merge two tensors along `axis`: even[0], odd[0], even[1], odd[1], ..."""
    n_even = even.shape[axis]
    n_odd = odd.shape[axis]
    if n_even == n_odd:
        return torch.stack([even, odd], dim=axis + 1).flatten(axis, axis + 1)
    # one more even than odd
    head = torch.stack([_take(even, axis, 0, n_odd), odd], dim=axis + 1).flatten(axis, axis + 1)
    return torch.cat([head, _take(even, axis, n_odd, None)], dim=axis)


__all__ = ["associative_scan"]
