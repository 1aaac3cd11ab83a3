"""`tfun.custom_vjp` and `tfun.custom_jvp`: JAX's custom-derivative decorators on
`torch.autograd.Function`.

Arguments are pytrees: the differentiable positional arguments are flattened with
`tfun.tree` into the tensor positional inputs of an `autograd.Function` (written with
`setup_context` and `generate_vmap_rule=True`), so the rules hold under `.backward()`,
`torch.autograd.grad`, and the `torch.func` / `tfun` transforms (`grad`, `vjp`, `vmap`,
`jacrev`; `jvp`/`jacfwd` for `custom_jvp`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.func

from . import _compat, _context
from ._closures import ClosureCells, Rebound, rebuild
from ._compat import forward_ad_level_active, grad_leaf
from ._errors import (
    ArgumentTypeError,
    ArgumentValueError,
    JitError,
    StructureMismatchError,
    TensorMismatchError,
    TfunError,
    format_message,
)
from ._funcinfo import describe
from ._grad import PrefixMismatch, _is_node, broadcast_prefix, conj_ct, describe_value, is_inexact, require_pair
from ._tree import partition, tree_flatten, tree_flatten_with_path, tree_unflatten
from .lax import _hop

__all__ = ["custom_vjp", "custom_jvp"]


_STATE = threading.local()
# [weakref to the trace, its state]: the state of the trace running now (`_state`)
_TRACE_STATE: list[Any] = [None, None]


# The state below is also trace-time state: under `tfun.jit`, Dynamo runs these functions as
# plain Python (a constant result) instead of tracing them. Traced, a write to `_STATE` inside
# an `autograd.Function` (tfun's rule) is a side effect Dynamo refuses ("HOP: Unsafe side
# effect", torch 2.11), and a value Dynamo read before another write could be stale.
#
# While Dynamo traces, the state is that trace's own (keyed by `_context.current_trace`): a
# trace that fails, or that Dynamo restarts, never runs the `__exit__` of the scopes it
# entered, and its depth must not outlive it. Kept in the thread's state, one failed
# `tfun.jit` inside a custom function's `fwd` left every custom rule in the process ignored,
# eagerly too: gradients of the primal instead of the rule's, without an error (hunt 29 F0).


def _state() -> Any:
    trace = _context.current_trace()
    if trace is None:
        return _STATE
    if _TRACE_STATE[0] is None or _TRACE_STATE[0]() is not trace:
        _TRACE_STATE[:] = [weakref.ref(trace), types.SimpleNamespace()]
    return _TRACE_STATE[1]


def _depth() -> int:
    return getattr(_state(), "depth", 0)


def _add_depth(delta: int) -> None:
    state = _state()
    state.depth = getattr(state, "depth", 0) + delta


def _push_transposing(level: int) -> None:
    state = _state()
    stack = getattr(state, "transposing", None)
    if stack is None:
        stack = state.transposing = []
    stack.append(level)


def _pop_transposing() -> None:
    _state().transposing.pop()


def _transposing_level() -> int | None:
    stack = getattr(_state(), "transposing", None)
    return stack[-1] if stack else None


for _f in (_depth, _add_depth, _push_transposing, _pop_transposing, _transposing_level):
    _f._dynamo_marked_constant = True  # type: ignore[attr-defined]
del _f


class _InsideForward:
    """While an autograd.Function's forward runs, its body is not differentiated, so a
    custom function called there (typically `f` inside its own `fwd`) just runs its primal."""

    def __enter__(self) -> None:
        _add_depth(1)

    def __exit__(self, *exc: Any) -> None:
        _add_depth(-1)


_tensor_level = _context.functorch_level


class _Transposing:
    """While a custom_jvp rule's tangent map is transposed (reverse mode), the tangents are
    wrapped at one torch.func level. A custom_jvp function applied inside the rule to a value
    that depends on those tangents is on the linear (tangent) path: as in JAX, it is
    differentiated as its primal function there, not through its own rule. (Through its rule,
    a rule that calls its own function, e.g. `f(x) = -x` with `tangent_out = f(t)`, would
    transpose itself forever.)"""

    def __init__(self, level: int) -> None:
        self.level = level

    def __enter__(self) -> None:
        _push_transposing(self.level)

    def __exit__(self, *exc: Any) -> None:
        _pop_transposing()


def _on_tangent_path(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether some tensor depends on the tangents of a custom_jvp rule being transposed."""
    level = _transposing_level()
    if level is None:
        return False
    return any(_tensor_level(t) >= level for t in tensors)


def _needs_rule(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the custom rule can matter: autograd or a torch.func transform may see it."""
    if _depth() > 0:
        return False
    if _context.functorch_active():
        return True
    if not tensors:
        return False
    import torch.autograd.forward_ad as fwAD

    if _forward_level_open() and any(fwAD.unpack_dual(t).tangent is not None for t in tensors):
        return True
    if not torch.is_grad_enabled():
        return False
    if any(t.requires_grad for t in tensors):
        return True
    # In the body of a loop lowered under grad mode, an input's `requires_grad` at trace time
    # may not be the truth (a carry traced from an `init` that does not require grad is
    # differentiated by the loop's autograd from the second step on): the loop lowers again
    # with such carries requiring grad if its results turn out differentiable (`_hop.grad_unknowns`)
    _hop.note_grad_unknown(tensors)
    return False


@_hop.assume_constant
def _forward_level_open() -> bool:
    """Whether a `torch.autograd.forward_ad` dual level is open (else no tensor is dual).
    Plain Python at trace time: traced, a `forward_ad.unpack_dual` before a `torch.func.jvp`
    in the same graph makes Dynamo (torch 2.13) fail that jvp's `make_dual` ("no level
    exists"), so it is not called where no level can be open."""
    return forward_ad_level_active()


def _bind_positional(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], op: str) -> tuple[Any, ...]:
    if not kwargs:
        return args
    try:
        sig = inspect.signature(fun)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise ArgumentTypeError(
            format_message(f"{op}: could not bind the call's arguments: {e}.", function=describe(fun))
        ) from None
    bound.apply_defaults()
    if bound.kwargs:
        raise ArgumentTypeError(
            format_message(
                f"{op}: keyword-only arguments are not supported: {sorted(bound.kwargs)}.",
                function=describe(fun),
                revise="Pass them positionally (as nondiff_argnums if they are not differentiable).",
            )
        )
    return tuple(bound.args)


def _normalize_nondiff(op: str, nondiff_argnums: Any) -> tuple[int, ...]:
    if isinstance(nondiff_argnums, int) and not isinstance(nondiff_argnums, bool):
        nondiff_argnums = (nondiff_argnums,)
    if not isinstance(nondiff_argnums, (tuple, list)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in nondiff_argnums
    ):
        raise ArgumentTypeError(
            format_message(
                f"{op}: nondiff_argnums must be a tuple of non-negative ints, got {nondiff_argnums!r}.",
            )
        )
    return tuple(sorted(set(nondiff_argnums)))


def _argnames_to_nums(op: str, fun: Callable[..., Any], nondiff_argnames: Any) -> tuple[int, ...]:
    """JAX's `nondiff_argnames`: parameter names of `fun`, as positions."""
    if isinstance(nondiff_argnames, str):
        nondiff_argnames = (nondiff_argnames,)
    if not isinstance(nondiff_argnames, (tuple, list)) or not all(isinstance(n, str) for n in nondiff_argnames):
        raise ArgumentTypeError(
            format_message(f"{op}: nondiff_argnames must be a tuple of strings, got {nondiff_argnames!r}.")
        )
    if not nondiff_argnames:
        return ()
    params = [
        p.name
        for p in inspect.signature(fun).parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    nums = []
    for name in nondiff_argnames:
        if name not in params:
            raise ArgumentValueError(
                format_message(
                    f"{op}: nondiff_argnames contains {name!r}, which is not a positional parameter of the function.",
                    function=describe(fun),
                )
            )
        nums.append(params.index(name))
    return tuple(nums)


# torch.func assertions that a custom rule can reach when a tensor it closes over (or a
# nondiff argument) lives at a vmap/grad level the autograd.Function does not see.
_FUNCTORCH_ASSERTS = ("INTERNAL ASSERT FAILED", "flat_bdims must not be None")


def _apply_rule(op: str, fun: Callable[..., Any], fn: Any, spec: Any) -> Any:
    """`fn.apply(spec, *tensors)`, with torch.func's internal assertions turned into a tfun error."""
    try:
        cap = spec.captures.tensors if getattr(spec, "captures", None) is not None else []
        inputs = [*spec.tensors, *cap]
        if _context.is_tracing():
            # Dynamo refuses one tensor passed to several inputs of an autograd.Function
            # (`f(a, a)`): a view of it for each repeat (gradients still sum into it)
            inputs = [t.view_as(t) if any(t is u for u in inputs[:k]) else t for k, t in enumerate(inputs)]
        return fn.apply(spec, *inputs)
    except (RuntimeError, AssertionError) as e:
        if isinstance(e, TfunError) or not any(m in str(e) for m in _FUNCTORCH_ASSERTS):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ArgumentValueError(
            format_message(
                f"{op}: torch.func cannot apply this function's rule under the enclosing transforms: a tensor "
                "that the function or its rules close over (or a nondiff argument) is batched by an enclosing "
                "vmap or differentiated by an enclosing grad/jvp that the custom function does not see as an "
                "input.",
                [f"torch.func: {first}"],
                function=describe(fun),
                revise="Pass such tensors to the custom function as positional (differentiable) arguments "
                "instead of closing over them (tfun finds tensors in closure cells, and in tuples, lists and "
                "dicts there, not in other objects), or apply the vmap outside the differentiation.",
            )
        ) from e


def _is_wrapped(x: Any) -> bool:
    """A tensor wrapped by a live `torch.func` transform (batched by a vmap, tracked by a
    grad, dual under a jvp)."""
    return isinstance(x, torch.Tensor) and _tensor_level(x) != -1


class _Captures:
    """The transform-wrapped tensors a custom function's rules see without taking them as
    inputs: in the closures of the function and its rules (and of the plain functions and
    custom functions those close over, see `tfun._closures`), and among its nondiff
    arguments.

    torch.func applies an `autograd.Function` only to its inputs: under `vmap` its generated
    batching rule runs the rules at a new level, where a tensor closed over from an enclosing
    level is invalid (torch's internal assertions). tfun therefore lifts such tensors into
    extra inputs of the `autograd.Function` and, while a rule runs, rebinds the closure cells
    (and nondiff arguments) that held them to the values the Function received (`_Bound`).
    They are constants of the custom function, as JAX's closure conversion makes them: a
    derivative with respect to them through the function is refused (see
    `_refuse_closure_derivative`).
    """

    def __init__(self, roots: Sequence[Any], nondiff: tuple[Any, ...]) -> None:
        self.found = ClosureCells(roots, _is_wrapped, _custom_parts)
        self.tensors = self.found.tensors
        self.nondiff = [self.found.leaves(v) for v in nondiff]
        self.forward_levels: list[bool] = []


def _custom_parts(obj: Any) -> list[Any] | None:
    """The functions of a custom function object, whose closures are searched too."""
    if isinstance(obj, (custom_jvp, custom_vjp)):
        return [getattr(obj, name, None) for name in ("fun", "fwd", "bwd", "jvp_fn")]
    return None


class _Bound:
    """While a rule runs: the closure cells and nondiff arguments that held captured tensors
    hold `values` (the Function's view of them); restored on exit."""

    def __init__(self, spec: _CallSpec, values: Sequence[Any]) -> None:
        self.spec, self.values = spec, values
        self.cells = Rebound(spec.captures.found if spec.captures is not None else None, values)

    def __enter__(self) -> None:
        cap = self.spec.captures
        if cap is None:
            return
        self.cells.__enter__()
        self.old_nondiff = self.spec.nondiff
        self.spec.nondiff = tuple(
            v if entry is None else rebuild(*entry, self.values) for v, entry in zip(self.spec.nondiff, cap.nondiff)
        )

    def __exit__(self, *exc: object) -> None:
        if self.spec.captures is None:
            return
        self.cells.__exit__(*exc)
        self.spec.nondiff = self.old_nondiff


def _capture(spec: _CallSpec, roots: Sequence[Any]) -> None:
    """Find the tensors to lift into the Function's inputs (only under a torch.func transform,
    eagerly: traced, tfun.jit refuses the transforms around a custom function)."""
    spec.captures = None
    if _context.is_tracing() or not _context.functorch_active():
        return
    cap = _Captures(roots, spec.nondiff)
    if cap.tensors:
        spec.captures = cap
        cap.forward_levels = [_jvp_wrapped(t) for t in cap.tensors]


def _checkpoint_op() -> Any:
    """Inside a checkpointed function, the primal run of a custom function is one op (see
    `tfun._checkpoint.custom_function_op`). Traced (tfun.jit) there is no such numbering."""
    if _context.is_tracing():
        return contextlib.nullcontext()
    from ._checkpoint import custom_function_op

    return custom_function_op()


def _callables(nondiff: tuple[Any, ...]) -> list[Any]:
    """The nondiff arguments that are functions: their closures are searched too (a nondiff
    function may close over a tensor of an enclosing transform, JAX's
    test_nondiff_arg_hiding_jvp_tracer)."""
    return [v for v in nondiff if callable(v) and not isinstance(v, torch.Tensor)]


def _jvp_wrapped(t: torch.Tensor) -> bool:
    """Whether `t` carries a tangent of an enclosing forward-mode transform (looked up
    through its batching wrappers). Under `vmap`, torch.func hands the `jvp` rule zero
    tangents for the inputs that have none, so which captured tensors can have one is
    decided here, before the Function is applied."""
    import torch.autograd.forward_ad as fwAD

    is_wrapped, is_batched = _functorch("is_functorch_wrapped_tensor"), _functorch("is_batchedtensor")
    level_of, unwrapped = _functorch("maybe_get_level"), _functorch("get_unwrapped")
    kinds = {level: kind for kind, level in _context.transform_stack()}
    while is_wrapped(t) or is_batched(t):
        if kinds.get(level_of(t)) == "Jvp":
            try:
                if fwAD.unpack_dual(t).tangent is not None:
                    return True
            except (RuntimeError, TypeError, ValueError):  # cannot tell: assume it has one
                return True
        t = unwrapped(t)
    return False


#: The private functorch functions (bound in `_compat`) that the paths below need:
#: `_jvp_wrapped` (eager: forward mode over forward mode, custom_vjp under torch.func)
#: and the traced custom_jvp call inside `tfun.jvp` / `tfun.vmap` (`_traced_jvp_call`,
#: `_traced_vmap_call`).
_JVP_WRAPPED_NEEDS = ("is_functorch_wrapped_tensor", "is_batchedtensor", "maybe_get_level", "get_unwrapped")
_TRACED_TRANSFORMS_NEED = ("unwrap_batched", "unwrap_for_grad", "add_batch_dim")
_TRACED_VMAP_NEEDS = ("functorch_interpreters", "unwrap_batched", "add_batch_dim", "vmap_decrement_nesting", "vmap_increment_nesting")
_LEVEL_BY_LEVEL_NEEDS = ("current_interpreter", "unwrap_for_grad", "wrap_for_grad", "unwrap_batched", "add_batch_dim")


def _functorch(name: str) -> Callable[..., Any]:
    """The functorch function `_compat.<name>`, present: callers first check with
    `_require_functorch`, which says what is missing and what to do."""
    fn = getattr(_compat, name)
    if fn is None:  # pragma: no cover - reached only past a missing `_require_functorch`
        raise TfunError(
            format_message(
                f"tfun: this torch ({torch.__version__}) lacks {_compat.functorch_missing(name)[0]}.",
                revise="Install a torch release tfun supports (docs/compatibility.md).",
            )
        )
    return fn


def _require_functorch(
    op: str,
    fun: Callable[..., Any],
    names: Sequence[str],
    what: str,
    revise: str,
    error: type[TfunError] = JitError,
) -> None:
    """Raise `error` naming what of `names` this torch lacks, if anything."""
    missing = _compat.functorch_missing(*names)
    if missing:
        raise error(
            format_message(
                f"{op}: {what} needs torch internals that this torch ({torch.__version__}) lacks: "
                f"{', '.join(missing)}.",
                function=describe(fun),
                revise=revise,
            )
        )


def _captured_values(spec: _CallSpec, inputs: Sequence[Any]) -> list[Any]:
    return list(inputs[len(spec.tensors) :])


def _refuse_closure_derivative(spec: _CallSpec, rule: Callable[..., Any], what: str) -> None:
    raise ArgumentValueError(
        format_message(
            f"{spec.op}: the function is differentiated with respect to a tensor that it or its rules close over "
            f"(or a nondiff argument), by the {what}: the custom rule gives derivatives with respect to the "
            "differentiable positional arguments only (as in JAX).",
            function=describe(rule),
            revise="Pass that tensor as a positional (differentiable) argument of the custom function, so its rule "
            "says how to differentiate it.",
        )
    )



def _wraps(obj: Any, fun: Callable[..., Any]) -> None:
    """`functools.update_wrapper(obj, fun)`; while Dynamo traces (a custom function made
    inside `tfun.jit`), without copying `fun.__dict__`, whose `dict.update` Dynamo 2.11 cannot
    trace."""
    functools.update_wrapper(obj, fun, updated=() if _context.is_tracing() else functools.WRAPPER_UPDATES)


def _check_rule_flags(op: str, symbolic_zeros: Any, optimize_remat: Any = False) -> None:
    for name, v in (("symbolic_zeros", symbolic_zeros), ("optimize_remat", optimize_remat)):
        if not isinstance(v, bool):
            raise ArgumentTypeError(format_message(f"{op}: {name} must be a bool, got {describe_value(v)}."))
    if symbolic_zeros:
        raise ArgumentValueError(
            format_message(
                f"{op}: symbolic_zeros=True is not supported: tfun passes zero tangents/cotangents as "
                "zero tensors (or None) and plain values to the rules.",
                revise="Drop symbolic_zeros=True and write the rules for ordinary tensors.",
            )
        )


class _Results:
    """What a custom function's forward learns about its outputs (`_CallSpec.results`).

    Created empty and written only by the forward: torch 2.13 and 2.14's Dynamo drop the
    attribute writes that a traced `autograd.Function` forward makes to an object that
    already has attribute writes pending in the same trace (as a `_CallSpec` built there
    has) whenever the forward runs a control-flow HOP (a `tfun.lax` op in `fwd`); an object
    with no pending writes keeps them (`tests/test_custom_derivatives.py`,
    `test_control_flow_inside_the_rule_under_jit`)."""


def _eager_autocast_state(tensors: Sequence[torch.Tensor]) -> _context.AutocastState | None:
    """The autocast state a rule run later (in the backward) must run under; None traced,
    where AOTAutograd traces the backward under the graph's own state."""
    return None if _context.is_tracing() else _context.autocast_state(t.device for t in tensors)


def _result(name: str) -> Any:
    return property(lambda self: getattr(self.results, name, None), doc=f"`results.{name}`")


class _CallSpec:
    """The static half of one call: nondiff args, argument structure, non-tensor leaves."""

    #: the forward's findings, read from `results` (see `_Results`)
    out_td = _result("out_td")
    n_out = _result("n_out")
    out_meta = _result("out_meta")
    res_td = _result("res_td")
    res_src = _result("res_src")
    in_meta = _result("in_meta")
    autocast = _result("autocast")  # the eager forward's autocast state, for rules run later

    def __init__(self, op: str, fun: Callable[..., Any], nondiff_argnums: tuple[int, ...], args: tuple[Any, ...]):
        for i in nondiff_argnums:
            if i >= len(args):
                raise ArgumentValueError(
                    format_message(
                        f"{op}: nondiff_argnums contains {i}, but the function was called with {len(args)} "
                        "positional arguments.",
                        function=describe(fun),
                    )
                )
        self.op = op
        self.captures: _Captures | None = None
        self.nargs = len(args)
        self.nondiff_argnums = nondiff_argnums
        self.diff_argnums = tuple(i for i in range(len(args)) if i not in nondiff_argnums)
        self.nondiff = tuple(args[i] for i in nondiff_argnums)
        self.diff = partition(tuple(args[i] for i in self.diff_argnums))
        self.tensor_pos = self.diff.positions
        self.tensors = self.diff.dynamic
        self.results = _Results()

    def diff_args(self, tensors: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(self.diff.combine(tensors[: len(self.tensors)]))

    def all_args(self, tensors: Sequence[Any]) -> list[Any]:
        diff = self.diff_args(tensors)
        out: list[Any] = [None] * self.nargs
        for i, v in zip(self.diff_argnums, diff):
            out[i] = v
        for i, v in zip(self.nondiff_argnums, self.nondiff):
            out[i] = v
        return out


def _check_fwd_pair(op: str, fwd: Callable[..., Any], pair: Any) -> None:
    """A custom_vjp `fwd` returns `(output, residuals)`."""
    require_pair(op, fwd, pair, "the fwd rule", "output, residuals", "Return `(output, residuals)` from fwd.")


def _flatten_outputs(op: str, fn: Callable[..., Any], role: str, out: Any) -> tuple[list[torch.Tensor], Any]:
    pl, td = tree_flatten_with_path(out)
    bad = [f"{role}{_ks(p)}: {describe_value(x)}" for p, x in pl if not isinstance(x, torch.Tensor)]
    if bad:
        raise ArgumentTypeError(
            format_message(
                f"{op}: every leaf of the {role} must be a tensor.",
                bad,
                function=describe(fn),
                revise="Return tensors (wrap Python numbers with torch.tensor).",
            )
        )
    return [x for _, x in pl], td


def _ks(p: Any) -> str:
    from ._tree import keystr

    return keystr(p)


class _CotangentMismatchError(TensorMismatchError, ValueError):
    """A `custom_vjp` bwd cotangent whose shape or dtype is not its argument's: a
    `TensorMismatchError` (so a `TypeError`, as every tfun shape/dtype mismatch) that is
    also a `ValueError`, the class JAX raises there."""


def _skeleton(unflatten: Callable[[list[Any]], Any], n: int) -> Any:
    """`unflatten` (a treedef's, or a `Partition`'s, whose structure survives a graph break:
    `_tree.unflatten_kept`) of `n` leaves that stand for nothing, for `_check_cotangents`.
    Traced, the leaves are empty tensors: Dynamo's optree support fails to rebuild a dict whose
    leaves are all constants (hunt 29 F3: a custom_vjp taking a dict, "unhashable type:
    'list'", a custom_jvp returning one, "length mismatch")."""
    if _context.is_tracing():
        return unflatten([torch.empty(0) for _ in range(n)])
    return unflatten(list(range(n)))


def _check_cotangents(
    op: str,
    rule: Callable[..., Any],
    what: str,
    returned: Any,
    expected: Any,
    expected_desc: str,
    shapes: Sequence[tuple[torch.Size, torch.dtype] | None],
    revise: str,
    mismatch: type[TensorMismatchError] = TensorMismatchError,
    cast_inexact: bool = False,
) -> list[Any]:
    """Match `returned` (None allowed at any prefix position = zero) against `expected`.

    With `cast_inexact`, a leaf of the expected shape whose expected dtype is floating or
    complex may have another dtype and is converted to the expected one (JAX accepts such a
    `custom_vjp` bwd cotangent: a float32 cotangent for a bfloat16 argument).

    Returns one entry (tensor or None) per leaf of `expected`.
    """
    try:
        entries = broadcast_prefix(returned, expected, lambda x: x is None or not _is_node(x), what)
    except PrefixMismatch as e:
        raise StructureMismatchError(
            format_message(
                f"{op}: the {what} must have the structure of {expected_desc} (None marks a zero).",
                [f"{e.path}: expected {describe_value(e.full_node)}, got {describe_value(e.prefix_node)}"],
                function=describe(rule),
                revise=revise,
            )
        ) from None
    out = []
    bullets = []
    for (path, got, _), meta in zip(entries, shapes):
        if got is None or meta is None:
            out.append(None)
            continue
        shape, dtype = meta
        if not isinstance(got, torch.Tensor):
            bullets.append(f"{path}: expected a tensor of shape {tuple(shape)} and dtype {dtype}, got {describe_value(got)}")
            continue
        inexact = dtype.is_floating_point or dtype.is_complex
        if cast_inexact and inexact and got.shape == shape and got.dtype != dtype:
            # a complex cotangent of a real argument: its real part, as the engine would take
            got = (got.real if got.is_complex() and not dtype.is_complex else got).to(dtype)
        if got.shape != shape or (dtype.is_floating_point or dtype.is_complex) and got.dtype != dtype:
            bullets.append(
                f"{path}: expected a tensor of shape {tuple(shape)} and dtype {dtype}, got a tensor of shape "
                f"{tuple(got.shape)} and dtype {got.dtype}"
            )
            continue
        out.append(got)
    if bullets:
        raise mismatch(
            format_message(
                f"{op}: each leaf of the {what} must have the shape and dtype of {expected_desc}.",
                bullets,
                function=describe(rule),
                revise=revise,
            )
        )
    return out


# --------------------------------------------------------------------------------------
# custom_vjp
# --------------------------------------------------------------------------------------




class _VjpSpec(_CallSpec):
    fwd: Callable[..., Any]
    bwd: Callable[..., Any]
    n_out: int
    res_td: Any
    res_src: list[tuple[str, Any]]
    in_meta: list[tuple[torch.Size, torch.dtype] | None]


class _CustomVjpFunction(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(spec: _VjpSpec, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        op = "tfun.custom_vjp"
        n = len(spec.tensors)
        with _Bound(spec, tensors[n:]), _InsideForward():
            pair = spec.fwd(*spec.all_args(tensors[:n]))
        _check_fwd_pair(op, spec.fwd, pair)
        out, res = pair
        found = spec.results  # (written there, not on `spec`: see `_Results`)
        out_leaves, found.out_td = _flatten_outputs(op, spec.fwd, "fwd output", out)
        found.n_out = len(out_leaves)
        res_leaves, found.res_td = tree_flatten(res)
        res_src: list[tuple[str, Any]] = []
        extra: list[torch.Tensor] = []
        # Traced inside a loop body or branch, an input returned as a residual is saved as a
        # copy: saved as it is, torch's loop autograd made the body return one of its inputs,
        # which its control-flow ops refuse ("Higher order ops do not support aliasing"; hunt
        # 25, finding 4: a closed-over `W` in `fwd`'s residuals, a standard JAX pattern)
        copy_inputs = _context.is_tracing() and _hop.in_body()
        for r in res_leaves:
            if not isinstance(r, torch.Tensor):
                res_src.append(("static", r))
            elif copy_inputs and any(r is t for t in tensors):
                res_src.append(("res", len(extra)))
                extra.append(r.clone())
            elif any(r is t for t in tensors):
                res_src.append(("in", next(i for i, t in enumerate(tensors) if r is t)))
            elif any(r is o for o in out_leaves):
                res_src.append(("out", next(i for i, o in enumerate(out_leaves) if r is o)))
            else:
                res_src.append(("res", len(extra)))
                extra.append(r)
        found.res_src = res_src
        found.in_meta = [(t.shape, t.dtype) if is_inexact(t) else None for t in tensors[:n]]
        # `bwd` runs under the forward's autocast state, as it does under tfun.jit (where the
        # backward is traced with the graph's): `.backward()` usually runs after the
        # `torch.autocast` block, where `bwd` would mix bfloat16 residuals with float32
        # inputs (torch's own `autograd.Function` asks for `torch.amp.custom_bwd` for this)
        found.autocast = _eager_autocast_state(tensors)
        out_leaves = [o.view_as(o) if any(o is t for t in tensors) else o for o in out_leaves]
        return tuple(out_leaves) + tuple(extra)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        spec: _VjpSpec = inputs[0]
        tensors = inputs[1:]
        extra = output[spec.n_out :]
        # Residuals that fwd computes are differentiable functions of the inputs (as in JAX):
        # a second-order derivative that flows into them is pulled back through fwd again
        # (see `_residual_pullback`), so they stay differentiable outputs here.
        ctx.set_materialize_grads(False)
        ctx.n_inputs = len(tensors)
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in output[: spec.n_out]]
        ctx.spec = spec
        # save only what the residuals reference
        to_save: list[torch.Tensor] = []
        ctx.res_slots = []
        for kind, v in spec.res_src:
            if kind == "static":
                ctx.res_slots.append(None)
                continue
            src = tensors[v] if kind == "in" else output[v] if kind == "out" else extra[v]
            ctx.res_slots.append(len(to_save))
            to_save.append(src)
        ctx.n_res_saved = len(to_save)
        # the inputs, to recompute fwd's residuals if they are differentiated; the captured
        # tensors (see _Captures) always, for the rules that close over them
        # (`len(extra) > 0`, not `bool(extra)`: Dynamo 2.11 cannot trace `bool` of a tuple)
        ctx.saved_all = len(extra) > 0
        to_save.extend(tensors if ctx.saved_all else tensors[len(spec.tensors) :])
        ctx.save_for_backward(*to_save)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:  # type: ignore[override]
        _refuse_forward_mode(ctx.spec.fwd)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        spec: _VjpSpec = ctx.spec
        saved = ctx.saved_tensors
        n = len(spec.tensors)
        rest = saved[ctx.n_res_saved :]
        inputs, caps = (rest[:n], rest[n:]) if ctx.saved_all else ((), rest)
        saved = saved[: ctx.n_res_saved]
        if caps and any(g is not None for g in grads) and any(ctx.needs_input_grad[1 + n :]):
            _refuse_closure_derivative(spec, spec.bwd, "reverse-mode derivative (grad, vjp)")
        with _Bound(spec, caps), _context.autocast_restored(spec.autocast):
            result = _CustomVjpFunction._backward(ctx, spec, saved, inputs, grads)
        return (*result, *(None,) * len(caps))

    @staticmethod
    def _backward(ctx: Any, spec: _VjpSpec, saved: Sequence[Any], inputs: Sequence[Any], grads: Any) -> tuple[Any, ...]:
        n_inputs = len(spec.tensors)
        res_leaves = [
            v if slot is None else saved[slot] for (kind, v), slot in zip(spec.res_src, ctx.res_slots)
        ]
        res = tree_unflatten(spec.res_td, res_leaves)
        out_grads = list(grads[: spec.n_out])
        res_grads = list(grads[spec.n_out :])
        pulled = _residual_pullback(spec, inputs, res_grads) if any(r is not None for r in res_grads) else None
        if all(o is None for o in out_grads):
            if pulled is None:
                return (None,) * (1 + n_inputs)
            return (None, *pulled)
        out_meta = ctx.out_meta
        out_grads = [
            torch.zeros(shape, dtype=dtype, device=device) if o is None else o
            for o, (shape, dtype, device) in zip(out_grads, out_meta)
        ]
        # bwd is written in JAX's convention: for complex values its cotangents are the
        # conjugates of torch's (see tfun._grad), both ways
        g = tree_unflatten(spec.out_td, [conj_ct(o) for o in out_grads])
        cts = spec.bwd(*spec.nondiff, res, g)
        n_diff = len(spec.diff_argnums)
        op = "tfun.custom_vjp"
        revise = (
            f"Return a tuple with one cotangent per differentiable positional argument ({n_diff} here"
            + (", e.g. `(g_x,)` for one argument" if n_diff == 1 else "")
            + "), each with its argument's structure, shapes and dtypes."
        )
        if not isinstance(cts, (tuple, list)):
            raise StructureMismatchError(
                format_message(
                    f"{op}: the bwd rule must return a tuple with one entry per differentiable argument "
                    f"({n_diff}), got {describe_value(cts)}.",
                    function=describe(spec.bwd),
                    revise=revise,
                )
            )
        if len(cts) != n_diff:
            raise StructureMismatchError(
                format_message(
                    f"{op}: the bwd rule must return a tuple with one entry per differentiable argument "
                    f"({n_diff}), got {len(cts)} entries.",
                    function=describe(spec.bwd),
                    revise=revise,
                )
            )
        # expected: the differentiable args, with their tensor metadata in forward's leaf order
        meta_per_leaf: list[Any] = [None] * len(spec.diff.leaves)
        for k, m in zip(spec.tensor_pos, spec.in_meta):
            meta_per_leaf[k] = m
        expected = _skeleton(spec.diff.unflatten, len(spec.diff.leaves))
        flat = _check_cotangents(
            op,
            spec.bwd,
            "bwd output",
            tuple(cts),
            expected,
            "the differentiable arguments",
            meta_per_leaf,
            revise,
            _CotangentMismatchError,
            cast_inexact=True,
        )
        result = [conj_ct(flat[k]) for k in spec.tensor_pos]
        if pulled is not None:
            result = [a if b is None else b if a is None else a + b for a, b in zip(result, pulled)]
        return (None, *result)


def _refuse_forward_mode(fwd: Callable[..., Any]) -> None:
    raise ArgumentTypeError(
        format_message(
            "tfun.custom_vjp: forward-mode differentiation (jvp, jacfwd, hessian) of a custom_vjp "
            "function is not supported, as in JAX.",
            function=describe(fwd),
            revise="Differentiate it in reverse mode (grad, vjp, jacrev), or give it a forward-mode rule "
            "with tfun.custom_jvp instead.",
        )
    )


class _CustomVjpTracedFunction(torch.autograd.Function):
    """`_CustomVjpFunction` without its `jvp` method, for `tfun.jit` / `torch.export`.

    Dynamo refuses an `autograd.Function` that defines `jvp` ("Unsupported custom jvp",
    torch 2.11-2.13); `_CustomVjpFunction.jvp` exists only to refuse forward mode with a
    tfun error. Traced, forward mode through the function is refused by torch instead,
    which `tfun.jit` reports as a `JitError`; reverse mode (`tfun.grad`, `.backward()`)
    uses the rule as eagerly.
    """

    generate_vmap_rule = True
    forward = staticmethod(_CustomVjpFunction.forward)
    setup_context = staticmethod(_CustomVjpFunction.setup_context)
    backward = staticmethod(_CustomVjpFunction.backward)

def _residual_pullback(spec: _VjpSpec, inputs: Sequence[torch.Tensor], res_grads: Sequence[Any]) -> list[Any]:
    """Cotangents of the inputs for cotangents of fwd's computed residuals.

    Reached only by higher-order differentiation (a derivative of `bwd`'s output flows into
    a residual): fwd's residual map is differentiated with `torch.func.vjp`, which composes
    with both `torch.autograd` and the `torch.func` transforms.
    """
    diff = [k for k, t in enumerate(inputs) if t.is_floating_point() or t.is_complex()]
    keep = [k for k, g in enumerate(res_grads) if g is not None]
    if not diff or not keep:
        return [None] * len(inputs)

    def residual_map(*d: torch.Tensor) -> tuple[torch.Tensor, ...]:
        full = list(inputs)
        for k, t in zip(diff, d):
            full[k] = t
        with _InsideForward():
            _, res = spec.fwd(*spec.all_args(full))
        computed = [r for (kind, _), r in zip(spec.res_src, tree_flatten(res)[0]) if kind == "res"]
        return tuple(computed[k] for k in keep)

    _, pull = torch.func.vjp(residual_map, *[inputs[k] for k in diff])
    got = pull(tuple(res_grads[k] for k in keep))
    out: list[Any] = [None] * len(inputs)
    for k, gk in zip(diff, got):
        out[k] = gk
    return out


class custom_vjp:
    """A function with a custom reverse-mode derivative, as `jax.custom_vjp`.

    ```python
    @tfun.custom_vjp
    def f(x, y):
        return torch.sin(x) * y

    def f_fwd(x, y):
        return f(x, y), (torch.cos(x), torch.sin(x), y)

    def f_bwd(res, g):
        cos_x, sin_x, y = res
        return (cos_x * g * y, sin_x * g)

    f.defvjp(f_fwd, f_bwd)
    ```

    Works under `.backward()`, `torch.autograd.grad`, `tfun.grad`/`vjp`/`jacrev`/`vmap`
    and their `torch.func` counterparts. Forward mode (`jvp`, `jacfwd`) is not available
    for a `custom_vjp` function, as in JAX. When no autograd or transform can see the call,
    the primal function `f` runs; otherwise `fwd` does. `bwd` runs differentiably, and, as
    in JAX, residuals that `fwd` computes are differentiable functions of the inputs, so
    `grad(grad(f))` is exact: a second-order cotangent that reaches a residual is pulled
    back through `fwd` (which then runs once more). With complex values `bwd` follows JAX's
    convention (the transpose: for `f(z) = c * z`, `bwd` returns `(c * g,)`); torch's
    conjugated cotangents are converted on the way in and out.

    **Arguments:**

    - `fun`: the primal function of positional pytree arguments, returning a pytree of
      tensors.
    - `nondiff_argnums`: positions of arguments that are not differentiated (Python
      values, functions; tensors there are constants). `bwd` receives them first, as in
      JAX: `bwd(*nondiff_args, residuals, g)`.
    - `nondiff_argnames`: the same, by parameter name (JAX's `nondiff_argnames`); joined
      with `nondiff_argnums`.

    **Returns:** a callable with `fun`'s signature; call `.defvjp(fwd, bwd)` on it where
    `fwd(*args) -> (output, residuals)` (residuals: any pytree) and `bwd(residuals, g)`
    returns a tuple with one cotangent per differentiable positional argument, each with
    that argument's structure (`None` anywhere marks a zero cotangent).

    Under `tfun.jit`, reverse mode (`tfun.grad`, `tfun.vjp`, `.backward()` on the jitted
    result) uses the rule, also for a call inside `tfun.vmap`s that `tfun.jit` traces (the
    rule is applied outside the vmaps, vectorised over their batch dimensions). There a
    nondiff argument must not be batched by the vmap, and `fun`, `fwd` and `bwd` must not close
    over a tensor it batches (both a `JitError`: pass such tensors as arguments). A call
    inside another traced transform (`tfun.jvp`, `tfun.jacfwd`, `torch.func.grad`) is a
    `JitError`: apply the transform outside `tfun.jit`.

    `fun`, `fwd` and `bwd` may close over tensors of enclosing transforms (batched by a
    `vmap`, tracked by an outer `grad`), and nondiff arguments may be such tensors (or
    functions that close over them): tfun lifts them into inputs of its
    `autograd.Function`. They are constants of the custom function: a derivative through
    one of them is an `ArgumentValueError` (as in JAX); pass
    such a tensor as a differentiable argument instead.
    """

    def __init__(
        self, fun: Callable[..., Any], nondiff_argnums: Sequence[int] = (), nondiff_argnames: Sequence[str] = ()
    ) -> None:
        _wraps(self, fun)
        self.fun = fun
        nums = tuple(_normalize_nondiff("tfun.custom_vjp", nondiff_argnums))
        self.nondiff_argnums = tuple(sorted(set(nums + _argnames_to_nums("tfun.custom_vjp", fun, nondiff_argnames))))
        self.fwd: Callable[..., Any] | None = None
        self.bwd: Callable[..., Any] | None = None

    def defvjp(
        self, fwd: Callable[..., Any], bwd: Callable[..., Any], symbolic_zeros: bool = False, optimize_remat: bool = False
    ) -> None:
        """Define the rule.

        **Arguments:**

        - `fwd`: `fwd(*args) -> (output, residuals)`, with the primal's signature.
        - `bwd`: `bwd(*nondiff_args, residuals, g) -> tuple` of cotangents, one per
          differentiable positional argument, each with its argument's structure and
          shapes (`None` marks a zero). A floating argument's cotangent may have another
          dtype, as in JAX; it is converted to the argument's dtype.
        - `symbolic_zeros`: JAX's flag; only `False` (the default) is supported.
        - `optimize_remat`: accepted for JAX compatibility (a bool); it changes nothing:
          `fwd` runs only when a gradient is needed, and `tfun.checkpoint` recomputes it.

        **Returns:** None.
        """
        _check_rule_flags("tfun.custom_vjp.defvjp", symbolic_zeros, optimize_remat)
        for name, fn in (("fwd", fwd), ("bwd", bwd)):
            if not callable(fn):
                raise ArgumentTypeError(
                    format_message(f"tfun.custom_vjp.defvjp: {name} must be callable, got {describe_value(fn)}.")
                )
        self.fwd, self.bwd = fwd, bwd

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        op = "tfun.custom_vjp"
        if self.fwd is None or self.bwd is None:
            raise ArgumentValueError(
                format_message(
                    f"{op}: no VJP rule is defined for this function.",
                    function=describe(self.fun),
                    revise="Call `f.defvjp(fwd, bwd)` before calling `f`.",
                )
            )
        args = _bind_positional(self.fun, args, kwargs, op)
        spec = _VjpSpec(op, self.fun, self.nondiff_argnums, args)
        if not _needs_rule(spec.tensors):
            with _checkpoint_op():
                return self.fun(*args)
        spec.fwd, spec.bwd = self.fwd, self.bwd
        if (
            not _context.is_tracing()
            and _context.functorch_active()
            and _jvp_wrapped_checkable(op, self.fun, "a custom_vjp function inside a torch.func transform")
            and any(_jvp_wrapped(t) for t in spec.tensors)
        ):
            # refused before torch.func applies the function: under vmap its generated
            # batching rule fails on forward mode before the Function's `jvp` is reached
            _refuse_forward_mode(self.fwd)
        _capture(spec, (self.fun, self.fwd, self.bwd, *_callables(spec.nondiff)))
        fn: Any = _CustomVjpFunction
        if _context.is_tracing():
            if _context.functorch_active():
                stack = _hop.traced_transforms()
                if all(k == "Vmap" for k, _ in stack):
                    return _traced_vmap_rule_call(spec, self.fun, stack)
                # Traced, the function has no `jvp` method to refuse forward mode with (see
                # _CustomVjpTracedFunction), and Dynamo traces an autograd.Function inside a
                # torch.func transform without its rule: every transform but vmap is refused.
                # (Forward mode of a custom_vjp is refused eagerly too, as in JAX.)
                names = {"Jvp": "jvp", "Vmap": "vmap", "Grad": "grad/vjp", "Functionalize": "functionalize"}
                shown = " of ".join(names.get(k, k) for k, _ in stack)
                raise JitError(
                    format_message(
                        f"{op}: under tfun.jit, a custom_vjp function cannot be called inside a torch.func "
                        f"transform other than tfun.vmap (here {shown}, outermost first: tfun.jvp, tfun.jacfwd, "
                        f"torch.func.*): torch.compile (torch {torch.__version__}) cannot trace its rule there.",
                        function=describe(self.fun),
                        revise="Call the transform outside tfun.jit (tfun.vmap(tfun.jit(f)) runs the rule around "
                        "the compiled function), or use reverse mode inside (tfun.grad and .backward() use the "
                        "rule under tfun.jit).",
                    )
                )
            fn = _CustomVjpTracedFunction
            _hop.note_custom_rule()
        outs = _apply_rule(op, self.fun, fn, spec)
        return tree_unflatten(spec.out_td, list(outs[: spec.n_out]))


@_hop.assume_constant
def _traced_vmap_sizes() -> tuple[tuple[int, int | None, str], ...]:
    """Trace time: the enclosing `vmap`s as `(level, batch size, randomness)`, outermost
    first; the batch size is None where it is symbolic."""
    out = []
    for i in _compat.functorch_interpreters():  # type: ignore[misc]
        size = i.batch_size()
        out.append((int(i.level()), size if type(size) is int else None, str(i.randomness())))
    return tuple(out)


def _refuse_traced_vmap(spec: _CallSpec, fun: Callable[..., Any], why: str, revise: str) -> None:
    raise JitError(
        format_message(
            f"{spec.op}: under tfun.jit, this call of a custom function inside tfun.vmap is not supported: {why}",
            function=describe(fun),
            revise=revise
            + " Or apply tfun.vmap outside tfun.jit (tfun.vmap(tfun.jit(f)) uses the rule around the compiled "
            "function).",
        )
    )


def _traced_vmap_rule_call(spec: Any, fun: Callable[..., Any], stack: tuple[tuple[str, int], ...]) -> Any:
    """A custom_vjp (or custom_jvp) call traced inside `vmap`s only (`tfun.jit` of
    `tfun.vmap(f)`, under an outer reverse mode: `tfun.vjp`/`tfun.grad` inside `tfun.jit`
    differentiate with autograd).

    Dynamo traces an `autograd.Function` into torch's `autograd_function_apply`, whose own
    `autograd.Function` has no batching rule: applied while a vmap is live it fails ("does
    not have vmap support"), even on unbatched tensors. So the batching is done here, outside
    the vmap: the call takes the batch dimensions off its tensor arguments (each moved to the
    front, outermost level first; an argument that a level does not batch, where the level
    batches another, is expanded, so that autograd sums its cotangent over that level, as
    torch's generated batching rule and JAX do; a level that batches no argument does not
    batch the call), leaves the vmaps (their levels popped, and
    pushed again afterwards with the same sizes and randomness, so they get the same level
    numbers), applies `_CustomVjpTracedFunction` (`_CustomJvpTracedFunction`) to the plain
    tensors with `fwd` and `bwd` (`fun` and the JVP rule) vectorised by `torch.func.vmap`
    over those dimensions, and puts the batch dimensions back on its outputs. Autograd outside
    the vmaps then differentiates through the rule."""
    if _hop.in_body() and min(lvl for _, lvl in stack) <= _hop.body_transform_level():
        # A vmap entered outside the innermost loop or branch body (a vmap entered inside it is
        # traced into the body's graph, and is right): the body's graph, traced here with the
        # vmaps live, is batched again by torch's rule
        # for the loop or cond op, which replays it: the batch dimensions that this call takes
        # off and puts back (and the vmaps it leaves) are then applied to tensors that are
        # already per-example, giving wrong gradients (an unbatched argument's expansion to the
        # batch size met a dimension of the same size) or a shape error (hunt 25, finding 3).
        _refuse_traced_vmap(
            spec,
            fun,
            "it is inside the body of a tfun.lax loop or branch (scan, map, fori_loop, cond, ...), whose "
            "graph torch batches again after tracing it, which the custom rule's batching cannot follow.",
            "Call the custom function outside the loop body (e.g. on the stacked outputs of a scan), or keep "
            "the batch as a tensor dimension inside the custom function instead of vmapping over it.",
        )
    _require_functorch(
        spec.op, fun, _TRACED_VMAP_NEEDS, "a custom function inside tfun.vmap inside tfun.jit",
        "Apply tfun.vmap outside tfun.jit (tfun.vmap(tfun.jit(f)) uses the rule around the compiled function), or "
        "install a torch release tfun supports (docs/compatibility.md).",
    )
    _unwrap_batched = _compat.unwrap_batched
    _vmap_decrement_nesting, _vmap_increment_nesting = _compat.vmap_decrement_nesting, _compat.vmap_increment_nesting
    levels = [lvl for _, lvl in stack]
    info = _traced_vmap_sizes()
    randomness = [r for _, _, r in info]
    for leaf in tree_flatten(spec.nondiff)[0]:
        if isinstance(leaf, torch.Tensor) and any(bd is not None for _, bd in _unbatch(leaf, levels)[1]):
            _refuse_traced_vmap(
                spec,
                fun,
                "a nondiff argument is a tensor batched by the vmap, and a nondiff argument is a constant of the "
                "rule, which tfun vectorises over the differentiable arguments only.",
                "Pass that tensor as a differentiable argument (its cotangent may be None).",
            )
    # the batch size of each level, from an argument it batches (symbolic sizes stay symbolic)
    sizes: list[Any] = [size for _, size, _ in info]
    batched = [False] * len(levels)
    for t in spec.tensors:
        inner = t
        for j in reversed(range(len(levels))):
            inner, bd = _unwrap_batched(inner, levels[j])
            if bd is not None and not batched[j]:
                sizes[j], batched[j] = inner.shape[bd], True
    if any(s is None for s in sizes):
        _refuse_traced_vmap(
            spec,
            fun,
            "no differentiable argument is batched by one of the vmaps, whose batch size is symbolic.",
            "Pass tfun.jit dynamic=False.",
        )
    # A level that batches no argument does not batch the call (as eagerly, where the rule then
    # runs once, with the cotangent summed over that level); a level that batches some: every
    # argument gets its batch dimension, at the front, outermost level first.
    peeled = []
    for t in spec.tensors:
        for j in reversed(range(len(levels))):
            t, bd = _unwrap_batched(t, levels[j])
            if batched[j]:
                t = t.unsqueeze(0).expand(sizes[j], *t.shape) if bd is None else t.movedim(bd, 0)
        # one tensor passed twice (`f(y, y)`): a view for the second (Dynamo refuses an
        # autograd.Function given the same tensor twice, "duplicate tensor input")
        peeled.append(t.view_as(t) if any(t is p for p in peeled) else t)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in peeled)):
        # nothing differentiates the call (only vmaps enclose it), unless autograd reaches a
        # tensor the function closes over, which the rule does not differentiate
        out = fun(*spec.all_args(spec.tensors))
        if torch.is_grad_enabled() and any(
            isinstance(o, torch.Tensor) and _unbatch(o, levels)[0].requires_grad for o in tree_flatten(out)[0]
        ):
            _refuse_closure_derivative(spec, fun, "reverse-mode derivative (grad, vjp)")
        return out
    randomness = [r for r, b in zip(randomness, batched) if b]
    vspec: Any
    if isinstance(spec, _VjpSpec):
        vspec, fn = _VjpSpec(spec.op, fun, spec.nondiff_argnums, tuple(spec.all_args(peeled))), _CustomVjpTracedFunction
        vspec.fwd = _vectorized_fwd(spec, randomness)
        vspec.bwd = _vectorized_bwd(spec, randomness)
    else:
        vspec, fn = _JvpSpec(spec.op, fun, spec.nondiff_argnums, tuple(spec.all_args(peeled))), _CustomJvpTracedFunction
        vspec.fun = _vectorized_fun(spec, randomness)
        vspec.jvp_fn = _vectorized_jvp_rule(spec, randomness)
    _hop.note_custom_rule()  # (its traced backward has no graph: see `_hop.custom_rules`)
    for _ in levels:
        _vmap_decrement_nesting()
    try:
        outs = _apply_rule(spec.op, fun, fn, vspec)
    finally:
        for size, (_, _, rnd) in zip(sizes, info):
            _vmap_increment_nesting(size, rnd)
    bdims = [(lvl, 0 if b else None) for lvl, b in zip(reversed(levels), reversed(batched))]
    return tree_unflatten(vspec.out_td, [_rebatch(o, bdims) for o in outs[: vspec.n_out]])


def _vmapped(fn: Callable[..., Any], randomness: Sequence[str]) -> Callable[..., Any]:
    """`fn` vectorised over one leading dimension per level (outermost first) of every input
    and output."""
    for rnd in reversed(randomness):
        fn = torch.func.vmap(fn, in_dims=0, out_dims=0, randomness=rnd)
    return fn


def _vectorized_fwd(spec: _VjpSpec, randomness: Sequence[str]) -> Callable[..., Any]:
    """`spec.fwd` over the batched arguments of `_traced_vmap_rule_call`: the output and the
    residuals' tensors come back batched; non-tensor residuals as they are."""
    op = spec.op

    def vfwd(*all_args: Any) -> tuple[Any, Any]:
        tensors = partition(tuple(all_args[i] for i in spec.diff_argnums)).dynamic
        box: dict[str, Any] = {}

        def one(*ts: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
            pair = spec.fwd(*spec.all_args(ts))
            _check_fwd_pair(op, spec.fwd, pair)
            out_leaves, box["out_td"] = _flatten_outputs(op, spec.fwd, "fwd output", pair[0])
            res_leaves, box["res_td"] = tree_flatten(pair[1])
            box["static"] = [None if isinstance(r, torch.Tensor) else r for r in res_leaves]
            # A residual that is an output tensor (`return y, (x, y)`, the usual way to save
            # the output) or a residual given twice is copied: on torch 2.11, Dynamo traces
            # this vmapped `fwd` with the vmap's values as extra outputs, and in a loop body's
            # backward the output's cotangent then went to its twin, leaving the rule a zero
            # cotangent (zero gradients, without an error; hunt 31, docs/compatibility.md).
            # (`is`, not `id`: Dynamo traces this)
            seen = list(out_leaves)
            res_t = []
            for r in res_leaves:
                if isinstance(r, torch.Tensor):
                    res_t.append(r.clone() if any(r is t for t in seen) else r)
                    seen.append(r)
            return tuple(out_leaves), tuple(res_t)

        outs, res_t = _vmapped(one, randomness)(*tensors)
        it = iter(res_t)
        res = [next(it) if v is None else v for v in box["static"]]
        return tree_unflatten(box["out_td"], list(outs)), tree_unflatten(box["res_td"], res)

    _wraps(vfwd, spec.fwd)  # errors about the rule name the user's fwd
    return vfwd


def _split_tensors(tree: Any) -> tuple[list[torch.Tensor], Callable[[Sequence[torch.Tensor]], Any]]:
    """`tree`'s tensor leaves, and a function that rebuilds `tree` with others in their place
    (the other leaves, None included, kept)."""
    leaves, td = tree_flatten(tree, none_is_leaf=True)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]

    def rebuild(new: Sequence[torch.Tensor]) -> Any:
        it = iter(new)
        return tree_unflatten(td, [next(it) if isinstance(x, torch.Tensor) else x for x in leaves])

    return tensors, rebuild


def _vectorized_fun(spec: _JvpSpec, randomness: Sequence[str]) -> Callable[..., Any]:
    """A custom_jvp's `fun` over the batched arguments of `_traced_vmap_rule_call`."""

    def vfun(*all_args: Any) -> Any:
        tensors = partition(tuple(all_args[i] for i in spec.diff_argnums)).dynamic
        box: dict[str, Any] = {}

        def one(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
            leaves, box["td"] = _flatten_outputs(spec.op, spec.fun, "output", spec.fun(*spec.all_args(ts)))
            return tuple(leaves)

        outs = _vmapped(one, randomness)(*tensors)
        return tree_unflatten(box["td"], list(outs))

    _wraps(vfun, spec.fun)
    return vfun


def _vectorized_jvp_rule(spec: _JvpSpec, randomness: Sequence[str]) -> Callable[..., Any]:
    """A custom_jvp's rule over the batched primals and tangents of `_traced_vmap_rule_call`:
    `(primal_out, tangent_out)` come back batched, None where the rule gave None."""

    def vrule(*a: Any) -> Any:
        p_tensors, p_rebuild = _split_tensors(a[-2])
        t_tensors, t_rebuild = _split_tensors(a[-1])
        box: dict[str, Any] = {}

        def one(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
            pair = spec.jvp_fn(*spec.nondiff, p_rebuild(ts[: len(p_tensors)]), t_rebuild(ts[len(p_tensors) :]))
            out, box["rebuild"] = _split_tensors(pair)
            return tuple(out)

        got = _vmapped(one, randomness)(*p_tensors, *t_tensors)
        return box["rebuild"](got)

    _wraps(vrule, spec.jvp_fn)
    return vrule


def _vectorized_bwd(spec: _VjpSpec, randomness: Sequence[str]) -> Callable[..., Any]:
    """`spec.bwd` over the batched residuals and cotangents of `_traced_vmap_rule_call`: the
    cotangents come back batched (the argument's structure, None where bwd gave None)."""

    def vbwd(*a: Any) -> Any:
        res_leaves, res_td = tree_flatten(a[-2])
        g_leaves, g_td = tree_flatten(a[-1])
        tensor_res = [r for r in res_leaves if isinstance(r, torch.Tensor)]
        box: dict[str, Any] = {}

        def one(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
            it = iter(ts[: len(tensor_res)])
            res = tree_unflatten(res_td, [next(it) if isinstance(r, torch.Tensor) else r for r in res_leaves])
            g = tree_unflatten(g_td, list(ts[len(tensor_res) :]))
            cts = spec.bwd(*spec.nondiff, res, g)
            leaves, box["td"] = tree_flatten(cts, none_is_leaf=True)
            box["static"] = [None if isinstance(c, torch.Tensor) else (c,) for c in leaves]
            return tuple(c for c in leaves if isinstance(c, torch.Tensor))

        got = iter(_vmapped(one, randomness)(*tensor_res, *g_leaves))
        return tree_unflatten(box["td"], [next(got) if s is None else s[0] for s in box["static"]])

    _wraps(vbwd, spec.bwd)
    return vbwd


# --------------------------------------------------------------------------------------
# custom_jvp
# --------------------------------------------------------------------------------------


class _JvpSpec(_CallSpec):
    fun: Callable[..., Any]
    jvp_fn: Callable[..., Any]
    n_out: int
    out_meta: list[tuple[torch.Size, torch.dtype]]


def _call_jvp_rule(
    spec: _JvpSpec, primals: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor], out: Any = None
) -> list[Any]:
    """The rule's flat tangents (None for integer outputs). `out`, where given, is the
    function's output (a tree of the output's structure; traced, rebuilding a dict from
    `spec.out_td` fails in Dynamo's optree support)."""
    op = "tfun.custom_jvp"
    p_args = spec.diff_args(primals)
    t_args = spec.diff_args(tangents)
    pair = spec.jvp_fn(*spec.nondiff, p_args, t_args)
    prim, tan = require_pair(
        op, spec.jvp_fn, pair, "the jvp rule", "primal_out, tangent_out", "Return `(primal_out, tangent_out)`."
    )
    expected = _skeleton(functools.partial(tree_unflatten, spec.out_td), spec.n_out) if out is None else out
    # the primal output itself comes from `fun`, but as in JAX the rule's must match it
    _check_cotangents(
        op,
        spec.jvp_fn,
        "primal_out",
        prim,
        expected,
        "the primal output",
        list(spec.out_meta),
        "Return a primal_out equal to the function's output (same structure, shapes and dtypes).",
    )
    flat = _check_cotangents(
        op,
        spec.jvp_fn,
        "tangent_out",
        tan,
        expected,
        "the primal output",
        [m if (m[1].is_floating_point or m[1].is_complex) else None for m in spec.out_meta],
        "Return a tangent_out with the structure, shapes and dtypes of the function's output.",
    )
    # integer and boolean outputs have no tangent (JAX's float0): whatever the rule gave
    # there is dropped, rather than handed to autograd, which refuses it
    return [t if (m[1].is_floating_point or m[1].is_complex) else None for t, m in zip(flat, spec.out_meta)]


class _CustomJvpFunction(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(spec: _JvpSpec, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        n = len(spec.tensors)
        with _Bound(spec, tensors[n:]), _InsideForward():
            out = spec.fun(*spec.all_args(tensors[:n]))
        found = spec.results  # (written there, not on `spec`: see `_Results`)
        leaves, found.out_td = _flatten_outputs("tfun.custom_jvp", spec.fun, "output", out)
        found.n_out = len(leaves)
        found.out_meta = [(o.shape, o.dtype) for o in leaves]
        # the backward runs the jvp rule again, usually after the `torch.autocast` block:
        # it must see the dtypes the forward saw (hunt 33, F4)
        found.autocast = _eager_autocast_state(tensors)
        # an output that is an input is returned as an alias so autograd can track it
        return tuple(o.view_as(o) if any(o is t for t in tensors) else o for o in leaves)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]
        tensors = inputs[1:]
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)

    @staticmethod
    def jvp(ctx: Any, _spec_tangent: Any, *tangents: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        spec: _JvpSpec = ctx.spec
        n = len(spec.tensors)
        primals, caps = ctx.saved_tensors[:n], ctx.saved_tensors[n:]
        fwd_levels = spec.captures.forward_levels if spec.captures is not None else []
        if any(t is not None and w for t, w in zip(tangents[n:], fwd_levels)):
            _refuse_closure_derivative(spec, spec.jvp_fn, "forward-mode derivative (jvp, jacfwd)")
        tans = [torch.zeros_like(p) if t is None else t for p, t in zip(primals, tangents)]
        with _Bound(spec, caps), _context.autocast_restored(spec.autocast):
            flat = _call_jvp_rule(spec, primals, tans)
        return tuple(
            None
            if not (m[1].is_floating_point or m[1].is_complex)
            else torch.zeros(m[0], dtype=m[1], device=primals[0].device if primals else None)
            if f is None
            else f
            for f, m in zip(flat, spec.out_meta)
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # The tangent map t -> jvp_rule(primals, t)[1] is linear; its VJP is the transpose.
        spec: _JvpSpec = ctx.spec
        n = len(spec.tensors)
        primals, caps = ctx.saved_tensors[:n], ctx.saved_tensors[n:]
        if caps and any(g is not None for g in grads) and any(ctx.needs_input_grad[1 + n :]):
            _refuse_closure_derivative(spec, spec.jvp_fn, "reverse-mode derivative (grad, vjp)")
        with _Bound(spec, caps), _context.autocast_restored(spec.autocast):
            result = _CustomJvpFunction._transpose(spec, primals, grads)
        return (*result, *(None,) * len(caps))

    @staticmethod
    def _transpose(spec: _JvpSpec, primals: Sequence[torch.Tensor], grads: Any) -> tuple[Any, ...]:
        diff_in = [k for k, p in enumerate(primals) if is_inexact(p)]
        diff_out = [k for k, m in enumerate(spec.out_meta) if m[1].is_floating_point or m[1].is_complex]

        def tangent_map(*t_diff: torch.Tensor) -> list[torch.Tensor]:
            tans = [torch.zeros_like(p) for p in primals]
            for k, t in zip(diff_in, t_diff):
                tans[k] = t
            with _Transposing(_tensor_level(t_diff[0])):
                flat = _call_jvp_rule(spec, primals, tans)
            res = []
            for k in diff_out:
                f = flat[k]
                m = spec.out_meta[k]
                if f is None:
                    # keep the output connected to the tangents so torch.func.vjp accepts it
                    f = torch.zeros(m[0], dtype=m[1], device=primals[0].device) + 0 * sum(
                        t.sum() for t in t_diff
                    )
                res.append(f)
            return res

        if not diff_in or not diff_out:
            return (None,) + (None,) * len(primals)
        _, pullback = torch.func.vjp(tangent_map, *[torch.zeros_like(primals[k]) for k in diff_in])  # type: ignore[misc]
        g = [torch.zeros(spec.out_meta[k][0], dtype=spec.out_meta[k][1]) if grads[k] is None else grads[k] for k in diff_out]
        cts = pullback(g)
        result: list[Any] = [None] * len(primals)
        for k, c in zip(diff_in, cts):
            result[k] = c
        return (None, *result)


class _CustomJvpTracedFunction(torch.autograd.Function):
    """`_CustomJvpFunction` without its `jvp` method, for `tfun.jit` / `torch.export`.

    Dynamo refuses an `autograd.Function` that defines `jvp` ("Unsupported custom jvp",
    torch 2.11-2.13). Traced, the function therefore has the reverse-mode derivative only:
    the JVP rule transposed (its backward), which `tfun.grad` and `.backward()` use.
    Forward mode under `tfun.jit` does not reach it: inside a traced `jvp` the call applies
    the rule to the dual tensors itself (`_traced_jvp_call`).
    """

    generate_vmap_rule = True
    forward = staticmethod(_CustomJvpFunction.forward)
    setup_context = staticmethod(_CustomJvpFunction.setup_context)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # transpose of the linear tangent map t -> jvp_rule(primals, t)[1], by autograd
        # through that map at t = 0 (Dynamo traces torch.autograd.grad, not torch.func.vjp)
        spec: _JvpSpec = ctx.spec
        primals = ctx.saved_tensors
        diff_in = [k for k, p in enumerate(primals) if is_inexact(p)]
        diff_out = [
            k
            for k, m in enumerate(spec.out_meta)
            if (m[1].is_floating_point or m[1].is_complex) and grads[k] is not None
        ]
        result: list[Any] = [None] * len(primals)
        if not diff_in or not diff_out:
            return (None, *result)
        higher = torch.is_grad_enabled()  # backward with create_graph: keep the graph
        if not higher:
            # The rule is differentiated in its tangents only. Saved primals that carry an
            # autograd history (the output of an op before this function, `f(x @ w)`) would
            # put that history under the torch.autograd.grad below, which Dynamo refuses
            # ("autograd.grad consumed returned tensor's grad_fn"): cut it.
            primals = tuple(p.detach() for p in primals)
        with torch.enable_grad():
            t_diff = [grad_leaf(torch.zeros_like(primals[k])) for k in diff_in]
            tans = [torch.zeros_like(p) for p in primals]
            for k, t in zip(diff_in, t_diff):
                tans[k] = t
            if higher:
                flat = _call_jvp_rule(spec, list(primals), tans)
            else:
                # first order: the rule's primal output and its coefficients (functions of the
                # primals) are not differentiated, so custom functions the rule calls run their
                # primal function. Through their own rule, a rule that calls its function (the
                # usual `return f(x), ...`) would have Dynamo trace this backward again, forever.
                with _InsideForward():
                    flat = _call_jvp_rule(spec, list(primals), tans)
            outs = [flat[k] for k in diff_out if flat[k] is not None and flat[k].requires_grad]
            gs = [grads[k] for k in diff_out if flat[k] is not None and flat[k].requires_grad]
            if not outs:
                return (None, *result)
            cts = torch.autograd.grad(outs, t_diff, gs, allow_unused=True, create_graph=higher)
        for k, c in zip(diff_in, cts):
            result[k] = torch.zeros_like(primals[k]) if c is None else c
        return (None, *result)


class custom_jvp:
    """A function with a custom forward-mode derivative, as `jax.custom_jvp`.

    ```python
    @tfun.custom_jvp
    def f(x):
        return torch.log1p(torch.exp(x))

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), torch.sigmoid(x) * t
    ```

    Under `tfun.jvp`/`jacfwd`/`torch.func.jvp` and forward-mode AD the rule gives the
    tangent. Reverse mode (`.backward()`, `grad`, `vjp`, `jacrev`) uses the transpose of
    the rule's tangent map, obtained by differentiating the rule with respect to its
    tangents (it must be linear in them and written with differentiable torch ops, as
    JAX requires). The primal output always comes from `fun`. Higher orders differentiate
    the rule, as in JAX, in every nesting: `tfun.hessian`, `jacrev(jacfwd(f))`, and forward
    over forward mode (`jvp` of `jvp`, `jacfwd(jacfwd(f))`, with `vmap`s between), where tfun
    applies the rule level by level (torch's `autograd.Function` alone would give a zero
    second-order tangent there).

    **Arguments:**

    - `fun`: the primal function of positional pytree arguments, returning a pytree of
      tensors.
    - `nondiff_argnums`: positions of arguments that are not differentiated; the rule
      receives them first: `jvp_fn(*nondiff_args, primals, tangents)`.
    - `nondiff_argnames`: the same, by parameter name (JAX's `nondiff_argnames`); joined
      with `nondiff_argnums`.

    **Returns:** a callable with `fun`'s signature; define the rule with
    `.defjvp(jvp_fn)` where `jvp_fn(primals, tangents) -> (primal_out, tangent_out)`,
    `primals` and `tangents` being tuples of the differentiable arguments and
    `tangent_out` having the output's structure (`None` marks a zero).

    `fun` and the rule may close over tensors of enclosing transforms (batched by a `vmap`,
    tracked by an outer `grad`), and nondiff arguments may be such tensors (or functions
    that close over them): tfun lifts them into inputs of its `autograd.Function`. They
    are constants of the custom function: a
    derivative through one of them is an `ArgumentValueError` (JAX raises there too); pass
    such a tensor as a differentiable argument instead.

    Under `tfun.jit`, reverse mode (`tfun.grad`, `.backward()` on the jitted result) uses
    the transposed rule, also for a call inside `tfun.vmap`s that `tfun.jit` traces (applied
    outside the vmaps, vectorised, as for `custom_vjp`, with the same two refusals), and
    forward mode inside the compiled function (`tfun.jvp`, `tfun.jacfwd`, with `tfun.vmap`s
    around or inside them) applies the rule to the tangents, as eagerly. Where the traced
    rule cannot be applied, the call is a `JitError` rather than `fun`'s own derivative:
    inside a second transform (a `jvp` of a `jvp`, `hessian`, `torch.func.grad`,
    `tfun.vjp`), or where reverse mode could reach the results of a `jvp` (an argument or
    closed-over tensor that requires grad; pass detached tensors or use `torch.no_grad()`
    when only the forward derivative is wanted). Apply such transforms outside `tfun.jit`.
    """

    def __init__(
        self, fun: Callable[..., Any], nondiff_argnums: Sequence[int] = (), nondiff_argnames: Sequence[str] = ()
    ) -> None:
        _wraps(self, fun)
        self.fun = fun
        nums = tuple(_normalize_nondiff("tfun.custom_jvp", nondiff_argnums))
        self.nondiff_argnums = tuple(sorted(set(nums + _argnames_to_nums("tfun.custom_jvp", fun, nondiff_argnames))))
        self.jvp_fn: Callable[..., Any] | None = None

    def defjvp(self, jvp_fn: Callable[..., Any], symbolic_zeros: bool = False) -> Callable[..., Any]:
        """Define the rule.

        **Arguments:**

        - `jvp_fn`: `jvp_fn(*nondiff_args, primals, tangents) -> (primal_out, tangent_out)`.
        - `symbolic_zeros`: JAX's flag; only `False` (the default) is supported.

        **Returns:** `jvp_fn`, so `defjvp` can be used as a decorator.
        """
        _check_rule_flags("tfun.custom_jvp.defjvp", symbolic_zeros)
        if not callable(jvp_fn):
            raise ArgumentTypeError(
                format_message(f"tfun.custom_jvp.defjvp: the rule must be callable, got {describe_value(jvp_fn)}.")
            )
        self.jvp_fn = jvp_fn
        return jvp_fn

    def defjvps(self, *tangent_fns: Callable[..., Any] | None) -> None:
        """Define the rule one argument at a time, as `jax.custom_jvp.defjvps`.

        **Arguments:**

        - `*tangent_fns`: one per differentiable positional argument (or `None` for an
          argument with zero derivative); `tangent_fns[i](t_i, primal_out, *primals)`
          returns that argument's contribution to `tangent_out`.

        **Returns:** None.
        """
        fun = self.fun

        def jvp_fn(*a: Any) -> tuple[Any, Any]:
            nondiff, primals, tangents = a[:-2], a[-2], a[-1]
            all_args = list(primals)
            for i, v in zip(self.nondiff_argnums, nondiff):
                all_args.insert(i, v)
            out = fun(*all_args)
            total: Any = None
            for fn, t in zip(tangent_fns, tangents):
                if fn is None:
                    continue
                contrib = fn(t, out, *primals)
                total = contrib if total is None else _tree_add(total, contrib)
            return out, total

        functools.update_wrapper(jvp_fn, tangent_fns[0] if tangent_fns and tangent_fns[0] else fun)
        self.jvp_fn = jvp_fn

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        op = "tfun.custom_jvp"
        if self.jvp_fn is None:
            raise ArgumentValueError(
                format_message(
                    f"{op}: no JVP rule is defined for this function.",
                    function=describe(self.fun),
                    revise="Call `f.defjvp(jvp_fn)` before calling `f`.",
                )
            )
        args = _bind_positional(self.fun, args, kwargs, op)
        spec = _JvpSpec(op, self.fun, self.nondiff_argnums, args)
        if not _needs_rule(spec.tensors) or _on_tangent_path(spec.tensors):
            with _checkpoint_op():
                return self.fun(*args)
        spec.fun, spec.jvp_fn = self.fun, self.jvp_fn
        if not _context.is_tracing() and _context.functorch_active() and _context.forward_mode_depth() >= 2:
            innermost = _context.innermost_transform()
        else:
            innermost = None
        if (
            innermost not in (None, "Grad")
            and _jvp_wrapped_checkable(
                op, self.fun, "a custom_jvp function inside nested forward-mode transforms (jvp of jvp, jacfwd of jacfwd)"
            )
            and any(_jvp_wrapped(t) for t in spec.tensors)
        ):
            # Forward mode over forward mode: handled level by level from the innermost
            # transform (see the two functions). With a grad/vjp innermost, the Function below
            # runs its rule there and the forward-mode levels below see the rule's ops (checked
            # against JAX in tests/test_custom_derivatives.py).
            if innermost not in ("Jvp", "Vmap"):
                _refuse_forward_over_forward(
                    op, self.fun, f"here the innermost torch.func transform is {_TRANSFORM_NAMES.get(innermost, innermost)}"
                )
            _require_functorch(
                op, self.fun, _LEVEL_BY_LEVEL_NEEDS, "forward mode over forward mode through a custom_jvp function",
                "Take the outer derivative in reverse mode (tfun.hessian, tfun.jacrev(tfun.jacfwd(f))), or install a "
                "torch release tfun supports (docs/compatibility.md).", error=TfunError,
            )
            _capture(spec, (self.fun, self.jvp_fn, *_callables(spec.nondiff)))
            if innermost == "Jvp":
                return _forward_over_forward_call(self, spec)
            return _batched_forward_over_forward_call(self, spec)
        _capture(spec, (self.fun, self.jvp_fn, *_callables(spec.nondiff)))
        fn: Any = _CustomJvpFunction
        if _context.is_tracing():
            if _context.functorch_active():
                stack = _hop.traced_transforms()
                if _forward_only(stack) or all(k == "Vmap" for k, _ in stack):
                    _require_functorch(
                        op,
                        self.fun,
                        _TRACED_TRANSFORMS_NEED,
                        "under tfun.jit, a custom_jvp function called inside tfun.jvp or tfun.vmap",
                        "Apply tfun.jvp / tfun.vmap outside tfun.jit (tfun.jvp(tfun.jit(f), ...) and "
                        "tfun.vmap(tfun.jit(f)) run the rule around the compiled function), or install a torch "
                        "release tfun supports (docs/compatibility.md).",
                    )
                if _forward_only(stack):
                    return _traced_jvp_call(spec, args, stack)
                if all(k == "Vmap" for k, _ in stack):
                    return _traced_vmap_rule_call(spec, self.fun, stack)
                _refuse_traced_transforms(op, self.fun, stack)
            fn = _CustomJvpTracedFunction
            _hop.note_custom_rule()
        outs = _apply_rule(op, self.fun, fn, spec)
        return tree_unflatten(spec.out_td, list(outs))


def _jvp_wrapped_checkable(op: str, fun: Callable[..., Any], what: str) -> bool:
    """True, where this torch has what `_jvp_wrapped` reads (eagerly); else a TfunError
    saying so."""
    _require_functorch(
        op,
        fun,
        _JVP_WRAPPED_NEEDS,
        what,
        "Call the function outside these torch.func transforms, or install a torch release tfun supports "
        "(docs/compatibility.md).",
        error=TfunError,
    )
    return True


def _forward_only(stack: tuple[tuple[str, int], ...]) -> bool:
    """Whether the enclosing transforms are one forward-mode `jvp` and any number of `vmap`s
    (`tfun.jvp`, `jacfwd`, `vmap` of `jvp`, `jvp` of `vmap`): the stacks a traced custom_jvp
    call handles by applying its rule to the tangents directly (`_traced_jvp_call`)."""
    kinds = [k for k, _ in stack]
    return kinds.count("Jvp") == 1 and all(k in ("Jvp", "Vmap") for k in kinds)


_TRANSFORM_NAMES = {"Jvp": "jvp", "Vmap": "vmap", "Grad": "grad/vjp", "Functionalize": "functionalize"}


def _refuse_traced_transforms(op: str, fun: Callable[..., Any], stack: tuple[tuple[str, int], ...]) -> None:
    shown = " of ".join(_TRANSFORM_NAMES.get(k, k) for k, _ in stack)
    raise JitError(
        format_message(
            f"{op}: under tfun.jit, a custom_jvp function can be called inside one forward-mode transform "
            f"(tfun.jvp, tfun.jacfwd, with any tfun.vmap around or inside it), but here the enclosing torch.func "
            f"transforms are {shown} (outermost first): torch.compile (torch {torch.__version__}) cannot "
            "trace the function's rule there, and differentiating the function itself would ignore the rule.",
            function=describe(fun),
            revise="Apply these transforms outside tfun.jit (tfun.vmap(tfun.jit(f)) and tfun.jvp(tfun.jit(f), ...) "
            "run the rule around the compiled function), or use reverse mode (tfun.grad and .backward() use the "
            "rule under tfun.jit).",
        )
    )


def _traced_jvp_call(spec: _JvpSpec, args: tuple[Any, ...], stack: tuple[tuple[str, int], ...]) -> Any:
    """A custom_jvp call traced inside one forward-mode transform and `vmap`s (see
    `_forward_only`).

    Dynamo refuses an `autograd.Function` with a `jvp` method, but it traces forward-mode AD
    itself: the call unpacks its arguments' dual tensors at the jvp's level, runs `fun` on the
    primals (which carry no tangent there, so `fun` is not differentiated) and the rule on the
    primals and tangents, and returns `fun`'s outputs made dual with the rule's tangents: the
    tangent is the rule's, as with `_CustomJvpFunction.jvp` eagerly. With no tangent at that
    level, `fun` just runs (so a rule that calls its own function does not recurse).

    `vmap`s inside the jvp (`jvp(vmap(f))`) batch the arguments above the dual tensors, and
    torch has no batching rule for unpacking a dual: the batch dimensions are taken off first
    (`_unbatch`), `fun` and the rule run on the re-batched primals and tangents, and the
    outputs and tangents are unbatched again to be made dual, then re-batched."""
    import torch.autograd.forward_ad as fwAD

    op = spec.op
    kinds = [k for k, _ in stack]
    vmap_levels = [lvl for k, lvl in stack[kinds.index("Jvp") + 1 :]]
    peeled = [_unbatch(t, vmap_levels) for t in spec.tensors]
    pairs = [fwAD.unpack_dual(inner) for inner, _ in peeled]
    if all(pr.tangent is None for pr in pairs):
        out = spec.fun(*args)
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and fwAD.unpack_dual(_unbatch(o, vmap_levels)[0]).tangent is not None:
                # no argument has a tangent, yet the output does: through a tensor `fun` closes over
                _refuse_closure_derivative(spec, spec.fun, "forward-mode derivative (jvp, jacfwd)")
        return out
    primals = [_rebatch(pr.primal, bdims) for pr, (_, bdims) in zip(pairs, peeled)]
    tans = [
        _rebatch(torch.zeros_like(pr.primal) if pr.tangent is None else pr.tangent, bdims)
        for pr, (_, bdims) in zip(pairs, peeled)
    ]
    # (not under `_InsideForward`: trace-time state that a trace abandoned by an error inside
    # `fun` would leave set. Custom functions that `fun` calls see primals with no tangent
    # at the jvp's level and just run their function.)
    out = spec.fun(*spec.all_args(primals))
    found = spec.results
    leaves, found.out_td = _flatten_outputs(op, spec.fun, "output", out)
    found.n_out = len(leaves)
    found.out_meta = [(o.shape, o.dtype) for o in leaves]
    flat = _call_jvp_rule(spec, primals, tans, out)
    duals = []
    for o, f in zip(leaves, flat):
        if not (o.is_floating_point() or o.is_complex()):
            duals.append(o)
            continue
        o_in, f_in, bdims = _unbatch_pair(o, torch.zeros_like(o) if f is None else f, vmap_levels)
        if fwAD.unpack_dual(o_in).tangent is not None or fwAD.unpack_dual(f_in).tangent is not None:
            # the function or its rule is differentiated through a tensor it closes over
            _refuse_closure_derivative(spec, spec.jvp_fn, "forward-mode derivative (jvp, jacfwd)")
        duals.append(_rebatch(fwAD.make_dual(o_in, f_in), bdims))
        if torch.is_grad_enabled() and (_requires_grad(o_in, stack) or _requires_grad(f_in, stack)):
            _refuse_outer_reverse(spec)
    return tree_unflatten(spec.out_td, duals)


def _requires_grad(t: torch.Tensor, stack: tuple[tuple[str, int], ...]) -> bool:
    """Whether `t`, a tensor at the jvp's level of `stack` (vmaps above it taken off), requires
    grad by the autograd outside every transform: a `torch.func` wrapper hides that, so the
    jvp's and the inner vmaps' wrappers are taken off first."""
    unwrap_batched, unwrap_for_grad = _functorch("unwrap_batched"), _functorch("unwrap_for_grad")
    kinds = [k for k, _ in stack]
    at = kinds.index("Jvp")
    t = unwrap_for_grad(t, stack[at][1])
    for _, level in reversed(stack[:at]):
        t, _ = unwrap_batched(t, level)
    return bool(t.requires_grad)


def _refuse_outer_reverse(spec: _JvpSpec) -> None:
    raise JitError(
        format_message(
            f"{spec.op}: under tfun.jit, the result of tfun.jvp through a custom_jvp function cannot be "
            "differentiated again by reverse mode (an argument, or a tensor the function or its rule closes over, "
            "requires grad, so an outer .backward() or tfun.grad could reach it): traced inside the jvp, the "
            "function's output would be differentiated through `fun`, not through its rule.",
            function=describe(spec.fun),
            revise="Pass tensors that do not require grad (e.g. `x.detach()`) or call under `torch.no_grad()` when "
            "only the forward-mode derivative is wanted, or take the outer derivative outside tfun.jit.",
        )
    )


def _unbatch(t: torch.Tensor, levels: Sequence[int]) -> tuple[torch.Tensor, list[tuple[int, Any]]]:
    """`t` with the batch dimensions of the `vmap` levels `levels` (outermost first) taken
    off, innermost level last, and each level's batch dimension (None: not batched there)."""
    unwrap_batched = _functorch("unwrap_batched")
    bdims: list[tuple[int, Any]] = []
    for level in reversed(levels):
        t, bdim = unwrap_batched(t, level)
        bdims.append((level, bdim))
    return t, bdims


def _unbatch_pair(
    a: torch.Tensor, b: torch.Tensor, levels: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, Any]]]:
    """Two tensors of the same per-example shape unbatched as `_unbatch` does, with their
    batch dimensions aligned (at 0; one batched at a level where the other is not is
    expanded), so that the two have the same shape."""
    unwrap_batched = _functorch("unwrap_batched")
    bdims: list[tuple[int, Any]] = []
    for level in reversed(levels):
        a, da = unwrap_batched(a, level)
        b, db = unwrap_batched(b, level)
        if da is None and db is None:
            bdims.append((level, None))
            continue
        if da is not None:
            a = a.movedim(da, 0)
        if db is not None:
            b = b.movedim(db, 0)
        size = a.shape[0] if da is not None else b.shape[0]
        if da is None:
            a = a.unsqueeze(0).expand(size, *a.shape)
        if db is None:
            b = b.unsqueeze(0).expand(size, *b.shape)
        bdims.append((level, 0))
    return a, b, bdims


def _rebatch(t: torch.Tensor, bdims: Sequence[tuple[int, Any]]) -> torch.Tensor:
    """Undo `_unbatch`: the batch dimensions put back, innermost level first."""
    add_batch_dim = _functorch("add_batch_dim")
    for level, bdim in reversed(bdims):
        if bdim is not None:
            t = add_batch_dim(t, bdim, level)
    return t


def _forward_over_forward_call(custom: custom_jvp, spec: _JvpSpec) -> Any:
    """An eager custom_jvp call inside two or more forward-mode transforms (`jvp` of `jvp`,
    `jacfwd` of `jacfwd`), the innermost transform being a `jvp`.

    torch runs an `autograd.Function`'s `jvp` rule outside the outer forward-mode transforms,
    so through `_CustomJvpFunction` the second-order tangent would be zero. Here the innermost
    level is handled by hand, as JAX's JVP of a custom_jvp does: the arguments' dual tensors
    are split at that level into primals and tangents of the level below; one level down,
    the output is the custom function itself applied to the primals (so the lower levels use
    the rule again), and the tangent is the rule applied to the primals and tangents (so the
    lower levels differentiate the rule: its own derivative, as in JAX); the two are made dual
    at the innermost level."""
    import torch.autograd.forward_ad as fwAD

    op = spec.op
    interp = _compat.current_interpreter()  # type: ignore[misc]
    level = int(interp.level())

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if _tensor_level(t) != level:
            return t, None
        pair = fwAD.unpack_dual(t)
        primal = _compat.unwrap_for_grad(pair.primal, level)  # type: ignore[misc]
        return primal, None if pair.tangent is None else _compat.unwrap_for_grad(pair.tangent, level)  # type: ignore[misc]

    caps: list[Any] = []
    if spec.captures is not None:
        for t in spec.captures.tensors:
            primal, tangent = split(t)
            if tangent is not None:
                _refuse_closure_derivative(spec, spec.jvp_fn, "forward-mode derivative (jvp, jacfwd)")
            caps.append(primal)
    parts = [split(t) for t in spec.tensors]
    primals = [p for p, _ in parts]
    with interp.lower(), _Bound(spec, caps):
        out = custom(*spec.all_args(primals))
        found = spec.results
        leaves, found.out_td = _flatten_outputs(op, spec.fun, "output", out)
        found.n_out = len(leaves)
        found.out_meta = [(o.shape, o.dtype) for o in leaves]
        if all(t is None for _, t in parts):
            flat: list[Any] = [None] * len(leaves)
        else:
            tans = [torch.zeros_like(p) if t is None else t for p, t in parts]
            flat = _call_jvp_rule(spec, primals, tans, out)
    duals = []
    for o, f in zip(leaves, flat):
        o_w = _compat.wrap_for_grad(o, level)  # type: ignore[misc]
        duals.append(o_w if f is None else fwAD.make_dual(o_w, _compat.wrap_for_grad(f, level)))  # type: ignore[misc]
    return tree_unflatten(spec.out_td, duals)


def _batched_forward_over_forward_call(custom: custom_jvp, spec: _JvpSpec) -> Any:
    """An eager custom_jvp call inside two or more forward-mode transforms, the innermost
    transform being a `vmap` (`jvp(jvp(vmap(f)))`, and `jacfwd` of `jacfwd` of `jacfwd`, which
    reaches a vmap between two jvps).

    The generated batching rule of `_CustomJvpFunction` would apply the Function one level
    down, where its `jvp` rule meets the forward-mode transforms the wrong way (see
    `_forward_over_forward_call`). Here the vmap level is handled by hand, as JAX batches a
    custom_jvp: the batch dimensions are taken off the arguments, and one level down a new
    custom function is called whose function is `fun` under `torch.func.vmap` and whose rule is
    the rule under `torch.func.vmap`; its outputs are batched again (at dimension 0)."""
    op = spec.op
    interp = _compat.current_interpreter()  # type: ignore[misc]
    level = int(interp.level())
    if spec.captures is not None and any(_tensor_level(t) == level for t in spec.captures.tensors):
        # a tensor batched at this level among the closures or nondiff arguments: the rules
        # would need it per example
        _refuse_forward_over_forward(
            op, spec.fun, "here the function or its rule closes over a tensor (or takes a nondiff tensor) batched by the innermost vmap"
        )
    parts = [_compat.unwrap_batched(t, level) for t in spec.tensors]  # type: ignore[misc]
    flat = [t for t, _ in parts]
    if all(b is None for _, b in parts):
        with interp.lower():
            return custom(*spec.all_args(flat))
    in_dims = tuple(None if b is None else int(b) for _, b in parts)
    fun, rule = spec.fun, spec.jvp_fn

    def per_example(*tensors: torch.Tensor) -> Any:
        return fun(*spec.all_args(tensors))

    def per_example_rule(primals: tuple[torch.Tensor, ...], tangents: tuple[torch.Tensor, ...]) -> Any:
        return rule(*spec.nondiff, spec.diff_args(primals), spec.diff_args(tangents))

    def batched_fun(*tensors: torch.Tensor) -> Any:
        return torch.func.vmap(per_example, in_dims=in_dims)(*tensors)

    def batched_rule(primals: tuple[torch.Tensor, ...], tangents: tuple[torch.Tensor, ...]) -> Any:
        return torch.func.vmap(per_example_rule, in_dims=(in_dims, in_dims))(tuple(primals), tuple(tangents))

    functools.update_wrapper(batched_fun, fun)
    functools.update_wrapper(batched_rule, rule)
    batched = custom_jvp(batched_fun)
    batched.defjvp(batched_rule)
    with interp.lower():
        out = batched(*flat)
    leaves, td = tree_flatten(out)
    return tree_unflatten(td, [_compat.add_batch_dim(o, 0, level) for o in leaves])  # type: ignore[misc]


def _refuse_forward_over_forward(op: str, fun: Callable[..., Any], why: str) -> None:
    """Forward mode over forward mode through a custom_jvp function where tfun cannot apply the
    rule level by level (`_forward_over_forward_call`, `_batched_forward_over_forward_call`):
    torch's `autograd.Function` would compute its `jvp` rule outside the outer forward-mode
    transform, so the second-order tangent would be zero (torch 2.13, also for a plain
    `autograd.Function` under `torch.func.jvp` twice). Refused rather than returned."""
    raise ArgumentValueError(
        format_message(
            f"{op}: forward mode over forward mode (jvp of jvp, jacfwd of jacfwd) through a custom_jvp "
            f"function is supported with jvp, vmap and grad transforms around it, but {why}: torch "
            f"{torch.__version__} would run the JVP rule outside the outer forward-mode transform, so the "
            "second-order tangent would be zero.",
            function=describe(fun),
            revise="Apply that transform outside the forward-mode transforms, or take the outer derivative in "
            "reverse mode: tfun.jacrev(tfun.jacfwd(f)), tfun.hessian (forward over reverse) or tfun.grad of tfun.jvp "
            "use the rule at both orders.",
        )
    )


def _tree_add(a: Any, b: Any) -> Any:
    from ._tree import tree_map

    return tree_map(lambda x, y: x + y, a, b)



