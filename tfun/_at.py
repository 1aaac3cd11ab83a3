"""`tfun.at(x)[idx].set(v)`: JAX's out-of-place indexed updates on torch tensors."""

from __future__ import annotations

import math
from typing import Any

import torch

from . import _context
from ._errors import ArgumentTypeError, ArgumentValueError, format_message

_MODES = (None, "promise_in_bounds", "clip", "drop", "fill")


def _bad_index(what: str) -> ArgumentTypeError:
    return ArgumentTypeError(
        format_message(
            "tfun.at: the index must be made of ints, slices, None, Ellipsis and integer or bool tensors.",
            [f"index: {what}"],
            revise="Write the index as you would for `x[idx]`, with integer tensors for gathers.",
        )
    )


def _fake(t: Any) -> bool:
    """Whether `t` is a fake tensor (eagerly only: Dynamo does not trace this)."""
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(t, torch.Tensor) and is_fake(t)


def _phantom_possible(index: Any) -> bool:
    """Whether a read may be one that no step of the program makes: in a higher-order op's
    body traced under `tfun.jit` or `torch.export` (which torch may run on values no step
    reads), or on fake tensors (tfun's check of the body of a loop of zero steps)."""
    from .lax import _hop  # tfun.lax does not import this module

    if _context.is_tracing():
        return _hop.in_body()
    return _fake(index)


def _describe(c: Any) -> str:
    """An index component, for a message: its value where that is cheap and safe to read."""
    if isinstance(c, torch.Tensor):
        if c.numel() == 1 and not _context.is_tracing() and not _fake(c):  # `is_tracing` first
            return f"{c.item()} (a {c.dtype} tensor)"
        return f"a {c.dtype} tensor of shape {tuple(c.shape)}"
    return repr(c)


def _components(idx: Any) -> tuple[Any, ...]:
    comps = idx if isinstance(idx, tuple) else (idx,)
    out = []
    for c in comps:
        if isinstance(c, (list, range)):
            c = torch.as_tensor(list(c))
        if isinstance(c, torch.Tensor):
            if c.dtype.is_floating_point or c.dtype.is_complex:
                raise _bad_index(f"a {c.dtype} tensor (indices must be integers or bools)")
        elif not (c is None or c is Ellipsis or isinstance(c, (int, slice))):
            raise _bad_index(f"got a {type(c).__name__}")
        out.append(c)
    return tuple(out)


def _positions(shape: torch.Size, idx: Any, mode: str | None, *, gather: bool, device: torch.device) -> torch.Tensor:
    """Flat positions of the indexed elements of a tensor of `shape`; -1 marks out-of-bounds ones.

    Integer components are normalized (negative from the end), clipped or flagged per
    `mode`; flagged ones index an extra padding slot of the position grid that holds -1.
    """
    comps = _components(idx)
    n_ell = sum(c is Ellipsis for c in comps)
    if n_ell > 1:
        raise _bad_index("more than one Ellipsis")
    used = sum(0 if (c is None or c is Ellipsis) else (c.ndim if isinstance(c, torch.Tensor) and c.dtype == torch.bool else 1) for c in comps)
    if used > len(shape):
        raise ArgumentValueError(
            format_message(
                "tfun.at: too many indices for the tensor.",
                [f"index: uses {used} dimensions, the tensor has {len(shape)} (shape {tuple(shape)})"],
            )
        )
    if n_ell:
        i = comps.index(Ellipsis)
        comps = comps[:i] + (slice(None),) * (len(shape) - used) + comps[i + 1:]
    clip = mode == "clip" or (mode in (None, "promise_in_bounds") and gather)
    dim = 0
    new: list[Any] = []
    padded_dims: list[int] = []
    for c in comps:
        if c is None:
            new.append(None)
            continue
        if isinstance(c, slice):
            new.append(c)
            dim += 1
            continue
        if isinstance(c, torch.Tensor) and c.dtype == torch.bool:
            new.append(c)
            dim += c.ndim
            continue
        n = shape[dim]
        t = torch.as_tensor(c, device=device).to(torch.int64)
        t = torch.where(t < 0, t + n, t)
        if isinstance(n, int) and n == 0:
            # An empty dimension has no element to clip to: every index is out of bounds.
            if gather and not _phantom_possible(t):
                raise ArgumentValueError(
                    format_message(
                        f"tfun.at: index is out of bounds for axis {dim} with size 0.",
                        [f"x.shape: {tuple(shape)}, index: {_describe(c)}"],
                        revise="Read from a tensor with at least one element along that axis, "
                        "or guard the read so that it does not run when the axis is empty.",
                    )
                )
            # In a traced loop body the read may be one that never runs for real: torch's
            # while_loop backward runs the body once more, on the initial carry, when the
            # loop ran zero times, and discards what it computes (tfun's
            # `_compat._zero_trip_grads`). It reads the fill value (NaN for floats); updates drop.
            t = torch.full_like(t, 0)
            padded_dims.append(dim)
        elif clip:
            # not `max(n - 1, 0)`: Python's `max` of a symbolic size inside a loop body came
            # out 0 in a non-strict `torch.export` graph (torch 2.13, 2.14.1), silently
            t = t.clamp(0, n - 1 if n > 0 else 0)
        else:
            t = torch.where((t >= 0) & (t < n), t, torch.full_like(t, n))  # n: the padding slot
            padded_dims.append(dim)
        new.append(t)
        dim += 1
    numel = math.prod(shape)
    grid = torch.arange(numel, device=device).reshape(shape)
    if padded_dims:
        pshape = list(shape)
        for d in padded_dims:
            pshape[d] += 1
        padded = torch.full(pshape, -1, dtype=torch.int64, device=device)
        padded[tuple(slice(0, s) for s in shape)] = grid
        grid = padded
    tensors = [k for k, c in enumerate(new) if isinstance(c, torch.Tensor)]
    if tensors and all(new[k].dim() == 0 and new[k].dtype != torch.bool for k in tensors):
        # Integer scalars only: torch indexes with a 0-d tensor by reading its value (a
        # data-dependent `.item()` under tfun.jit). As 1-element index tensors they broadcast
        # to one dimension of size 1, dropped again: where the first of them stands when
        # they are adjacent, else in front (NumPy's rule for advanced indices).
        adjacent = tensors == list(range(tensors[0], tensors[-1] + 1))
        at = sum(1 for c in new[: tensors[0]] if c is None or isinstance(c, slice)) if adjacent else 0
        return grid[tuple(c.reshape(1) if isinstance(c, torch.Tensor) else c for c in new)].squeeze(at)
    return grid[tuple(new)]


class _IndexedRef:
    def __init__(self, x: torch.Tensor, idx: Any) -> None:
        self._x = x
        self._idx = idx

    def _pos(self, mode: str | None, gather: bool) -> torch.Tensor:
        if mode not in _MODES:
            raise ArgumentValueError(
                format_message(
                    "tfun.at: mode must be one of None, 'promise_in_bounds', 'clip', 'drop', 'fill'.",
                    [f"mode: got {mode!r}"],
                )
            )
        return _positions(self._x.shape, self._idx, mode, gather=gather, device=self._x.device)

    def get(self, *, mode: str | None = None, fill_value: Any = None) -> torch.Tensor:
        """`x[idx]`, with JAX's out-of-bounds handling (default: clip; `"fill"`/`"drop"`: `fill_value`)."""
        x = self._x
        pos = self._pos(mode, gather=True)
        empty = any(isinstance(n, int) and n == 0 for n in x.shape)
        if empty:  # traced only (eagerly `_positions` refused): every position is out of bounds
            out = x.new_zeros(pos.shape)
        else:
            # indexed with a 1-d tensor: a gather also for a 0-d `pos` (a 0-d index would be read)
            out = x.reshape(-1)[pos.clamp(min=0).reshape(-1)].reshape(pos.shape)
        if mode in ("fill", "drop") or empty:  # JAX's gather fills for both
            if fill_value is None:
                if x.dtype.is_floating_point or x.dtype.is_complex:
                    fill_value = math.nan
                elif x.dtype == torch.bool:
                    fill_value = True
                else:
                    info = torch.iinfo(x.dtype)
                    fill_value = info.min if info.min < 0 else info.max
            out = torch.where(pos < 0, torch.as_tensor(fill_value, dtype=x.dtype, device=x.device), out)
        return out

    def _scatter(self, v: Any, op: str, mode: str | None) -> torch.Tensor:
        x = self._x
        pos = self._pos(mode, gather=False)
        v = torch.as_tensor(v, device=x.device).to(x.dtype) if not isinstance(v, torch.Tensor) else v.to(x.dtype)
        try:
            vb = torch.broadcast_to(v, pos.shape)
        except RuntimeError:
            raise ArgumentValueError(
                format_message(
                    f"tfun.at: the values of `.{op}` must broadcast to the indexed shape.",
                    [f"values.shape: {tuple(v.shape)}, x[idx].shape: {tuple(pos.shape)}"],
                    revise="Reshape the values to the shape of `x[idx]` (or one that broadcasts to it).",
                )
            ) from None
        numel = x.numel()
        # Out-of-bounds updates go to one extra slot, dropped at the end (no data-dependent shapes).
        flat = torch.cat([x.reshape(-1), x.new_zeros(1)])
        target = torch.where(pos < 0, torch.full_like(pos, numel), pos).reshape(-1)
        vals = vb.reshape(-1)
        if op == "set":
            out = flat.index_put((target,), vals)
        elif op == "add":
            out = flat.index_put((target,), vals, accumulate=True)
        else:
            reduce = {"multiply": "prod", "min": "amin", "max": "amax"}[op]
            out = flat.scatter_reduce(0, target, vals, reduce=reduce, include_self=True)
        return out[:numel].reshape(x.shape)

    def set(self, values: Any, *, mode: str | None = None) -> torch.Tensor:
        """A copy of `x` with `x[idx] = values` (out-of-bounds updates dropped unless `mode="clip"`)."""
        return self._scatter(values, "set", mode)

    def add(self, values: Any, *, mode: str | None = None) -> torch.Tensor:
        """A copy of `x` with `x[idx] += values`; repeated indices accumulate."""
        return self._scatter(values, "add", mode)

    def multiply(self, values: Any, *, mode: str | None = None) -> torch.Tensor:
        """A copy of `x` with `x[idx] *= values`; repeated indices accumulate."""
        return self._scatter(values, "multiply", mode)

    mul = multiply

    def min(self, values: Any, *, mode: str | None = None) -> torch.Tensor:
        """A copy of `x` with `x[idx] = minimum(x[idx], values)`."""
        return self._scatter(values, "min", mode)

    def max(self, values: Any, *, mode: str | None = None) -> torch.Tensor:
        """A copy of `x` with `x[idx] = maximum(x[idx], values)`."""
        return self._scatter(values, "max", mode)


class at:
    """Out-of-place indexed updates, JAX's `x.at[idx]`: `tfun.at(x)[idx].set(v)`.

    `tfun.at(x)[idx]` names the elements `x[idx]` (any index `x[...]` accepts: ints,
    slices, `None`, `...`, integer and bool tensors); its methods return a **new** tensor
    and never write to `x`:

    | JAX | tfun |
    |---|---|
    | `x.at[idx].set(v)` | `tfun.at(x)[idx].set(v)` |
    | `x.at[idx].add(v)` | `tfun.at(x)[idx].add(v)` |
    | `x.at[idx].multiply(v)` / `.mul` | `tfun.at(x)[idx].multiply(v)` / `.mul` |
    | `x.at[idx].min(v)` / `.max(v)` | `tfun.at(x)[idx].min(v)` / `.max(v)` |
    | `x.at[idx].get(mode=..., fill_value=...)` | `tfun.at(x)[idx].get(mode=..., fill_value=...)` |

    Semantics are JAX's: `values` are cast to `x.dtype` and broadcast to the shape of
    `x[idx]`; repeated indices accumulate for `add`/`multiply`/`min`/`max` (for `set`, one
    of the writes wins, unspecified which, as in JAX); negative indices count from the end.
    Out-of-bounds indices follow `mode`: by default `get` clips them and updates drop
    them; `"clip"` clamps into range; `"drop"` and `"fill"` drop updates and make `get`
    return `fill_value` (default NaN for floats, the most negative value for signed ints,
    the largest for unsigned, True for bools).

    An axis of size 0 has no element to clip to: `get` on it raises an `ArgumentValueError`
    (JAX raises IndexError), except in a loop or branch body traced by `tfun.jit` or
    `torch.export`, where it returns the fill value. There torch may run a body on values
    no step of the program reads: under jit with gradients, the backward of a `while_loop`
    (or a `fori_loop` with tensor bounds) runs the body once on the initial carry even when
    the loop ran zero times, and tfun discards what it computes. So a loop over an empty
    sequence (`fori_loop(0, n, ...)` with `n = 0`, reading `tfun.at(xs)[i].get()`) works
    under jit with gradients as eagerly, where `torch.index_select` on the empty `xs` would
    raise. Under jit a body that really runs and reads an empty axis gets NaNs, not an error.

    Every result is differentiable in `x` and `values` (a gather, `index_put` or
    `scatter_reduce`), and works under `tfun.vmap`, `tfun.grad` and `tfun.jit`: out-of-bounds
    updates are routed to a scratch slot rather than filtered, so no shape depends on
    data. For `min`/`max` with ties, the gradient is torch's `scatter_reduce` rule (split
    evenly among equal values), which can differ from JAX's.

    **Arguments:**

    - `x`: the tensor to index.

    **Returns:**

    An object to subscript: `tfun.at(x)[idx]`, whose methods are listed above.
    """

    def __init__(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise ArgumentTypeError(
                format_message(
                    "tfun.at: x must be a torch.Tensor.",
                    [f"x: got a {type(x).__name__}"],
                    revise="Convert it first, e.g. `tfun.at(torch.as_tensor(x))`.",
                )
            )
        self._x = x

    def __getitem__(self, idx: Any) -> _IndexedRef:
        return _IndexedRef(self._x, idx)
