"""Shared infrastructure of the lowerings of tfun.lax ops to PyTorch's control-flow
higher-order operators (HOPs).

Each op's lowering lives in the op's own module, next to its validation and its eager
implementation (`_lower_cond` and `_lower_switch` in `_cond.py`, `_lower_while_loop` in
`_loops.py`, `_lower_scan` in `_scan.py`, `_lower_map` in `_map.py`,
`_lower_associative_scan` in `_associative_scan.py`); an op calls its lowering where
`tfun._context.is_tracing()` is true. This module holds what they share, and is the ONLY
module that touches torch's private HOP entry points (`torch_cond`, `torch_scan`,
`torch_while_loop`, `torch_map`, `torch_associative_scan`), so that changes between torch
releases are absorbed here.

A lowering receives arguments already validated and normalized by the op (Python scalars
in carries turned into tensors, `pred` a 0-d bool tensor, `index` a 0-d integer tensor
already clamped), and starts with `begin_lowering()`.

How the lowering works (torch 2.11-2.13):

- Every function handed to a HOP is wrapped so that it takes and returns *flat* lists of
  tensors in tfun's pytree order (optree namespace "tfun"); the user function sees tfun
  pytrees (`carrier`). Outputs whose structure is not known in advance (cond/switch outputs,
  scan's `ys`, map's output) are returned in the user's own structure and rebuilt by Dynamo
  (`pack` / `unpack`).
- HOP bodies may not return a tensor that aliases an input or another output; the wrapper
  clones such outputs (`unalias`; `return c, c` is legal in tfun).
- tfun's rules run while the body is traced: a carry whose structure, dtype or shape
  differs from `init`, or cond branches with different outputs, raise
  `StructureMismatchError` / `TensorMismatchError`. Dynamo cannot trace the message
  formatting, so the wrapper computes a small *constant* description of both sides
  (`describe`) and hands it to `escape_*` helpers that Dynamo runs as plain Python
  (`torch._dynamo.assume_constant_result`; see `assume_constant`). Dynamo reports such an
  exception wrapped in `torch._dynamo.exc.Unsupported`/`UncapturedHigherOrderOpError`;
  `tfun.jit` unwraps it (`unwrap_dynamo_error`).
- Gradients come from torch's own HOP autograd. For scan under inductor, torch 2.13 needs
  two workarounds, applied under grad mode except while exporting (see `_scan._lower_scan`):
  every body output is cloned (else "scan might be aliasing the input or the output"), and
  the gradients reaching the outputs are made contiguous by a hook (inductor's scan
  computes wrong values from stride-0 tangents such as the gradient of `carry.sum()`).
- Inductor in torch 2.11-2.14 lets a HOP body in the backward graph overwrite its inputs in
  place (it applies the outer graph's donated-buffer indices to the body's placeholders),
  which made the gradients of stacked scans wrong (2-layer and bidirectional RNNs).
  Every lowering first runs `_escape_prepare_inductor` (from `begin_lowering`), which
  applies torch's upstream fix (`_subgraph_inputs_never_donated`): under `tfun.jit` and
  plain `torch.compile` alike.
- torch 2.13's scan autograd rejects integer and bool carries and ys; under grad mode they
  cross the HOP as float64 tensors that hold them exactly (see `_scan._to_floating`).
- Inductor on torch 2.11 and 2.13 computes wrong gradients through a complex
  `associative_scan` lowered to torch's generic HOP (S4D, S5, LRU); tfun lowers it as its own
  log-depth algorithm in plain ops instead, and only CUDA without gradients takes torch's
  fused HOP (`_associative_scan._combine_mode`).
- Known torch 2.13 limitations: `x.T` inside a cond branch triggers a spurious Dynamo
  aliasing error (use `x.t()` / `x.mT`); `associative_scan` lowers to a log-depth
  unrolled tree of the combine function, not one HOP node (except CUDA's fused mode);
  gradients through a scan nested in a scan body are not implemented by torch (any
  backend); `torch.compile(torch.func.grad(f))` fails for every control-flow HOP (see
  `is_tracing`).
"""

from __future__ import annotations

import ast
import collections
import functools
import itertools
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _compat, _context, _errors, _funcinfo, _rules
from .._errors import ArgumentTypeError, SideEffectError, StructureMismatchError, TensorMismatchError
from .._tree import tree_flatten, tree_unflatten

__all__ = [
    "distinct",
    "is_tracing",
    "begin_lowering",
    "lowerings",
    "custom_rules",
    "note_custom_rule",
    "func_reverse_modes",
    "note_func_reverse",
    "refuse_func_reverse_if_differentiated",
    "remat_scope",
    "unroll_scope",
    "unrolled_steps",
    "check_unrolled_length",
    "refuse_unrolled",
    "MAX_UNROLLED_STEPS",
    "remat_body",
    "in_body",
    "body_scope",
    "traced_transforms",
    "exported_length_may_be_symbolic",
    "register_remat",
    "escape_policy_key",
    "keyed_policy",
    "policy_of",
    "torch_cond",
    "torch_scan",
    "torch_while_loop",
    "torch_map",
    "torch_associative_scan",
    "assume_constant",
    "escaped_trace_key",
    "check_side_effects",
    "check_state",
    "check_result",
    "promote_weak",
    "promote_weak_init",
    "unwrap_dynamo_error",
]

# ----------------------------------------------------------------------------------------
# Feature detection (torch 2.11 - 2.13)
# ----------------------------------------------------------------------------------------

def is_tracing() -> bool:
    """True under `torch.compile` (Dynamo) and `torch.export.export`: `tfun._context.is_tracing`,
    the one place that answers it.

    Known torch 2.13 limitation: `torch.compile(torch.func.grad(f))` fails for every
    control-flow HOP (cond, scan, map: "Expected FakeTensor, got Tensor", asserted by
    Dynamo's aliasing check of the HOP body, whose inputs are functorch-wrapped there), so
    `tfun.jit(torch.func.grad(f))` with lax ops inside does not compile; `tfun.jit(f)` followed
    by `.backward()` and `tfun.jit(tfun.grad(f))` do, with any backend.
    """
    return _context.is_tracing()


def torch_cond() -> Callable[..., Any]:
    _compat.cond_autograd_fixes()  # torch 2.13's backward fails on strided gradients (see there)
    _compat.cond_vmap_fixes()  # under vmap: broadcast branch outputs, conds with nothing batched
    _compat.subgraph_input_asserts_off()  # per-call layout checks Inductor made when compiling
    return torch.cond


def torch_scan() -> Callable[..., Any]:
    from torch._higher_order_ops.scan import scan as _scan

    _compat.scan_autograd_fixes()  # torch 2.11's scan autograd lacks two fixes of 2.13 (see there)
    _compat.scan_vmap_fixes()  # scan autograd under vmap: an init whose batch dim is innermost
    _compat.subgraph_input_asserts_off()  # per-step layout checks Inductor made when compiling
    return _scan


def _scan_flat_body(*args: Any, combine_fn: Callable[[list[Any], list[Any]], Any], num_init: int) -> Any:
    """The body torch's scan op calls with its flat arguments: `combine_fn(carry, x)` with the
    flat carry and the flat slice of `xs` as lists (torch's `wrap_combine_fn_flat` for lists)."""
    return combine_fn(list(args[:num_init]), list(args[num_init:]))


def scan_flat(
    body: Callable[[list[Any], list[Any]], Any], init: list[Any], xs: list[Any], reverse: bool
) -> tuple[list[Any], tuple[list[Any], list[Any]]]:
    """torch's scan of `body(carry_list, x_list) -> (carry_list, (ys_list, extra_list))` over
    flat lists along dim 0: `(carry_list, (ys_list, extra_list))`, the ys stacked along dim 0.

    Under Dynamo the scan op is called directly (`_compat.scan_hop`): the graph is the one
    torch's wrapper `scan()` records (the same op, `xs` and the ys flipped for `reverse`), and
    Dynamo does not trace the wrapper's Python. Eagerly and at the top level of a non-strict
    export (where the wrapper compiles the op itself) it goes through the wrapper
    (`call_hop`)."""
    scan = torch_scan()
    op = _compat.scan_hop()
    if op is None or not _context.is_dynamo_tracing():
        return call_hop(scan, body, init, xs, dim=0, reverse=reverse)
    if reverse:
        xs = [torch.flip(t, [0]) for t in xs]
    combine = functools.partial(_scan_flat_body, combine_fn=body, num_init=len(init))
    carry, (ys, extra) = op(combine, list(init), list(xs), ())
    if reverse:
        ys, extra = _flipped(ys), _flipped(extra)
    return list(carry), (list(ys), list(extra))


def _flipped(tree: Any) -> Any:
    """`tree` (tensors in lists, tuples and dicts: the ys of a scan body, some wrapped in the
    dicts that carry their dtype or complex pairs across the HOP) with each tensor flipped
    along dim 0."""
    if isinstance(tree, torch.Tensor):
        return tree.flip([0])
    if isinstance(tree, dict):
        return {k: _flipped(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_flipped(v) for v in tree)
    return tree


def torch_while_loop() -> Callable[..., Any]:
    fn = getattr(torch, "while_loop", None)
    if fn is None:
        from torch._higher_order_ops.while_loop import while_loop as fn
    _compat.while_loop_autograd_fixes()  # torch 2.11's backward keeps strided gradients (see there)
    _compat.subgraph_input_asserts_off()  # per-step layout checks Inductor made when compiling
    return fn


def torch_map() -> Callable[..., Any]:
    from torch._higher_order_ops.map import map as _map

    return _map


def torch_associative_scan() -> Callable[..., Any]:
    from torch._higher_order_ops.associative_scan import associative_scan as _as

    return _as


def call_hop(hop: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`hop(*args, **kwargs)`, a call of one of torch's control-flow HOPs (above).

    Under non-strict `torch.export` this code runs as plain Python and Dynamo traces only the
    HOP's bodies: a tfun error raised in a body (a rule it breaks) reached the user as torch's
    `UncapturedHigherOrderOpError` (hunt 28 F6). Here it is raised as itself, with Dynamo's
    error as its cause, as eagerly and under `tfun.jit` (which translates at its own boundary).
    Where Dynamo traces this code (`tfun.jit`, strict export) the call is traced as it is:
    strict export reports torch's error, whose text carries tfun's message.
    """
    if _context.is_dynamo_tracing():
        return hop(*args, **kwargs)
    try:
        return hop(*args, **kwargs)
    except Exception as e:
        found = unwrap_dynamo_error(e)
        if found is None or found is e:
            raise
        raise found from e


#: Counters of trace-time events, read before and after a traced call to learn what it did.
#: Counted at trace time, in plain Python (Dynamo constants, `_escape_count`): as a traced
#: global write it would be a side effect, which HOP bodies (nested control flow) may not have.
#:
#: - "lowerings": control-flow ops lowered to HOPs (read by tfun.grad's traced path);
#: - "custom_rules": custom functions (tfun.custom_jvp / custom_vjp) applied in traced code
#:   with their rules as a traced `autograd.Function`: Dynamo compiles such a Function's
#:   backward once, and its result is not differentiable again (its gradient would be cut);
#: - "func_reverse": reverse-mode torch.func transforms (`torch.func.grad`/`vjp`/`jacrev`, as
#:   `tfun.grad` inside `tfun.vmap`, or `tfun.jacrev`, run them) applied in traced code:
#:   torch's while_loop backward differentiates a body that runs one wrongly (see
#:   `refuse_func_reverse_if_differentiated`);
#: - "grad_unknowns": see `grad_unknowns`.
_COUNTS: dict[str, int] = {"lowerings": 0, "custom_rules": 0, "func_reverse": 0, "grad_unknowns": 0}


def lowerings() -> int:
    """A counter of HOP lowerings: a traced caller compares it before and after a call to
    learn whether the call contained control flow."""
    return _escape_count("lowerings", False)


def begin_lowering() -> None:
    """Called first by every lowering, at trace time: counts it (`lowerings`) and makes
    Inductor's lowering of HOP bodies safe (`_subgraph_inputs_never_donated`) and possible
    under a plain `torch.compile` (`_compat.allow_scalar_outputs_in_trace`)."""
    _escape_count("lowerings", True)
    _escape_prepare_inductor()


# ----------------------------------------------------------------------------------------
# Inductor: the inputs of a HOP body are never donated (torch 2.11 - 2.14)
# ----------------------------------------------------------------------------------------


def _subgraph_inputs_never_donated() -> bool:
    """Make Inductor treat every input of a HOP body it lowers as owned by the caller.

    Inductor lowers the body of a scan / while_loop / cond / map in the backward graph as a
    `torch._inductor.graph.SubgraphLowering`, which inherits the *outer* backward graph's
    donated-buffer indices (`bw_donated_idxs`, AOTAutograd's list of saved tensors the
    backward may overwrite) and applies them to its own, unrelated placeholder order. A body
    input at such a position is then written in place, so the first iteration of the
    while_loop that scan's backward becomes overwrites a buffer that the rest of the
    backward still reads. Two stacked scans (a 2-layer or bidirectional LSTM/GRU) share the
    zero buffer their backward scans start from: the second backward scan then starts from
    the first one's final carry gradient, and the gradients of the earlier layer are wrong
    (pytorch/pytorch#153679; fixed upstream by pytorch/pytorch#193960, not in torch 2.14.1).

    This applies the upstream fix: after `SubgraphLowering.__init__`, its
    `bw_donated_idxs` is cleared, so no body input is donated (the outer backward graph
    keeps its own donation). Idempotent; returns whether subgraph lowering is now safe.
    Called at trace time by every lowering (through `_escape_prepare_inductor`), so it is in
    place before Inductor lowers the graph, under `tfun.jit` and plain `torch.compile` alike.
    """
    try:
        from torch._inductor import graph as inductor_graph
    except ImportError:  # pragma: no cover - inductor unavailable: nothing lowers subgraphs
        return True
    cls = getattr(inductor_graph, "SubgraphLowering", None)
    if cls is None or getattr(cls, "_tfun_inputs_never_donated", False):
        return True
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.bw_donated_idxs = None

    cls.__init__ = __init__
    cls._tfun_inputs_never_donated = True
    return True


# ----------------------------------------------------------------------------------------
# Escape hatches: plain Python run by Dynamo at trace time with constant arguments
# ----------------------------------------------------------------------------------------

def assume_constant(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch._dynamo.assume_constant_result`, without importing Dynamo at tfun's import.

    Importing `torch._dynamo` costs about a second; eager users never need it. When Dynamo
    is already loaded its decorator is used; otherwise the function gets the marker that
    decorator sets in torch 2.11-2.13 (`_dynamo_marked_constant`), which Dynamo reads
    when it later traces a call to the function.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and hasattr(dynamo, "assume_constant_result"):
        return dynamo.assume_constant_result(fn)
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


# key -> {label: description}; entries are small tuples of constants. Bounded.
_EXCHANGE: collections.OrderedDict[int, dict[str, Any]] = collections.OrderedDict()
_EXCHANGE_MAX = 256
_KEYS = itertools.count(1)


@assume_constant
def _escape_count(name: str, add: bool) -> int:
    if add:
        _COUNTS[name] += 1
    return _COUNTS[name]


def custom_rules() -> int:
    """A counter of custom functions applied in traced code (see `lowerings`)."""
    return _escape_count("custom_rules", False)


def note_custom_rule() -> None:
    """Called by a custom function applied in traced code, with its rule."""
    _escape_count("custom_rules", True)


def note_opaque_op() -> None:
    """Called where tfun puts into traced code an opaque op whose backward has no derivative of
    its own (the fused RNN ops of `tfun.nn`, the Triton `linear_scan`): counted as a custom
    rule (`custom_rules`), so that a traced gradient around it that may be differentiated again
    is kept first-order (`tfun._first_order`) or refused, never differentiated through it."""
    if _context.is_tracing():
        _escape_count("custom_rules", True)


def func_reverse_modes() -> int:
    """A counter of reverse-mode torch.func transforms applied in traced code."""
    return _escape_count("func_reverse", False)


def note_func_reverse() -> None:
    """Called where tfun applies a reverse-mode torch.func transform (traced code only)."""
    if _context.is_tracing():
        _escape_count("func_reverse", True)


#: What torch's backward of each HOP does with a body that runs a reverse-mode torch.func
#: transform (see `refuse_func_reverse_if_differentiated`); scan's (and so fori_loop's with
#: Python-int bounds) is right, and has no entry.
_FUNC_REVERSE_WRONG = {
    "tfun.lax.while_loop": (
        "loop",
        "torch's while_loop backward takes that body's derivative at the first step's values for every step",
    ),
    "tfun.lax.cond": ("cond", "torch's cond backward drops the derivative through that gradient"),
    "tfun.lax.switch": ("switch", "torch's cond backward drops the derivative through that gradient"),
    "tfun.lax.map": ("map", "torch's map backward returns zeros through that gradient"),
}
_FUNC_REVERSE_REVISE = {
    "tfun.lax.while_loop": "Write the loop with tfun.lax.scan, or fori_loop with Python-int bounds (their backward "
    "is right), or take the outer gradient outside tfun.jit.",
    "tfun.lax.cond": "Take the derivative outside the branch (compute it before the cond, or compute both "
    "branches and pick with tfun.lax.select), or take the outer gradient outside tfun.jit.",
    "tfun.lax.switch": "Take the derivative outside the branches (compute it before the switch, or compute every "
    "branch and pick with tfun.lax.select), or take the outer gradient outside tfun.jit.",
    "tfun.lax.map": "For per-row gradients use tfun.vmap instead of the map (`tfun.vmap(tfun.grad(f))(xs)` "
    "compiles where f has no control flow), or write the map as a scan, whose backward is right "
    "(`tfun.lax.scan(lambda c, x: (c, f(x)), None, xs)[1]`), or take the outer gradient outside tfun.jit.",
}


def refuse_func_reverse_if_differentiated(op: str, role: str, fn: Callable[..., Any], tensors: Sequence[Any]) -> None:
    """Traced, in a HOP body (`role` of `op`) that ran a reverse-mode torch.func transform (a
    traced `tfun.grad` or `tfun.vjp` inside a body, a `tfun.grad` inside `tfun.vmap`,
    `tfun.jacrev`, `tfun.hessian`): if the HOP can be differentiated (grad mode, and one of
    `tensors`, the body's inputs and outputs, requires grad), refuse. torch's backward of
    while_loop, cond and map (2.13 through 2.15) differentiates such a body wrongly, without
    an error (tests/lax/test_loops.py, tests/test_jit_grad_in_body.py); scan's is right."""
    if not torch.is_grad_enabled():
        return
    tensors = [x for x in tensors if isinstance(x, torch.Tensor)]
    if not any(x.requires_grad for x in tensors):
        # (in a loop body traced from an `init` that does not require grad, the loop lowers
        # again with its carries requiring grad if its results turn out differentiable)
        note_grad_unknown(tensors)
        return
    noun, wrong = _FUNC_REVERSE_WRONG[op]
    raise _errors.JitError(
        _errors.format_message(
            f"{op}: under tfun.jit, this {role} runs a reverse-mode derivative (tfun.grad, tfun.vjp, tfun.jacrev "
            f"or tfun.hessian, through torch.func) and the {noun} is itself differentiated. "
            f"{wrong} (torch {torch.__version__}), so tfun refuses rather than return a wrong "
            "gradient.",
            function=_funcinfo.describe(fn),
            revise=_FUNC_REVERSE_REVISE[op],
        )
    )


# ----------------------------------------------------------------------------------------
# tfun.checkpoint around control flow, traced
# ----------------------------------------------------------------------------------------

#: The traced `tfun.checkpoint` calls enclosing the code being traced whose function
#: contains control flow (torch's checkpoint op refuses HOPs inside it; the checkpoint is
#: then applied to each body instead), innermost last, each as the key of its policy in
#: `_POLICIES` (0: no policy), and the trace that stack belongs to (a trace that raises
#: leaves it behind; the next trace starts empty). Plain Python read and written at trace
#: time through `_escape_remat` (Dynamo constants), as `_COUNTS`.
_REMAT_STACK: list[Any] = [[], None]
#: policy key -> policy, for the policies of traced checkpoints around control flow: the
#: bodies' checkpoints name theirs by key (an int, a constant to Dynamo, in
#: `functools.partial(keyed_policy, key)`) and look it up whenever torch asks that policy:
#: Dynamo's fake run of the graph, AOTAutograd's partitioning right after the trace (after
#: any number of other traces' keys were made: hundreds of bodies in one function), and,
#: for the "eager" backend, each run of the graph. So a key is never evicted: one policy *object* has one key for the life of
#: the process (`_POLICY_KEYS`, by identity; the policy is held, so its id stays its own),
#: and a body's checkpoint reuses its enclosing checkpoint's key. The registry grows with
#: the distinct policy objects traced, not with traces or bodies (a policy made inside the
#: compiled function is a new object per compile: one entry per compile).
_POLICIES: dict[int, Callable[..., bool]] = {}
#: id(policy) -> its key in `_POLICIES`.
_POLICY_KEYS: dict[int, int] = {}
#: `tfun.checkpoint` of a function, with the policy of a key: registered by
#: tfun._checkpoint, a layer above this one, at its import.
_REMAT: list[Callable[[Callable[..., Any], int], Callable[..., Any]]] = []


def register_remat(wrap: Callable[[Callable[..., Any], int], Callable[..., Any]]) -> None:
    """Called once, at import, by tfun._checkpoint: how `remat_body` checkpoints a body
    (`wrap(fn, policy_key)`)."""
    _REMAT[:] = [wrap]


def keyed_policy(key: int, func: Any, *args: Any, **kwargs: Any) -> bool:
    """The policy registered under `key` (`escape_policy_key`), asked as a policy: what a
    body's checkpoint is given, as `functools.partial(keyed_policy, key)`."""
    policy = policy_of(key)
    return policy is not None and bool(policy(func, *args, **kwargs))


def _key_of_keyed(policy: Any) -> int | None:
    """The key of `functools.partial(keyed_policy, key)`, else None."""
    if (
        isinstance(policy, functools.partial)
        and policy.func is keyed_policy
        and len(policy.args) == 1
        and not policy.keywords
        and isinstance(policy.args[0], int)
    ):
        return policy.args[0]
    return None


@assume_constant
def escape_policy_key(policy: Callable[..., bool] | None) -> int:
    """Trace time: a key (an int) for `policy` (0 for `None`), looked up by `policy_of`. The
    same policy object always gets the same key; a `keyed_policy` partial (a body's
    checkpoint inside a traced checkpoint) gets its own key back, not a new one."""
    if policy is None:
        return 0
    key = _key_of_keyed(policy)
    if key is not None:
        return key
    key = _POLICY_KEYS.get(id(policy))
    if key is None:
        key = next(_KEYS)
        _POLICIES[key] = policy
        _POLICY_KEYS[id(policy)] = key
    return key


def policy_of(key: int) -> Callable[..., bool] | None:
    """The policy of a key from `escape_policy_key` (plain Python, never traced)."""
    return None if key == 0 else _POLICIES[key]


@assume_constant
def _escape_remat(push: int | None, pop: bool) -> int:
    """Push a policy key, pop, or neither; return the innermost key, or -1 outside every scope."""
    trace = _context.current_trace()
    if _REMAT_STACK[1] is None or _REMAT_STACK[1]() is not trace:
        _REMAT_STACK[:] = [[], None if trace is None else weakref.ref(trace)]
    stack = _REMAT_STACK[0]
    if push is not None:
        stack.append(push)
    elif pop and stack:
        stack.pop()
    return stack[-1] if stack else -1


#: Functions applied, in traced code, to what a `tfun.jit` function returns (registered by
#: the transforms): a traced `tfun.vjp`'s pullback leaves its trace without its autograd graph.
JIT_OUTPUT_HOOKS: list[Callable[[Any], Any]] = []


def jit_output(out: Any) -> Any:
    """What a compiled `tfun.jit` function returns: `out` through `JIT_OUTPUT_HOOKS`."""
    for hook in JIT_OUTPUT_HOOKS:
        out = hook(out)
    return out


#: The trace `trace_key` last numbered (a weak reference) and its number.
_TRACE_KEY: list[Any] = [None, 0]
_TRACE_NUMBERS = itertools.count(1)


@assume_constant
def _escape_trace_key() -> int:
    trace = _context.current_trace()
    if trace is None:
        return -1  # traced without a Dynamo trace (non-strict torch.export): one key for all
    if _TRACE_KEY[0] is None or _TRACE_KEY[0]() is not trace:
        _TRACE_KEY[:] = [weakref.ref(trace), next(_TRACE_NUMBERS)]
    return int(_TRACE_KEY[1])


def escaped_trace_key() -> int:
    """`trace_key` as plain Python at trace time, for code that runs there (an assumed
    constant's body): the number of the Dynamo trace running now, or -1 without one."""
    return _escape_trace_key()


def trace_key() -> int:
    """A number for the trace running now, a compile-time constant in traced code (0 when not
    tracing): a value captured in one trace (a traced `tfun.vjp`'s pullback, which holds that
    trace's autograd graph) tells by it whether it is used in the same trace."""
    return _escape_trace_key() if _context.is_tracing() else 0


class remat_scope:
    """Trace time: while active, `remat_body` checkpoints the bodies of the control-flow ops
    lowered, with the policy of `policy_key` (`with remat_scope(key): out = fun(*args)` in a
    traced `tfun.checkpoint`)."""

    def __init__(self, policy_key: int = 0) -> None:
        self.policy_key = policy_key

    def __enter__(self) -> None:
        _escape_remat(self.policy_key, False)

    def __exit__(self, *exc: Any) -> None:
        _escape_remat(None, True)


def remat_body(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` checkpointed (its intermediates recomputed in backward, but for what the
    innermost scope's policy saves) inside a `remat_scope`, else `fn`: called by every
    lowering on the functions its HOP runs."""
    if _REMAT:
        key = _escape_remat(None, False)
        if key >= 0:
            return _REMAT[0](fn, key)
    return fn


# ----------------------------------------------------------------------------------------
# Inside a HOP body
# ----------------------------------------------------------------------------------------

#: How many HOP bodies enclose the code being traced, and the trace that count belongs to
#: (as `_REMAT_STACK`). A HOP runs its body with autograd off (torch's scan, while_loop, cond
#: and map differentiate the body as a graph), so a traced `tfun.grad` there cannot use
#: `torch.autograd.grad` on fresh leaves ("element 0 of tensors does not require grad"): it
#: uses torch.func's transform, which Dynamo traces into the body's graph.
#: The same for the bodies of loops lowered under grad mode (`in_grad_body`).
_DEPTHS: dict[str, list[Any]] = {"body": [0, None], "grad": [0, None], "derivative": [0, None]}


@assume_constant
def _escape_depth(which: str, delta: int) -> int:
    """Add `delta` to the depth `which` ("body", "grad") of the trace running now; return it."""
    depth = _DEPTHS[which]
    trace = _context.current_trace()
    if depth[1] is None or depth[1]() is not trace:
        depth[:] = [0, None if trace is None else weakref.ref(trace)]
    depth[0] = max(depth[0] + delta, 0)
    return int(depth[0])


class body_scope:
    """Trace time: the user's function of a HOP body runs inside it (`with body_scope(): out =
    f(...)`, in every lowering's body wrapper), so that `in_body` answers True there.
    `grad=True` for the body of a loop lowered under grad mode (torch's autograd will
    differentiate it): `in_grad_body` answers True there too."""

    def __init__(self, grad: bool = False) -> None:
        self.grad = grad

    def __enter__(self) -> None:
        _escape_depth("body", 1)
        _escape_body_level(True)
        if self.grad:
            _escape_depth("grad", 1)

    def __exit__(self, *exc: Any) -> None:
        _escape_depth("body", -1)
        _escape_body_level(False)
        if self.grad:
            _escape_depth("grad", -1)


#: For each HOP body enclosing the code being traced, innermost last, the deepest `torch.func`
#: level live where its trace began (0: none); and the trace the stack belongs to.
_BODY_LEVELS: list[Any] = [[], None]


@assume_constant
def traced_transforms() -> tuple[tuple[str, int], ...]:
    """Trace time: the `torch.func` transforms that enclose the call being traced, as
    `(kind, level)` pairs, outermost first (`_context.transform_stack` through a Dynamo escape
    hatch: plain Python at trace time, where Dynamo pushes the real interpreters of the
    transforms it traces)."""
    return _context.transform_stack()


@assume_constant
def _escape_body_level(push: bool | None) -> int:
    """Trace time: at a body's start (`push=True`) record the deepest live `torch.func` level,
    at its end (`False`) forget it, or (None) only read; return the innermost body's record
    (-1 outside every body)."""
    trace = _context.current_trace()
    if _BODY_LEVELS[1] is None or _BODY_LEVELS[1]() is not trace:
        _BODY_LEVELS[:] = [[], None if trace is None else weakref.ref(trace)]
    stack = _BODY_LEVELS[0]
    if push is True:
        stack.append(max((level for _, level in _context.transform_stack()), default=0))
    elif push is False and stack:
        stack.pop()
    return stack[-1] if stack else -1


def body_transform_level() -> int:
    """Trace time: the deepest `torch.func` level that was live where the innermost enclosing
    HOP body's trace began (0: none; -1: not in a body). A transform of a deeper level was
    entered inside the body and is traced into the body's graph; one of this level or less
    encloses the HOP, whose own batching rule replays the body's graph."""
    return _escape_body_level(None)


def grad_unknowns() -> int:
    """A counter of decisions taken in the body of a loop lowered under grad mode from inputs'
    `requires_grad` alone, found False (`note_grad_unknown`): a custom function's rule left
    out, a reverse-mode refusal not made. Read before and after a loop's lowering
    (`_scan.scan`): where it changed and the loop's results require grad, the loop lowers
    again with its floating carries requiring grad, so that those decisions see the truth
    (`lower_seeing_grad`)."""
    return _escape_count("grad_unknowns", False)


def lower_seeing_grad(lower: Callable[[Any], Any], init: Any, final_carry: Callable[[Any], Any]) -> Any:
    """`lower(init)`, the lowering of a loop whose carry starts as `init`, lowered again with
    `init`'s floating leaves requiring grad (`requiring_grad_like`) where a decision in its
    body read `requires_grad` and found False (`grad_unknowns` changed) while the loop's final
    carry (`final_carry(out)`) comes out requiring grad. Traced, a carry's `requires_grad` is
    `init`'s, so a body that makes the carry differentiable (`init` is `torch.zeros`, the body
    adds a parameter) was traced as if nothing in it were differentiated: a custom function's
    rule left out, a reverse-mode refusal not made. The first lowering is then dead code,
    which AOTAutograd drops."""
    unknowns = grad_unknowns()
    out = lower(init)
    if grad_unknowns() != unknowns:
        again = requiring_grad_like(init, final_carry(out))
        if again is not None:
            out = lower(again)
    return out


def requiring_grad_like(init: Any, carry: Any) -> Any:
    """`init` with each floating leaf that does not require grad made a fresh leaf that does
    (`_compat.grad_leaf`), where `carry` (the lowered loop's final carry) requires grad; None
    where nothing is to change. The fresh leaves' own gradients are not used: their values are
    `init`'s, and nothing flowed into them before."""
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(carry)[0]):
        return None
    leaves, treedef = tree_flatten(init)
    marked = [
        _compat.grad_leaf(t)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and not t.requires_grad
        else t
        for t in leaves
    ]
    if all(a is b for a, b in zip(marked, leaves)):
        return None
    return tree_unflatten(treedef, marked)


def note_grad_unknown(tensors: Sequence[Any]) -> None:
    """Record a `requires_grad`-based decision in a loop body lowered under grad mode, where
    the body's floating inputs did not require grad (see `grad_unknowns`)."""
    if in_grad_body() and any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) for t in tensors):
        _escape_count("grad_unknowns", True)


def in_grad_body() -> bool:
    """Trace time: whether the code being traced runs inside the body of a loop lowered under
    grad mode (`body_scope(grad=True)`), which torch's autograd may differentiate."""
    return _escape_depth("grad", 0) > 0


def refuse_cond_in_vmapped_grad_body(op: str, fn: Callable[..., Any]) -> None:
    """Refuse a `cond`/`switch` inside a loop body lowered under grad mode under a traced
    `vmap` (`tfun.jit(tfun.vmap(f))` where `f` loops): torch's vmap rule for `cond` there
    compiles, and Inductor then computes wrong gradients (torch 2.13 and 2.14.1: a `cond` on
    the loop index in a vmapped `scan`, gradients off by up to 5 where `aot_eager` is right).
    Inside the body, whether anything it reads requires grad is not known at trace time, so
    grad mode decides, as for the scan lowering's own autograd precautions (`_scan`). A
    JitError with the alternatives instead of wrong numbers; under `torch.no_grad()` it
    compiles (and is right: `tests/test_scan_in_place.py`).

    Where tfun's batch-first vmap rule for scan is installed (`_compat.scan_vmap_batch_first`:
    torch 2.11 - 2.14) there is nothing to refuse: with it, values and every gradient equal eager
    float64 under aot_eager and Inductor (`tests/lax/test_batching.py`, cond and switch in scan,
    fori_loop and map bodies, nested, reverse, multi-output), so the refusal stays for a torch
    whose scan rule tfun leaves as it is."""
    if not (vmap_traced() and in_grad_body()) or _compat.scan_vmap_batch_first():
        return
    raise _errors.JitError(
        _errors.format_message(
            f"{op} inside a loop body under a traced tfun.vmap (`tfun.jit(tfun.vmap(f))`), with grad mode on, "
            "is refused: torch's batching of `torch.cond` there gives wrong gradients under Inductor "
            f"(torch {torch.__version__}).",
            function=_funcinfo.describe(fn),
            revise="Call it under `torch.no_grad()` when no gradient is needed; else write the branch as a "
            "`tfun.lax.select` / `torch.where` of both branches' values (both are computed), or apply "
            "tfun.vmap outside tfun.jit (`tfun.vmap(tfun.jit(f))`, uncompiled inside the transform).",
        )
    )


def in_body() -> bool:
    """Trace time: whether the code being traced runs inside a HOP body (a lowered loop's or
    branch's function), where autograd is off."""
    return _escape_depth("body", 0) > 0


# ----------------------------------------------------------------------------------------
# Second-order reverse mode under tfun.jit: loops unrolled
# ----------------------------------------------------------------------------------------

#: Most loop steps a traced derivative that is differentiated again unrolls (the product of
#: the lengths of nested unrolled loops), unless the loop asks for it with `unroll=True`.
MAX_UNROLLED_STEPS = 1024
#: Most loop steps unrolled without a `PerformanceWarning` where nothing in the trace is known
#: to differentiate the derivative again: it is unrolled only because its arguments, or tensors
#: it closes over, require grad (an `nn.Parameter`), so that a `.backward()` outside could. Each
#: unrolled step costs compile time (about 0.4 s a step for a small RNN's gradient on a CPU,
#: torch 2.13 Inductor: 7 s at 64 steps as one loop op, 32 s unrolled; 119 s at 256), and a
#: training step that only reads the gradient pays it for nothing.
WARN_UNROLLED_STEPS = 16
#: The traced reverse-mode derivatives (`tfun.grad`, `tfun.vjp`) enclosing the code being
#: traced whose results must stay differentiable (an outer `tfun.grad` or `.backward()` can
#: reach them), innermost last, each as `(steps, cause)`: the number of loop steps unrolled
#: around the code (1 at the derivative), and why, where no traced derivative encloses it (a
#: description of the arguments or closed-over tensors that require grad; None where an
#: enclosing traced derivative differentiates it); and the trace that stack belongs to (as
#: `_REMAT_STACK`). torch's control-flow HOPs have no second derivative: inside such a
#: derivative, `scan`, `fori_loop` with static bounds and `map` run their steps in Python (the
#: graph holds each step's ops) and the other control-flow ops are refused (`refuse_unrolled`,
#: called by each of them before it lowers).
_UNROLL_STACK: list[Any] = [[], None]
_INHERIT = "<inherit>"


def _unroll_stack() -> list[tuple[int, str | None]]:
    """The unroll stack of the trace running now (a fresh one for a new trace)."""
    trace = _context.current_trace()
    if _UNROLL_STACK[1] is None or _UNROLL_STACK[1]() is not trace:
        _UNROLL_STACK[:] = [[], None if trace is None else weakref.ref(trace)]
    return _UNROLL_STACK[0]


@assume_constant
def _escape_unroll(push: int | None, pop: bool, cause: str | None = _INHERIT) -> int:
    """Push a step count (with its cause: `_INHERIT` takes the innermost one's), pop, or
    neither; return the innermost count, or 0 outside every scope."""
    stack = _unroll_stack()
    if push is not None:
        if cause == _INHERIT:
            cause = stack[-1][1] if stack else None
        stack.append((push, cause))
    elif pop and stack:
        stack.pop()
    return stack[-1][0] if stack else 0


@assume_constant
def unroll_cause() -> str | None:
    """Trace time: why the innermost unrolled region unrolls where no traced derivative
    encloses it (`unroll_scope`'s `cause`), or None."""
    stack = _unroll_stack()
    return stack[-1][1] if stack else None


class unroll_scope:
    """Trace time: while active (`active=True`), the loops lowered run their steps in Python
    (`unrolled_steps`); `steps` multiplies the enclosing count (an unrolled loop's body runs
    inside `unroll_scope(True, n)`). A traced `tfun.grad` whose result stays differentiable
    enters `unroll_scope(True, derivative=True, cause=...)`; every traced reverse-mode
    derivative enters one (`derivative=True`, active or not), so that a derivative inside
    another knows it is differentiated by it. `cause` (a derivative's): why its result stays
    differentiable, a phrase naming what requires grad (kept where no traced derivative
    encloses it: then nothing in the trace is known to differentiate it again, and
    `check_unrolled_length` warns past `WARN_UNROLLED_STEPS`)."""

    def __init__(self, active: bool, steps: int = 1, *, derivative: bool = False, cause: str | None = None) -> None:
        # (eagerly nothing is unrolled and no depth is kept: `derivative` only while tracing)
        self.active, self.steps, self.cause = active, steps, cause
        self.derivative = derivative and _context.is_tracing()

    def __enter__(self) -> None:
        cause: str | None = _INHERIT
        if self.derivative:
            enclosed = _escape_depth("derivative", 1) > 1
            cause = None if enclosed else self.cause
        if self.active:
            _escape_unroll(max(_escape_unroll(None, False), 1) * self.steps, False, cause)

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            _escape_unroll(None, True)
        if self.derivative:
            _escape_depth("derivative", -1)


def derivative_depth(delta: int) -> None:
    """Trace time: add `delta` to the depth of traced derivatives enclosing the code traced
    next (`unroll_scope(..., derivative=True)` does so around a block; this is for code that
    must not be a `with` block)."""
    if _context.is_tracing():
        _escape_depth("derivative", delta)


def in_derivative() -> bool:
    """Trace time: whether a traced reverse-mode derivative encloses the code being traced (it
    differentiates whatever that code computes: a derivative there must stay exact), or the
    code runs inside a loop unrolled for one."""
    return _escape_depth("derivative", 0) > 0 or unrolled_steps() > 0


def fully_unrolled(unroll: Any) -> bool:
    """Whether a loop's `unroll` asks for every step unrolled (`True` or `0`, as in JAX)."""
    return unroll is True or (not isinstance(unroll, bool) and unroll == 0)


def unrolled_steps() -> int:
    """Trace time: the loop steps unrolled around the code being traced inside a derivative
    that is differentiated again (at least 1 there), or 0 where loops lower to HOPs."""
    return _escape_unroll(None, False)


def _unroll_context(cause: str | None) -> str:
    """How a derivative is differentiated again, for messages: known (an enclosing traced
    derivative), or possibly, by a `.backward()` outside (`cause`, see `unroll_scope`)."""
    if cause is None:
        return "is differentiated again (tfun.grad of tfun.grad, or a gradient that an outer .backward() reaches)"
    return f"may be differentiated again ({cause}, so a .backward() outside the compiled function could reach it)"


def _unroll_fixes(cause: str | None) -> str:
    """The ways out, for a loop or op unrolled or refused inside a derivative that may be
    differentiated again because of `cause` (see `unroll_scope`)."""
    if cause is None:
        return ""
    return (
        "If the gradient is not differentiated again (a training step that reads it), call the jitted function "
        "under `torch.no_grad()` or pass those tensors detached (`W.detach()`, or `p.detach()` for each parameter): "
        "the loop then stays one loop op. "
    )


def check_unrolled_length(op: str, fn: Callable[..., Any], n: int, unroll: Any) -> None:
    """Refuse unrolling a loop of `n` steps (times the enclosing unrolled steps) past
    `MAX_UNROLLED_STEPS`, unless the loop asks for it (`unroll=True` or `unroll=0`); past
    `WARN_UNROLLED_STEPS`, where the unrolling has a `cause` (nothing in the trace is known to
    differentiate the derivative again), warn (`tfun.errors.PerformanceWarning`) with the fixes."""
    total = unrolled_steps() * n
    if fully_unrolled(unroll):
        return
    cause = unroll_cause()
    if total > MAX_UNROLLED_STEPS:
        raise _errors.JitError(
            _errors.format_message(
                f"{op}: under tfun.jit, this loop is inside a gradient that {_unroll_context(cause)}. "
                f"torch {torch.__version__} has no second derivative of its loop op, so tfun unrolls the loop in the "
                f"graph; here that is {total} steps (nested loops multiply), more than tfun unrolls unasked "
                f"({MAX_UNROLLED_STEPS}).",
                function=_funcinfo.describe(fn),
                revise=_unroll_fixes(cause) + "Pass unroll=True to this loop to unroll it all the same (the compile "
                "time grows with the steps), or take the higher-order derivative outside tfun.jit.",
            )
        )
    if cause is not None and total > WARN_UNROLLED_STEPS:
        _escape_warn_unrolled(
            op, _funcinfo.describe(fn), _funcinfo.location(fn), total, _unroll_context(cause), _unroll_fixes(cause)
        )


@assume_constant
def _escape_warn_unrolled(op: str, fn: str, where: tuple[str, int] | None, total: int, context: str, fixes: str) -> None:
    """Plain Python at trace time: the `PerformanceWarning` of `check_unrolled_length`, at the
    loop body's own file:line."""
    message = (
        f"{op} ({fn}): under tfun.jit this loop is unrolled into {total} steps in the graph, because it is "
        f"inside a gradient that {context}, and torch {torch.__version__} has no "
        "second derivative of its loop op. Compile time grows with the steps (about 0.4 s a step for a small "
        f"RNN on a CPU). {fixes}If it is differentiated again (a gradient penalty), pass unroll=True to this "
        "loop: it is unrolled all the same, without this warning."
    )
    _funcinfo.warn_at(where, message, _errors.PerformanceWarning)


def refuse_unrolled(op: str, fn: Callable[..., Any]) -> None:
    """Called by a lowering that has no unrolled form, inside a derivative that is
    differentiated again: a `JitError` (torch's HOPs have no second derivative)."""
    if unrolled_steps() == 0:
        return
    cause = unroll_cause()
    raise _errors.JitError(
        _errors.format_message(
            f"{op}: under tfun.jit, this op is inside a gradient that {_unroll_context(cause)}, and torch "
            f"{torch.__version__} has no second derivative of a control-flow op. tfun unrolls scan, fori_loop "
            f"with static bounds and map there, but not {op.rsplit('.', 1)[-1]}.",
            function=_funcinfo.describe(fn),
            revise=_unroll_fixes(cause) + "Otherwise take the higher-order derivative outside tfun.jit, "
            "or write this step without it (e.g. tfun.lax.select or torch.where for a cond whose branches are "
            "cheap and safe to run both).",
        )
    )


def refuse_vmapped(op: str, fn: Callable[..., Any]) -> None:
    """Called by a lowering whose torch op has no rule for torch.func transforms
    (`while_loop`), when traced inside one (`tfun.jit(tfun.vmap(f))`): a `JitError` that says
    what works instead."""
    if not vmap_traced():
        return
    raise _errors.JitError(
        _errors.format_message(
            f"{op}: under tfun.jit, this loop is inside a torch.func transform (tfun.vmap, tfun.jvp, jacfwd, "
            f"...), and torch {torch.__version__}'s while_loop op has no rule for one (no vmap, no jvp), so it "
            "cannot be traced there. Under tfun.vmap, scan, fori_loop with static bounds, map and cond can.",
            function=_funcinfo.describe(fn),
            revise="Use tfun.lax.fori_loop with Python-int bounds or tfun.lax.scan when the trip count is known, "
            "keep the batch as a tensor dimension in the loop's carry instead of vmapping over it, or apply "
            "tfun.vmap outside tfun.jit (`tfun.vmap(tfun.jit(f))`: right values, but the jitted function then "
            "runs uncompiled).",
        )
    )


@assume_constant
def escape_new_key() -> int:
    return next(_KEYS)


@assume_constant
def _escape_prepare_inductor() -> bool:
    """Run at trace time by every lowering: see `_subgraph_inputs_never_donated` and
    `_compat.allow_scalar_outputs_in_trace`."""
    _compat.allow_scalar_outputs_in_trace(_context.current_trace())
    return _subgraph_inputs_never_donated()


@assume_constant
def escape_exchange(key: int, label: str, desc: Any, code: Any, op: str, what: str, root: str, revise: str) -> Any:
    """Record `desc` for branch `label` of the HOP call `key`. If another branch recorded a
    different description, return `(is_structural, message)`; else None."""
    d = _EXCHANGE.setdefault(key, {})
    _EXCHANGE.move_to_end(key)
    while len(_EXCHANGE) > _EXCHANGE_MAX:
        _EXCHANGE.popitem(last=False)
    d[label] = desc
    for other, odesc in d.items():
        if other != label and not _rules.descriptions_agree(odesc, desc):
            names = (f"{other} output", f"{label} output")
            return _mismatch(op, what, root, names, odesc, desc, code, revise)
    return None


@assume_constant
def _escape_message(op: str, what: str, root: str, names: Any, a: Any, b: Any, code: Any, revise: str) -> Any:
    """`(is_structural, message)` for a mismatch between descriptions `a` and `b`."""
    return _mismatch(op, what, root, tuple(names), a, b, code, revise)



@assume_constant
def _escape_side_effects(op: str, role: str, code: Any) -> Any:
    """The message of the side effects tfun's rules find in `code` without running it
    (rebinding a global or nonlocal, setting an attribute of an outer object, writing
    through `.data`), worded as eagerly; None if there are none."""
    from .. import _rules

    problems = _rules.static_code_side_effects(code)
    if not problems:
        return None
    return _rules.side_effect_message(op, role, _funcinfo.describe_code(code), code.co_name, problems)


@assume_constant
def _escape_state_message(op: str, role: str, code: Any, before: Any, after: Any) -> str:
    from .. import _rules

    names = ("torch.set_default_dtype", "torch.set_grad_enabled")
    problems = _rules.torch_state_problems(list(zip(names, before)), list(zip(names, after)))
    name = code.co_name if code is not None else "the function"
    return _rules.side_effect_message(op, role, fn_text(code) or name, name, problems)


def torch_state() -> tuple[Any, bool]:
    return (torch.get_default_dtype(), torch.is_grad_enabled())


def check_state(op: str, role: str, fn: Any, before: tuple[Any, bool]) -> None:
    """A traced body may not leave torch's default dtype or grad mode changed (eagerly:
    `_rules.torch_state_changes`)."""
    after = torch_state()
    if after[0] != before[0] or after[1] != before[1]:
        raise SideEffectError(_escape_state_message(op, role, code_of(fn), before, after))


def check_side_effects(op: str, role: str, fn: Any) -> None:
    """At trace time, the side-effect rules that need no run of `fn` (those a HOP body
    cannot be refused for by Dynamo, which accepts some of them): the same
    `SideEffectError` as eagerly."""
    code = code_of(fn)
    if code is None:
        return
    msg = _escape_side_effects(op, role, code)
    if msg is not None:
        raise SideEffectError(msg)


def _mismatch(op: str, what: str, root: str, names: tuple[str, str], a: Any, b: Any, code: Any, revise: str) -> Any:
    """`(is_structural, message)`: the message from `_rules.description_mismatch`, the
    formatter of the eager checks (`{name}` in `revise` is the function's name)."""
    revise = revise.replace("{name}", code.co_name if code is not None else "the function")
    return _rules.description_mismatch(op, what, root, names, a, b, fn_text(code), revise)


# ----------------------------------------------------------------------------------------
# Constant descriptions of pytrees (computed in traced code, formatted in plain Python)
# ----------------------------------------------------------------------------------------


def skeleton(td: Any) -> Any:
    """A tuple of constants with `td`'s shape: None for a leaf, else (type, entries, children)."""
    if td.is_leaf():
        return None
    return (td.type, tuple(td.entries()), tuple(skeleton(c) for c in td.children()))


def _leaf_desc(x: Any, sizes: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (x.dtype, tuple(sizes) if sizes is not None else (None,) * x.dim(), x.device)
    return (type(x),)


def describe(td: Any, leaves: Sequence[Any]) -> Any:
    """A description of the pytree `td` with `leaves` made of constants, in plain Python and
    in code that Dynamo traces alike (an escape hatch's argument): each tensor's sizes as the
    call being traced has them (`trace_sizes`); a None size is one not known, which agrees
    with any (`_rules.descriptions_agree`)."""
    return (skeleton(td), tuple(_leaf_desc(x, n) for x, n in zip(leaves, trace_sizes(leaves))))


# Sizes at trace time. Traced code cannot tell a symbolic size from an int (Dynamo answers
# `type(s) is int` for both), and a symbolic size cannot be passed to an escape hatch, nor
# compared without a guard that would specialize it. Dynamo's `comptime` runs a callback at
# trace time that reads a traced variable's fake tensor: its sizes as this call has them (a
# symbol's hint) go to `_SIZES`, and `_escape_take_sizes` hands them to the traced code as
# constants. They describe the call being traced, as eager sizes do, and add no guard. (So
# two sizes that are different expressions equal in the traced call, `s0` and 4 at s0 = 4,
# agree; a graph with a symbolic length traced at that length would not refuse them at
# another, where eager would. Not the case of a static first compile, nor of the symbolic
# recompile that tfun.jit makes at a second length, which is traced at that length.)
_COMPTIME: Any = None  # `_compat.dynamo_comptime()`, set at the first trace (`_escape_load_comptime`)
_SIZES: dict[int, list[Any]] = {}


@assume_constant
def _escape_load_comptime() -> bool:
    global _COMPTIME
    if _COMPTIME is None:
        _COMPTIME = _compat.dynamo_comptime()
    return _COMPTIME is not None


def _comptime_record_sizes(ctx: Any) -> None:
    """The `comptime` callback of `trace_sizes`: reads its locals `key` and `leaf`."""
    key = ctx.get_local("key").as_python_constant()
    _SIZES.setdefault(key, []).append(_compat.comptime_local_sizes(ctx, "leaf"))
    while len(_SIZES) > 256:  # traces that failed between recording and taking
        del _SIZES[next(iter(_SIZES))]


@assume_constant
def _escape_take_sizes(key: int) -> tuple[Any, ...]:
    return tuple(_SIZES.pop(key, ()))


def trace_sizes(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """For each of `leaves`, its sizes as ints (this call's, a symbol's hint; None for a
    size with none, e.g. data-dependent), or None for a leaf that is not a tensor: constants
    in code that Dynamo traces, for `describe`. Sizes that cannot be read (a
    torch without `comptime`) are None."""
    if not _context.is_dynamo_tracing():
        return tuple(_compat.sizes_now(x) for x in leaves)
    unknown = tuple((None,) * x.dim() if isinstance(x, torch.Tensor) else None for x in leaves)
    if not _escape_load_comptime():  # pragma: no cover - every supported torch has comptime
        return unknown
    key = escape_new_key()
    for leaf in leaves:
        _COMPTIME(_comptime_record_sizes)
    sizes = _escape_take_sizes(key)
    return sizes if len(sizes) == len(leaves) else unknown


def code_of(fn: Any) -> Any:
    for _ in range(8):
        if isinstance(fn, functools.partial):
            fn = fn.func
            continue
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None and callable(wrapped):
            fn = wrapped  # a `functools.wraps` wrapper (tfun.checkpoint, tfun.grad, ...): the user's function
            continue
        code = getattr(fn, "__code__", None)
        if code is not None:
            return code
        inner = getattr(fn, "__func__", None)
        if inner is not None:
            fn = inner
            continue
        if isinstance(fn, torch.nn.Module):
            fn = type(fn).forward
            continue
        return None
    return None


def fn_text(code: Any) -> str | None:
    return None if code is None else _funcinfo.describe_code(code)


def raise_mismatch(op: str, what: str, root: str, names: tuple[str, str], a: Any, b: Any, fn: Any, revise: str) -> None:
    raise_result(_escape_message(op, what, root, names, a, b, code_of(fn), revise))


def raise_result(result: Any) -> None:
    structural, msg = result
    if structural:
        raise StructureMismatchError(msg)
    raise TensorMismatchError(msg)


# ----------------------------------------------------------------------------------------
# Leaf normalization and aliasing
# ----------------------------------------------------------------------------------------


def exported_length_may_be_symbolic(length: Any) -> bool:
    """Whether `torch.export` traces with a length that may be a `Dim`: a symbolic size under
    non-strict export, and any size under strict export, whose Dynamo shows traced code a
    symbolic size as an int. Algorithms whose graph depends on the length (associative_scan's
    log-depth one, the SSM layers' chunked scan and S4D's convolution kernel) would make export
    specialize it and refuse the `Dim` ("Constraints violated", "Cannot create Dim with
    inconsistent min=2, max=2"; hunts 26 and 28): they take a loop instead."""
    return _compat.is_exporting() and (_context.is_dynamo_tracing() or not isinstance(length, int))


def carrier(td: Any, leaves: Sequence[Any]) -> Any:
    """A tree of `td`'s structure (its own leaves), for a HOP body to rebuild the treedef from.

    Bodies never close over a treedef: under non-strict export the outer code runs as plain
    Python (a C `optree.PyTreeSpec`) while the body is traced by Dynamo, whose optree
    polyfill accepts only its own treedefs. (Not int leaves: Dynamo 2.13 fails to unflatten
    a dict whose leaves are all constants.)
    """
    return tree_unflatten(td, list(leaves))


def check_output_leaves(op: str, arg: str, fn: Any, tree: Any) -> None:
    """Every leaf of `tree`, which `fn` returned, is a tensor or a Python scalar (a numpy
    value becomes a tensor too); else the `ArgumentTypeError` eager and traced code share.
    Runs in plain Python and under Dynamo alike."""
    leaves, td = tree_flatten(tree)
    for i, x in enumerate(leaves):
        if not isinstance(x, (torch.Tensor, bool, int, float, complex)) and type(x).__module__ != "numpy":
            raise ArgumentTypeError(_escape_leaf_message(op, arg, skeleton(td), i, type(x), code_of(fn)))


@assume_constant
def _escape_leaf_message(op: str, arg: str, skel: Any, index: int, tp: type, code: Any) -> str:
    path = _rules.skeleton_leaf_paths(skel)[index]
    return _rules.non_tensor_leaf_message(op, arg, path, _rules.scalar_text(tp), fn_text(code))


def as_tensor(x: Any, like: Any = None) -> Any:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (bool, int, float, complex)):
        if like is not None:
            return torch.tensor(x, dtype=like.dtype, device=like.device)
        return torch.tensor(x)
    return x


def _view_root(t: torch.Tensor) -> torch.Tensor:
    base = t._base
    return t if base is None else base


def unalias(ts: Sequence[Any], ins: Sequence[Any] = (), *, views: bool = True, clone_all: bool = False) -> list[Any]:
    """`ts` with aliasing removed, for torch's HOPs, which refuse it ("scan might be aliasing
    the input or the output") where JAX programs have it freely: a tensor that shares its
    storage with one of `ins` or with an earlier one of `ts` is cloned.

    - For a body's outputs (`ins`: the body's inputs), `views` also clones any view: a HOP
      body may not return one. `clone_all` clones every output (scan under autograd; see
      `_scan._lower_scan`).
    - For a HOP's operands, `distinct` (views are fine there): `scan(cell, (h0, h0), xs)`.
    """
    seen = [_view_root(t) for t in ins if isinstance(t, torch.Tensor)]
    result = []
    for t in ts:
        if isinstance(t, torch.Tensor):
            root = _view_root(t)
            if clone_all or (views and t._base is not None) or any(root is s for s in seen):
                t = t.clone()
                root = t
            seen.append(root)
        result.append(t)
    return result


def distinct(operands: Sequence[Any]) -> list[Any]:
    """A HOP's tensor operands, none aliasing another (`unalias` without `views`)."""
    return unalias(operands, views=False)


def check_result(
    op: str, what: str, root: str, fn: Any, in_td: Any, in_leaves: Sequence[Any], out: Any, revise: str
) -> list[Any]:
    """Flatten `out`, check it against (in_td, in_leaves) and return its leaves as tensors
    with the dtype of the corresponding input leaf where they were Python scalars."""
    leaves, td = tree_flatten(out)
    if not _compat.same_treedef(td, in_td):  # not `!=`: Dynamo 2.11 cannot trace it (see there)
        raise_mismatch(op, what, root, ("input", "output"), describe(in_td, in_leaves), describe(td, leaves), fn, revise)
    # a Python scalar stands for a 0-d tensor of its default dtype (weakly typed, as in JAX;
    # eagerly: `_rules.normalize_weak_outputs`)
    leaves = [as_tensor(x, ref) if _rules.weak_output_dtype_ok(x, ref) else x for x, ref in zip(leaves, in_leaves)]
    for x, ref in zip(leaves, in_leaves):
        if not isinstance(x, torch.Tensor) or x.dtype != ref.dtype or x.shape != ref.shape or x.device != ref.device:
            raise_mismatch(op, what, root, ("input", "output"), describe(in_td, in_leaves), describe(td, leaves), fn, revise)
    return leaves



# ----------------------------------------------------------------------------------------
# Passing an output of unknown structure through a HOP
# ----------------------------------------------------------------------------------------

# A body's output of arbitrary pytree structure (a `cond` branch's, a `map` function's, a
# `scan` body's `y`) crosses the HOP as the flat list of its leaves: torch's HOPs return only
# tensors in builtin containers, which they flatten with torch's own pytree, so a node
# registered with tfun (a `register_dataclass` class, a custom node) was refused under
# `tfun.jit`, and a dict returned by two branches in two key insertion orders was two
# structures to `torch.cond` (both run eagerly). The structure goes around the HOP instead,
# through an escape hatch: the body records it (`pack`), the code after the HOP rebuilds the
# tree from it (`unpack`).

#: key -> the recorded structure of a HOP call's body output (a real treedef where the body
#: ran as plain Python, else `_skeleton_of`'s constants). Bounded.
_OUT_TREES: collections.OrderedDict[int, Any] = collections.OrderedDict()
_OUT_TREES_MAX = 256
_DICTS = (dict, collections.OrderedDict, collections.defaultdict)
_NONE_TYPE = type(None)
#: The `(unflatten function, metadata)` of each recorded node that is not a dict is an
#: attribute of this module, `_tfun_node_<id>`, which traced code reads by its name (a
#: constant): Dynamo cannot take a class or a function out of an escape hatch's result, and a
#: dict of them would be read as Dynamo first saw it in a trace (one with two HOPs records the
#: second one's nodes after reading it). Attributes are never replaced, so a guard on one
#: stays true.
_NODE_IDS = itertools.count(1)
_THIS = sys.modules[__name__]
_NONE, _TUPLE, _LIST, _DICT, _ORDERED, _DEFAULT, _OTHER = range(7)


def _skeleton_of(td: Any) -> Any:
    """`td` (Dynamo's stand-in treedef) as constants: None for a leaf, else `(type, metadata,
    entries, children)`. A dict-like node's keys are its `entries` (in its children's order);
    its metadata is only a `defaultdict`'s `default_factory`."""
    if td.is_leaf():
        return None
    typ = td.type
    if typ is dict:
        meta = _insertion_order(td._metadata)
    elif typ is collections.defaultdict:
        meta = td._metadata[0]
    elif typ in _DICTS:
        meta = None
    else:
        meta = td._metadata
    return (typ, meta, tuple(td.entries()), tuple(_skeleton_of(c) for c in td.children()))


def _insertion_order(meta: Any) -> tuple[Any, ...] | None:
    """A dict node's keys in insertion order, where Dynamo's flatten of a dict records them
    (its metadata `(original_keys, sorted_keys)`; optree's own Python flatten keeps only the
    sorted keys): eager optree gives a dict back in that order."""
    if isinstance(meta, tuple) and len(meta) == 2 and all(isinstance(m, (list, tuple)) for m in meta):
        return tuple(meta[0])
    return None


@assume_constant
def _escape_out_tree(key: int, tree: Any) -> int:
    """Record the structure of call `key`'s body output: a real treedef as it is, else the
    skeleton as `(kind, node id, entries, children)` constants (see `_NODE_IDS`)."""
    _OUT_TREES[key] = tree if not isinstance(tree, tuple) else _encode(tree)
    _OUT_TREES.move_to_end(key)
    while len(_OUT_TREES) > _OUT_TREES_MAX:
        _OUT_TREES.popitem(last=False)
    return 0


def _encode(skel: Any) -> Any:
    if skel is None:
        return None
    typ, meta, entries, children = skel
    kids = tuple(_encode(c) for c in children)
    if typ is _NONE_TYPE:
        return (_NONE, 0, (), kids)
    if typ is tuple:
        return (_TUPLE, 0, (), kids)
    if typ is list:
        return (_LIST, 0, (), kids)
    if typ is dict:
        return (_DICT, meta, entries, kids)  # (meta: the keys in insertion order, or None)
    if typ is collections.OrderedDict:
        return (_ORDERED, 0, entries, kids)
    node = next(_NODE_IDS)
    if typ is collections.defaultdict:
        setattr(_THIS, f"_tfun_node_{node}", (None, meta))
        return (_DEFAULT, node, entries, kids)
    import optree

    from .._tree import NAMESPACE

    setattr(_THIS, f"_tfun_node_{node}", (optree.register_pytree_node.get(typ, namespace=NAMESPACE).unflatten_func, meta))
    return (_OTHER, node, entries, kids)


@assume_constant
def _escape_out_tree_of(key: int) -> Any:
    return _OUT_TREES[key]


def _rebuild(skel: Any, leaves: Any) -> Any:
    if skel is None:
        return next(leaves)
    kind, node, entries, children = skel
    kids = [_rebuild(c, leaves) for c in children]
    if kind == _NONE:
        return None
    if kind == _TUPLE:
        return tuple(kids)
    if kind == _LIST:
        return kids
    if kind == _DICT:
        if node is None:
            return dict(zip(entries, kids))
        out = dict.fromkeys(node)  # the insertion order, as eager optree gives it back
        out.update(zip(entries, kids))
        return out
    if kind == _ORDERED:
        return collections.OrderedDict(zip(entries, kids))
    fn, meta = getattr(_THIS, f"_tfun_node_{node}")
    if kind == _DEFAULT:
        return collections.defaultdict(meta, zip(entries, kids))
    return fn(meta, tuple(kids))  # (a tuple of children, as optree passes them)


def pack(key: int, td: Any, leaves: list[Any]) -> list[Any]:
    """In a HOP body: record `td` for HOP call `key` and return the flat `leaves` (what the
    body returns to torch's HOP in place of the tree)."""
    _escape_out_tree(key, _skeleton_of(td) if torch.compiler.is_dynamo_compiling() else td)
    return list(leaves)


def unpack(key: int, flat: Sequence[Any]) -> Any:
    """After the HOP: the tree recorded for call `key`, with the HOP's flat outputs."""
    tree = _escape_out_tree_of(key)
    if tree is not None and not isinstance(tree, tuple):  # a real treedef: the body ran as plain Python
        return tree_unflatten(tree, list(flat))
    return _rebuild(tree, iter(flat))


# ----------------------------------------------------------------------------------------
# scan
# ----------------------------------------------------------------------------------------


def promote_weak(c_leaves: list[Any], weak: Any, out_carry: Any) -> list[Any]:
    """`c_leaves` with the leaves that were Python scalars in `init` converted to the dtype
    the body gives them, where JAX's weak-type promotion allows it (as eagerly)."""
    expected = _rules.promote_weak_init(c_leaves, weak, out_carry)
    return [t if t.dtype == m.dtype else t.to(m.dtype) for t, m in zip(c_leaves, expected)]


def promote_weak_init(
    c_leaves: list[Any],
    weak: Any,
    new_carry: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    runs: bool = True,
    rules: tuple[str, str, Callable[..., Any], tuple[Any, ...]] | None = None,
) -> list[Any]:
    """The flat carry `c_leaves` of a loop, with the leaves that were Python scalars in its
    `init` (`weak`, by flat index) converted to the dtype the body gives them, as JAX
    promotes a weakly typed `init`: `new_carry(leaves, *args)` (the body's new carry, or
    None where the body returns something else: the loop's own checks report it) runs once
    with those leaves weakly typed (`_weak.WeakMode`), and its result is discarded, as JAX
    traces a loop body twice. Traced, that run is dead code. Eagerly it is one real step
    when the loop `runs` (the first step's inputs are real values); for a loop that runs
    zero times it is on fake tensors (nothing is computed on values the loop never sees),
    or, where fake tensors cannot follow the body (`.item()`), for real, as zero-length
    loops find their outputs (`_scan.zero_length_outputs`).

    `rules`, `(op, role, fn, fn_args)`: eagerly, that run is the first run of the user's
    `fn` on `fn_args`, so it runs under the side-effect rules (`_rules.checked_call`): a
    refused side effect is reported from it, before it could happen twice."""
    if not weak:
        return c_leaves
    from ._weak import WeakMode

    n = len(c_leaves)
    positions = sorted(weak)

    def run(*flat: Any) -> Any:
        leaves = list(flat[:n])
        with WeakMode([leaves[i] for i in positions]):
            return new_carry(leaves, *flat[n:])

    def probe() -> Any:
        if runs or _context.is_tracing():
            return run(*c_leaves, *args)
        try:
            out_leaves, out_def = _rules.abstract_eval(run, (*c_leaves, *args))
            return tree_unflatten(out_def, out_leaves)
        except _rules.AbstractEvalUnavailable:
            with torch.no_grad():
                return run(*c_leaves, *args)

    if rules is None or _context.is_tracing():
        out = probe()
    else:
        op, role, fn, fn_args = rules
        out = _rules.checked_call(op, role, fn, fn_args, call=probe)
    return promote_weak(c_leaves, weak, out)


# ----------------------------------------------------------------------------------------
# vmap inside tfun.jit: carries batched as JAX batches them
# ----------------------------------------------------------------------------------------


def vmap_traced() -> bool:
    """Whether a traced loop runs inside a `torch.func` transform that Dynamo traces
    (`tfun.jit(tfun.vmap(f))`): `torch._C._are_functorch_transforms_active`, which Dynamo
    folds at trace time."""
    return _context.is_tracing() and _context.functorch_active()


def outer_batched(t: Any) -> bool:
    """Whether `t` is batched by its outermost functorch wrapper (safe in traced code; see
    `_batching.is_batched` for every level, eagerly)."""
    # (`is_batchedtensor` is one of the functorch predicates Dynamo folds; it sees the outermost
    # wrapper, which is enough for `vmap` inside `tfun.jit`, where no grad wrapper sits between)
    check = _compat.is_batchedtensor
    return check is not None and isinstance(t, torch.Tensor) and bool(check(t))


def batched_like(t: Any, like: Any) -> Any:
    """`t`'s values with `like`'s batch dimensions (a `where` on an all-false mask shaped like
    `like`: exact for every dtype, -0.0 and NaN included). `t` itself where it has the same
    batching already or is not a tensor of `like`'s shape."""
    if not (outer_batched(like) and isinstance(t, torch.Tensor)) or outer_batched(t) or t.shape != like.shape:
        return t
    return torch.where(torch.zeros_like(like, dtype=torch.bool), t, t)


def batch_carry_like_body(c_leaves: list[Any], new_carry: Callable[..., Any], args: tuple[Any, ...] = ()) -> list[Any]:
    """The flat carry `c_leaves` of a traced loop under `vmap` (`vmap_traced`), with each leaf
    that the body returns batched made batched too: JAX's batching rule for loops, a fixpoint.
    torch's own vmap rule for `scan` batches the carry as `init` is batched and fails where
    the body batches more of it ("Expected init and carry to have same metadata": a carry
    that starts as `torch.zeros(n)` and takes in a batched `x`).

    `new_carry(leaves, *args)` runs the body once per round (the new carry, or None where
    the body returns something else: the loop's own checks report it); its ops are dead
    code, as with `promote_weak_init`. Each round batches at least one more leaf, so at
    most `len(c_leaves) + 1` rounds run; most loops need two."""
    if not vmap_traced():
        return c_leaves
    c_leaves = list(c_leaves)
    for _ in range(len(c_leaves) + 1):
        out = new_carry(c_leaves, *args)
        if out is None:
            return c_leaves
        out_leaves, _ = tree_flatten(out)
        if len(out_leaves) != len(c_leaves):
            return c_leaves
        grown = [batched_like(c, o) for c, o in zip(c_leaves, out_leaves)]
        if all(g is c for g, c in zip(grown, c_leaves)):
            return c_leaves
        c_leaves = grown
    return c_leaves



def is_exporting() -> bool:
    return _compat.is_exporting()  # Dynamo 2.11 folds torch.compiler.is_exporting() to True


# ----------------------------------------------------------------------------------------
# Errors raised inside Dynamo tracing
# ----------------------------------------------------------------------------------------


def unwrap_dynamo_error(exc: BaseException) -> BaseException | None:
    """The tfun error that Dynamo wrapped in `exc`, rebuilt, or None.

    An exception raised while Dynamo traces user code surfaces as
    `torch._dynamo.exc.Unsupported` / `UncapturedHigherOrderOpError` whose cause is an
    `Observed<Name>Error` carrying only the text `raised exception Name('message')`.
    """
    try:
        import torch._dynamo.exc as dexc
    except ImportError:  # pragma: no cover
        return None
    from .._errors import TfunError

    inverse = {v: k for k, v in getattr(dexc, "observed_exception_map", {}).items()}
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, TfunError):
            return e
        real = inverse.get(type(e))
        if real is not None and isinstance(real, type) and issubclass(real, TfunError):
            rebuilt = real(*_parse_observed_args(e, real.__name__))
            rebuilt.__cause__ = None
            return rebuilt
        e = e.__cause__ or e.__context__
    return None


def _parse_observed_args(e: BaseException, name: str) -> tuple[Any, ...]:
    text = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
    prefix = "raised exception "
    if text.startswith(prefix):
        text = text[len(prefix) :]
    if text == f"UserDefinedExceptionObjectVariable({name})":
        # torch 2.11's Dynamo drops the arguments from the text: they were recorded when
        # the error was constructed (`_compat.record_raised`)
        recorded = _compat.raised_args(name)
        if recorded is not None:
            return recorded
    if text.startswith(name + "(") and text.endswith(")"):
        try:
            value = ast.literal_eval(text[len(name) :])
        except (ValueError, SyntaxError):
            return (text,)
        return value if isinstance(value, tuple) else (value,)
    return (text,)
