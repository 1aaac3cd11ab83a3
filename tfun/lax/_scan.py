"""`scan`: a loop that carries state and stacks per-step outputs."""

from __future__ import annotations

import functools
import numbers
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .. import _compat, _context, _funcinfo, _rules
from .._errors import ArgumentTypeError, ArgumentValueError, JitError, TensorMismatchError, format_message
from .._tree import PyTreeSpec, keystr, tree_flatten, tree_structure, tree_unflatten
from . import _hop

Carry = TypeVar("Carry")
X = TypeVar("X")
Y = TypeVar("Y")

REVISE_CARRY = (
    "Revise `{name}` so that the carry it returns has the structure of `init`, with tensors of the same "
    "dtype, shape and device."
)


def check_unroll(op: str, unroll: Any) -> int | bool:
    """JAX's rule: a bool, or a non-negative int (0 and `True` both mean "unroll fully").
    Returns it (a numpy one as the Python scalar it holds)."""
    unroll = _rules.static_from_numpy(op, "unroll", unroll)
    if isinstance(unroll, bool):
        return unroll
    if not isinstance(unroll, numbers.Integral):
        raise ArgumentTypeError(
            f"{op}: unroll must be a non-negative int or a bool, but got {_rules.describe_leaf(unroll)}."
        )
    if unroll < 0:
        raise ArgumentValueError(f"{op}: unroll must be a bool or a non-negative int, but got {unroll}.")
    return int(unroll)


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


def _pair_message(op: str, got: str, function: str | None, short: str) -> str:
    """The message of a body that does not return a pair (eagerly and traced); `got`
    describes what it returned."""
    return format_message(
        f"{op}: the body function must return a pair (carry, y), but it returned {got}.",
        function=function,
        revise=f"Revise `{short}` to return `(new_carry, y)`; use `None` for y if there is none.",
    )


def split_pair(op: str, f: Callable[..., Any], out: Any) -> tuple[Any, Any]:
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return out[0], out[1]
    got = 'a tensor' if isinstance(out, torch.Tensor) else _rules.describe_node(tree_structure(out))
    raise ArgumentTypeError(_pair_message(op, got, _funcinfo.describe(f), _funcinfo.short_name(f)))


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
    revise = REVISE_CARRY.format(name=_funcinfo.short_name(f))
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
    op: str, role: str, f: Callable[..., Any], args: tuple[Any, ...], rules: _rules.FirstCall
) -> Any:
    """What `f(*args)` returns, found without running `f` for real: a pytree of fake tensors.

    Used by zero-length loops, where JAX knows the output types from tracing (and checks
    them: the caller runs the carry rules on the result; the side-effect rules run here,
    once per signature: `rules`, the caller's first-call record). An error of `f` propagates; where fake tensors cannot follow `f`, it
    runs for real without gradients on the (empty) inputs.
    """
    fake = rules.part("fake")
    first = rules.first and fake.first
    try:
        leaves, treedef = _rules.abstract_eval(f, args, op=op, role=role, why=_WHY_ZERO, side_effects=first)
        if first:
            fake.record()
    except _rules.AbstractEvalUnavailable:
        with torch.no_grad():
            return f(*args)
    return tree_unflatten(treedef, leaves)


def empty_outputs(y_leaves: Sequence[Any], inputs: Sequence[Any]) -> list[torch.Tensor]:
    """The stacked outputs of a loop of zero steps: empty tensors shaped like the fake
    `y_leaves` with a leading 0. Where autograd records and one of `inputs` requires grad,
    each floating output joins the graph through that input times zero (a zero derivative),
    as torch's own ops on empty tensors do, so that
    `ys.sum().backward()` runs rather than failing on an output with no `grad_fn`."""
    ys = [_rules.empty_like_fake(y, 0) for y in y_leaves]
    if not torch.is_grad_enabled():
        return ys
    linked = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not linked:
        return ys
    # `x.sum() * 0`, not an empty slice's sum: the slice's backward (a masked fill) fails to
    # compile in Inductor 2.11's C++ backend in float64 ("cannot convert 'double' to
    # VectorizedN<double, 2>"). Its value (NaN where `x` has an infinity) reaches no element:
    # every `y` is empty.
    anchor = sum(x.sum() * 0 for x in linked)
    return [y + anchor.to(y.dtype) if y.is_floating_point() or y.is_complex() else y for y in ys]


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
    - `init`: the initial carry, a pytree of tensors. A Python scalar is weakly typed, as
      in JAX: it takes the dtype the body gives its carry leaf, decided by one run of the
      body in which it combines with tensors as a Python scalar would (`scan(lambda c, x:
      (c + x, x), 0, xs_int8)` carries int8, `0.0` with float16 `xs` a float16), then the
      loop runs on a 0-d tensor of that dtype (see "Weak types" in the rules docs).
    - `xs`: a pytree of tensors that share the size of their leading axis, or `None`.
    - `length`: the number of steps; required if `xs` is `None`, checked against `xs`
      otherwise.
    - `reverse`: scan from the end of `xs` to its start (`ys` keep `xs`'s order).
    - `unroll`: how many steps of `f` one iteration of the compiled loop runs, as in JAX: an int
      `k >= 1`, or `True` / `0` for all of them (the loop disappears). Under `tfun.jit` a larger
      `k` gives the compiler `k` steps to fuse per iteration, for a longer compile; a remainder
      of `length % k` steps runs after the loop (before it with `reverse=True`). Eagerly it
      changes nothing: the Python loop already runs one step at a time at full speed.

    **Returns:** `(final_carry, stacked_ys)`.
    """
    op = "tfun.lax.scan"
    _rules.check_callable(op, "f", f)
    unroll = check_unroll(op, unroll)
    weak: dict[int, Any] = {}
    carry_leaves, carry_def = _rules.as_tensor_leaves(op, "init", init, weak)
    init = tree_unflatten(carry_def, carry_leaves)
    x_leaves, x_def = xs_leaves(op, xs)
    if isinstance(length, torch.Tensor) and _context.is_tracing():
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
        if not isinstance(length, torch.SymInt):  # (a symbolic size under non-strict torch.export)
            length = _rules.check_int(op, "length", length, minimum=0)
    n = _rules.leading_length(op, "xs", x_leaves, x_def, length)
    if x_def.num_leaves and any(not isinstance(x, torch.Tensor) for x in tree_flatten(xs)[0]):
        xs = tree_unflatten(x_def, x_leaves)
    if weak:
        # Python scalars in init take the dtype the body gives them (JAX's weak types),
        # learned from one run of the body on the first step's x
        i0 = n - 1 if reverse else 0
        x0 = tree_unflatten(x_def, [x[i0] if n else x.new_empty(x.shape[1:]) for x in x_leaves])

        def new_carry(leaves: list[Any], x: Any) -> Any:
            res = f(tree_unflatten(carry_def, leaves), x)
            return res[0] if isinstance(res, (tuple, list)) and len(res) == 2 else None

        carry_leaves = _hop.promote_weak_init(
            carry_leaves, weak, new_carry, (x0,), runs=n > 0,
            rules=(op, "body function", f, (tree_unflatten(carry_def, carry_leaves), x0)),
        )
        init = tree_unflatten(carry_def, carry_leaves)
    if _context.is_tracing():
        _hop.check_side_effects(op, "body function", f)
        if _hop.unrolled_steps() or (_hop.fully_unrolled(unroll) and _hop.in_derivative()):
            # inside a traced derivative that is differentiated again: no HOP (see _hop). A
            # symbolic length is specialized: each length is its own unrolled graph. Every step
            # unrolled (`unroll=True`) inside any traced derivative: no HOP either, so that a
            # gradient of parameters stays exact (`_grad`: it is computed first-order, with
            # `tfun._first_order`'s refusal, only where a loop op is left)
            n = len(range(n))  # (Dynamo specializes `range`: a Python int)
            _hop.check_unrolled_length(op, f, n, unroll)
            return _unrolled_in_python(f, init, xs, n, bool(reverse))
        f = _hop.remat_body(f)
        if n and _hop.vmap_traced():
            # a carry leaf the body batches enters batched (JAX's fixpoint; torch's rule has none)
            i0 = n - 1 if reverse else 0
            x0 = tree_unflatten(x_def, [x[i0] for x in x_leaves])

            def body_carry(leaves: list[Any], x: Any) -> Any:
                res = f(tree_unflatten(carry_def, leaves), x)
                return res[0] if isinstance(res, (tuple, list)) and len(res) == 2 else None

            init = tree_unflatten(carry_def, _hop.batch_carry_like_body(tree_flatten(init)[0], body_carry, (x0,)))
        k = unroll_steps(unroll, n)
        if _hop.in_body() and isinstance(n, int) and 1 <= n <= k:
            # One step, or every step unrolled, inside another op's body: the steps run in the
            # body's graph, no HOP. Same values; and torch 2.13 cannot differentiate a scan HOP
            # nested in a loop body (Dynamo's "derivative for aten::detach_copy is not
            # implemented" where the inner body reads a tensor that requires grad), which
            # refused scanning `tfun.nn.LSTM.step` (a one-step scan) under tfun.jit (hunt 30 F3)
            return _steps_in_python(f, n, bool(reverse))(init, xs)
        if k > 1:
            # a static length (`len(range(n))`: Dynamo specializes `range`, so each length is a
            # graph of its own, as under jax.jit): with a symbolic one, Inductor failed to lower
            # the blocks' `(n // k, k, ...)` view ("KeyError: s86", a jitted fn's second length,
            # hunt 27)
            return _lower_unrolled(f, init, xs, len(range(n)), bool(reverse), k)
        return _hop.lower_seeing_grad(lambda c: _lower_scan(f, c, xs, n, bool(reverse)), init, lambda out: out[0])
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
    carry_sig = _rules.leaf_signature(carry_leaves)
    rules = _rules.first_call(op, f, carry_def, carry_sig, x_def, x_sig)

    if n == 0:
        x0 = tree_unflatten(x_def, [torch.empty(x.shape[1:], dtype=x.dtype, device=x.device) for x in x_leaves])
        carry0, y0 = split_pair(op, f, zero_length_outputs(op, "body function", f, (init, x0), rules))
        check_carry(op, f, carry_def, carry_leaves, carry0, weak=weak)
        y_leaves, y_def = tree_flatten(y0)
        return init, tree_unflatten(y_def, empty_outputs(y_leaves, [*carry_leaves, *x_leaves]))

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
    if rules.first:
        out = _rules.checked_call(op, "body function", f, (carry, x_at(i0)))
        carry, y = split_pair(op, f, out)
        _hop.check_output_leaves(op, "y", f, y)
        raw = carry
        carry = check_carry(op, f, carry_def, carry_leaves, carry, weak=weak)
        rules.record()
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
    if _rules.leaf_signature(tree_flatten(carry)[0]) != carry_sig:
        check_carry(op, f, carry_def, carry_leaves, carry, weak=weak)
    ys = stack_outputs(op, f, y_lists, y_def, reverse)
    return carry, ys


# ----------------------------------------------------------------------------------------
# Lowering under tfun.jit / torch.export: torch's scan (see `_hop`)
# ----------------------------------------------------------------------------------------


@_hop.assume_constant
def _escape_pair_message(op: str, got: Any, code: Any) -> str:
    """The message of a scan body that does not return a pair; `got` is the skeleton of
    what it returned (None for a tensor). Worded as the eager check words it."""
    name = code.co_name if code is not None else "the function"
    return _pair_message(op, "a tensor" if got is None else _rules.skeleton_node_text(got), _hop.fn_text(code), name)


def check_carry_traced(op: str, fn: Any, carry: Any, out: Any) -> Any:
    """`out` (what `fn` returned for `carry`) checked against `carry` inside a traced body,
    with the wording of the eager carry check; Python scalars become tensors."""
    in_leaves, in_td = tree_flatten(carry)
    leaves = _hop.check_result(op, "body_fun input and output", "carry", fn, in_td, in_leaves, out, REVISE_CARRY)
    return tree_unflatten(in_td, leaves)


def _check_step(op: str, f: Any, res: Any, in_td: Any, in_leaves: Sequence[Any], revise: str) -> tuple[list[Any], Any]:
    """One traced step's result `res = f(carry, x)`: a pair whose carry matches the input
    carry `(in_td, in_leaves)` and whose y has tensor (or Python scalar) leaves. Returns the
    new carry's leaves (Python scalars as tensors of the carry's dtype) and y."""
    if not isinstance(res, (tuple, list)) or len(res) != 2:
        got = None if isinstance(res, torch.Tensor) else _hop.skeleton(tree_structure(res))
        raise ArgumentTypeError(_escape_pair_message(op, got, _hop.code_of(f)))
    new_c, y = res
    _hop.check_output_leaves(op, "y", f, y)  # (in the order of the eager checks)
    return _hop.check_result(op, "body carry input and output", "carry", f, in_td, in_leaves, new_c, revise), y


def lower_splitting_complex(lower: Callable[[bool], Any], inputs: Any) -> Any:
    """`lower(split)`, the lowering of a loop (scan, map) whose complex leaves cross its HOP as
    `view_as_real` pairs when `split` (workaround 4 in `_lower_scan`; torch's loop autograd
    cannot differentiate those views). Not under export. Without grad mode they do; with it,
    where `inputs` (the loop's operands) hold a complex leaf, the loop is lowered split first
    and kept where its outputs do not require grad (nothing it reads does: a frozen model's
    generation loop called without `torch.no_grad()`, hunt 34 F3), else lowered again unsplit
    (the first lowering is then dead code, which Dynamo drops)."""
    if _hop.is_exporting():
        return lower(False)
    if not torch.is_grad_enabled():
        return lower(True)
    if any(isinstance(t, torch.Tensor) and t.is_complex() for t in tree_flatten(inputs)[0]):
        out = lower(True)
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(out)[0]):
            return out
    return lower(False)


def _lower_scan(
    f: Callable[[Any, Any], Any], init: Any, xs: Any, length: int, reverse: bool
) -> tuple[Any, Any]:
    """`torch._higher_order_ops.scan` with tfun pytrees, `xs=None` and Python scalars.

    `init`'s leaves that were Python scalars are already converted to the dtype the body
    gives them by `scan` (`_hop.promote_weak_init`, whose traced body run is dead code, as
    JAX traces a loop body twice to promote a weak `init`). Complex leaves: see
    `lower_splitting_complex`."""
    return lower_splitting_complex(lambda split: _lower_scan_as(f, init, xs, length, reverse, split), (init, xs))


def _lower_scan_as(
    f: Callable[[Any, Any], Any], init: Any, xs: Any, length: int, reverse: bool, split_complex: bool
) -> tuple[Any, Any]:
    """`_lower_scan`, complex leaves crossing the HOP as real pairs where `split_complex`."""
    _hop.begin_lowering()
    op = "tfun.lax.scan"
    c_leaves, c_td = tree_flatten(init)
    c_leaves = [x.contiguous() for x in c_leaves]
    x_leaves, x_td = tree_flatten(xs)
    # torch's scan traces the body on a contiguous copy of a slice and runs it on the slices of
    # `xs` as they are: for a strided `xs` (a transposed or sliced view) a `reshape` in the body,
    # traced as a view, failed at run time under `aot_eager` ("view size is not compatible with
    # input tensor's size and stride"); the slices are made to agree (a copy of a strided `xs`)
    x_leaves = [x.contiguous() for x in x_leaves]
    n_c = len(c_leaves)
    revise = REVISE_CARRY

    c_carrier, x_carrier = _hop.carrier(c_td, c_leaves), _hop.carrier(x_td, x_leaves)
    n_x = len(x_leaves)
    key = _hop.escape_new_key()  # the ys' structure goes around the HOP (`_hop.pack`)
    # Workarounds for inductor compiling torch 2.13's scan backward (not needed by export):
    # 1. torch's scan autograd saves per-step intermediates next to the body's outputs; when
    #    one of them *is* an output (tanh's result is both the new carry and what tanh's
    #    backward saves), its functionalization fails with "scan might be aliasing the input
    #    or the output". Cloning every body output avoids that. It is done whenever grad
    #    mode is on: the body may close over tensors that require grad, and inside the body
    #    a carry's `requires_grad` is that of `init`, not of later steps.
    # 2. inductor's scan lowering computes wrong values when the backward scan's tangents
    #    have stride 0 (the gradient of `carry.sum()`); a hook on each output makes them dense.
    # 3. torch's scan autograd accepts no integer or bool carries or ys ("outs_to_grad length
    #    (2) != tangents length (3)": it asks a tangent of every output but differentiates
    #    only the floating ones). Under grad mode they cross the HOP as float64 tensors that
    #    hold them exactly (`_to_floating` / `_from_floating`). Complex leaves are
    #    left alone: torch 2.13's scan autograd cannot differentiate complex view ops.
    for_inductor = not _hop.is_exporting()
    clone_all = for_inductor and torch.is_grad_enabled()
    check_export_constants(op, f)
    encode = _encodes_bits()  # (also under export: an exported program is differentiated too)
    c_dtypes = [t.dtype for t in c_leaves]
    # 4. Inductor (2.11-2.14.1) cannot compile a scan with a complex carry, `xs` or `ys`: its
    #    pass that rewrites scan as a while_loop leaves such a scan alone, then asserts ("scan
    #    is not lowered to while_loop"; the generation loop over `S4D/S5/LRU.step`, hunt 31).
    #    Where the scan is not differentiated they cross the HOP as `view_as_real` pairs (a
    #    view, exact; `split_complex`); where it is, complex leaves are refused (`tfun.jit`'s
    #    complex-loop-body message).
    split = split_complex
    c_cplx = [split and t.is_complex() for t in c_leaves]
    x_cplx = [split and t.is_complex() for t in x_leaves]
    batching = _hop.vmap_traced()

    def body(carry_flat: list[Any], x_flat: list[Any]) -> Any:
        raw_ins = list(carry_flat) + list(x_flat)
        if encode:
            carry_flat = [_from_floating(t, d) for t, d in zip(carry_flat[:n_c], c_dtypes)] + list(carry_flat[n_c:])
        if split:
            carry_flat = _from_real(carry_flat, c_cplx)
            x_flat = _from_real(x_flat, x_cplx)
        c_td_in = tree_structure(c_carrier)
        carry = tree_unflatten(c_td_in, list(carry_flat)[:n_c])
        x = tree_unflatten(tree_structure(x_carrier), list(x_flat)[:n_x])
        state = _hop.torch_state()
        with _hop.body_scope(grad=clone_all):
            res = f(carry, x)
        _hop.check_state(op, "body function", f, state)
        new_leaves, y = _check_step(op, f, res, c_td_in, carry_flat[:n_c], revise)
        new_leaves = [t.contiguous() for t in new_leaves]
        if batching:  # a carry that enters batched leaves batched (a body may return a constant)
            new_leaves = [_hop.batched_like(t, c) for t, c in zip(new_leaves, carry_flat[:n_c])]
        y_leaves, y_td = tree_flatten(y)
        y_leaves = [_hop.as_tensor(t) for t in y_leaves]
        y_dtypes = [t.dtype if isinstance(t, torch.Tensor) else None for t in y_leaves]
        if encode:
            new_leaves = [_to_floating(t) for t in new_leaves]
            y_leaves = [_to_floating(t) if isinstance(t, torch.Tensor) else t for t in y_leaves]
        if split:
            new_leaves = _to_real(new_leaves, c_cplx)
            y_leaves = _to_real(y_leaves, [isinstance(t, torch.Tensor) and t.is_complex() for t in y_leaves])
        ins = raw_ins + list(carry_flat) + list(x_flat)
        # every output a copy under tfun.jit, in every grad mode: torch's scan refuses a body
        # output that is a tensor the body closes over (`lambda c, x: (c + x, V)`) under
        # `torch.no_grad()` too (hunt 27); Inductor removes the copies it does not need
        outs = _hop.unalias(new_leaves + y_leaves, ins, clone_all=for_inductor)
        if n_c == 0:
            outs = [raw_ins[0].clone()] + outs  # the placeholder carry
        k = max(n_c, 1)
        ys_out = outs[k:]
        if encode:  # the original dtype travels as the key of a marker dict (see _unmark)
            ys_out = [_mark(t, d) for t, d in zip(ys_out, y_dtypes)]
        if split:  # (likewise a complex y's)
            ys_out = [{_COMPLEX_KEY: t} if d is not None and d.is_complex else t for t, d in zip(ys_out, y_dtypes)]
        # torch's scan needs at least one y: stack a dummy 0-d tensor when y has no leaves
        extra = [] if y_leaves else [torch.zeros((), device=raw_ins[0].device)]
        return list(outs[:k]), (_hop.pack(key, y_td, ys_out), extra)

    if length == 0:
        return _scan_empty(f, init, xs, x_leaves, x_td)
    dev = (c_leaves + x_leaves)[0].device if (c_leaves or x_leaves) else torch.device("cpu")
    init_flat = c_leaves if n_c else [torch.zeros((), device=dev)]
    xs_flat = list(x_leaves) if x_leaves else [torch.zeros((length,), device=dev)]
    if encode:
        init_flat = [_to_floating(t) for t in init_flat]
    if split:
        init_flat = _to_real(init_flat, c_cplx) if n_c else init_flat
        xs_flat = _to_real(xs_flat, x_cplx) if x_leaves else xs_flat
    # copies: torch's scan refuses an `init` that is also a tensor the body closes over, or a
    # view of one ("scan might be aliasing the input or the output": `fori_loop(0, n, lambda i,
    # z: f(z, x), x)`, `scan(step, x[0], x)` reading `x[1]`; hunt 28), and which tensors the
    # body closes over is not known here (Dynamo lifts them). A carry-sized copy per call, as
    # while_loop's; `xs` may alias them (torch's scan slices it)
    init_flat = [t.clone() for t in init_flat] if n_c else init_flat
    operands = _hop.distinct(list(init_flat) + list(xs_flat))  # e.g. scan(cell, (h0, h0), xs)
    init_flat, xs_flat = operands[: len(init_flat)], operands[len(init_flat) :]
    carry_flat, (ys, _) = _hop.scan_flat(body, init_flat, xs_flat, reverse)
    carry_flat = list(carry_flat)[:n_c]
    if encode:
        carry_flat = [_from_floating(t, d) for t, d in zip(carry_flat, c_dtypes)]
    if split:
        carry_flat = _from_real(carry_flat, c_cplx)
    ys = _hop.unpack(key, ys)
    if encode or split:
        ys = _unmark(ys)
    if for_inductor:
        carry_flat = [_contiguous_grad(t) for t in carry_flat]
        y_leaves, y_td = tree_flatten(ys)
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in y_leaves):
            ys = tree_unflatten(y_td, [_contiguous_grad(t) for t in y_leaves])
    return tree_unflatten(c_td, carry_flat), ys


def unroll_steps(unroll: int | bool, n: int) -> int:
    """The steps per compiled iteration that `unroll` asks for, for a loop of `n` steps: a
    Python int even where `n` is a symbolic length (a jitted function's trace at a second
    length), where `min(unroll, n)` put a symbolic block size into the body's graph, which
    torch's scan could not save for its backward (hunt 26, F1). `len(range(n))` is a Python
    int (Dynamo specializes `range`: that length gets its own graph)."""
    if _hop.fully_unrolled(unroll):
        return len(range(n))
    k = int(unroll)  # False is 1
    return k if n >= k else len(range(n))


def _lower_unrolled(
    f: Callable[[Any, Any], Any], init: Any, xs: Any, length: int, reverse: bool, k: int
) -> tuple[Any, Any]:
    """`scan` with `unroll=k` under tracing: torch's scan over blocks of `k` steps, whose body
    runs `f` `k` times in Python (so the compiler sees, and fuses, `k` steps at once), then
    one block of the `length % k` steps left over. `reverse` scans the blocks, and each
    block's steps, from the end; the left-over steps are then the first `length % k`."""
    # (not divmod: Dynamo cannot trace it.) The left-over count is a Python int (`range` is
    # specialized) where the length is symbolic: it sizes a block body (hunt 26, F1)
    q, r = length // k, len(range(length % k))
    x_leaves, x_td = tree_flatten(xs)

    def block(size: int) -> Callable[[Any, Any], Any]:
        return _steps_in_python(f, size, reverse)

    def blocks(lo: int, hi: int, size: int) -> Any:  # steps lo..hi of xs as (blocks, size, ...)
        return tree_unflatten(x_td, [x[lo:hi].reshape(-1, size, *x.shape[1:]) for x in x_leaves])

    def steps(ys: Any) -> Any:  # (blocks, size, ...) back to (steps, ...)
        y_leaves, y_td = tree_flatten(ys)
        return tree_unflatten(y_td, [y.reshape(-1, *y.shape[2:]) for y in y_leaves])

    main_lo = r if reverse else 0
    carry, ys = _lower_scan(block(k), init, blocks(main_lo, main_lo + q * k, k), q, reverse)
    ys = steps(ys)
    if r:
        rest_lo = 0 if reverse else q * k
        carry, rest = _lower_scan(block(r), carry, blocks(rest_lo, rest_lo + r, r), 1, reverse)
        parts = (steps(rest), ys) if reverse else (ys, steps(rest))
        y_leaves, y_td = tree_flatten(parts[0])
        ys = tree_unflatten(y_td, [torch.cat(pair) for pair in zip(y_leaves, tree_flatten(parts[1])[0])])
    return carry, ys


def _steps_in_python(f: Callable[[Any, Any], Any], size: int, reverse: bool) -> Callable[[Any, Any], Any]:
    """`(carry, xb) -> (carry, ys)`: `size` steps of `f` run in Python over `xb`, whose leaves
    have a leading axis of `size` (in reverse order for `reverse`), the `ys` stacked."""
    op = "tfun.lax.scan"

    def run_block(carry: Any, xb: Any) -> Any:
        # (the slices' structure is `xb`'s, which the body's trace built: under non-strict
        # torch.export, Dynamo traces this body and refuses optree's `x_td` from outside it)
        xb_leaves, xb_td = tree_flatten(xb)
        ys: list[Any] = []  # in the order of the steps run; appended (Dynamo 2.11 cannot
        # trace `list.__setitem__` in a HOP body), put back in step order after the loop
        for j in range(size - 1, -1, -1) if reverse else range(size):
            res = f(carry, tree_unflatten(xb_td, [x[j] for x in xb_leaves]))
            in_leaves, in_td = tree_flatten(carry)
            new_leaves, y = _check_step(op, f, res, in_td, in_leaves, REVISE_CARRY)
            carry = tree_unflatten(in_td, new_leaves)
            ys.append(y)
        if reverse:
            ys = ys[::-1]
        y_td = tree_structure(ys[0])
        flat = [[_hop.as_tensor(t) for t in tree_flatten(y)[0]] for y in ys]
        return carry, tree_unflatten(y_td, [torch.stack(col) for col in zip(*flat)])

    return run_block


def _unrolled_in_python(f: Callable[[Any, Any], Any], init: Any, xs: Any, length: int, reverse: bool) -> Any:
    """Traced `scan` inside a derivative that is differentiated again (`_hop.unroll_scope`):
    every step in the graph, no HOP, so autograd can differentiate the loop twice."""
    x_leaves, x_td = tree_flatten(xs)
    if length == 0:
        return _scan_empty(f, init, xs, x_leaves, x_td)
    with _hop.unroll_scope(True, length):
        return _steps_in_python(f, length, reverse)(init, xs)


def check_export_constants(op: str, f: Any) -> None:
    """Under non-strict `torch.export`, refuse a scan body that reads a real tensor (see
    `_refuse_real_constants`); elsewhere nothing."""
    if _hop.is_exporting() and not _context.is_dynamo_tracing():
        _refuse_real_constants(op, f)


def _refuse_real_constants(op: str, f: Any) -> None:
    """Non-strict `torch.export`: torch 2.13's scan fails on a *real* tensor that the body
    reads from its globals or closure (a module-level tensor; parameters and buffers are
    fake there) with "Cannot access data pointer of Tensor". Refuse it with a tfun error
    that names the tensors and the fix, before torch fails."""
    from torch._subclasses.fake_tensor import is_fake

    found: list[str] = []
    seen: set[int] = set()

    def visit(fn: Any, where: str, depth: int) -> None:
        fn = fn if isinstance(fn, types.FunctionType) else _funcinfo.unwrap_callable(fn)
        if not isinstance(fn, types.FunctionType) or id(fn) in seen or depth < 0:
            return
        seen.add(id(fn))
        named = [(f"nonlocal `{n}`", c) for n, c in zip(fn.__code__.co_freevars, fn.__closure__ or ())]
        values = []
        for label, cell in named:
            try:
                values.append((label, cell.cell_contents))
            except ValueError:
                continue
        values += [(f"global `{n}`", fn.__globals__[n]) for n in sorted(_rules.global_names(fn.__code__)) if n in fn.__globals__]
        for label, v in values:
            if isinstance(v, torch.Tensor) and not is_fake(v):
                found.append(f"{label} of `{fn.__name__}`{where}: {_rules.dtype_name(v.dtype)}{list(v.shape)}")
            elif isinstance(v, (types.FunctionType, functools.partial)):
                visit(v, f" (called by `{fn.__name__}`)", depth - 1)

    visit(f, "", 4)
    if found:
        raise JitError(
            format_message(
                f"{op}: under torch.export (non-strict), the body reads tensors that are neither inputs nor "
                f"parameters or buffers of the exported module, which torch {torch.__version__}'s scan cannot "
                "trace:",
                found,
                function=_hop.fn_text(_hop.code_of(f)),
                revise="Register such a tensor as a buffer of the module (`self.register_buffer(...)`) or pass it "
                "as an argument, or export with strict=True.",
            )
        )


# Integer and bool leaves cross torch's scan as float64 tensors that hold them exactly (`_to_floating`).
_BITS_KEY = "__tfun_bits__"  # + the dtype's name: the marker dict of such a y leaf


def _is_bits(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def _to_floating(t: torch.Tensor) -> torch.Tensor:
    """An integer or bool `t` as float64 values that hold it exactly; any other `t` itself.

    A dtype of at most 32 bits (bool, int8 ... int32, uint8 ... uint32) converts: float64
    holds each of its values. A 64-bit integer becomes its high and low 32-bit halves on a
    new last dimension (`[..., 0]` the signed high half, `[..., 1]` the low half), each exact.
    Not its bits viewed as float64: a negative int64 is a NaN bit pattern there, and Inductor,
    folding a constant (`torch.tensor(-7)` as a scan's `init`), wrote the canonical NaN,
    which came back as 9221120237041090560 (hunt 32, finding 1). Also no `view(dtype)`,
    which functorch 2.11 cannot batch (a traced vmap of such a loop was a JitError)."""
    if not _is_bits(t.dtype):
        return t
    if t.dtype.itemsize < 8:
        return t.to(torch.float64)
    t = t.to(torch.int64)
    return torch.stack([(t >> 32).to(torch.float64), (t & 0xFFFFFFFF).to(torch.float64)], dim=-1)


def _from_floating(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `_to_floating` for a leaf of dtype `dtype`."""
    if not _is_bits(dtype):
        return t
    if dtype.itemsize < 8:
        return t.to(dtype)
    return ((t[..., 0].to(torch.int64) << 32) | t[..., 1].to(torch.int64)).to(dtype)


def _mark(t: Any, dtype: Any) -> Any:
    """A y leaf as a HOP output: an encoded one in a marker dict whose key names its dtype."""
    if dtype is None or not _is_bits(dtype):
        return t
    return {_BITS_KEY + str(dtype).replace("torch.", ""): t}


def _encodes_bits() -> bool:
    """Whether a HOP's integer and bool outputs cross it as exact float64 (`_to_floating`): under grad
    mode (torch's autograd of cond/map/scan asks a tangent of every output), under
    `torch.export` too, whose program is differentiated through its module (hunt 24: "outs_to_grad
    length (2) != tangents length (3)" from the exported module of a scan with an integer carry)."""
    return torch.is_grad_enabled()


def _mark_bits(leaves: list[Any], td: Any) -> tuple[list[Any], Any]:
    """The flat outputs `leaves` of treedef `td` with each integer or bool leaf encoded
    (`_to_floating`) in a marker dict (`_mark`): the new flat leaves and their treedef."""
    if all(x.is_floating_point() or x.is_complex() for x in leaves):
        return leaves, td
    return tree_flatten(tree_unflatten(td, [_mark(_to_floating(x), x.dtype) for x in leaves]))


_COMPLEX_KEY = "__tfun_complex__"  # the marker dict of a complex y crossing as real pairs


def _mark_complex(leaves: list[Any], td: Any) -> tuple[list[Any], Any]:
    """The flat outputs `leaves` of treedef `td` with each complex leaf as its `view_as_real`
    pair in a marker dict (`_unmark` makes it complex again): the new flat leaves and treedef."""
    marked = [
        {_COMPLEX_KEY: _to_real([x], [True])[0]} if isinstance(x, torch.Tensor) and x.is_complex() else x for x in leaves
    ]
    return tree_flatten(tree_unflatten(td, marked))


def _to_real(leaves: list[Any], which: list[bool]) -> list[Any]:
    """The leaves flagged in `which` (complex tensors) as their `view_as_real` pairs."""
    return [torch.view_as_real(t.resolve_conj().contiguous()) if w else t for t, w in zip(leaves, which)] + list(
        leaves[len(which) :]
    )


def _from_real(leaves: list[Any], which: list[bool]) -> list[Any]:
    """Inverse of `_to_real` (the leaves past `which` are left as they are)."""
    return [torch.view_as_complex(t.contiguous()) if w else t for t, w in zip(leaves, which)] + list(leaves[len(which) :])


def _is_marked(x: Any) -> bool:
    return type(x) is dict and len(x) == 1 and next(iter(x)).startswith((_BITS_KEY, _COMPLEX_KEY))


def _unmark(tree: Any) -> Any:
    """Inverse of `_mark` over a tree of stacked ys."""
    parts, td = tree_flatten(tree, is_leaf=_is_marked, none_is_leaf=True)
    out = []
    for x in parts:
        if _is_marked(x):
            ((key, t),) = x.items()
            if key == _COMPLEX_KEY:
                x = torch.view_as_complex(t.contiguous())
            else:
                x = _from_floating(t, getattr(torch, key[len(_BITS_KEY) :]))
        out.append(x)
    return tree_unflatten(td, out)


def _make_contiguous(g: torch.Tensor) -> torch.Tensor:
    return g.contiguous()


def _contiguous_grad(t: Any) -> Any:
    """`t`, whose gradient is made dense (contiguous) before it reaches scan's backward."""
    if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled() and not _compat.scan_backward_dense() and not _hop.in_body():
        t = t.view_as(t)
        t.register_hook(_make_contiguous)
    return t


def _scan_empty(f: Any, init: Any, xs: Any, x_leaves: list[Any], x_td: Any) -> tuple[Any, Any]:
    """Zero steps: the final carry is `init`; `ys` have a leading axis of size 0."""
    x0 = tree_unflatten(x_td, [x.new_zeros(x.shape[1:]) for x in x_leaves])
    _, y = f(init, x0)
    y_leaves, y_td = tree_flatten(y)
    y_leaves = [_hop.as_tensor(t) for t in y_leaves]
    # joined to the graph of the inputs and of what the body closes over (through its one
    # traced call), as eagerly: `.backward()` of a T=0 output ran into torch's "does not
    # require grad" under tfun.jit (hunt 27)
    return init, tree_unflatten(y_td, empty_outputs(y_leaves, [*tree_flatten(init)[0], *x_leaves, *y_leaves]))


__all__ = ["scan"]
