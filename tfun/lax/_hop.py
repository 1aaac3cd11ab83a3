"""Lowering of tfun.lax ops to PyTorch's control-flow higher-order operators (HOPs).

This is the ONLY module that touches torch's private HOP APIs (`torch.cond`,
`torch._higher_order_ops.while_loop`, `scan`, `map`, `associative_scan`), so that changes
between torch releases are absorbed here.

Interface used by the lax ops (arguments already validated and normalized by the op:
Python scalars in carries turned into tensors, `pred` a 0-d bool tensor, `index` a 0-d
integer tensor already clamped):

- `is_tracing() -> bool`: True when the op is being traced by torch.compile / torch.export
  and must lower to a HOP instead of running its eager Python loop.
- `cond(pred, true_fun, false_fun, operands: tuple) -> out`
- `switch(index, branches, operands: tuple) -> out`
- `while_loop(cond_fun, body_fun, init_val) -> final_val`
- `scan(f, init, xs, length: int, reverse: bool) -> (carry, ys)`
- `map(f, xs) -> ys`
- `associative_scan(fn, elems, reverse: bool, axis: int) -> out`

How the lowering works (torch 2.11-2.13):

- Every function handed to a HOP is wrapped so that it takes and returns *flat* lists of
  tensors in tfun's pytree order (optree namespace "tfun"); the user function sees tfun
  pytrees. Outputs whose structure is not known in advance (cond/switch outputs, scan's
  `ys`, map's output) are returned in the user's own structure and rebuilt by Dynamo.
- HOP bodies may not return a tensor that aliases an input or another output; the wrapper
  clones such outputs (`return c, c` is legal in tfun).
- tfun's rules run while the body is traced: a carry whose structure, dtype or shape
  differs from `init`, or cond branches with different outputs, raise
  `StructureMismatchError` / `TensorMismatchError`. Dynamo cannot trace the message
  formatting, so the wrapper computes a small *constant* description of both sides and
  hands it to `_escape_*` helpers that Dynamo runs as plain Python
  (`torch._dynamo.assume_constant_result`). Dynamo reports such an exception wrapped in
  `torch._dynamo.exc.Unsupported`/`UncapturedHigherOrderOpError`; `tfun.jit` unwraps it
  (`unwrap_dynamo_error`).
- Gradients come from torch's own HOP autograd. For scan under inductor, torch 2.13 needs
  two workarounds, applied under grad mode except while exporting (see `scan`): every body
  output is cloned (else "scan might be aliasing the input or the output"), and the
  gradients reaching the outputs are made contiguous by a hook (inductor's scan computes
  wrong values from stride-0 tangents such as the gradient of `carry.sum()`).
- Inductor in torch 2.11-2.14 lets a HOP body in the backward graph overwrite its inputs in
  place (it applies the outer graph's donated-buffer indices to the body's placeholders),
  which made the gradients of stacked scans wrong (2-layer and bidirectional RNNs).
  Every lowering first runs `_escape_prepare_inductor`, which applies torch's upstream fix
  (`_subgraph_inputs_never_donated`): under `tfun.jit` and plain `torch.compile` alike.
- torch 2.13's scan autograd rejects integer and bool carries and ys; under grad mode they
  cross the HOP as int64 bits in float64 tensors (exact; see `scan`).
- Inductor on torch 2.13 computes wrong gradients through a complex `associative_scan`
  (S4D, S5, LRU): under grad mode with a backend other than eager/aot_eager it is refused
  with a `JitError` (`_escape_complex_scan_refusal`).
- Known torch 2.13 limitations: `x.T` inside a cond branch triggers a spurious Dynamo
  aliasing error (use `x.t()` / `x.mT`); `associative_scan` on the CPU lowers to torch's
  "generic" mode (a log-depth unrolled tree of the combine function, not one HOP node);
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
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _compat, _context, _funcinfo, _rules
from .._errors import (
    ArgumentTypeError,
    JitError,
    SideEffectError,
    StructureMismatchError,
    TensorMismatchError,
    format_message,
)
from .._tree import tree_flatten, tree_structure, tree_unflatten

__all__ = [
    "is_tracing",
    "cond",
    "switch",
    "while_loop",
    "scan",
    "map",
    "associative_scan",
    "check_carry",
    "check_export_constants",
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


def _torch_cond() -> Callable[..., Any]:
    return torch.cond


def _torch_scan() -> Callable[..., Any]:
    from torch._higher_order_ops.scan import scan as _scan

    _compat.scan_autograd_fixes()  # torch 2.11's scan autograd lacks two fixes of 2.13 (see there)
    return _scan


def _torch_while_loop() -> Callable[..., Any]:
    fn = getattr(torch, "while_loop", None)
    if fn is None:
        from torch._higher_order_ops.while_loop import while_loop as fn
    _compat.while_loop_autograd_fixes()  # torch 2.11's backward keeps strided gradients (see there)
    return fn


def _torch_map() -> Callable[..., Any]:
    from torch._higher_order_ops.map import map as _map

    return _map


def _torch_associative_scan() -> Callable[..., Any]:
    from torch._higher_order_ops.associative_scan import associative_scan as _as

    return _as


#: How many control-flow ops have been lowered to HOPs (read by tfun.grad's traced path).
#: Counted at trace time, in plain Python (Dynamo constants): as a traced global write it
#: would be a side effect, which HOP bodies (nested control flow) may not have.
_LOWERINGS = [0]


def lowerings() -> int:
    """A counter of HOP lowerings: a traced caller compares it before and after a call to
    learn whether the call contained control flow."""
    return _escape_lowerings(False)


def _count_lowering() -> None:
    _escape_lowerings(True)


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

def _assume_constant(fn: Callable[..., Any]) -> Callable[..., Any]:
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


@_assume_constant
def _escape_lowerings(count: bool) -> int:
    if count:
        _LOWERINGS[0] += 1
    return _LOWERINGS[0]


@_assume_constant
def _escape_new_key() -> int:
    return next(_KEYS)


@_assume_constant
def _escape_prepare_inductor() -> bool:
    """Run at trace time by every lowering: see `_subgraph_inputs_never_donated`."""
    return _subgraph_inputs_never_donated()


@_assume_constant
def _escape_exchange(key: int, label: str, desc: Any, code: Any, op: str, what: str, root: str, revise: str) -> Any:
    """Record `desc` for branch `label` of the HOP call `key`. If another branch recorded a
    different description, return `(is_structural, message)`; else None."""
    d = _EXCHANGE.setdefault(key, {})
    _EXCHANGE.move_to_end(key)
    while len(_EXCHANGE) > _EXCHANGE_MAX:
        _EXCHANGE.popitem(last=False)
    d[label] = desc
    for other, odesc in d.items():
        if other != label and odesc != desc:
            names = (f"{other} output", f"{label} output")
            return _mismatch(op, what, root, names, odesc, desc, code, revise)
    return None


@_assume_constant
def _escape_message(op: str, what: str, root: str, names: Any, a: Any, b: Any, code: Any, revise: str) -> Any:
    """`(is_structural, message)` for a mismatch between descriptions `a` and `b`."""
    return _mismatch(op, what, root, tuple(names), a, b, code, revise)


@_assume_constant
def _escape_pair_message(op: str, got: Any, code: Any) -> str:
    """The message of a scan body that does not return a pair; `got` is the skeleton of
    what it returned (None for a tensor). Worded as the eager check words it."""
    name = code.co_name if code is not None else "the function"
    return format_message(
        f"{op}: the body function must return a pair (carry, y), but it returned "
        f"{'a tensor' if got is None else _node_text(got)}.",
        function=_fn_text(code),
        revise=f"Revise `{name}` to return `(new_carry, y)`; use `None` for y if there is none.",
    )


@_assume_constant
def _escape_side_effects(op: str, role: str, code: Any) -> Any:
    """The message of the side effects tfun's rules find in `code` without running it
    (rebinding a global or nonlocal, setting an attribute of an outer object, writing
    through `.data`), worded as eagerly; None if there are none."""
    from .. import _rules

    problems = _rules.static_code_side_effects(code)
    if not problems:
        return None
    return _rules.side_effect_message(op, role, _funcinfo.describe_code(code), code.co_name, problems)


@_assume_constant
def _escape_state_message(op: str, role: str, code: Any, before: Any, after: Any) -> str:
    from .. import _rules

    names = ("torch.set_default_dtype", "torch.set_grad_enabled")
    problems = _rules.torch_state_problems(list(zip(names, before)), list(zip(names, after)))
    name = code.co_name if code is not None else "the function"
    return _rules.side_effect_message(op, role, _fn_text(code) or name, name, problems)


def _torch_state() -> tuple[Any, bool]:
    return (torch.get_default_dtype(), torch.is_grad_enabled())


def _check_state(op: str, role: str, fn: Any, before: tuple[Any, bool]) -> None:
    """A traced body may not leave torch's default dtype or grad mode changed (eagerly:
    `_rules.torch_state_changes`)."""
    after = _torch_state()
    if after[0] != before[0] or after[1] != before[1]:
        raise SideEffectError(_escape_state_message(op, role, _code_of(fn), before, after))


def check_side_effects(op: str, role: str, fn: Any) -> None:
    """At trace time, the side-effect rules that need no run of `fn` (those a HOP body
    cannot be refused for by Dynamo, which accepts some of them): the same
    `SideEffectError` as eagerly."""
    code = _code_of(fn)
    if code is None:
        return
    msg = _escape_side_effects(op, role, code)
    if msg is not None:
        raise SideEffectError(msg)


def _mismatch(op: str, what: str, root: str, names: tuple[str, str], a: Any, b: Any, code: Any, revise: str) -> Any:
    structural = a[0] != b[0]
    revise = revise.replace("{name}", code.co_name if code is not None else "the function")
    return structural, _format_mismatch("structure" if structural else "tensor", op, what, root, names, a, b, code, revise)


# ----------------------------------------------------------------------------------------
# Constant descriptions of pytrees (computed in traced code, formatted in plain Python)
# ----------------------------------------------------------------------------------------


def _skeleton(td: Any) -> Any:
    """A tuple of constants with `td`'s shape: None for a leaf, else (type, entries, children)."""
    if td.is_leaf():
        return None
    return (td.type, tuple(td.entries()), tuple(_skeleton(c) for c in td.children()))


def _leaf_desc(x: Any, shapes: bool) -> Any:
    if isinstance(x, torch.Tensor):
        if shapes:
            shape = tuple(s if type(s) is int else None for s in x.shape)
        else:
            shape = (None,) * x.dim()
        return (x.dtype, shape, x.device)
    return (type(x),)


def _describe(td: Any, leaves: Sequence[Any], shapes: bool = True) -> Any:
    """`shapes=False` where sizes may be symbolic (a body traced by the Dynamo run that
    non-strict export starts): they cannot be passed to an escape hatch as constants."""
    return (_skeleton(td), tuple(_leaf_desc(x, shapes) for x in leaves))


def _code_of(fn: Any) -> Any:
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


def _fn_text(code: Any) -> str | None:
    return None if code is None else _funcinfo.describe_code(code)


def _node_text(sk: Any) -> str:
    if sk is None:
        return "a leaf"
    t, entries, children = sk
    n = len(children)
    if t is type(None):
        return "None"
    if t is tuple:
        return f"a tuple of {n}"
    if t is list:
        return f"a list of {n}"
    if isinstance(t, type) and issubclass(t, dict):
        return f"a {t.__name__} with keys {list(entries)}"
    if isinstance(t, type) and issubclass(t, tuple) and hasattr(t, "_fields"):
        return f"a {t.__name__}({', '.join(getattr(t, '_fields'))})"
    return f"a {getattr(t, '__qualname__', t)} with children {list(entries)}"


def _entry_text(sk: Any, entry: Any) -> str:
    t = sk[0]
    if t in (tuple, list) or t is collections.deque:
        return f"[{entry}]"
    if isinstance(t, type) and issubclass(t, dict):
        return f"[{entry!r}]"
    if isinstance(t, type) and issubclass(t, tuple) and hasattr(t, "_fields"):
        return f".{getattr(t, '_fields')[entry]}" if isinstance(entry, int) else f".{entry}"
    if isinstance(entry, str):
        return f".{entry}"
    return f"[{entry!r}]"


def _structure_diffs(a: Any, b: Any, path: str) -> list[tuple[str, Any, Any]]:
    if a == b:
        return []
    if a is None or b is None or a[0] is not b[0] or a[1] != b[1]:
        return [(path, a, b)]
    out: list[tuple[str, Any, Any]] = []
    for entry, ca, cb in zip(a[1], a[2], b[2]):
        out.extend(_structure_diffs(ca, cb, path + _entry_text(a, entry)))
    return out or [(path, a, b)]


def _leaf_paths(sk: Any, path: str = "") -> list[str]:
    if sk is None:
        return [path]
    out: list[str] = []
    for entry, child in zip(sk[1], sk[2]):
        out.extend(_leaf_paths(child, path + _entry_text(sk, entry)))
    return out


def _dtype_text(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _leaf_text(d: Any) -> str:
    if len(d) == 1:
        t = d[0]
        return {bool: "a Python bool", int: "a Python int", float: "a Python float"}.get(t, f"a {t.__qualname__}")
    dtype, shape, device = d
    dims = ",".join("?" if s is None else str(s) for s in shape)
    return f"{_dtype_text(dtype)}[{dims}] on {device}"


def _format_mismatch(
    kind: str, op: str, what: str, root: str, names: tuple[str, str], a: Any, b: Any, code: Any, revise: str
) -> str:
    (ska, la), (skb, lb) = a, b
    fn = _fn_text(code)
    if kind == "structure" or ska != skb:
        bullets = [
            f"{root}{p}: {names[0]} is {_node_text(x)}, {names[1]} is {_node_text(y)}"
            for p, x, y in _structure_diffs(ska, skb, "")
        ]
        return format_message(
            f"{op}: {what} must have the same pytree structure, but they differ:",
            bullets,
            function=fn,
            revise=revise,
        )
    bullets = []
    for p, x, y in zip(_leaf_paths(ska), la, lb):
        if x == y:
            continue
        if len(x) == 1 or len(y) == 1:
            diffs = ["kinds"]
        else:
            diffs = [n + "s" for n, u, v in zip(("dtype", "shape", "device"), x, y) if u != v]
        bullets.append(f"{root}{p}: {names[0]} is {_leaf_text(x)}, {names[1]} is {_leaf_text(y)} ({' and '.join(diffs)} differ)")
    return format_message(
        f"{op}: {what} must have the same dtype, shape and device, but they differ:",
        bullets,
        function=fn,
        revise=revise,
    )


def _raise_mismatch(op: str, what: str, root: str, names: tuple[str, str], a: Any, b: Any, fn: Any, revise: str) -> None:
    _raise(_escape_message(op, what, root, names, a, b, _code_of(fn), revise))


def _raise(result: Any) -> None:
    structural, msg = result
    if structural:
        raise StructureMismatchError(msg)
    raise TensorMismatchError(msg)


# ----------------------------------------------------------------------------------------
# Leaf normalization and aliasing
# ----------------------------------------------------------------------------------------


def _dynamo_outside() -> bool:
    """True when the code around the HOP call is traced by Dynamo (torch.compile, strict
    export); False when it runs as plain Python (non-strict export)."""
    f = getattr(torch.compiler, "is_dynamo_compiling", None)
    return bool(f()) if f is not None else True


def _carrier(td: Any, leaves: Sequence[Any]) -> Any:
    """A tree of `td`'s structure (its own leaves), for a HOP body to rebuild the treedef from.

    Bodies never close over a treedef: under non-strict export the outer code runs as plain
    Python (a C `optree.PyTreeSpec`) while the body is traced by Dynamo, whose optree
    polyfill accepts only its own treedefs. (Not int leaves: Dynamo 2.13 fails to unflatten
    a dict whose leaves are all constants.)
    """
    return tree_unflatten(td, list(leaves))


def _as_tensor(x: Any, like: Any = None) -> Any:
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


def _unalias(outs: list[Any], ins: Sequence[Any], clone_all: bool = False) -> list[Any]:
    """Clone outputs that are (views of) inputs or of earlier outputs: HOP bodies may not alias.

    `clone_all`: clone every output (scan under autograd; see `scan`).
    """
    seen = [_view_root(t) for t in ins if isinstance(t, torch.Tensor)]
    result = []
    for t in outs:
        if isinstance(t, torch.Tensor):
            root = _view_root(t)
            if t._base is not None or any(root is s for s in seen) or clone_all:
                t = t.clone()
                root = t
            seen.append(root)
        result.append(t)
    return result


def _check_result(
    op: str, what: str, root: str, fn: Any, in_td: Any, in_leaves: Sequence[Any], out: Any, revise: str
) -> list[Any]:
    """Flatten `out`, check it against (in_td, in_leaves) and return its leaves as tensors
    with the dtype of the corresponding input leaf where they were Python scalars."""
    leaves, td = tree_flatten(out)
    if td != in_td:
        _raise_mismatch(op, what, root, ("input", "output"), _describe(in_td, in_leaves), _describe(td, leaves), fn, revise)
    # a Python scalar stands for a 0-d tensor of its default dtype (weakly typed, as in JAX;
    # eagerly: `_rules.normalize_weak_outputs`)
    leaves = [_as_tensor(x, ref) if _rules.weak_output_dtype_ok(x, ref) else x for x, ref in zip(leaves, in_leaves)]
    for x, ref in zip(leaves, in_leaves):
        if not isinstance(x, torch.Tensor) or x.dtype != ref.dtype or x.shape != ref.shape or x.device != ref.device:
            _raise_mismatch(op, what, root, ("input", "output"), _describe(in_td, in_leaves), _describe(td, leaves), fn, revise)
    return leaves


def check_carry(op: str, fn: Any, carry: Any, out: Any) -> Any:
    """`out` (what `fn` returned for `carry`) checked against `carry` inside a traced body,
    with the wording of the eager carry check; Python scalars become tensors."""
    in_leaves, in_td = tree_flatten(carry)
    leaves = _check_result(op, "body_fun input and output", "carry", fn, in_td, in_leaves, out, _REVISE_CARRY)
    return tree_unflatten(in_td, leaves)


# ----------------------------------------------------------------------------------------
# Passing an output of unknown structure through a HOP
# ----------------------------------------------------------------------------------------

#: `None` inside HOP outputs travels as `{_NONE_KEY: ()}`: torch's scan treats a `None`
#: there as a leaf, and Dynamo accepts only tensors and builtin containers in HOP outputs.
_NONE_KEY = "__tfun_none__"


def _is_nothing(x: Any) -> bool:
    return type(x) is dict and len(x) == 1 and _NONE_KEY in x


def _pack(td: Any, leaves: list[Any]) -> Any:
    """The tree `td` with `leaves`, its `None` nodes replaced by `{_NONE_KEY: ()}` markers."""
    tree = tree_unflatten(td, leaves)
    parts, td_n = tree_flatten(tree, none_is_leaf=True)
    return tree_unflatten(td_n, [{_NONE_KEY: ()} if x is None else x for x in parts])


def _unpack(tree: Any) -> Any:
    """Inverse of `_pack`."""
    parts, td = tree_flatten(tree, is_leaf=_is_nothing, none_is_leaf=True)
    return tree_unflatten(td, [None if _is_nothing(x) else x for x in parts])


# ----------------------------------------------------------------------------------------
# cond / switch
# ----------------------------------------------------------------------------------------


_REVISE_BRANCHES = (
    "Revise the branches so that they all return the same pytree structure with tensors of the same dtype, "
    "shape and device."
)
_REVISE_CARRY = (
    "Revise `{name}` so that the carry it returns has the structure of `init`, with tensors of the same "
    "dtype, shape and device."
)


def _branch(op: str, fn: Any, key: int, label: str, op_carrier: Any, shapes: bool) -> Callable[..., Any]:
    def branch(*flat: Any) -> Any:
        operands = tree_unflatten(tree_structure(op_carrier), list(flat))
        state = _torch_state()
        out = fn(*operands)
        _check_state(op, label, fn, state)
        leaves, td = tree_flatten(out)
        leaves = [_as_tensor(x) for x in leaves]
        bad = _escape_exchange(key, label, _describe(td, leaves, shapes), _code_of(fn), op, "branch outputs", "output", _REVISE_BRANCHES)
        if bad is not None:
            _raise(bad)
        leaves = _unalias(leaves, flat)
        return _pack(td, leaves)

    return branch


def cond(pred: Any, true_fun: Callable[..., Any], false_fun: Callable[..., Any], operands: tuple[Any, ...]) -> Any:
    """`torch.cond` with tfun pytrees, tfun's branch rules and alias-free outputs."""
    _count_lowering()
    _escape_prepare_inductor()
    flat, op_td = tree_flatten(tuple(operands))
    key = _escape_new_key()
    # Sizes are not exchanged: once Dynamo makes a size symbolic (a second input shape),
    # it cannot be passed to an escape hatch as a constant, and nothing in traced code tells
    # a symbolic size from a concrete one (Dynamo answers `type(s) is int` for both).
    # Ranks are compared; differing sizes of equal rank are left to torch.cond's own check.
    shapes = False
    t = _branch("tfun.lax.cond", true_fun, key, "true_fun", _carrier(op_td, flat), shapes)
    f = _branch("tfun.lax.cond", false_fun, key, "false_fun", _carrier(op_td, flat), shapes)
    return _unpack(_torch_cond()(pred, t, f, tuple(flat)))


def switch(index: Any, branches: Sequence[Callable[..., Any]], operands: tuple[Any, ...]) -> Any:
    """`branches[index](*operands)` as a balanced tree of `torch.cond`s (depth log2 n)."""
    _count_lowering()
    _escape_prepare_inductor()
    branches = tuple(branches)
    flat, op_td = tree_flatten(tuple(operands))
    key = _escape_new_key()
    wrapped = [
        _branch("tfun.lax.switch", b, key, f"branches[{i}]", _carrier(op_td, flat), False)  # sizes: see cond
        for i, b in enumerate(branches)
    ]
    cond_ = _torch_cond()

    def build(lo: int, hi: int) -> Callable[..., Any]:
        if hi - lo == 1:
            return wrapped[lo]
        mid = (lo + hi) // 2
        left, right = build(lo, mid), build(mid, hi)

        def node(*args: Any) -> Any:
            return cond_(index < mid, left, right, tuple(args))

        return node

    if len(wrapped) == 1:
        return _unpack(wrapped[0](*flat))
    return _unpack(build(0, len(wrapped))(*flat))


# ----------------------------------------------------------------------------------------
# while_loop
# ----------------------------------------------------------------------------------------


def while_loop(
    cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any], init_val: Any, weak: Any = None
) -> Any:
    """`torch.while_loop` over the flat leaves of `init_val` (`weak`: see `scan`)."""
    _count_lowering()
    _escape_prepare_inductor()
    op = "tfun.lax.while_loop"
    leaves, td = tree_flatten(init_val)
    leaves = [x.contiguous() for x in leaves]
    if not leaves:
        # nothing is carried: the loop cannot change anything observable
        return init_val
    if weak:
        leaves = promote_weak(leaves, weak, body_fun(tree_unflatten(td, leaves)))

    carrier = _carrier(td, leaves)

    def c(*flat: Any) -> Any:
        state = _torch_state()
        p = cond_fun(tree_unflatten(tree_structure(carrier), list(flat)))
        _check_state(op, "cond_fun", cond_fun, state)
        if not isinstance(p, torch.Tensor):
            p = torch.tensor(bool(p), device=flat[0].device)
        return p

    def b(*flat: Any) -> Any:
        td_in = tree_structure(carrier)
        state = _torch_state()
        out = body_fun(tree_unflatten(td_in, list(flat)))
        _check_state(op, "body_fun", body_fun, state)
        new = _check_result(
            op,
            "body_fun input and output",
            "carry",
            body_fun,
            td_in,
            flat,
            out,
            _REVISE_CARRY,
        )
        new = [x.contiguous() for x in new]
        return tuple(_unalias(new, flat))

    out = _torch_while_loop()(c, b, tuple(leaves))
    return tree_unflatten(td, list(out))


# ----------------------------------------------------------------------------------------
# scan
# ----------------------------------------------------------------------------------------


def promote_weak(c_leaves: list[Any], weak: Any, out_carry: Any) -> list[Any]:
    """`c_leaves` with the leaves that were Python scalars in `init` converted to the dtype
    the body gives them, where JAX's weak-type promotion allows it (as eagerly)."""
    expected = _rules.promote_weak_init(c_leaves, weak, out_carry)
    return [t if t.dtype == m.dtype else t.to(m.dtype) for t, m in zip(c_leaves, expected)]


def scan(
    f: Callable[[Any, Any], Any], init: Any, xs: Any, length: int, reverse: bool, weak: Any = None
) -> tuple[Any, Any]:
    """`torch._higher_order_ops.scan` with tfun pytrees, `xs=None` and Python scalars.

    `weak`: the flat indices of `init`'s leaves that were Python scalars (see
    `_rules.weak_scalars`); the body is traced once outside the HOP to learn their dtypes
    (its ops are dead code), as JAX traces a loop body twice to promote a weak `init`."""
    _count_lowering()
    _escape_prepare_inductor()
    op = "tfun.lax.scan"
    c_leaves, c_td = tree_flatten(init)
    c_leaves = [x.contiguous() for x in c_leaves]
    x_leaves, x_td = tree_flatten(xs)
    if weak and length > 0:
        x0 = tree_unflatten(x_td, [x[0] for x in x_leaves])
        res = f(tree_unflatten(c_td, c_leaves), x0)
        if isinstance(res, (tuple, list)) and len(res) == 2:
            c_leaves = promote_weak(c_leaves, weak, res[0])
    n_c = len(c_leaves)
    revise = _REVISE_CARRY

    c_carrier, x_carrier = _carrier(c_td, c_leaves), _carrier(x_td, x_leaves)
    n_x = len(x_leaves)
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
    #    only the floating ones). Under grad mode they cross the HOP as the bits of int64 in
    #    a float64 tensor (`_to_floating` / `_from_floating`, exact). Complex leaves are
    #    left alone: torch 2.13's scan autograd cannot differentiate complex view ops.
    for_inductor = not _is_exporting()
    clone_all = for_inductor and torch.is_grad_enabled()
    check_export_constants(op, f)
    encode = clone_all
    c_dtypes = [t.dtype for t in c_leaves]

    def body(carry_flat: list[Any], x_flat: list[Any]) -> Any:
        raw_ins = list(carry_flat) + list(x_flat)
        if encode:
            carry_flat = [_from_floating(t, d) for t, d in zip(carry_flat[:n_c], c_dtypes)] + list(carry_flat[n_c:])
        c_td_in = tree_structure(c_carrier)
        carry = tree_unflatten(c_td_in, list(carry_flat)[:n_c])
        x = tree_unflatten(tree_structure(x_carrier), list(x_flat)[:n_x])
        state = _torch_state()
        res = f(carry, x)
        _check_state(op, "body function", f, state)
        if not isinstance(res, (tuple, list)) or len(res) != 2:
            got = None if isinstance(res, torch.Tensor) else _skeleton(tree_structure(res))
            raise ArgumentTypeError(_escape_pair_message(op, got, _code_of(f)))
        new_c, y = res
        new_leaves = _check_result(op, "body carry input and output", "carry", f, c_td_in, carry_flat[:n_c], new_c, revise)
        new_leaves = [t.contiguous() for t in new_leaves]
        y_leaves, y_td = tree_flatten(y)
        y_leaves = [_as_tensor(t) for t in y_leaves]
        y_dtypes = [t.dtype if isinstance(t, torch.Tensor) else None for t in y_leaves]
        if encode:
            new_leaves = [_to_floating(t) for t in new_leaves]
            y_leaves = [_to_floating(t) if isinstance(t, torch.Tensor) else t for t in y_leaves]
        ins = raw_ins + list(carry_flat) + list(x_flat)
        outs = _unalias(new_leaves + y_leaves, ins, clone_all=clone_all)
        if n_c == 0:
            outs = [raw_ins[0].clone()] + outs  # the placeholder carry
        k = max(n_c, 1)
        ys_out = outs[k:]
        if encode:  # the original dtype travels as the key of a marker dict (see _unmark)
            ys_out = [_mark(t, d) for t, d in zip(ys_out, y_dtypes)]
        # torch's scan needs at least one y: stack a dummy 0-d tensor when y has no leaves
        extra = [] if y_leaves else [torch.zeros((), device=raw_ins[0].device)]
        return list(outs[:k]), (_pack(y_td, ys_out), extra)

    if length == 0:
        return _scan_empty(f, init, xs, x_leaves, x_td)
    dev = (c_leaves + x_leaves)[0].device if (c_leaves or x_leaves) else torch.device("cpu")
    init_flat = c_leaves if n_c else [torch.zeros((), device=dev)]
    xs_flat = list(x_leaves) if x_leaves else [torch.zeros((length,), device=dev)]
    if encode:
        init_flat = [_to_floating(t) for t in init_flat]
    carry_flat, (ys, _) = _torch_scan()(body, init_flat, xs_flat, dim=0, reverse=reverse)
    carry_flat = list(carry_flat)[:n_c]
    if encode:
        carry_flat = [_from_floating(t, d) for t, d in zip(carry_flat, c_dtypes)]
    ys = _unpack(ys)
    if encode:
        ys = _unmark(ys)
    if for_inductor:
        carry_flat = [_contiguous_grad(t) for t in carry_flat]
        y_leaves, y_td = tree_flatten(ys)
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in y_leaves):
            ys = tree_unflatten(y_td, [_contiguous_grad(t) for t in y_leaves])
    return tree_unflatten(c_td, carry_flat), ys


def check_export_constants(op: str, f: Any) -> None:
    """Under non-strict `torch.export`, refuse a scan body that reads a real tensor (see
    `_refuse_real_constants`); elsewhere nothing."""
    if _is_exporting() and not _dynamo_outside():
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
        values += [(f"global `{n}`", fn.__globals__[n]) for n in sorted(_global_names(fn.__code__)) if n in fn.__globals__]
        for label, v in values:
            if isinstance(v, torch.Tensor) and not is_fake(v):
                found.append(f"{label} of `{fn.__name__}`{where}: {_dtype_text(v.dtype)}{list(v.shape)}")
            elif isinstance(v, (types.FunctionType, functools.partial)):
                visit(v, f" (called by `{fn.__name__}`)", depth - 1)

    visit(f, "", 4)
    if found:
        from .._errors import JitError

        raise JitError(
            format_message(
                f"{op}: under torch.export (non-strict), the body reads tensors that are neither inputs nor "
                f"parameters or buffers of the exported module, which torch {torch.__version__}'s scan cannot "
                "trace:",
                found,
                function=_fn_text(_code_of(f)),
                revise="Register such a tensor as a buffer of the module (`self.register_buffer(...)`) or pass it "
                "as an argument, or export with strict=True.",
            )
        )


def _global_names(code: Any) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names

# Integer and bool leaves cross torch's scan as float64 tensors holding int64 bits (see `scan`).
_BITS_KEY = "__tfun_bits__"  # + the dtype's name: the marker dict of such a y leaf


def _is_bits(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def _to_floating(t: torch.Tensor) -> torch.Tensor:
    """An integer or bool `t` as the bits of `t.to(int64)` viewed as float64 (exact); any
    other `t` itself."""
    return t.to(torch.int64).view(torch.float64) if _is_bits(t.dtype) else t


def _from_floating(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `_to_floating` for a leaf of dtype `dtype`."""
    return t.view(torch.int64).to(dtype) if _is_bits(dtype) else t


def _mark(t: Any, dtype: Any) -> Any:
    """A y leaf as a HOP output: an encoded one in a marker dict whose key names its dtype."""
    if dtype is None or not _is_bits(dtype):
        return t
    return {_BITS_KEY + str(dtype).replace("torch.", ""): t}


def _is_marked(x: Any) -> bool:
    return type(x) is dict and len(x) == 1 and next(iter(x)).startswith(_BITS_KEY)


def _unmark(tree: Any) -> Any:
    """Inverse of `_mark` over a tree of stacked ys."""
    parts, td = tree_flatten(tree, is_leaf=_is_marked, none_is_leaf=True)
    out = []
    for x in parts:
        if _is_marked(x):
            ((key, t),) = x.items()
            x = _from_floating(t, getattr(torch, key[len(_BITS_KEY) :]))
        out.append(x)
    return tree_unflatten(td, out)


def _make_contiguous(g: torch.Tensor) -> torch.Tensor:
    return g.contiguous()


def _contiguous_grad(t: Any) -> Any:
    """`t`, whose gradient is made dense (contiguous) before it reaches scan's backward."""
    if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled() and not _compat.scan_backward_dense():
        t = t.view_as(t)
        t.register_hook(_make_contiguous)
    return t


def _is_exporting() -> bool:
    return _compat.is_exporting()  # Dynamo 2.11 folds torch.compiler.is_exporting() to True


def _scan_empty(f: Any, init: Any, xs: Any, x_leaves: list[Any], x_td: Any) -> tuple[Any, Any]:
    """Zero steps: the final carry is `init`; `ys` have a leading axis of size 0."""
    x0 = tree_unflatten(x_td, [x.new_zeros(x.shape[1:]) for x in x_leaves])
    _, y = f(init, x0)
    y_leaves, y_td = tree_flatten(y)
    # (no builtin `map` in this module: `map` below is the lowering of tfun.lax.map)
    ys = [torch.empty((0, *t.shape), dtype=t.dtype, device=t.device) for t in (_as_tensor(y) for y in y_leaves)]
    return init, tree_unflatten(y_td, ys)


# ----------------------------------------------------------------------------------------
# map
# ----------------------------------------------------------------------------------------


def map(f: Callable[[Any], Any], xs: Any) -> Any:  # noqa: A001 - mirrors tfun.lax.map
    """`torch._higher_order_ops.map` over the leading axis of every leaf of `xs`."""
    _count_lowering()
    _escape_prepare_inductor()
    x_leaves, x_td = tree_flatten(xs)

    x_carrier = _carrier(x_td, x_leaves)
    if x_leaves and x_leaves[0].shape[0] == 0:
        # torch's map rejects zero rows: the output structure comes from one call on a zero row
        y = f(tree_unflatten(x_td, [x.new_zeros(x.shape[1:]) for x in x_leaves]))
        y_leaves, y_td = tree_flatten(y)
        ys = [torch.empty((0, *t.shape), dtype=t.dtype, device=t.device) for t in (_as_tensor(v) for v in y_leaves)]
        return tree_unflatten(y_td, ys)

    def body(x_flat: list[Any]) -> Any:
        state = _torch_state()
        y = f(tree_unflatten(tree_structure(x_carrier), list(x_flat)))
        _check_state("tfun.lax.map", "function", f, state)
        y_leaves, y_td = tree_flatten(y)
        y_leaves = _unalias([_as_tensor(t) for t in y_leaves], x_flat)
        return _pack(y_td, y_leaves)

    return _unpack(_torch_map()(body, list(x_leaves)))


# ----------------------------------------------------------------------------------------
# associative_scan
# ----------------------------------------------------------------------------------------

#: Use the fused "pointwise" mode of torch's associative_scan for CUDA inputs. The combine
#: function must then contain only pointwise ops; set to False to always use "generic".
POINTWISE_ON_CUDA = True


def associative_scan(fn: Callable[[Any, Any], Any], elems: Any, reverse: bool, axis: int) -> Any:
    """`torch._higher_order_ops.associative_scan` with tfun pytrees."""
    _count_lowering()
    _escape_prepare_inductor()
    op = "tfun.lax.associative_scan"
    leaves, td = tree_flatten(elems)
    n = len(leaves)
    cuda = all(x.device.type == "cuda" for x in leaves)
    mode = "pointwise" if (cuda and POINTWISE_ON_CUDA) else "generic"

    carrier = _carrier(td, leaves)
    if leaves and leaves[0].shape[axis] == 0:
        return elems  # nothing to combine (torch's associative_scan rejects length 0), as in eager
    if torch.is_grad_enabled() and not _is_exporting() and any(x.is_complex() for x in leaves):
        # Inductor (torch 2.13) computes wrong gradients through a complex associative_scan
        # (S4D/S5/LRU, length >= 4; the outputs are right): refuse rather than return them.
        # without sizes: under Dynamo a symbolic size (automatic dynamic shapes) cannot be told
        # from a concrete one, and cannot be passed to an escape hatch (see cond)
        msg = _escape_complex_scan_refusal(_describe(td, leaves, False), _code_of(fn))
        if msg is not None:
            raise JitError(msg)

    def combine(a: list[Any], b: list[Any]) -> Any:
        td_in = tree_structure(carrier)
        state = _torch_state()
        out = fn(tree_unflatten(td_in, list(a)), tree_unflatten(td_in, list(b)))
        _check_state(op, "combine function", fn, state)
        out_leaves, out_td = tree_flatten(out)
        if out_td != td_in or len(out_leaves) != n:
            _raise_mismatch(
                op,
                "combine function input and output",
                "elems",
                ("input", "output"),
                _describe(td_in, a),
                _describe(out_td, out_leaves),
                fn,
                "Revise `{name}` to return a pytree like its inputs, combining them elementwise.",
            )
        return _unalias([_as_tensor(t, r) for t, r in zip(out_leaves, a)], list(a) + list(b))

    out = _torch_associative_scan()(combine, list(leaves), dim=axis, reverse=reverse, combine_mode=mode)
    return tree_unflatten(td, list(out))


#: Backends under which gradients through a complex associative_scan are right (tested).
_COMPLEX_SCAN_GRAD_BACKENDS = ("eager", "aot_eager")


def _compiling_backend() -> str | None:
    """The name of the backend Dynamo is compiling for ("inductor", "aot_eager", ...), or
    None where it cannot be told (a custom backend, or torch internals that moved)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        fn = InstructionTranslator.current_tx().output.compiler_fn
    except Exception:  # noqa: BLE001 - not under Dynamo, or its internals changed: unknown
        return None
    name = getattr(fn, "compiler_name", None) or getattr(fn, "_compiler_name", None)
    return name if isinstance(name, str) else None


@_assume_constant
def _escape_complex_scan_refusal(desc: Any, code: Any) -> str | None:
    """None if the backend being compiled for differentiates a complex associative_scan
    correctly; else the message of the JitError that refuses it."""
    backend = _compiling_backend()
    if backend in _COMPLEX_SCAN_GRAD_BACKENDS:
        return None
    sk, leaf_descs = desc
    bullets = [
        f"elems{p}: a {_dtype_text(d[0])} tensor on {d[2]}"
        for p, d in zip(_leaf_paths(sk), leaf_descs)
        if len(d) == 3 and d[0].is_complex
    ]
    bullets.append(f"backend: {backend or 'not one of ' + ', '.join(_COMPLEX_SCAN_GRAD_BACKENDS)}")
    return format_message(
        "tfun.lax.associative_scan: complex elems must be compiled with a backend whose gradients are right, "
        "but Inductor on torch 2.13 computes wrong gradients through a complex associative_scan (its outputs "
        "are right), so this is refused:",
        bullets,
        function=_fn_text(code),
        revise='Compile with tfun.jit(..., backend="aot_eager") (exact), or run the compiled function under '
        "torch.no_grad() if no gradient is needed.",
    )


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
