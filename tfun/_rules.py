"""Trace-time rules shared by every tfun.lax op.

Three families of rules, as in the paper's section 2.1:

- **structure match**: two pytrees that must agree (cond branch outputs, loop carry in and
  out, associative_scan's combine output and input) have the same structure;
- **tensor match**: their corresponding leaves have the same dtype, shape and device;
- **no side effects**: a function given to an op may not mutate a Python object it did not
  create, rebind a global or nonlocal name, or write in place to a tensor it did not
  create.

Rules run when a function is first seen for an input signature (`Signature`); later calls
with the same code and signature skip them (`seen`). The cache is keyed on the function's
*code object*, so a closure re-created on every call (a body defined inside
`nn.Module.forward`) is as cheap as a cached one.
"""

from __future__ import annotations

import dis
import os
import sysconfig
import types
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import optree
import torch

from . import _funcinfo
from ._errors import (
    ArgumentTypeError,
    ArgumentValueError,
    SideEffectError,
    StructureMismatchError,
    TensorMismatchError,
    format_message,
)
from ._tree import NAMESPACE, PyTreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

_SCALAR_TYPES = (bool, int, float, complex)

# ----------------------------------------------------------------------------------------
# Describing leaves and nodes
# ----------------------------------------------------------------------------------------

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def tensor_type(t: torch.Tensor) -> str:
    """JAX-style type of a tensor: `float32[3,4]`."""
    return f"{dtype_name(t.dtype)}[{','.join(str(s) for s in t.shape)}]"


def describe_leaf(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tensor_type(x)} on {x.device}"
    if isinstance(x, bool):
        return "a Python bool"
    if isinstance(x, int):
        return "a Python int"
    if isinstance(x, float):
        return "a Python float"
    return f"a {type(x).__qualname__}"


def describe_node(spec: PyTreeSpec) -> str:
    """A short English description of a pytree node (the root of `spec`)."""
    if spec.is_leaf():
        return "a leaf"
    if spec.kind == optree.PyTreeKind.NONE:
        return "None"
    t: Any = spec.type
    n = spec.num_children
    kind = spec.kind
    if kind == optree.PyTreeKind.TUPLE:
        return f"a tuple of {n}"
    if kind == optree.PyTreeKind.LIST:
        return f"a list of {n}"
    if kind in (optree.PyTreeKind.DICT, optree.PyTreeKind.ORDEREDDICT, optree.PyTreeKind.DEFAULTDICT):
        return f"a {t.__name__} with keys {list(spec.entries())}"
    if kind == optree.PyTreeKind.NAMEDTUPLE:
        return f"a {t.__name__}({', '.join(t._fields)})"
    name = getattr(t, "__qualname__", str(t))
    return f"a {name} with children {list(spec.entries())}"


def _entry_str(spec: PyTreeSpec, entry: Any) -> str:
    kind = spec.kind
    if kind in (optree.PyTreeKind.TUPLE, optree.PyTreeKind.LIST, optree.PyTreeKind.DEQUE):
        return f"[{entry}]"
    if kind in (optree.PyTreeKind.DICT, optree.PyTreeKind.ORDEREDDICT, optree.PyTreeKind.DEFAULTDICT):
        return f"[{entry!r}]"
    if kind == optree.PyTreeKind.NAMEDTUPLE:
        return f".{getattr(spec.type, '_fields')[entry]}"
    if isinstance(entry, str):
        return f".{entry}"
    return f"[{entry!r}]"


def structure_differences(a: PyTreeSpec, b: PyTreeSpec, path: str = "") -> list[tuple[str, PyTreeSpec, PyTreeSpec]]:
    """Where two structures differ: `(path, subtree_a, subtree_b)`, outermost first."""
    if a == b:
        return []
    same_node = (
        not a.is_leaf()
        and not b.is_leaf()
        and a.type == b.type
        and a.num_children == b.num_children
        and list(a.entries()) == list(b.entries())
    )
    if not same_node:
        return [(path, a, b)]
    out: list[tuple[str, PyTreeSpec, PyTreeSpec]] = []
    for entry, ca, cb in zip(a.entries(), a.children(), b.children()):
        out.extend(structure_differences(ca, cb, path + _entry_str(a, entry)))
    if not out:  # same children but different node data (e.g. a static dataclass field)
        out.append((path, a, b))
    return out


# ----------------------------------------------------------------------------------------
# Structure and tensor match
# ----------------------------------------------------------------------------------------


def check_structure(
    op: str,
    what: str,
    expected: PyTreeSpec,
    actual: PyTreeSpec,
    *,
    root: str,
    names: tuple[str, str],
    fn: Callable[..., Any] | None,
    revise: str,
) -> None:
    """Raise `StructureMismatchError` if `actual` differs from `expected`.

    `what` completes the headline `"{op}: {what} must have the same pytree structure."`;
    `root` prefixes every key path (e.g. `"carry"`); `names` name the two sides.
    """
    if expected == actual:
        return
    bullets = []
    for path, a, b in structure_differences(expected, actual):
        bullets.append(f"{root}{path}: {names[0]} is {describe_node(a)}, {names[1]} is {describe_node(b)}")
    raise StructureMismatchError(
        format_message(
            f"{op}: {what} must have the same pytree structure, but they differ:",
            bullets,
            function=None if fn is None else _funcinfo.describe(fn),
            revise=revise,
        )
    )


def leaf_differences(a: Any, b: Any) -> list[str]:
    """What differs between two leaves: among 'dtype', 'shape', 'device', or 'kind'."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return ["kind"]
    diffs = []
    if a.dtype != b.dtype:
        diffs.append("dtype")
    if a.shape != b.shape:
        diffs.append("shape")
    if a.device != b.device:
        diffs.append("device")
    return diffs


def check_tensors(
    op: str,
    what: str,
    expected_leaves: Sequence[Any],
    actual_leaves: Sequence[Any],
    treedef: PyTreeSpec,
    *,
    root: str,
    names: tuple[str, str],
    fn: Callable[..., Any] | None,
    revise: str,
    check_shape: bool = True,
) -> None:
    """Raise `TensorMismatchError` if corresponding leaves differ in dtype, shape or device."""
    bullets = []
    paths = None
    for i, (a, b) in enumerate(zip(expected_leaves, actual_leaves)):
        diffs = leaf_differences(a, b)
        if not check_shape and "shape" in diffs:
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim():
                diffs.remove("shape")
        if diffs:
            if paths is None:
                paths = [keystr(p) for p in treedef.accessors()]
            what_differs = "kinds" if diffs == ["kind"] else " and ".join(d + "s" for d in diffs)
            bullets.append(
                f"{root}{paths[i]}: {names[0]} is {describe_leaf(a)}, {names[1]} is {describe_leaf(b)}"
                f" ({what_differs} differ)"
            )
    if bullets:
        raise TensorMismatchError(
            format_message(
                f"{op}: {what} must have the same dtype, shape and device, but they differ:",
                bullets,
                function=None if fn is None else _funcinfo.describe(fn),
                revise=revise,
            )
        )


# ----------------------------------------------------------------------------------------
# Argument normalization and checks
# ----------------------------------------------------------------------------------------


def as_tensor_leaves(op: str, arg: str, tree: Any) -> tuple[list[torch.Tensor], PyTreeSpec]:
    """Flatten `tree`; Python scalars become 0-d tensors; anything else non-tensor is an error."""
    leaves, treedef = tree_flatten(tree)
    for i, leaf in enumerate(leaves):
        if type(leaf) is torch.Tensor or isinstance(leaf, torch.Tensor):
            continue
        if isinstance(leaf, _SCALAR_TYPES):
            leaves[i] = torch.tensor(leaf)
            continue
        if type(leaf).__module__ == "numpy":
            leaves[i] = torch.as_tensor(leaf)
            continue
        path = keystr(treedef.accessors()[i])
        raise ArgumentTypeError(
            format_message(
                f"{op}: every leaf of {arg} must be a tensor or a Python scalar, but {arg}{path} is "
                f"{describe_leaf(leaf)}.",
                revise=f"Pass tensors (or bool/int/float) in {arg}; keep other values out of the pytree "
                "(close over them in the function instead).",
            )
        )
    return leaves, treedef


def as_tensor_tree(op: str, arg: str, tree: Any) -> Any:
    leaves, treedef = tree_flatten(tree)
    if all(isinstance(x, torch.Tensor) for x in leaves):
        return tree
    leaves, treedef = as_tensor_leaves(op, arg, tree)
    return tree_unflatten(treedef, leaves)


def check_callable(op: str, arg: str, fn: Any) -> None:
    if not callable(fn):
        raise ArgumentTypeError(f"{op}: {arg} must be callable, but got {describe_leaf(fn)}: {fn!r}.")


def check_scalar_predicate(op: str, what: str, pred: Any, fn: Callable[..., Any] | None = None) -> Any:
    """A boolean scalar: Python bool, or a 0-d bool tensor. Returns it unchanged."""
    if isinstance(pred, bool):
        return pred
    if isinstance(pred, torch.Tensor):
        if pred.dtype != torch.bool or pred.dim() != 0:
            raise ArgumentTypeError(
                format_message(
                    f"{op}: {what} must be a boolean scalar (a bool tensor of shape ()), but it is "
                    f"{describe_leaf(pred)}.",
                    function=None if fn is None else _funcinfo.describe(fn),
                    revise="Reduce it to one boolean, e.g. with `.all()`, `.any()` or a comparison of a "
                    "0-d tensor.",
                )
            )
        return pred
    raise ArgumentTypeError(
        format_message(
            f"{op}: {what} must be a boolean scalar (a bool tensor of shape ()), but it is "
            f"{describe_leaf(pred)}.",
            function=None if fn is None else _funcinfo.describe(fn),
            revise="Return a 0-d bool tensor (or a Python bool).",
        )
    )


def check_int(op: str, arg: str, value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
            value = int(value)
        else:
            raise ArgumentTypeError(f"{op}: {arg} must be a Python int, but got {describe_leaf(value)}.")
    if minimum is not None and value < minimum:
        raise ArgumentValueError(f"{op}: {arg} must be >= {minimum}, but got {value}.")
    return value


def canonical_axis(op: str, axis: Any, ndim: int, arg: str = "axis") -> int:
    axis = check_int(op, arg, axis)
    if not -ndim <= axis < ndim:
        raise ArgumentValueError(
            f"{op}: {arg}={axis} is out of range for tensors of rank {ndim} (valid: {-ndim} to {ndim - 1})."
        )
    return axis % ndim if ndim else 0


def leading_length(
    op: str, arg: str, leaves: Sequence[torch.Tensor], treedef: PyTreeSpec, length: int | None, axis: int = 0
) -> int:
    """Check that every leaf has the same size along `axis` (and equals `length` if given)."""
    sizes = []
    for i, leaf in enumerate(leaves):
        if leaf.dim() <= axis:
            path = keystr(treedef.accessors()[i])
            raise ArgumentValueError(
                format_message(
                    f"{op}: every leaf of {arg} needs an axis {axis} to scan over, but {arg}{path} is "
                    f"{describe_leaf(leaf)}.",
                    revise=f"Give every leaf of {arg} a leading axis of the scan's length.",
                )
            )
        sizes.append(leaf.shape[axis])
    # compared pairwise, not through a set: under tfun.jit a size may be symbolic, and
    # hashing it would specialize it (one compilation per sequence length)
    distinct = sizes[:1] + [s for s in sizes[1:] if s != sizes[0]]
    if len(distinct) > 1 or (length is not None and distinct and distinct[0] != length):
        paths = [keystr(p) for p in treedef.accessors()]
        bullets = [f"{arg}{p}: {describe_leaf(leaf)} (size {s})" for p, leaf, s in zip(paths, leaves, sizes)]
        if length is not None:
            bullets.append(f"length argument: {length}")
        raise ArgumentValueError(
            format_message(
                f"{op}: {arg} leaves and `length` must agree on the size of axis {axis}, but they do not:"
                if length is not None
                else f"{op}: {arg} leaves must agree on the size of axis {axis}, but they do not:",
                bullets,
                revise=f"Make every leaf of {arg} the same length along axis {axis}"
                + (" and equal to `length`." if length is not None else "."),
            )
        )
    if distinct:
        return distinct[0]
    if length is None:
        raise ArgumentValueError(f"{op}: {arg} has no leaves, so `length` must be given.")
    return length


# ----------------------------------------------------------------------------------------
# First-trace cache
# ----------------------------------------------------------------------------------------

_SEEN: dict[Hashable, Any] = {}
_SEEN_MAX = 4096


def leaf_signature(leaves: Sequence[Any]) -> tuple[Any, ...]:
    return tuple((x.dtype, x.shape, x.device) if isinstance(x, torch.Tensor) else type(x) for x in leaves)


def fn_key(fn: Any) -> Hashable:
    code = _funcinfo.fn_code(fn)
    return code if code is not None else id(fn)


def seen(key: Hashable) -> Any:
    """The value recorded for `key` by `remember`, or None."""
    return _SEEN.get(key)


def remember(key: Hashable, value: Any = True) -> None:
    if len(_SEEN) >= _SEEN_MAX:
        _SEEN.clear()
    _SEEN[key] = value


def clear_cache() -> None:
    """Forget every function seen so far (its rules run again on its next call)."""
    _SEEN.clear()
    _STATIC.clear()


# ----------------------------------------------------------------------------------------
# Side effects: static (bytecode) part
# ----------------------------------------------------------------------------------------

_STATIC: dict[Any, list[str]] = {}


def _static_violations(code: types.CodeType, outer_free: frozenset[str]) -> list[str]:
    found = []
    own_cells = set(code.co_cellvars)
    line = code.co_firstlineno
    for ins in dis.get_instructions(code):
        if ins.positions is not None and ins.positions.lineno is not None:
            line = ins.positions.lineno
        if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            verb = "rebinds" if ins.opname == "STORE_GLOBAL" else "deletes"
            found.append(f"{verb} global `{ins.argval}` (line {line})")
        elif ins.opname in ("STORE_DEREF", "DELETE_DEREF") and ins.argval in outer_free:
            verb = "rebinds" if ins.opname == "STORE_DEREF" else "deletes"
            found.append(f"{verb} nonlocal `{ins.argval}` (line {line})")
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            # A nested function's free variables that are not cells of this function
            # belong to a scope outside the user's function.
            nested_outer = frozenset(v for v in const.co_freevars if v not in own_cells) | (
                outer_free & frozenset(const.co_freevars)
            )
            found.extend(_static_violations(const, nested_outer))
    return found


def static_side_effects(fn: Any) -> list[str]:
    code = _funcinfo.fn_code(fn)
    if code is None:
        return []
    cached = _STATIC.get(code)
    if cached is None:
        cached = _static_violations(code, frozenset(code.co_freevars))
        _STATIC[code] = cached
    return cached


# ----------------------------------------------------------------------------------------
# Side effects: dynamic (snapshot) part
# ----------------------------------------------------------------------------------------

_MAX_OBJECTS = 3000
_MAX_DEPTH = 4
_SKIP_TYPES = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    torch.dtype,
    torch.device,
    torch.Size,
)


def _fingerprint(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        try:
            return ("tensor", obj._version)
        except Exception:  # functorch wrappers may not expose a version counter
            return None
    if isinstance(obj, list):
        return ("list", len(obj), tuple(map(id, obj)))
    if isinstance(obj, dict):
        return ("dict", len(obj), tuple((k, id(v)) for k, v in obj.items()))
    if isinstance(obj, (set, frozenset)):
        return ("set", len(obj), frozenset(map(id, obj)))
    if isinstance(obj, bytearray):
        return ("bytearray", bytes(obj))
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        return ("object", tuple((k, id(v)) for k, v in d.items()))
    return None


def _is_user_function(obj: Any) -> bool:
    if not isinstance(obj, types.FunctionType):
        return False
    filename = obj.__code__.co_filename
    return not (filename.startswith(_LIBRARY_PREFIXES) or "site-packages" in filename or filename.startswith("<frozen"))


_LIBRARY_PREFIXES = tuple(
    {p for p in (sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("purelib"), os.path.dirname(torch.__file__)) if p}
)


def _children(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, torch.Tensor):
        return []

    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (set, frozenset)):
        return []
    if isinstance(obj, torch.nn.Module):
        out: list[tuple[str, Any]] = []
        for name, p in obj._parameters.items():
            if p is not None:
                out.append((f".{name}", p))
        for name, b in obj._buffers.items():
            if b is not None:
                out.append((f".{name}", b))
        for name, m in obj._modules.items():
            if m is not None:
                out.append((f".{name}", m))
        for k, v in obj.__dict__.items():
            if not k.startswith("_") and not isinstance(v, _SKIP_TYPES):
                out.append((f".{k}", v))
        return out
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        return [(f".{k}", v) for k, v in d.items()]
    return []


def _kind(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return "tensor"
    return type(obj).__qualname__


def roots_of(fn: Any) -> list[tuple[str, Any]]:
    """The outer objects a function can reach: closure cells, referenced globals, defaults,
    bound `self`, partial arguments, callable objects and modules."""
    roots: list[tuple[str, Any]] = []
    for _ in range(16):
        target = None if isinstance(fn, types.FunctionType) else getattr(type(fn), "__tfun_target__", None)
        if target is not None:
            # a tfun wrapper whose own state is a cache (tfun.jit): what the wrapped function
            # reaches is what counts; filling the cache is not a side effect of the call
            fn = target.__get__(fn)
            continue
        if isinstance(fn, types.MethodType):
            roots.append(("self", fn.__self__))
            fn = fn.__func__
            continue
        if hasattr(fn, "func") and hasattr(fn, "args") and hasattr(fn, "keywords"):  # functools.partial
            roots.extend((f"partial argument {i}", a) for i, a in enumerate(fn.args))
            roots.extend((f"partial argument `{k}`", v) for k, v in fn.keywords.items())
            fn = fn.func
            continue
        if isinstance(fn, types.FunctionType):
            break
        if callable(fn) and not isinstance(fn, type) and hasattr(fn, "__dict__"):
            roots.append(("self", fn))
            call = getattr(type(fn), "forward", None) if isinstance(fn, torch.nn.Module) else None
            fn = call or getattr(type(fn), "__call__", None)
            if fn is None:
                return roots
            continue
        return roots
    if not isinstance(fn, types.FunctionType):
        return roots
    code = fn.__code__
    if fn.__closure__:
        for name, cell in zip(code.co_freevars, fn.__closure__):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            roots.append((f"nonlocal `{name}`", value))
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    g = fn.__globals__
    for name in sorted(names):
        if name in g:
            v = g[name]
            if not isinstance(v, _SKIP_TYPES):
                roots.append((f"global `{name}`", v))
    for i, d in enumerate(fn.__defaults__ or ()):
        roots.append((f"default argument {i}", d))
    for k, d in (fn.__kwdefaults__ or {}).items():
        roots.append((f"default argument `{k}`", d))
    return roots


class Snapshot:
    """Fingerprints of every object reachable from some roots, to diff after a call."""

    __slots__ = ("entries",)

    def __init__(self, roots: Sequence[tuple[str, Any]]):
        entries: list[tuple[str, Any, Any]] = []
        visited: set[int] = set()
        frontier = [(name, obj, 0) for name, obj in roots]
        while frontier and len(entries) < _MAX_OBJECTS:
            name, obj, depth = frontier.pop(0)
            if id(obj) in visited:
                continue
            if isinstance(obj, _SKIP_TYPES):
                if _is_user_function(obj) and depth < _MAX_DEPTH:
                    # A helper the function calls: what it reaches, the function reaches too.
                    visited.add(id(obj))
                    frontier.extend(
                        (f"{rname} (through `{getattr(obj, '__name__', '?')}`)", r, depth + 1)
                        for rname, r in roots_of(obj)
                    )
                continue
            visited.add(id(obj))
            fp = _fingerprint(obj)
            if fp is not None:
                entries.append((name, obj, fp))
            if depth < _MAX_DEPTH:
                frontier.extend((name + suffix, child, depth + 1) for suffix, child in _children(obj))
        self.entries = entries

    def changes(self) -> list[str]:
        out = []
        for name, obj, fp in self.entries:
            now = _fingerprint(obj)
            if now == fp:
                continue
            if fp[0] == "tensor":
                out.append(
                    f"it writes in place to {name}, a tensor it did not create (version {fp[1]} -> {now[1]})"
                    if now is not None
                    else f"it writes in place to {name}"
                )
            elif fp[0] in ("list", "dict", "set"):
                out.append(f"it mutates {name} (a {_kind(obj)}: {fp[1]} items before the call, {now[1]} after)")
            else:
                out.append(f"it mutates {name} (a {_kind(obj)}: its attributes changed)")
        return out


def _raise_side_effects(op: str, role: str, fn: Any, problems: list[str]) -> None:
    raise SideEffectError(
        format_message(
            f"{op}: the {role} must not have side effects, but it does:",
            problems,
            function=_funcinfo.describe(fn),
            revise=f"Revise `{_funcinfo.short_name(fn)}` so that it only returns values: carry state through "
            "its inputs and outputs, build new objects instead of mutating outer ones, and use "
            "out-of-place tensor ops (`x + y`, not `x.add_(y)`) on tensors it did not create.",
        )
    )


def check_static_side_effects(op: str, role: str, fn: Any) -> None:
    problems = static_side_effects(fn)
    if problems:
        _raise_side_effects(op, role, fn, problems)


def checked_call(op: str, role: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Call `fn(*args)` once under the side-effect rules (static and dynamic)."""
    check_static_side_effects(op, role, fn)
    roots = roots_of(fn)
    roots.extend((f"its argument {i}" if len(args) > 1 else "its argument", a) for i, a in enumerate(args))
    snap = Snapshot(roots)
    out = fn(*args)
    problems = snap.changes()
    if problems:
        _raise_side_effects(op, role, fn, problems)
    return out


# ----------------------------------------------------------------------------------------
# Abstract evaluation (for branches not taken, and zero-length loops)
# ----------------------------------------------------------------------------------------


class AbstractEvalUnavailable(Exception):
    """Raised when a function cannot be evaluated abstractly (data-dependent, transforms)."""


def abstract_eval(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[list[Any], PyTreeSpec]:
    """Run `fn(*args)` on fake tensors: output leaves (fake tensors) and structure.

    Like JAX's tracing to avtals: nothing is computed, shapes and dtypes propagate. Closed-
    over real tensors are allowed. Raises `AbstractEvalUnavailable` where fake tensors
    cannot follow the function (data-dependent control flow, `.item()`, functorch
    transforms active); tfun errors raised by nested ops propagate.
    """
    from ._errors import TfunError

    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as e:  # pragma: no cover
        raise AbstractEvalUnavailable(str(e)) from e
    try:
        if getattr(torch._C, "_functorch").peek_interpreter_stack() is not None:
            raise AbstractEvalUnavailable("functorch transform active")
    except AttributeError:
        pass
    leaves, treedef = tree_flatten(args)
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            fake_leaves = [
                mode.from_tensor(x.detach()) if isinstance(x, torch.Tensor) else x for x in leaves
            ]
            fake_args = tree_unflatten(treedef, fake_leaves)
            with torch.no_grad():
                out = fn(*fake_args)
            out_leaves, out_def = tree_flatten(out)
    except TfunError:
        raise
    except Exception as e:  # data-dependent ops, unsupported ops, ...
        raise AbstractEvalUnavailable(f"{type(e).__name__}: {e}") from e
    return out_leaves, out_def


def empty_like_fake(x: Any, leading: int | None = None) -> Any:
    """A real empty tensor with the metadata of a fake one (optionally with a leading axis)."""
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    shape = tuple(x.shape) if leading is None else (leading, *x.shape)
    return torch.empty(shape, dtype=x.dtype, device=x.device)


__all__ = [
    "NAMESPACE",
    "tensor_type",
    "describe_leaf",
    "describe_node",
    "structure_differences",
    "check_structure",
    "check_tensors",
    "as_tensor_leaves",
    "as_tensor_tree",
    "check_callable",
    "check_scalar_predicate",
    "check_int",
    "canonical_axis",
    "leading_length",
    "leaf_signature",
    "fn_key",
    "seen",
    "remember",
    "clear_cache",
    "static_side_effects",
    "check_static_side_effects",
    "checked_call",
    "Snapshot",
    "abstract_eval",
    "AbstractEvalUnavailable",
    "empty_like_fake",
    "tree_flatten_with_path",
]
