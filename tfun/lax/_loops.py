"""`while_loop` and `fori_loop`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from .. import _context, _funcinfo, _rules
from .._errors import ArgumentTypeError, ArgumentValueError, JitError, format_message
from .._tree import tree_flatten, tree_leaves, tree_structure, tree_unflatten
from . import _batching, _hop
from ._scan import (
    REVISE_CARRY,
    check_body_abstractly,
    check_carry,
    check_carry_traced,
    check_export_constants,
    check_unroll,
    scan,
)

T = TypeVar("T")


def _check_pred(op: str, fn: Callable[..., Any], pred: Any) -> None:
    _rules.check_scalar_predicate(op, "cond_fun's output", pred, fn)


def _stops(op: str, cond_fun: Callable[..., Any], pred: Any) -> bool:
    """Whether an eager while_loop stops at `pred` (cond_fun's output): `not pred`, with
    make_fx's refusal to read a traced value made a tfun error (`_rules.raise_if_unreadable`)."""
    try:
        return not pred
    except RuntimeError as e:
        _rules.raise_if_unreadable(op, "cond_fun's output", pred, e, cond_fun)
        raise


def while_loop(cond_fun: Callable[[T], Any], body_fun: Callable[[T], T], init_val: T) -> T:
    """Apply `body_fun` while `cond_fun` is true.

    Semantics, as a Python function (JAX's `lax.while_loop`, exactly):

    ```python
    def while_loop(cond_fun, body_fun, init_val):
        val = init_val
        while cond_fun(val):
            val = body_fun(val)
        return val
    ```

    Type: `(c -> bool) -> (c -> c) -> c -> c`.

    `cond_fun` must return a boolean scalar (a bool tensor of shape `()` or a Python bool);
    `body_fun` must return a value of the structure, dtypes, shapes and devices of
    `init_val` (checked on fake tensors when the loop runs zero times, as JAX traces the
    body whatever the trip count). Python scalars in `init_val` become 0-d tensors (an
    `int` becomes int64). The trip count may depend on data. Eagerly each test of
    `cond_fun` reads one boolean from the device; under `tfun.jit` it lowers to PyTorch's
    `while_loop` higher-order op.

    **Arguments:**

    - `cond_fun`: `val -> bool scalar`.
    - `body_fun`: `val -> val`.
    - `init_val`: the initial loop value, a pytree; a Python scalar in it is weakly typed,
      as in JAX, and takes the dtype the body gives it (as `scan`'s `init`).

    **Returns:** the final loop value.
    """
    op = "tfun.lax.while_loop"
    _rules.check_callable(op, "cond_fun", cond_fun)
    _rules.check_callable(op, "body_fun", body_fun)
    weak: dict[int, Any] = {}
    leaves, treedef = _rules.as_tensor_leaves(op, "init_val", init_val, weak)
    if weak:
        # Python scalars in init_val take the dtype the body gives them (JAX's weak types),
        # learned from one run of the body on init_val (on fake tensors where the loop runs
        # zero times)
        runs = True
        if not _context.is_tracing():
            val0 = tree_unflatten(treedef, leaves)
            pred = _rules.checked_call(op, "cond_fun", cond_fun, (val0,))
            _check_pred(op, cond_fun, pred)
            runs = _batching.is_batched(pred) or bool(pred)
        leaves = _hop.promote_weak_init(
            leaves,
            weak,
            lambda ls: body_fun(tree_unflatten(treedef, ls)),
            runs=runs,
            rules=(op, "body_fun", body_fun, (tree_unflatten(treedef, leaves),)),
        )
    val: Any = tree_unflatten(treedef, leaves)
    if _context.is_tracing():
        _hop.refuse_unrolled(op, body_fun)
        _hop.refuse_vmapped(op, body_fun)
        _hop.check_side_effects(op, "cond_fun", cond_fun)
        _hop.check_side_effects(op, "body_fun", body_fun)
        body = _hop.remat_body(body_fun)
        return _hop.lower_seeing_grad(lambda v: _lower_while_loop(cond_fun, body, v), val, lambda out: out)
    sig = _rules.leaf_signature(leaves)
    rules = _rules.first_call(op, (cond_fun, body_fun), treedef, sig)
    # What has been checked for this signature: None, nothing; "cond", cond_fun for real and
    # body_fun only on fake tensors (the loop ran zero times); True, both for real.
    state = rules.recorded
    if state is not True:
        if state is None:
            pred = _rules.checked_call(op, "cond_fun", cond_fun, (val,))
            _check_pred(op, cond_fun, pred)
        else:
            pred = cond_fun(val)
        if _batching.is_batched(pred):
            return _batched_while(op, cond_fun, body_fun, val, pred, treedef, leaves, rules)
        if _stops(op, cond_fun, pred):
            if state is None:
                check_body_abstractly(op, "body_fun", body_fun, (val,), treedef, leaves)
                rules.record("cond")
            return val
        new = _rules.checked_call(op, "body_fun", body_fun, (val,))
        checked = check_carry(op, body_fun, treedef, leaves, new, what="body_fun input and output", weak=weak)
        if checked is not new:
            rules.part("weak").record()
        rules.record(True)
        val = checked
    is_leaf = treedef.is_leaf()
    cf = cast(Callable[[Any], Any], cond_fun)
    bf = cast(Callable[[Any], Any], body_fun)
    if not rules.part("weak").first:
        # the body returns Python scalars for 0-d carries (weakly typed, as in JAX): they
        # become tensors of the carry's dtype at every step

        def bf(v: Any) -> Any:
            return _rules.normalize_weak_outputs(leaves, body_fun(v))

    while True:
        pred = cf(val)
        if _batching.is_batched(pred):
            return _batched_while(op, cond_fun, body_fun, val, pred, treedef, leaves, rules)
        try:  # (`_stops` inline: a call per step costs more than the `try`)
            if not pred:
                break
        except RuntimeError as e:
            _rules.raise_if_unreadable(op, "cond_fun's output", pred, e, cond_fun)
            raise
        val = bf(val)
        if is_leaf:
            if type(val) is not torch.Tensor and not isinstance(val, torch.Tensor):  # fast path first
                val = check_carry(op, body_fun, treedef, leaves, val, what="body_fun input and output", weak=weak)
        elif tree_structure(val) != treedef:
            check_carry(op, body_fun, treedef, leaves, val, what="body_fun input and output", weak=weak)
    if _rules.leaf_signature(tree_flatten(val)[0]) != sig:
        check_carry(op, body_fun, treedef, leaves, val, what="body_fun input and output", weak=weak)
    return cast(T, val)


def _batched_while(
    op: str,
    cond_fun: Callable[..., Any],
    body_fun: Callable[..., Any],
    val: Any,
    pred: torch.Tensor,
    treedef: Any,
    leaves: Any,
    rules: _rules.FirstCall,
) -> Any:
    """vmap over a data-dependent condition: loop while any example is active, and freeze
    the examples whose condition is false (JAX's batching rule for while_loop).

    The carry rules hold as without vmap: `torch.where` would otherwise promote a dtype
    the body changes, or broadcast a shape it changes, without a word."""
    if not _batching.any_true(pred):
        if rules.first:
            check_body_abstractly(op, "body_fun", body_fun, (val,), treedef, leaves)
            rules.record("cond")
        return val
    sig = _rules.leaf_signature(leaves)
    checked = rules.recorded is True
    while _batching.any_true(pred):
        if checked:
            new = body_fun(val)
        else:
            new = _rules.checked_call(op, "body_fun", body_fun, (val,))
        new_leaves, new_def = tree_flatten(new)
        if new_def != treedef or _rules.leaf_signature(new_leaves) != sig:
            check_carry(op, body_fun, treedef, leaves, new, what="body_fun input and output")
        if not checked:
            rules.record(True)
            checked = True
        old_leaves = tree_flatten(val)[0]
        # A leaf the body forwards unchanged (the same tensor) needs no select, and stays
        # unbatched when it was (JAX's forwarding: `out_axes=None` may apply to it).
        val = tree_unflatten(
            treedef, [n if n is o else torch.where(pred, n, o) for n, o in zip(new_leaves, old_leaves)]
        )
        pred = cond_fun(val)
    return val


def _loop_bound(op: str, name: str, v: Any) -> Any:
    if isinstance(v, torch.SymInt):
        # a size that is a symbol (`xs.shape[0]` under non-strict torch.export with a `Dim`):
        # a static bound whose value the graph keeps symbolic (Dynamo shows it as an int)
        return v
    given = v
    # numpy bounds: JAX takes them (a concrete one is the int it holds; a traced one, a tensor)
    v = _rules.from_numpy(v)
    if isinstance(v, bool) or not isinstance(v, (int, torch.Tensor)):
        raise ArgumentTypeError(
            f"{op}: lower and upper must be integers (a Python int or an integer tensor of shape ()), but "
            f"{name} is {_rules.describe_leaf(given)}."
        )
    if isinstance(v, torch.Tensor) and (v.dim() != 0 or v.is_floating_point() or v.is_complex() or v.dtype == torch.bool):
        raise ArgumentTypeError(
            f"{op}: lower and upper must be integers (a Python int or an integer tensor of shape ()), but "
            f"{name} is {_rules.describe_leaf(given)}."
        )
    return v


def fori_loop(
    lower: int | torch.Tensor,
    upper: int | torch.Tensor,
    body_fun: Callable[[Any, T], T],
    init_val: T,
    *,
    unroll: int | bool | None = None,
) -> T:
    """Loop `body_fun` over the integers from `lower` to `upper`.

    Semantics, as a Python function (JAX's `lax.fori_loop`):

    ```python
    def fori_loop(lower, upper, body_fun, init_val):
        val = init_val
        for i in range(lower, upper):
            val = body_fun(i, val)
        return val
    ```

    Type: `int -> int -> (int -> c -> c) -> c -> c`.

    `i` is passed as a 0-d integer tensor (int64 for Python bounds, the promoted dtype of
    tensor bounds), as JAX passes a traced integer. With Python-int bounds the loop has a
    static trip count and lowers to `scan` under `tfun.jit`; with tensor bounds it lowers
    to `while_loop`.

    **Arguments:**

    - `lower`, `upper`: Python ints or integer tensors of shape `()`.
    - `body_fun`: `(i, val) -> val`.
    - `init_val`: the initial loop value, a pytree; a Python scalar in it is weakly typed,
      as in JAX, and takes the dtype the body gives it (as `scan`'s `init`).
    - `unroll`: with Python-int bounds, the steps per iteration of the compiled loop under
      `tfun.jit`, as in `scan` (an int `k >= 1`, or `True` / `0` for all). Eagerly it changes
      nothing. A loop with a bound that is traced (a tensor under `tfun.jit`) or differs per
      example (under `vmap`) is a `while_loop`, whose trip count is not static: there, as in
      JAX, an int `unroll` other than 1 (`0`, `2`, ...) is an `ArgumentValueError` (`None`,
      `False`, `1` and, as JAX's check is `unroll != 1`, `True` change nothing).

    **Returns:** the final loop value.
    """
    op = "tfun.lax.fori_loop"
    _rules.check_callable(op, "body_fun", body_fun)
    # a numpy bound, which tfun.jit traces (its messages say so, and what to pass instead)
    numpy_bound = _rules.is_numpy_scalar(lower) or _rules.is_numpy_scalar(upper)
    lower = _loop_bound(op, "lower", lower)
    upper = _loop_bound(op, "upper", upper)
    if unroll is not None:
        unroll = check_unroll(op, unroll)
    tensors: list[torch.Tensor] = [v for v in (lower, upper) if isinstance(v, torch.Tensor)]
    dtype = torch.int64
    device = torch.device("cpu")
    if tensors:
        dtype = tensors[0].dtype if len(tensors) == 1 else torch.promote_types(tensors[0].dtype, tensors[1].dtype)
        device = tensors[0].device
    weak: dict[int, Any] = {}
    leaves, treedef = _rules.as_tensor_leaves(op, "init_val", init_val, weak)
    if weak:
        # Python scalars in init_val take the dtype the body gives them (JAX's weak types),
        # learned from one run of the body at index `lower` (on fake tensors where the loop
        # runs zero times)
        runs = len(tensors) > 0 or bool(upper > lower)  # not bool(list): Dynamo 2.11 cannot trace it
        i0 = torch.as_tensor(lower, dtype=dtype, device=device)
        leaves = _hop.promote_weak_init(
            leaves,
            weak,
            lambda ls, i: body_fun(i, tree_unflatten(treedef, ls)),
            (i0,),
            runs=runs,
            rules=(op, "body_fun", body_fun, (i0, tree_unflatten(treedef, leaves))),
        )
    val: Any = tree_unflatten(treedef, leaves)

    tracing = _context.is_tracing()
    if tracing or any(_batching.is_batched(t) for t in tensors):
        # Traced, or a bound that differs per example under vmap: a static trip count is
        # not known, so loop with while_loop (whose batching rule freezes finished examples).
        if tracing:
            _hop.check_side_effects(op, "body_fun", body_fun)
        if not tensors:
            # A symbolic bound (a Python int argument that tfun.jit has seen change) stays a
            # symbol (see `_loop_bound`): the comparison below guards on the trip count's
            # sign only. Not `torch.sym_max(span, 0)`: Inductor could not compile a scan of
            # `Max(0, s)` steps ("KeyError: s66" in `sympy_interp` on every later call,
            # torch 2.11-2.14.1; hunt 34 F6).
            n = upper - lower

            def step(v: Any, i: Any) -> Any:
                # checked here, so that a bad carry is reported as fori_loop's, with body_fun named
                return _traced_fori_body(op, body_fun, i, v), None

            # the index is scanned over rather than carried: torch 2.13's scan autograd
            # fails on an integer carry ("outs_to_grad length != tangents length")
            if n <= 0:
                return val
            check_export_constants(op, body_fun)
            idx = torch.arange(lower, lower + n, dtype=dtype, device=device)
            val, _ = scan(step, val, idx, length=n, unroll=1 if unroll is None else unroll)
            return val
        if unroll is not None and unroll is not False and unroll != 1:
            # JAX's rule: a loop whose trip count is not static (a traced or per-example
            # bound) is a while_loop, which cannot be unrolled
            raise ArgumentValueError(
                format_message(
                    f"{op}: unroll={unroll!r} needs a static trip count, but a loop bound is a "
                    + (
                        ("numpy value, which tfun.jit traces as an array (a traced tensor)." if numpy_bound else "traced tensor (under tfun.jit).")
                        if tracing
                        else "tensor that differs per example (under vmap)."
                    ),
                    revise="Pass Python ints for lower and upper to unroll the loop (a numpy value: `int(n)` outside "
                    "tfun.jit, or pass it in an argument marked static, `tfun.jit(f, static_argnums=...)`), or leave "
                    "unroll out.",
                )
            )
        lo = torch.as_tensor(lower, dtype=dtype, device=device)
        hi = torch.as_tensor(upper, dtype=dtype, device=device)

        def w_cond(c: Any) -> Any:
            return c[0] < c[1]

        if tracing:
            _hop.refuse_unrolled(op, body_fun)  # (a traced bound: no static trip count to unroll)
            if _hop.vmap_traced():
                # refused here, as fori_loop's, rather than by the while_loop it would lower to
                # (whose message names a loop the user did not write; hunt 31, finding 5)
                raise JitError(
                    format_message(
                        f"{op}: under tfun.jit inside a torch.func transform (tfun.vmap, tfun.jvp, jacfwd, ...), "
                        "a loop bound is "
                        + (
                            "a numpy value, which tfun.jit traces as an array (a traced tensor)"
                            if numpy_bound
                            else "a traced tensor"
                        )
                        + f", so the loop has no static trip count and lowers to torch's while_loop, which torch "
                        f"{torch.__version__} cannot trace there (it has no vmap or jvp rule).",
                        function=_funcinfo.describe(body_fun),
                        revise="Pass Python ints for lower and upper (a size such as `x.shape[0]` is one; a numpy "
                        "value: `int(n)` outside tfun.jit, or pass it in an argument marked static, "
                        "`tfun.jit(f, static_argnums=...)`), keep the batch as a tensor dimension in the carry "
                        "instead of vmapping over it, or apply tfun.vmap outside tfun.jit (`tfun.vmap(tfun.jit(f))`).",
                    )
                )

            def w_body(c: Any) -> Any:
                return (c[0] + 1, c[1], _traced_fori_body(op, body_fun, c[0], c[2]))

        else:
            # Eager vmap: the rules are fori_loop's and body_fun's, not those of the
            # while_loop this runs on (whose body would be named in its errors).
            _check_fori_body_once(op, body_fun, lo, val, treedef, leaves, dtype, device)
            sig = _rules.leaf_signature(leaves)

            def w_body(c: Any) -> Any:
                out = body_fun(c[0], c[2])
                out_leaves, out_def = tree_flatten(out)
                if out_def != treedef or _rules.leaf_signature(out_leaves) != sig:
                    check_carry(op, body_fun, treedef, leaves, out, what="body_fun input and output")
                return (c[0] + 1, c[1], out)

        return while_loop(w_cond, w_body, (lo, hi, val))[2]

    try:
        lo_i, hi_i = int(lower), int(upper)
    except RuntimeError as e:
        _rules.raise_if_unreadable(op, "a bound", upper if isinstance(upper, torch.Tensor) else lower, e)
        raise
    if hi_i <= lo_i:
        _check_fori_body_once(op, body_fun, lo_i, val, treedef, leaves, dtype, device)
        return val
    idx = torch.arange(lo_i, hi_i, dtype=dtype, device=device).unbind(0)
    sig = _rules.leaf_signature(leaves)
    rules = _rules.first_call(op, body_fun, treedef, sig, dtype)
    start = 0
    if rules.first:
        new = _rules.checked_call(op, "body_fun", body_fun, (idx[0], val))
        checked = check_carry(op, body_fun, treedef, leaves, new, what="body_fun input and output", weak=weak)
        if checked is not new:
            rules.part("weak").record()
        rules.record()
        val = checked
        start = 1
    is_leaf = treedef.is_leaf()
    bf2 = cast(Callable[[Any, Any], Any], body_fun)
    if not rules.part("weak").first:
        # Python scalars for 0-d carries (weakly typed, as in JAX): tensors at every step

        def bf2(i: Any, v: Any) -> Any:
            return _rules.normalize_weak_outputs(leaves, body_fun(i, v))

    for k in range(start, len(idx)):
        val = bf2(idx[k], val)
        if is_leaf:
            if type(val) is not torch.Tensor and not isinstance(val, torch.Tensor):  # fast path first
                val = check_carry(op, body_fun, treedef, leaves, val, what="body_fun input and output", weak=weak)
        elif tree_structure(val) != treedef:
            check_carry(op, body_fun, treedef, leaves, val, what="body_fun input and output", weak=weak)
    if _rules.leaf_signature(tree_flatten(val)[0]) != sig:
        check_carry(op, body_fun, treedef, leaves, val, what="body_fun input and output", weak=weak)
    return cast(T, val)


def _traced_fori_body(op: str, body_fun: Callable[..., Any], i: Any, val: Any) -> Any:
    """`body_fun(i, val)` inside the HOP body that a traced fori_loop lowers to (scan's or
    while_loop's), under fori_loop's rules, so that its errors name fori_loop and
    `body_fun` as eagerly, not the lowering's own body."""
    state = _hop.torch_state()
    out = body_fun(i, val)
    _hop.check_state(op, "body_fun", body_fun, state)
    return check_carry_traced(op, body_fun, val, out)


def _check_fori_body_once(
    op: str,
    body_fun: Callable[..., Any],
    i: int | torch.Tensor,
    val: Any,
    treedef: Any,
    leaves: Any,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """body_fun's carry rules on fake tensors, once per signature, where it may not run
    for real (an empty range; bounds that differ per example under vmap)."""
    rules = _rules.first_call(op, body_fun, treedef, _rules.leaf_signature(leaves), dtype)
    fake = rules.part("fake")
    if not rules.first or not fake.first:
        return
    if not isinstance(i, torch.Tensor):
        i = torch.tensor(i, dtype=dtype, device=device)
    check_body_abstractly(op, "body_fun", body_fun, (i, val), treedef, leaves)
    fake.record()


# ----------------------------------------------------------------------------------------
# Lowering under tfun.jit / torch.export: torch's while_loop (see `_hop`)
# ----------------------------------------------------------------------------------------


def _lower_while_loop(
    cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any], init_val: Any
) -> Any:
    """`torch.while_loop` over the flat leaves of `init_val` (whose Python scalars
    `while_loop` has converted: see `_scan._lower_scan`)."""
    _hop.begin_lowering()
    op = "tfun.lax.while_loop"
    leaves, td = tree_flatten(init_val)
    # copies: torch's while_loop refuses a carry input that is also an input its functions
    # close over ("cond_fn might be aliasing the input"), as when the body reads a fori_loop
    # bound or the initial value; which tensors they close over is not known here
    leaves = [x.clone(memory_format=torch.contiguous_format) for x in leaves]
    if not leaves:
        # nothing is carried: the loop cannot change anything observable
        return init_val

    carrier = _hop.carrier(td, leaves)
    grad_body = torch.is_grad_enabled() and not _hop.is_exporting()  # (see `_scan._lower_scan`)

    def c(*flat: Any) -> Any:
        state = _hop.torch_state()
        p = cond_fun(tree_unflatten(tree_structure(carrier), list(flat)))
        _hop.check_state(op, "cond_fun", cond_fun, state)
        _check_pred(op, cond_fun, p)  # the eager rule, on the traced value's dtype and shape
        if not isinstance(p, torch.Tensor):
            p = torch.tensor(bool(p), device=flat[0].device)
        return p

    def b(*flat: Any) -> Any:
        td_in = tree_structure(carrier)
        state = _hop.torch_state()
        reverse = _hop.func_reverse_modes()
        with _hop.body_scope(grad=grad_body):
            out = body_fun(tree_unflatten(td_in, list(flat)))
        _hop.check_state(op, "body_fun", body_fun, state)
        if _hop.func_reverse_modes() != reverse:
            _hop.refuse_func_reverse_if_differentiated(op, "loop's body", body_fun, [*flat, *tree_leaves(out)])
        new = _hop.check_result(
            op,
            "body_fun input and output",
            "carry",
            body_fun,
            td_in,
            flat,
            out,
            REVISE_CARRY,
        )
        new = [x.contiguous() for x in new]
        # under tfun.jit every new carry is a copy: torch's while_loop refuses one that is a
        # tensor the body closes over (`lambda c: (c[0] + 1, V)`) in every grad mode (hunt 27),
        # and Dynamo does not let tfun tell one from a computed tensor; Inductor removes the
        # copies it does not need (`remove_noop_ops`)
        return tuple(_hop.unalias(new, flat, clone_all=not _hop.is_exporting()))

    out = _hop.call_hop(_hop.torch_while_loop(), c, b, tuple(_hop.distinct(leaves)))  # e.g. init_val=(x, x)
    if grad_body:
        # differentiated, torch's while_loop returns its carries as views into the stack of
        # every iteration's, at an offset of the unknown trip count; a later loop body or branch
        # that closes over one made Dynamo lift that offset's symbol with no source (a bare
        # AssertionError "Source of '4*u0 - 4' is None", hunt 34 F7). Copies have none.
        out = [x.clone() if isinstance(x, torch.Tensor) else x for x in out]
    return tree_unflatten(td, list(out))


__all__ = ["while_loop", "fori_loop"]

