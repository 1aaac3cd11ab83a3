"""`scan`: a loop that carries state and stacks per-step outputs."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .. import _funcinfo, _rules
from .._errors import ArgumentTypeError, ArgumentValueError, TensorMismatchError, format_message
from .._tree import PyTreeSpec, keystr, tree_flatten, tree_structure, tree_unflatten
from . import _hop

Carry = TypeVar("Carry")
X = TypeVar("X")
Y = TypeVar("Y")

_REVISE_CARRY = (
    "Revise `{name}` so that the carry it returns has the structure of `init`, with tensors of the same "
    "dtype, shape and device."
)


def check_unroll(op: str, unroll: Any) -> None:
    """JAX's rule: a bool, or a non-negative int (0 and `True` both mean "unroll fully")."""
    if isinstance(unroll, bool):
        return
    if not isinstance(unroll, numbers.Integral):
        raise ArgumentTypeError(
            f"{op}: unroll must be a non-negative int or a bool, but got {_rules.describe_leaf(unroll)}."
        )
    if unroll < 0:
        raise ArgumentValueError(f"{op}: unroll must be a bool or a non-negative int, but got {unroll}.")


def xs_leaves(op: str, xs: Any, arg: str = "xs") -> tuple[list[torch.Tensor], PyTreeSpec]:
    leaves, treedef = tree_flatten(xs)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            continue
        if type(leaf).__module__ == "numpy":
            leaves[i] = torch.as_tensor(leaf)
            continue
        raise ArgumentTypeError(
            format_message(
                f"{op}: every leaf of {arg} must be a tensor with a leading axis to loop over, but "
                f"{arg}{keystr(treedef.accessors()[i])} is {_rules.describe_leaf(leaf)}.",
                revise=f"Stack the per-step values of {arg} into tensors.",
            )
        )
    return leaves, treedef


def split_pair(op: str, f: Callable[..., Any], out: Any) -> tuple[Any, Any]:
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return out[0], out[1]
    raise ArgumentTypeError(
        format_message(
            f"{op}: the body function must return a pair (carry, y), but it returned "
            f"{_rules.describe_node(tree_structure(out)) if not isinstance(out, torch.Tensor) else 'a tensor'}.",
            function=_funcinfo.describe(f),
            revise=f"Revise `{_funcinfo.short_name(f)}` to return `(new_carry, y)`; use `None` for y if there is none.",
        )
    )


def check_carry(
    op: str,
    f: Callable[..., Any],
    carry_def: PyTreeSpec,
    carry_leaves: Sequence[Any],
    new_carry: Any,
    *,
    what: str = "body carry input and output",
    weak: dict[int, Any] | None = None,
) -> Any:
    """Check `new_carry` against the carry `(carry_def, carry_leaves)`; return it with its
    weakly typed Python scalars made tensors of the carry's dtype. As in JAX, a Python
    scalar output matches a 0-d carry of its default dtype (`1.5` a float32 carry), and a
    leaf of `init` that was a Python scalar (`weak`, by flat index) takes the dtype of the
    body's output where JAX's promotion allows it."""
    new_carry = _rules.normalize_weak_outputs(carry_leaves, new_carry)
    carry_leaves = _rules.promote_weak_init(carry_leaves, weak, new_carry)
    new_leaves, new_def = tree_flatten(new_carry)
    revise = _REVISE_CARRY.format(name=_funcinfo.short_name(f))
    _rules.check_structure(op, what, carry_def, new_def, root="carry", names=("input", "output"), fn=f, revise=revise)
    _rules.check_tensors(op, what, carry_leaves, new_leaves, carry_def, root="carry", names=("input", "output"), fn=f, revise=revise)
    return new_carry


def stack_outputs(
    op: str, f: Callable[..., Any], y_lists: list[list[Any]], y_def: PyTreeSpec, reverse: bool, root: str = "y"
) -> Any:
    """Stack each leaf's per-step values (in the order the steps ran) along a new axis.

    Every step must give a leaf of one dtype, shape and device: `torch.stack` would
    promote a dtype that changes between steps, so dtypes are compared first. A step is
    named by its index in the stacked output (`reverse` runs the last one first).
    """
    out = []
    paths = None
    for k, lst in enumerate(y_lists):
        first = lst[0]
        if not isinstance(first, torch.Tensor):
            lst = [torch.as_tensor(v) for v in lst]
            first = lst[0]
        dtype = first.dtype
        stacked = None
        if all(getattr(v, "dtype", None) is dtype for v in lst):
            try:
                stacked = torch.stack(lst[::-1] if reverse else lst)
            except (RuntimeError, TypeError):
                pass
        if stacked is None:
            if paths is None:
                paths = [keystr(p) for p in y_def.accessors()]
            bad = next(i for i, v in enumerate(lst) if _rules.leaf_differences(first, v))
            n = len(lst)
            step0, step_bad = (n - 1, n - 1 - bad) if reverse else (0, bad)
            raise TensorMismatchError(
                format_message(
                    f"{op}: the per-step outputs must have the same dtype, shape and device at every step, "
                    "but they differ:",
                    [f"{root}{paths[k]}: step {step0} gives {_rules.describe_leaf(first)}, step {step_bad} gives "
                     f"{_rules.describe_leaf(lst[bad])}"],
                    function=_funcinfo.describe(f),
                    revise=f"Revise `{_funcinfo.short_name(f)}` so that every step returns outputs of one type.",
                )
            )
        out.append(stacked)
    return tree_unflatten(y_def, out)


_WHY_ZERO = "to check its output in a loop of zero steps"


def zero_length_outputs(
    op: str, role: str, f: Callable[..., Any], args: tuple[Any, ...], key: Any
) -> Any:
    """What `f(*args)` returns, found without running `f` for real: a pytree of fake tensors.

    Used by zero-length loops, where JAX knows the output types from tracing (and checks
    them: the caller runs the carry rules on the result; the side-effect rules run here,
    once per `key`). An error of `f` propagates; where fake tensors cannot follow `f`, it
    runs for real without gradients on the (empty) inputs.
    """
    fake_key = (key, "fake")
    first = _rules.seen(key) is None and _rules.seen(fake_key) is None
    try:
        leaves, treedef = _rules.abstract_eval(f, args, op=op, role=role, why=_WHY_ZERO, side_effects=first)
        if first:
            _rules.remember(fake_key)
    except _rules.AbstractEvalUnavailable:
        with torch.no_grad():
            return f(*args)
    return tree_unflatten(treedef, leaves)


def check_body_abstractly(
    op: str,
    role: str,
    f: Callable[..., Any],
    args: tuple[Any, ...],
    carry_def: PyTreeSpec,
    carry_leaves: Sequence[Any],
    *,
    pick: Callable[[Any], Any] = lambda out: out,
    what: str = "body_fun input and output",
) -> None:
    """The carry rules for a loop that runs zero times: JAX traces its body whatever the
    trip count, so a body that breaks them fails there, not first in production when the
    loop does run. `f` is evaluated on fake tensors; skipped where fake tensors cannot
    follow it (it is checked when it first runs for real)."""
    try:
        leaves, treedef = _rules.abstract_eval(f, args, op=op, role=role, why=_WHY_ZERO, side_effects=True)
    except _rules.AbstractEvalUnavailable:
        return
    check_carry(op, f, carry_def, carry_leaves, pick(tree_unflatten(treedef, leaves)), what=what)


def scan(
    f: Callable[[Carry, X], tuple[Carry, Y]],
    init: Carry,
    xs: X | None = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    _split_transpose: bool = False,
) -> tuple[Carry, Y]:
    """Loop `f` over the leading axis of `xs`, carrying state, and stack the outputs.

    Semantics, as a Python function (JAX's `lax.scan`, exactly):

    ```python
    def scan(f, init, xs=None, length=None, reverse=False, unroll=1):
        if xs is None:
            xs = [None] * length
        carry = init
        ys = []
        for x in (reversed(xs) if reverse else xs):
            carry, y = f(carry, x)
            ys.append(y)
        if reverse:
            ys.reverse()
        return carry, tree_map(lambda *leaves: torch.stack(leaves), *ys)
    ```

    Type: `(c -> a -> (c, b)) -> c -> [a] -> (c, [b])`.

    `xs` and `y` are pytrees: "stacking" is per leaf, along a new leading axis. `f` must
    return a carry of the same structure, dtypes, shapes and devices as `init`. A `None`
    leaf of `y` is an empty subtree (stacked `ys` has `None` there).

    Eagerly this is a Python loop, as fast as a hand-written one, and gradients flow
    through it as through that loop. Under `tfun.jit` / `torch.export` it lowers to
    PyTorch's `scan` higher-order op: one graph node whatever the length.

    **Arguments:**

    - `f`: the body, `f(carry, x) -> (new_carry, y)`.
    - `init`: the initial carry, a pytree of tensors (Python scalars become 0-d tensors).
    - `xs`: a pytree of tensors that share the size of their leading axis, or `None`.
    - `length`: the number of steps; required if `xs` is `None`, checked against `xs`
      otherwise.
    - `reverse`: scan from the end of `xs` to its start (`ys` keep `xs`'s order).
    - `unroll`: accepted for JAX compatibility (a non-negative int or a bool, as in JAX); it changes
      nothing in eager mode.

    **Returns:** `(final_carry, stacked_ys)`.
    """
    op = "tfun.lax.scan"
    _rules.check_callable(op, "f", f)
    check_unroll(op, unroll)
    weak: dict[int, Any] = {}
    carry_leaves, carry_def = _rules.as_tensor_leaves(op, "init", init, weak)
    init = tree_unflatten(carry_def, carry_leaves)
    x_leaves, x_def = xs_leaves(op, xs)
    if isinstance(length, torch.Tensor) and _hop.is_tracing():
        # JAX's ConcretizationTypeError: the step count must be known when tracing
        raise ArgumentTypeError(
            format_message(
                f"{op}: length must be a concrete int under tfun.jit, but it is a traced tensor "
                f"({_rules.describe_leaf(length)}).",
                revise="Pass it as a Python int (a static argument of tfun.jit: static_argnums), or let xs "
                "determine the length.",
            )
        )
    if length is not None:
        length = _rules.check_int(op, "length", length, minimum=0)
    n = _rules.leading_length(op, "xs", x_leaves, x_def, length)
    if x_def.num_leaves and any(not isinstance(x, torch.Tensor) for x in tree_flatten(xs)[0]):
        xs = tree_unflatten(x_def, x_leaves)
    if _hop.is_tracing():
        _hop.check_side_effects(op, "body function", f)
        return _hop.scan(f, init, xs, n, bool(reverse), weak)
    return _scan_eager(op, f, init, carry_leaves, carry_def, xs, x_leaves, x_def, n, bool(reverse), weak)


def _scan_eager(
    op: str,
    f: Callable[..., Any],
    init: Any,
    carry_leaves: list[torch.Tensor],
    carry_def: PyTreeSpec,
    xs: Any,
    x_leaves: list[torch.Tensor],
    x_def: PyTreeSpec,
    n: int,
    reverse: bool,
    weak: dict[int, Any] | None = None,
) -> tuple[Any, Any]:
    x_sig = tuple((x.dtype, x.shape[1:], x.device) for x in x_leaves)
    key = (op, _rules.fn_key(f), carry_def, _rules.leaf_signature(carry_leaves), x_def, x_sig)

    if n == 0:
        x0 = tree_unflatten(x_def, [torch.empty(x.shape[1:], dtype=x.dtype, device=x.device) for x in x_leaves])
        carry0, y0 = split_pair(op, f, zero_length_outputs(op, "body function", f, (init, x0), key))
        check_carry(op, f, carry_def, carry_leaves, carry0, weak=weak)
        y_leaves, y_def = tree_flatten(y0)
        ys = tree_unflatten(y_def, [_rules.empty_like_fake(y, 0) for y in y_leaves])
        return init, ys

    slices = [x.unbind(0) for x in x_leaves]
    n_x = len(slices)
    x_is_leaf = x_def.is_leaf()
    x_none = tree_unflatten(x_def, []) if n_x == 0 else None
    order = range(n - 1, -1, -1) if reverse else range(n)

    def x_at(i: int) -> Any:
        if x_is_leaf:
            return slices[0][i]
        if n_x == 0:
            return x_none
        return tree_unflatten(x_def, [s[i] for s in slices])

    carry = init
    it = iter(order)
    i0 = next(it)
    # The cache only decides whether the rules run; structures always come from the
    # actual outputs (closures of one code object may differ in what they return).
    if _rules.seen(key) is None:
        out = _rules.checked_call(op, "body function", f, (carry, x_at(i0)))
        carry, y = split_pair(op, f, out)
        raw = carry
        carry = check_carry(op, f, carry_def, carry_leaves, carry, weak=weak)
        _rules.remember(key)
    else:
        carry, y = split_pair(op, f, f(carry, x_at(i0)))
        if tree_structure(carry) != carry_def:
            check_carry(op, f, carry_def, carry_leaves, carry, weak=weak)
        raw = carry
        carry = _rules.normalize_weak_outputs(carry_leaves, carry)
    call = f
    if carry is not raw:
        # Python scalars the body returns for 0-d carries (weakly typed, as in JAX) become
        # tensors of the carry's dtype at every step

        def call(c: Any, x: Any) -> Any:
            c2, y2 = split_pair(op, f, f(c, x))
            return _rules.normalize_weak_outputs(carry_leaves, c2), y2

    y_leaves, y_def = tree_flatten(y)
    y_lists: list[list[Any]] = [[v] for v in y_leaves]

    carry_is_leaf = carry_def.is_leaf()
    y_is_leaf = y_def.is_leaf()
    y_first = y_lists[0] if y_is_leaf else None
    n_y = y_def.num_leaves
    for i in it:
        out = call(carry, x_at(i))
        if type(out) is not tuple or len(out) != 2:
            out = split_pair(op, f, out)
        carry, y = out
        if carry_is_leaf:
            if not isinstance(carry, torch.Tensor):
                check_carry(op, f, carry_def, carry_leaves, carry, weak=weak)
        elif tree_structure(carry) != carry_def:
            check_carry(op, f, carry_def, carry_leaves, carry, weak=weak)
        if y_is_leaf:
            y_first.append(y)  # type: ignore[union-attr]
        elif n_y:
            leaves, d = tree_flatten(y)
            if d != y_def:
                _rules.check_structure(
                    op, "the y outputs of every step", y_def, d, root="y", names=(f"step {i0}", f"step {i}"), fn=f,
                    revise=f"Revise `{_funcinfo.short_name(f)}` so that every step returns y of one structure.",
                )
            for lst, v in zip(y_lists, leaves):
                lst.append(v)
        elif y is not None and tree_structure(y) != y_def:
            _rules.check_structure(
                op, "the y outputs of every step", y_def, tree_structure(y), root="y", names=(f"step {i0}", f"step {i}"), fn=f,
                revise=f"Revise `{_funcinfo.short_name(f)}` so that every step returns y of one structure.",
            )
    if _rules.leaf_signature(tree_flatten(carry)[0]) != key[3]:
        check_carry(op, f, carry_def, carry_leaves, carry, weak=weak)
    ys = stack_outputs(op, f, y_lists, y_def, reverse)
    return carry, ys


__all__ = ["scan"]
