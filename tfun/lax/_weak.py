"""JAX's weak types for the Python scalars of a loop's `init`, for the one body run that
decides the carry's dtype.

JAX gives a Python scalar a *weak* type: in an arithmetic op with a typed array it takes
the array's dtype (`0 + x_int8` is int8), and a loop whose `init` has a weakly typed leaf
traces its body once, converts that leaf to the dtype the body returns for it, and traces
again. tfun makes such a leaf a 0-d tensor of the scalar's default dtype (int64, float32),
and torch promotes two 0-d tensors to the wider dtype (`tensor(0) + tensor(1, int8)` is
int64), while a Python scalar would have given int8: torch's "wrapped number" rule is
JAX's weak-type rule, but Python cannot make a wrapped-number tensor.

`WeakMode` restores the rule for that first run. It tracks which tensors are weak: the
weak `init` leaves, and every tensor an op computes from weak tensors and Python scalars
only (a conversion with an explicit dtype, `x.to(torch.int8)`, gives a strong tensor, as
`astype` does in JAX). An elementwise op (`ELEMENTWISE`, by name) that mixes weak and strong
tensors first converts its weak operands to the dtype torch would give if they were Python
scalars of their kind, so `c + x` computes in `x`'s dtype exactly as `0 + x` would; every
other op runs as it is. The loop then converts the weak `init` leaves to the dtypes the
body returned (`_rules.promote_weak_init`) and runs without the mode: it costs nothing
after that first run, and nothing at all for an `init` without Python scalars.

The mode is plain Python that Dynamo traces, so `tfun.jit` runs the same rule inside its
trace (the dtype-deciding body run there is dead code, as in `_scan._lower_scan`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .. import _compat
from .._rules import dtype_category

__all__ = ["WeakMode", "ELEMENTWISE", "common_dtype"]


# Elementwise ops whose operands type promotion combines (a Python scalar operand is a
# wrapped number for them), by name, as torch functions, Tensor methods and operators.
_BINARY = (
    "add sub subtract rsub mul multiply div divide true_divide floor_divide remainder fmod pow "
    "maximum minimum fmax fmin atan2 arctan2 hypot copysign nextafter xlogy logaddexp logaddexp2 "
    "bitwise_and bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift "
    "eq ne lt le gt ge greater greater_equal less less_equal not_equal clamp clip where"
).split()
_DUNDERS = (
    "add radd sub rsub mul rmul truediv rtruediv div floordiv rfloordiv mod rmod pow rpow "
    "and rand or ror xor rxor lshift rlshift rshift rrshift eq ne lt le gt ge"
).split()
# Ops that join a list of tensors (JAX promotes weak members of a `jnp.stack` as it does
# the operands of `+`).
_JOINS = "stack cat concat concatenate hstack vstack".split()


# By name, not by function object: strict `torch.export` hands the mode other objects
# for the same op (torch 2.13) than eager code and `torch.compile` do.
ELEMENTWISE: frozenset[str] = frozenset(_BINARY + [f"__{n}__" for n in _DUNDERS] + _JOINS)

# Conversions: their result has the dtype asked for, not a weak one (JAX's `astype`).
_CONVERSIONS = frozenset(
    "to type type_as long int short char byte half float double bfloat16 bool cfloat cdouble "
    "new_tensor new_zeros new_ones new_empty new_full".split()
)


def _promote(a: torch.dtype | None, b: torch.dtype) -> torch.dtype:
    return b if a is None else torch.promote_types(a, b)




def _combine(higher: torch.dtype | None, lower: torch.dtype | None) -> torch.dtype | None:
    """torch's `combine_categories` (c10's type promotion of dimensioned tensors over 0-d
    tensors over wrapped numbers): the lower-priority dtype only counts when its kind is
    higher."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    if higher.is_complex:
        return higher
    if lower.is_complex:
        # the complex dtype of the higher priority's precision where it is floating
        return _compat.complex_of_float.get(higher, torch.complex64) if higher.is_floating_point else lower
    if higher.is_floating_point:
        return higher
    if higher == torch.bool or lower.is_floating_point:
        return torch.promote_types(higher, lower)
    return higher


def _scalar_dtype(kind: int) -> torch.dtype:
    """The dtype of a Python scalar of kind `kind` (bool, int, float, complex)."""
    if kind == 0:
        return torch.bool
    if kind == 1:
        return torch.int64
    if kind == 2:
        return torch.get_default_dtype()
    return torch.complex128 if torch.get_default_dtype() == torch.float64 else torch.complex64


def common_dtype(strong: Sequence[torch.Tensor], weak: Sequence[torch.Tensor]) -> torch.dtype | None:
    """The dtype torch's type promotion gives `strong` with every `weak` tensor replaced by
    a Python scalar of its kind (`torch.result_type` for any number of operands)."""
    dim = zero = wrapped = None
    for t in strong:
        if t.dim() > 0:
            dim = _promote(dim, t.dtype)
        else:
            zero = _promote(zero, t.dtype)
    for t in weak:
        wrapped = _promote(wrapped, _scalar_dtype(dtype_category(t.dtype)))
    return _combine(dim, _combine(zero, wrapped))


def _tensors(tree: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in `tree` (an op's arguments: tensors, scalars, and lists, tuples or
    dicts of them), appended to `out`. Plain loops, not a pytree flatten: this runs for
    every op of the weak body run."""
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (list, tuple)):
        for a in tree:
            _tensors(a, out)
    elif isinstance(tree, dict):
        for a in tree.values():
            _tensors(a, out)
    return out


def _cast_weak(tree: Any, mode: "WeakMode", dtype: torch.dtype) -> Any:
    """`tree` with its weak tensors of another dtype converted to `dtype`."""
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.dtype != dtype and mode.is_weak(tree) else tree
    if isinstance(tree, (list, tuple)):
        cast = [_cast_weak(a, mode, dtype) for a in tree]
        return cast if isinstance(tree, list) else tuple(cast)
    if isinstance(tree, dict):
        return {k: _cast_weak(a, mode, dtype) for k, a in tree.items()}
    return tree


class WeakMode(TorchFunctionMode):
    """JAX's weak-type promotion for the tensors in `weak` and those computed from them
    (see the module docstring). Active for one body run only."""

    def __init__(self, weak: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.weak = list(weak)

    def is_weak(self, t: torch.Tensor) -> bool:
        # identity, not hashing: Dynamo traces `is` on tensors
        for w in self.weak:
            if t is w:
                return True
        return False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = _tensors(kwargs, _tensors(args, []))
        flags = [self.is_weak(t) for t in tensors]
        if not any(flags):
            return func(*args, **kwargs)
        if not all(flags):
            if getattr(func, "__name__", "") in ELEMENTWISE:
                args, kwargs = self._promote_operands(func, args, kwargs)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "") not in _CONVERSIONS and kwargs.get("dtype") is None:
            self.weak.extend(_tensors(out, []))
        return out

    def _promote_operands(self, func: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
        # `where`'s condition is not an operand of the promotion
        head, operands = ((args[0],), args[1:]) if getattr(func, "__name__", "") == "where" and args else ((), args)
        tensors = _tensors(kwargs, _tensors(operands, []))
        strong = [t for t in tensors if not self.is_weak(t)]
        weak = [t for t in tensors if self.is_weak(t)]
        if not strong or not weak:
            return args, kwargs
        dtype = common_dtype(strong, weak)
        if dtype is None:
            return args, kwargs
        return head + tuple(_cast_weak(list(operands), self, dtype)), _cast_weak(kwargs, self, dtype)

