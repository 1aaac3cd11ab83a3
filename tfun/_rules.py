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

import collections
import contextlib
import dis
import functools
import logging
import os
import sys
import sysconfig
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import optree
import torch

from . import _compat, _context, _funcinfo
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


def tensor_type(t: torch.Tensor | LeafMeta) -> str:
    """JAX-style type of a tensor: `float32[3,4]`."""
    return f"{dtype_name(t.dtype)}[{','.join(str(s) for s in t.shape)}]"


class LeafMeta:
    """What the rules need to know of a tensor (dtype, shape, device), without the tensor.

    Caches keep these instead of tensors, so that a checked output (and the autograd graph
    behind it) is freed as soon as the user drops it.
    """

    __slots__ = ("dtype", "shape", "device")

    def __init__(self, dtype: torch.dtype, shape: torch.Size, device: torch.device):
        self.dtype = dtype
        self.shape = torch.Size(shape)
        self.device = device

    @classmethod
    def of(cls, x: Any) -> Any:
        """The metadata of a tensor; any other leaf unchanged."""
        if isinstance(x, torch.Tensor):
            return cls(x.dtype, x.shape, x.device)
        return x

    def dim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"LeafMeta({tensor_type(self)} on {self.device})"


def leaf_metas(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """`LeafMeta.of` each leaf: a tensor-free record of what the rules compare."""
    return tuple(LeafMeta.of(x) for x in leaves)


def _is_tensorlike(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, LeafMeta))


def tensor_text(dtype: torch.dtype, dims: Sequence[int | None], device: Any) -> str:
    """A tensor in messages: `float32[3,4] on cpu` (`?` for a size not known)."""
    return f"{dtype_name(dtype)}[{','.join('?' if s is None else str(s) for s in dims)}] on {device}"


def scalar_text(tp: type) -> str:
    """A non-tensor leaf of type `tp` in messages: `a Python int`, `a str`, `a numpy.int64`."""
    if tp.__module__ == "numpy":
        return f"a numpy.{tp.__name__}"
    for py, text in ((bool, "a Python bool"), (int, "a Python int"), (float, "a Python float")):
        if issubclass(tp, py):
            return text
    return f"a {tp.__qualname__}"


def describe_leaf(x: Any) -> str:
    if _is_tensorlike(x):
        return tensor_text(x.dtype, x.shape, x.device)
    if _is_ndarray(x):
        return f"a numpy array of dtype {x.dtype} and shape {tuple(x.shape)}"
    return scalar_text(type(x))


def is_numpy_scalar(x: Any) -> bool:
    """A numpy scalar or 0-d numpy array (a traced one too: Dynamo keeps its `ndim`)."""
    return type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 0


def from_numpy(x: Any) -> Any:
    """A numpy scalar or 0-d array where an op takes a Python scalar or a 0-d tensor (a `cond`
    predicate, a `switch` index, a loop bound), as JAX accepts it. Eagerly it becomes the
    Python scalar it holds, and takes that path. Under `tfun.jit` Dynamo traces every numpy
    value as an array over a tensor (an argument, a closure, a global alike), so it becomes
    that tensor, as `jax.jit` traces a numpy argument. Anything else is returned unchanged."""
    if not is_numpy_scalar(x):
        return x
    if not _context.is_tracing():
        return x.item()
    return torch.as_tensor(x)


def static_from_numpy(op: str, arg: str, x: Any) -> Any:
    """`from_numpy` for an argument that must be known while tracing (a `length`, an `axis`,
    a `batch_size`, `unroll`): eagerly the Python scalar a numpy one holds; under tracing a
    tfun error, since Dynamo has made it a traced value (JAX: a concretization error)."""
    if not is_numpy_scalar(x):
        return x
    if not _context.is_tracing():
        return x.item()
    raise ArgumentTypeError(
        format_message(
            f"{op}: {arg} must be known while tracing, but it is a numpy value, which tfun.jit (Dynamo) traces "
            "as an array.",
            revise=f"Pass {arg} as a Python int (`int(n)`), or mark the argument it comes from static "
            "(`tfun.jit(f, static_argnums=...)`: a static numpy scalar reaches `f` as the Python scalar it holds).",
        )
    )


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
# The one formatter of mismatch messages (eager checks and tfun.jit's lowerings)
# ----------------------------------------------------------------------------------------


def structure_message(op: str, what: str, bullets: Sequence[str], function: str | None, revise: str) -> str:
    return format_message(
        f"{op}: {what} must have the same pytree structure, but they differ:", bullets, function=function, revise=revise
    )


def tensor_message(op: str, what: str, bullets: Sequence[str], function: str | None, revise: str) -> str:
    return format_message(
        f"{op}: {what} must have the same dtype, shape and device, but they differ:",
        bullets,
        function=function,
        revise=revise,
    )


def structure_bullet(root: str, path: str, names: tuple[str, str], a_text: str, b_text: str) -> str:
    return f"{root}{path}: {names[0]} is {a_text}, {names[1]} is {b_text}"


def tensor_bullet(root: str, path: str, names: tuple[str, str], a_text: str, b_text: str, diffs: Sequence[str]) -> str:
    """`diffs`: what differs, among 'dtype', 'shape', 'device', or ['kind']."""
    what_differs = "kinds" if list(diffs) == ["kind"] else " and ".join(d + "s" for d in diffs)
    return f"{root}{path}: {names[0]} is {a_text}, {names[1]} is {b_text} ({what_differs} differ)"


# Descriptions: what traced code (a HOP body under Dynamo) can hand to plain Python as
# constants instead of treedefs and tensors (`tfun.lax._hop.describe`): a pytree as a
# skeleton, None for a leaf, else `(type, entries, children)`; a leaf as
# `(dtype, sizes, device)` (a size None where unknown) or `(type,)`.


def skeleton_node_text(sk: Any) -> str:
    """`describe_node` for a skeleton."""
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


def _skeleton_entry_text(sk: Any, entry: Any) -> str:
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


def _skeleton_differences(a: Any, b: Any, path: str) -> list[tuple[str, Any, Any]]:
    """`structure_differences` for skeletons."""
    if a == b:
        return []
    if a is None or b is None or a[0] is not b[0] or a[1] != b[1]:
        return [(path, a, b)]
    out: list[tuple[str, Any, Any]] = []
    for entry, ca, cb in zip(a[1], a[2], b[2]):
        out.extend(_skeleton_differences(ca, cb, path + _skeleton_entry_text(a, entry)))
    return out or [(path, a, b)]


def skeleton_leaf_paths(sk: Any, path: str = "") -> list[str]:
    """The key path of every leaf of a skeleton, in order (as `keystr` writes them)."""
    if sk is None:
        return [path]
    out: list[str] = []
    for entry, child in zip(sk[1], sk[2]):
        out.extend(skeleton_leaf_paths(child, path + _skeleton_entry_text(sk, entry)))
    return out


def leaf_desc_text(d: Any) -> str:
    """`describe_leaf` for a leaf description."""
    if len(d) == 1:
        return scalar_text(d[0])
    return tensor_text(*d)


def _leaf_descs_agree(x: Any, y: Any) -> bool:
    """Leaf descriptions `x` and `y` agree: equal, where a None size (one not known at trace
    time) agrees with any size."""
    if x == y:
        return True
    if len(x) != 3 or len(y) != 3 or x[0] != y[0] or x[2] != y[2] or len(x[1]) != len(y[1]):
        return False
    return all(a is None or b is None or a == b for a, b in zip(x[1], y[1]))


def descriptions_agree(a: Any, b: Any) -> bool:
    """Descriptions `(skeleton, leaf descriptions)` agree: the same skeleton, and leaves that
    agree (`_leaf_descs_agree`)."""
    (ska, la), (skb, lb) = a, b
    return ska == skb and len(la) == len(lb) and all(_leaf_descs_agree(x, y) for x, y in zip(la, lb))


def description_mismatch(
    op: str, what: str, root: str, names: tuple[str, str], a: Any, b: Any, function: str | None, revise: str
) -> tuple[bool, str]:
    """`(is_structural, message)` for two differing descriptions `(skeleton, leaf
    descriptions)`: the message `check_structure` / `check_tensors` give eagerly."""
    (ska, la), (skb, lb) = a, b
    if ska != skb:
        bullets = [
            structure_bullet(root, p, names, skeleton_node_text(x), skeleton_node_text(y))
            for p, x, y in _skeleton_differences(ska, skb, "")
        ]
        return True, structure_message(op, what, bullets, function, revise)
    bullets = []
    for p, x, y in zip(skeleton_leaf_paths(ska), la, lb):
        if _leaf_descs_agree(x, y):
            continue
        if len(x) == 1 or len(y) == 1:
            diffs = ["kind"]
        else:
            diffs = [n for n, u, v in zip(("dtype", "shape", "device"), x, y) if u != v]
            if "shape" in diffs and _leaf_descs_agree((None, x[1], None), (None, y[1], None)):
                diffs.remove("shape")  # only sizes not known differ
        bullets.append(tensor_bullet(root, p, names, leaf_desc_text(x), leaf_desc_text(y), diffs))
    return False, tensor_message(op, what, bullets, function, revise)


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
    bullets = [
        structure_bullet(root, path, names, describe_node(a), describe_node(b))
        for path, a, b in structure_differences(expected, actual)
    ]
    raise StructureMismatchError(
        structure_message(op, what, bullets, None if fn is None else _funcinfo.describe(fn), revise)
    )


def leaf_differences(a: Any, b: Any) -> list[str]:
    """What differs between two leaves: among 'dtype', 'shape', 'device', or 'kind'."""
    if not _is_tensorlike(a) or not _is_tensorlike(b):
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
            if _is_tensorlike(a) and _is_tensorlike(b) and a.dim() == b.dim():
                diffs.remove("shape")
        if diffs:
            if paths is None:
                paths = [keystr(p) for p in treedef.accessors()]
            bullets.append(tensor_bullet(root, paths[i], names, describe_leaf(a), describe_leaf(b), diffs))
    if bullets:
        raise TensorMismatchError(
            tensor_message(op, what, bullets, None if fn is None else _funcinfo.describe(fn), revise)
        )


# ----------------------------------------------------------------------------------------
# Argument normalization and checks
# ----------------------------------------------------------------------------------------


def as_tensor_leaves(
    op: str, arg: str, tree: Any, weak: dict[int, Any] | None = None
) -> tuple[list[torch.Tensor], PyTreeSpec]:
    """Flatten `tree`; Python scalars become 0-d tensors; anything else non-tensor is an error.
    With `weak`, the Python scalars (weakly typed values, whose dtype a loop may take from
    the body's output, as JAX promotes a weak `init`) are recorded there by flat index."""
    leaves, treedef = tree_flatten(tree)
    for i, leaf in enumerate(leaves):
        if type(leaf) is torch.Tensor or isinstance(leaf, torch.Tensor):
            continue
        if isinstance(leaf, _SCALAR_TYPES):
            if weak is not None and _is_weak(leaf):
                weak[i] = leaf
            leaves[i] = torch.tensor(leaf)
            continue
        if type(leaf).__module__ == "numpy":
            leaves[i] = torch.as_tensor(leaf)
            continue
        raise ArgumentTypeError(non_tensor_leaf_message(op, arg, keystr(treedef.accessors()[i]), describe_leaf(leaf)))
    return leaves, treedef


def non_tensor_leaf_message(op: str, arg: str, path: str, leaf_text: str, function: str | None = None) -> str:
    """The message for a leaf of `arg` that is neither a tensor nor a Python scalar (an
    argument, or what a user function returned: then `function` names it)."""
    revise = (
        f"Return tensors (or bool/int/float) in {arg}; keep other values out of it."
        if function is not None
        else f"Pass tensors (or bool/int/float) in {arg}; keep other values out of the pytree "
        "(close over them in the function instead)."
    )
    return format_message(
        f"{op}: every leaf of {arg} must be a tensor or a Python scalar, but {arg}{path} is {leaf_text}.",
        function=function,
        revise=revise,
    )


def _is_weak(x: Any) -> bool:
    """A Python scalar: weakly typed, as in JAX (numpy scalars are not: they have a dtype)."""
    return isinstance(x, _SCALAR_TYPES) and type(x).__module__ != "numpy"


def scalar_dtype(x: Any) -> torch.dtype:
    """The dtype a Python scalar becomes (`torch.tensor(x).dtype`), without allocating."""
    if isinstance(x, bool):
        return torch.bool
    if isinstance(x, int):
        return torch.int64
    if isinstance(x, float):
        return torch.get_default_dtype()
    return torch.complex128 if torch.get_default_dtype() == torch.float64 else torch.complex64


def weak_output_dtype_ok(x: Any, ref: Any) -> bool:
    """Whether a Python scalar `x` may stand for the 0-d tensor `ref` (JAX: a weakly typed
    output matches a carry of the dtype the scalar has by default, and shape ())."""
    return _is_weak(x) and _is_tensorlike(ref) and ref.dim() == 0 and scalar_dtype(x) == ref.dtype


def normalize_weak_outputs(expected_leaves: Sequence[Any], out: Any) -> Any:
    """`out` with every Python scalar leaf that may stand for its expected 0-d tensor made
    that tensor (`weak_output_dtype_ok`); `out` itself when there is none."""
    leaves, treedef = tree_flatten(out)
    if len(leaves) != len(expected_leaves) or not any(_is_weak(x) for x in leaves):
        return out
    changed = False
    for i, (x, ref) in enumerate(zip(leaves, expected_leaves)):
        if weak_output_dtype_ok(x, ref):
            leaves[i] = torch.tensor(x, dtype=ref.dtype, device=ref.device)
            changed = True
    return tree_unflatten(treedef, leaves) if changed else out


def dtype_category(dtype: torch.dtype) -> int:
    """Type promotion's order of kinds: bool < integer < floating < complex. A Python
    scalar of a kind no higher than a tensor's takes the tensor's dtype (`torch.result_type`,
    written out so that Dynamo can trace it)."""
    if dtype == torch.bool:
        return 0
    if dtype.is_complex:
        return 3
    if dtype.is_floating_point:
        return 2
    return 1


def promote_weak_init(expected_leaves: Sequence[Any], weak: dict[int, Any] | None, out: Any) -> list[Any]:
    """The expected carry leaves, with each leaf that came from a Python scalar in `init`
    taking the dtype of the body's output where JAX's weak-type promotion allows it: the
    output is 0-d on the same device and `result_type(scalar, output)` is its dtype."""
    expected = list(expected_leaves)
    if not weak:
        return expected
    leaves = tree_flatten(out)[0]
    if len(leaves) != len(expected):
        return expected
    for i, v in weak.items():
        o, ref = leaves[i], expected[i]
        if (
            isinstance(o, torch.Tensor)
            and _is_tensorlike(ref)
            and o.dim() == 0
            and o.dtype != ref.dtype
            and o.device == ref.device
            and dtype_category(scalar_dtype(v)) <= dtype_category(o.dtype)  # result_type(v, o) is o.dtype
        ):
            expected[i] = LeafMeta(o.dtype, o.shape, o.device)
    return expected


def as_tensor_tree(op: str, arg: str, tree: Any) -> Any:
    leaves, treedef = tree_flatten(tree)
    if all(isinstance(x, torch.Tensor) for x in leaves):
        return tree
    leaves, treedef = as_tensor_leaves(op, arg, tree)
    return tree_unflatten(treedef, leaves)


def check_callable(op: str, arg: str, fn: Any) -> None:
    if not callable(fn):
        raise ArgumentTypeError(f"{op}: {arg} must be callable, but got {describe_leaf(fn)}: {fn!r}.")


def check_concrete(op: str, what: str, value: Any, fn: Callable[..., Any] | None = None) -> None:
    """A value an eager op must read (a predicate, an index) may not be on the meta device,
    which has shapes and dtypes but no values (`.item()` would fail inside torch)."""
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        raise ArgumentTypeError(
            format_message(
                f"{op}: {what} must have a value to choose what runs, but it is {describe_leaf(value)}: "
                "a meta tensor has a dtype and shape but no value.",
                function=None if fn is None else _funcinfo.describe(fn),
                revise=f"Compute {what} on a device with data (cpu, cuda), or pass a Python scalar; to trace "
                "shapes only, run the whole program under `tfun.jit` or `torch.export`, where both branches "
                "are traced.",
            )
        )


def raise_if_unreadable(
    op: str, what: str, value: Any, error: BaseException, fn: Callable[..., Any] | None = None
) -> None:
    """Where reading `value` (a predicate, an index, a bound) raised `error` because `make_fx`
    traces it (`torch.func.linearize`; torch's "trying to get value out of a tracing tensor"),
    a tfun error that says so; otherwise nothing (the caller re-raises `error`)."""
    if not (
        isinstance(error, RuntimeError)
        and isinstance(value, torch.Tensor)
        and _context.make_fx_tracing()
        and "_local_scalar_dense" in str(error)
    ):
        return
    raise ArgumentValueError(
        format_message(
            f"{op}: {what} is {describe_leaf(value)} whose value is unknown here: `make_fx` is tracing "
            f"(as `torch.func.linearize` does), which records ops without values, and {op} reads {what} "
            "to choose what runs.",
            function=None if fn is None else _funcinfo.describe(fn),
            revise="For a linearization, use `tfun.linearize(f, *primals)` (it evaluates f on values, "
            f"as `tfun.jvp` does); to trace the {op.rsplit('.', 1)[-1]} itself into a graph, use `tfun.jit` "
            "or `torch.export.export`.",
        )
    ) from error


def check_scalar_predicate(op: str, what: str, pred: Any, fn: Callable[..., Any] | None = None) -> Any:
    """A boolean scalar: Python bool, or a 0-d bool tensor (a numpy bool as the Python bool
    it holds). Returns it."""
    pred = from_numpy(pred)
    if isinstance(pred, bool):
        return pred
    check_concrete(op, what, pred, fn)
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
    given = value
    value = static_from_numpy(op, arg, value)
    if isinstance(value, bool) or not isinstance(value, int):
        if (
            isinstance(value, torch.Tensor)
            and value.dim() == 0
            and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        ):
            value = int(value)
        else:
            raise ArgumentTypeError(f"{op}: {arg} must be a Python int, but got {describe_leaf(given)}.")
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
    return tuple((x.dtype, x.shape, x.device) if _is_tensorlike(x) else type(x) for x in leaves)


class _Unkeyed:
    """The key of a callable the cache cannot hold weakly: equal to nothing else, so the
    rules run on every call (never skipped for a different function at a reused id)."""

    __slots__ = ()


def fn_key(fn: Any) -> Hashable:
    """The cache key of a function: a weak reference to its code object (or to the callable
    itself when it has none). Weak, so that the cache keeps no function or code alive; a dead
    reference equals only itself, so a new function can never inherit an old one's entry."""
    code = _funcinfo.fn_code(fn)
    target = code if code is not None else fn
    try:
        return weakref.ref(target)
    except TypeError:
        return _Unkeyed()


def seen(key: Hashable) -> Any:
    """The value recorded for `key` by `remember`, or None."""
    return _SEEN.get(key)


def remember(key: Hashable, value: Any = True) -> None:
    """Record `key` (bounded: the oldest entries go first). Values must hold no tensors:
    keep `LeafMeta`s, structures and signatures, so that nothing the user drops stays alive."""
    while len(_SEEN) >= _SEEN_MAX:
        del _SEEN[next(iter(_SEEN))]
    _SEEN[key] = value


class FirstCall:
    """What the rules have checked for one call signature of an op: the one way the ops use
    the first-call cache (`first_call` makes one; `seen` and `remember` are its storage).

    An op runs its rules while `first` is true and then `record`s that they passed (with
    a value where later calls need one: cond keeps the branch taken and its output
    metadata); later calls with the same key skip them. `part(name)` is the record of a
    named part of the rules ("fake": checked on fake tensors only; "weak": the body
    returns Python scalars for 0-d carries).
    """

    __slots__ = ("key",)

    def __init__(self, key: Hashable) -> None:
        self.key = key

    @property
    def recorded(self) -> Any:
        """The value `record` stored, or None where the rules have not run."""
        return _SEEN.get(self.key)

    @property
    def first(self) -> bool:
        """Whether the rules have yet to run for this signature."""
        return self.recorded is None

    def record(self, value: Any = True) -> None:
        """The rules passed (`value`, not None, holds no tensors: see `remember`). Recording
        again what is recorded changes nothing."""
        if _SEEN.get(self.key) is not value:
            remember(self.key, value)

    def part(self, name: str) -> FirstCall:
        return FirstCall((self.key, name))

    def call(
        self, op: str, role: str, fn: Callable[..., Any], args: tuple[Any, ...], call: Callable[[], Any] | None = None
    ) -> Any:
        """`fn(*args)` (or `call()`), under the side-effect rules (`checked_call`) while
        `first`; it records nothing (the op's other rules may still fail)."""
        if self.first:
            return checked_call(op, role, fn, args, call=call)
        return fn(*args) if call is None else call()


def first_call(op: str, fns: Any, *signature: Hashable) -> FirstCall:
    """The first-call record of `op` called with the function `fns` (or a tuple of
    functions: cond's and switch's branches) on inputs of `signature` (structures, leaf
    signatures, static arguments). Functions are keyed by their code (`fn_key`)."""
    fkey = tuple(fn_key(f) for f in fns) if isinstance(fns, tuple) else fn_key(fns)
    return FirstCall((op, fkey, *signature))


def clear_cache() -> None:
    """Forget every function seen so far (its rules run again on its next call)."""
    _SEEN.clear()
    _STATIC.clear()


# ----------------------------------------------------------------------------------------
# Side effects: static (bytecode) part
# ----------------------------------------------------------------------------------------

_STATIC: weakref.WeakKeyDictionary[types.CodeType, list[str]] = weakref.WeakKeyDictionary()


_LOAD_OUTER = ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_NAME", "LOAD_CLASSDEREF")


def _outer_base(ins: list[Any], i: int, outer_free: frozenset[str], args: frozenset[str]) -> str | None:
    """The outer object `ins[i]` (a `LOAD_ATTR` chain ending at `ins[i]`) starts from, as
    `global `name`.attr`, or None when it starts from a local the function made itself."""
    attrs: list[str] = []
    j = i
    while j >= 0 and ins[j].opname in ("LOAD_ATTR", "LOAD_METHOD"):
        attrs.append(str(ins[j].argval))
        j -= 1
    if j < 0:
        return None
    base = ins[j]
    name = str(base.argval)
    if base.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
        kind = "global"
    elif base.opname in ("LOAD_DEREF", "LOAD_CLASSDEREF") and name in outer_free:
        kind = "nonlocal"
    elif base.opname.startswith("LOAD_FAST") and name in args:
        kind = "argument"
    else:
        return None
    return f"{kind} `{name}`" + "".join(f".{a}" for a in reversed(attrs))


def _static_violations(code: types.CodeType, outer_free: frozenset[str], top: bool = True) -> list[str]:
    found = []
    own_cells = set(code.co_cellvars)
    line = code.co_firstlineno
    ins = list(dis.get_instructions(code))
    args = frozenset(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]) if top else frozenset()
    for k, ins_k in enumerate(ins):
        if ins_k.positions is not None and ins_k.positions.lineno is not None:
            line = ins_k.positions.lineno
        if ins_k.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            verb = "rebinds" if ins_k.opname == "STORE_GLOBAL" else "deletes"
            found.append(f"{verb} global `{ins_k.argval}` (line {line})")
        elif ins_k.opname in ("STORE_DEREF", "DELETE_DEREF") and ins_k.argval in outer_free:
            verb = "rebinds" if ins_k.opname == "STORE_DEREF" else "deletes"
            found.append(f"{verb} nonlocal `{ins_k.argval}` (line {line})")
        elif ins_k.opname in ("STORE_ATTR", "DELETE_ATTR") and k > 0:
            # `obj.attr = v` on an object the function did not create: a global or nonlocal
            # (a module, an object with __slots__, an nn.Module), seen without running it
            base = _outer_base(ins, k - 1, outer_free, frozenset())
            if base is not None:
                verb = "sets" if ins_k.opname == "STORE_ATTR" else "deletes"
                found.append(f"{verb} attribute `{ins_k.argval}` of {base} (line {line})")
        elif (
            ins_k.opname in ("LOAD_ATTR", "LOAD_METHOD")
            and k > 0
            and ins[k - 1].opname == "LOAD_ATTR"
            and ins[k - 1].argval == "data"
            and isinstance(ins_k.argval, str)
            and ins_k.argval.endswith("_")
            and not ins_k.argval.startswith("_")
        ):
            # `p.data.mul_(...)`: `.data` has a version counter of its own, so the write is
            # invisible to the snapshot; it is found here
            base = _outer_base(ins, k - 2, outer_free, args)
            if base is not None:
                found.append(
                    f"writes in place to {base}, a tensor it did not create, through `.data` "
                    f"(`.data.{ins_k.argval}`, line {line})"
                )
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            # A nested function's free variables that are not cells of this function
            # belong to a scope outside the user's function.
            nested_outer = frozenset(v for v in const.co_freevars if v not in own_cells) | (
                outer_free & frozenset(const.co_freevars)
            )
            found.extend(_static_violations(const, nested_outer, top=False))
    return found


def static_code_side_effects(code: types.CodeType) -> list[str]:
    """The side effects found in `code` itself (cached per code object): what
    `static_side_effects` reports without following helpers. Needs no function object, so
    `tfun.jit`'s lowering runs it at trace time, as eager calls do."""
    cached = _STATIC.get(code)
    if cached is None:
        cached = _static_violations(code, frozenset(code.co_freevars))
        _STATIC[code] = cached
    return list(cached)


def global_names(code: types.CodeType) -> set[str]:
    """The global and attribute names `code` and the code objects nested in it use."""
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names


def _helper_violations(fn: types.FunctionType, depth: int, seen_codes: set[int]) -> list[str]:
    """What the user functions `fn` names as globals or closes over (helpers it calls) do
    that `fn` may not: rebinding a global or nonlocal, setting an outer attribute."""
    out: list[str] = []
    if depth >= _MAX_DEPTH:
        return out
    code = fn.__code__
    names = global_names(code)
    helpers = [fn.__globals__.get(n) for n in sorted(names)]
    for cell in fn.__closure__ or ():
        try:
            helpers.append(cell.cell_contents)
        except ValueError:
            continue
    for h in helpers:
        if not _is_user_function(h) or id(h.__code__) in seen_codes:
            continue
        seen_codes.add(id(h.__code__))
        where = _funcinfo.describe_code(h.__code__, h.__name__)
        for problem in static_code_side_effects(h.__code__):
            out.append(f"calls `{where}`, which {problem}")
        out.extend(_helper_violations(h, depth + 1, seen_codes))
    return out


def static_side_effects(fn: Any) -> list[str]:
    code = _funcinfo.fn_code(fn)
    if code is None:
        return []
    found = static_code_side_effects(code)
    base = _funcinfo.unwrap_callable(fn)
    if isinstance(base, types.FunctionType):
        found.extend(_helper_violations(base, 0, {id(code)}))
    return found


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


#: Objects whose state changes on a harmless first use (logging's lazily created handlers
#: and level caches): neither fingerprinted nor followed.
_OPAQUE_TYPES: tuple[type, ...] = (logging.Logger, logging.Handler, logging.Manager, logging.PlaceHolder, logging.Filter)

#: numpy arrays up to this size are fingerprinted by their bytes (they have no version
#: counter); a write into a larger one is not seen.
_MAX_ARRAY_BYTES = 1 << 20


def _slot_names(tp: type) -> list[str]:
    names: list[str] = []
    for klass in tp.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        names.extend(n for n in slots if n not in ("__dict__", "__weakref__") and n not in names)
    return names


_MISSING = object()


def _slot_items(obj: Any) -> tuple[tuple[str, Any], ...]:
    return tuple((n, getattr(obj, n, _MISSING)) for n in _slot_names(type(obj)))


def _is_ndarray(obj: Any) -> bool:
    return type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray"


def _fingerprint(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        try:
            return ("tensor", obj._version)
        except Exception:  # functorch wrappers may not expose a version counter
            return None
    if isinstance(obj, (list, collections.deque)):
        return ("list", len(obj), tuple(map(id, obj)))
    if isinstance(obj, dict):
        return ("dict", len(obj), tuple((k, id(v)) for k, v in obj.items()))
    if isinstance(obj, (set, frozenset)):
        return ("set", len(obj), frozenset(map(id, obj)))
    if isinstance(obj, bytearray):
        return ("bytearray", bytes(obj))
    if _is_ndarray(obj):
        if obj.nbytes > _MAX_ARRAY_BYTES:
            return None
        return ("ndarray", obj.shape, obj.dtype.str, obj.tobytes())
    items: tuple[tuple[str, int], ...] = ()
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        items = tuple((k, id(v)) for k, v in d.items())
    if isinstance(obj, torch.nn.Module):
        # rebinding a parameter, buffer or submodule (`self.buf = ...`, `register_buffer`)
        # changes these dicts, not `__dict__`
        for kind in ("_parameters", "_buffers", "_modules"):
            items += tuple((f"{kind}.{k}", id(v)) for k, v in getattr(obj, kind, {}).items())
    slots = _slot_items(obj) if not isinstance(obj, torch.Tensor) and hasattr(type(obj), "__slots__") else ()
    if slots:
        items += tuple((k, id(v)) for k, v in slots)
    if not isinstance(d, dict) and not slots:
        return None
    return ("object", items)


def _only_cached_properties(obj: Any, before: tuple[tuple[str, int], ...], after: tuple[tuple[str, int], ...]) -> bool:
    """Whether `after` differs from `before` only by values `functools.cached_property`
    computed on first read (a read, not a side effect)."""
    old = dict(before)
    new = dict(after)
    if any(new.get(k, _MISSING) != v for k, v in old.items()):
        return False
    added = set(new) - set(old)
    return bool(added) and all(isinstance(getattr(type(obj), k, None), functools.cached_property) for k in added)


def _torch_state() -> tuple[tuple[str, Any], ...]:
    """Torch's global settings a body may not leave changed (`torch.set_default_dtype`,
    `torch.set_grad_enabled`, ... called outside a `with`)."""
    return (
        ("torch.set_default_dtype", torch.get_default_dtype()),
        ("torch.set_grad_enabled", torch.is_grad_enabled()),
        ("torch.use_deterministic_algorithms", torch.are_deterministic_algorithms_enabled()),
        ("torch.set_num_threads", torch.get_num_threads()),
    )


_SETTERS: dict[str, Callable[[Any], Any]] = {
    "torch.set_default_dtype": torch.set_default_dtype,
    "torch.set_grad_enabled": torch.set_grad_enabled,
    "torch.use_deterministic_algorithms": torch.use_deterministic_algorithms,
    "torch.set_num_threads": torch.set_num_threads,
}


def _restore_torch_state(state: tuple[tuple[str, Any], ...]) -> None:
    """Put back the settings that differ from `state` (and only those)."""
    for (name, before), (_, now) in zip(state, _torch_state()):
        if before != now:
            _SETTERS[name](before)


def _state_text(v: Any) -> str:
    return dtype_name(v) if isinstance(v, torch.dtype) else repr(v)


def torch_state_problems(before: Sequence[tuple[str, Any]], after: Sequence[tuple[str, Any]]) -> list[str]:
    """One bullet per torch setting that differs between `before` and `after`."""
    return [
        f"it leaves torch's global state changed: `{name}` was {_state_text(a)} before the call and is "
        f"{_state_text(b)} after (use it as a context manager, `with torch.set_grad_enabled(False):`, or "
        "set it outside the function)"
        for (name, a), (_, b) in zip(before, after)
        if a != b
    ]


def torch_state_changes(before: tuple[tuple[str, Any], ...]) -> list[str]:
    """What torch's global settings changed since `before` (which is then restored)."""
    out = torch_state_problems(before, _torch_state())
    if out:
        _restore_torch_state(before)
    return out


def _is_user_function(obj: Any) -> bool:
    if not isinstance(obj, types.FunctionType):
        return False
    filename = obj.__code__.co_filename
    return not (filename.startswith(_LIBRARY_PREFIXES) or "site-packages" in filename or filename.startswith("<frozen"))


#: Code under these is a library's, not the user's: Python's, the installed packages', torch's
#: and tfun's own (an editable install is outside site-packages; its module-level caches change
#: on every call and are not the user's state).
_LIBRARY_PREFIXES = tuple(
    {
        p
        for p in (
            sysconfig.get_paths().get("stdlib"),
            sysconfig.get_paths().get("purelib"),
            os.path.dirname(torch.__file__),
            os.path.dirname(os.path.abspath(__file__)) + os.sep,
        )
        if p
    }
)


def _children(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, torch.Tensor):
        return []

    if isinstance(obj, (list, tuple, collections.deque)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if _is_ndarray(obj):
        return []
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
        for kind in _HOOK_DICTS:
            hooks = getattr(obj, kind, None)
            if hooks:
                # a hook runs when the module is called: what it mutates, the call mutates
                out.extend((f" (its hook `{getattr(h, '__name__', '?')}`)", h) for h in hooks.values())
        return out
    out = []
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        out.extend((f".{k}", v) for k, v in d.items())
    if hasattr(type(obj), "__slots__"):
        out.extend((f".{k}", v) for k, v in _slot_items(obj) if v is not _MISSING)
    return out


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


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
        orig = getattr(fn, "_torchdynamo_orig_callable", None)
        if orig is not None and orig is not fn:
            # a `torch.compile`d function: Dynamo's own state (the frame callback and its
            # caches) is not the user's; what the compiled function reaches is
            fn = orig
            continue
        if (
            isinstance(fn, types.FunctionType)
            and not _is_user_function(fn)
            and callable(getattr(fn, "__wrapped__", None))
        ):
            fn = fn.__wrapped__  # a library's `functools.wraps` wrapper: the wrapped function
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
    names = global_names(code)
    g = fn.__globals__
    for name in sorted(names):
        if name in g:
            v = g[name]
            # a helper function it names: followed by `Snapshot` (what the helper reaches,
            # the function reaches too; a helper appending to a global list, hunt 28)
            if not isinstance(v, _SKIP_TYPES) or _is_user_function(v):
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
            if id(obj) in visited or isinstance(obj, _OPAQUE_TYPES):
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

    def changes(self, fn: Any = None) -> list[str]:
        """What changed since the snapshot. With `fn` and other threads alive, a change to
        a container or an object's attributes is blamed on `fn` only where its bytecode
        (or a helper's) can make it (`_mutation_kinds`): another thread may have made it.
        In-place tensor and numpy writes are always blamed (torch code writes them, which
        bytecode does not show)."""
        out = []
        kinds = None
        for name, obj, fp in self.entries:
            now = _fingerprint(obj)
            if now == fp:
                continue
            if fp[0] == "object" and now is not None and _only_cached_properties(obj, fp[1], now[1]):
                continue
            if fn is not None and fp[0] in ("list", "dict", "set", "object") and threading.active_count() > 1:
                if kinds is None:
                    kinds = _mutation_kinds(fn)
                if ("object" if fp[0] == "object" else "container") not in kinds:
                    continue
            if fp[0] == "tensor":
                out.append(
                    f"it writes in place to {name}, a tensor it did not create (version {fp[1]} -> {now[1]})"
                    if now is not None
                    else f"it writes in place to {name}"
                )
            elif fp[0] in ("list", "dict", "set"):
                out.append(f"it mutates {name} (a {_kind(obj)}: {fp[1]} items before the call, {now[1]} after)")
            elif fp[0] == "ndarray":
                out.append(f"it writes to {name} (a numpy array: its contents changed)")
            else:
                out.append(f"it mutates {name} (a {_kind(obj)}: its attributes changed)")
        return out


#: Method names that mutate a container (list, dict, set, deque) or an object's attributes.
_CONTAINER_MUTATORS = frozenset(
    "append extend insert pop remove clear update add discard setdefault popitem sort reverse appendleft "
    "extendleft popleft rotate __setitem__ __delitem__ __iadd__ __ior__ __isub__ __iand__ difference_update "
    "intersection_update symmetric_difference_update heappush heappop heapreplace heappushpop heapify shuffle".split()
)
_OBJECT_MUTATORS = frozenset(
    "setattr delattr __setattr__ __delattr__ register_buffer register_parameter register_module add_module "
    "train eval requires_grad_ apply zero_grad update setdefault __dict__ load_state_dict".split()
)


def _mutation_kinds(fn: Any) -> frozenset[str]:
    """Which outer mutations `fn`'s bytecode, or that of the user functions it names (to a
    depth of four), can make: "container" (item stores, mutating methods, `+=`) and
    "object" (attribute stores, setattr, nn.Module setters)."""
    kinds: set[str] = set()
    base = _funcinfo.unwrap_callable(fn)
    todo: list[tuple[Any, int]] = [(base, 0)]
    seen_codes: set[int] = set()
    while todo and len(kinds) < 2:
        f, depth = todo.pop()
        code = getattr(f, "__code__", None)
        if code is None or id(code) in seen_codes:
            continue
        seen_codes.add(id(code))
        stack = [code]
        names: set[str] = set()
        while stack:
            c = stack.pop()
            names.update(c.co_names)
            stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
            for ins in dis.get_instructions(c):
                op = ins.opname
                if op in ("STORE_SUBSCR", "DELETE_SUBSCR"):
                    kinds.add("container")
                elif op in ("STORE_ATTR", "DELETE_ATTR"):
                    kinds.add("object")
                elif op == "BINARY_OP" and ins.argrepr.endswith("="):
                    kinds.add("container")  # `lst += [...]` extends the list in place
                elif isinstance(ins.argval, str) and op.startswith("LOAD_"):
                    if ins.argval in _CONTAINER_MUTATORS:
                        kinds.add("container")
                    if ins.argval in _OBJECT_MUTATORS:
                        kinds.add("object")
        if depth < _MAX_DEPTH and isinstance(f, types.FunctionType):
            helpers = [f.__globals__.get(n) for n in names]
            for cell in f.__closure__ or ():
                try:
                    helpers.append(cell.cell_contents)
                except ValueError:
                    continue
            todo.extend((h, depth + 1) for h in helpers if _is_user_function(h))
            # methods of the objects the function reaches (`self.helper()`), and what calling
            # a module runs (its forward, its hooks)
            for _, root in roots_of(f):
                if isinstance(root, _SKIP_TYPES) or isinstance(root, (torch.Tensor, list, dict, set, tuple)):
                    continue
                methods = [getattr(type(root), n, None) for n in names]
                if isinstance(root, torch.nn.Module):
                    methods.append(getattr(type(root), "forward", None))
                    for kind in _HOOK_DICTS:
                        methods.extend(getattr(root, kind, {}).values())
                todo.extend((m, depth + 1) for m in methods if _is_user_function(m))
    return frozenset(kinds)


def side_effect_message(op: str, role: str, function: str, short: str, problems: Sequence[str]) -> str:
    """The message of a `SideEffectError` (eagerly, and from `tfun.jit`'s lowering)."""
    return format_message(
        f"{op}: the {role} must not have side effects, but it does:",
        problems,
        function=function,
        revise=f"Revise `{short}` so that it only returns values: carry state through "
        "its inputs and outputs, build new objects instead of mutating outer ones, and use "
        "out-of-place tensor ops (`x + y`, not `x.add_(y)`) on tensors it did not create.",
    )


def _raise_side_effects(op: str, role: str, fn: Any, problems: list[str]) -> None:
    raise SideEffectError(side_effect_message(op, role, _funcinfo.describe(fn), _funcinfo.short_name(fn), problems))


def check_static_side_effects(op: str, role: str, fn: Any) -> None:
    problems = static_side_effects(fn)
    if problems:
        _raise_side_effects(op, role, fn, problems)


def checked_call(
    op: str, role: str, fn: Callable[..., Any], args: tuple[Any, ...], call: Callable[[], Any] | None = None
) -> Any:
    """Call `fn(*args)` once under the side-effect rules (static and dynamic). With `call`,
    run `call()` instead, under the rules of `fn` on `args` (an op that calls `fn` on
    batches of `args` through `vmap`, say)."""
    check_static_side_effects(op, role, fn)
    roots = roots_of(fn)
    roots.extend((f"its argument {i}" if len(args) > 1 else "its argument", a) for i, a in enumerate(args))
    snap = Snapshot(roots)
    state = _torch_state()
    out = fn(*args) if call is None else call()
    problems = snap.changes(fn) + torch_state_changes(state)
    if problems:
        _raise_side_effects(op, role, fn, problems)
    return out


# ----------------------------------------------------------------------------------------
# Abstract evaluation (for branches not taken, and zero-length loops)
# ----------------------------------------------------------------------------------------


class AbstractEvalUnavailable(Exception):
    """Raised when fake tensors cannot follow a function: it needs values (`.item()`, a
    Python `if` on a tensor, `nonzero`, boolean masks), or an op has no fake implementation.
    Such a function is checked when it runs for real instead."""


def _fake_limitations() -> tuple[type[BaseException], ...]:
    """The exceptions by which fake tensors say "this needs real data, or is not supported"."""
    from torch._subclasses import fake_tensor as ft

    names = (
        "DataDependentOutputException",
        "DynamicOutputShapeException",
        "UnsupportedOperatorException",
        "UnsupportedFakeTensorException",
        "UnsupportedMutationAliasingException",
        "MetadataMismatchError",
    )
    found: list[type[BaseException]] = [getattr(ft, n) for n in names if hasattr(ft, n)]
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        found.append(GuardOnDataDependentSymNode)
    except ImportError:  # pragma: no cover
        pass
    return tuple(found)


# Words of torch's messages that blame the fake tensor, not the function (`.numpy()` on a
# tensor subclass, reading a data pointer or storage that a fake tensor does not have, an
# op with no fake or meta kernel). A user's own exception (a NotImplementedError of a mode
# it does not support, say) is not one: JAX's tracing raises it too.
_LIMITATION_WORDS = ("fake", "tensor subclass", "data pointer", "data_ptr", "storage", "meta backend", "'meta' backend")
_LIMITATION_WORD_TYPES = (RuntimeError, TypeError, NotImplementedError)


def is_fake_limitation(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) means that fake tensors cannot
    follow the function, rather than that the function is wrong for inputs of these types."""
    limitations = _fake_limitations()
    seen_ids: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen_ids:
        seen_ids.add(id(e))
        if isinstance(e, limitations):
            return True
        text = str(e).lower()
        if type(e) in _LIMITATION_WORD_TYPES and any(w in text for w in _LIMITATION_WORDS):
            return True
        e = e.__cause__ or e.__context__
    return False


class _QuietFakeTensorLog(logging.Filter):
    """Drops torch's `failed while attempting to run meta` tracebacks while tfun evaluates
    a function on fake tensors: the error is reported (or deliberately set aside) by tfun."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.local, "depth", 0)


_QUIET = _QuietFakeTensorLog()
_QUIET_INSTALLED = False


def _eager_stance() -> Any:
    """Compiled functions (`torch.compile`, `tfun.jit`) called on fake tensors run their
    Python eagerly: compiling for fake inputs fails, or crashes the process."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:  # pragma: no cover
        return contextlib.nullcontext()
    return set_stance("force_eager")


def _fake_input(mode: Any, x: Any, transformed: bool) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    wrapped = _compat.is_functorch_wrapped_tensor  # None: a torch without functorch wrappers
    if wrapped is not None and wrapped(x):
        # Under vmap/grad: a plain fake tensor of the per-example (logical) type; batched
        # tensors the function closes over still combine with it, as in the real call.
        with mode:
            fake = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
    else:
        fake = mode.from_tensor(x.detach())
    if not transformed and x.requires_grad and (fake.is_floating_point() or fake.is_complex()):
        fake.requires_grad_(True)  # a function may differentiate through its input itself
    return fake


def _own_saved_tensor_hooks(transformed: bool) -> Any:
    """Saved-tensor hooks that keep what a fake evaluation saves for autograd to itself.

    A run on fake tensors with grad mode on saves fake activations for autograd, through the
    saved-tensor hooks active around the call: `torch.utils.checkpoint`'s (non-reentrant, its
    default), which then counted more tensors in the forward than in its recompute (where
    tfun's first-call check is cached) and raised `CheckpointError` on the first step at each
    new shape around an eager `cond`/`switch`; `save_on_cpu`; a user's own pack hook, handed
    `FakeTensor`s (hunt 33, F8). The innermost hooks are the ones torch calls, so identity
    hooks here shield the outer ones. Only where hooks are active: `torch.func.grad` refuses
    to run under any (a `tfun.grad` in a branch), and torch allows none around a `torch.func`
    transform."""
    if transformed or not _compat.saved_tensor_hooks_active():
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_identity, _identity)


def _identity(t: Any) -> Any:
    return t


def abstract_eval(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    op: str | None = None,
    role: str | None = None,
    why: str = "to check its output",
    report_fn: Callable[..., Any] | None = None,
    side_effects: bool = False,
) -> tuple[list[Any], PyTreeSpec]:
    """Run `fn(*args)` on fake tensors: output leaves (fake tensors) and structure.

    Like JAX's tracing to avals: nothing is computed, dtypes and shapes propagate. Closed-
    over real tensors are allowed, and so are vmap/grad transforms (inputs they wrap become
    fake tensors of their per-example type). Raises `AbstractEvalUnavailable` where fake
    tensors cannot follow the function (`is_fake_limitation`: `.item()`, data-dependent
    shapes, ops without a fake kernel). Any other exception is an error of the function
    itself, as JAX would raise it when tracing: it propagates unchanged, with a note naming
    `op`, `role` and the function (`report_fn`, default `fn`). tfun errors of nested ops
    propagate too. With `side_effects`, the side-effect rules hold as in `checked_call`
    (a function run on fake tensors could otherwise leave them in the user's objects).
    """
    global _QUIET_INSTALLED
    from ._errors import TfunError

    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as e:  # pragma: no cover
        raise AbstractEvalUnavailable(str(e)) from e
    if not _QUIET_INSTALLED:
        logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QUIET)
        _QUIET_INSTALLED = True
    leaves, treedef = tree_flatten(args)
    _QUIET.local.depth = getattr(_QUIET.local, "depth", 0) + 1
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        transformed = _context.in_functorch_transform()
        fake_leaves = [_fake_input(mode, x, transformed) for x in leaves]
        snap = None
        if side_effects:
            check_static_side_effects(op or "tfun", role or "function", fn)
            snap = Snapshot(roots_of(fn))
        state = _torch_state()
        with _eager_stance(), _own_saved_tensor_hooks(transformed), mode, warnings.catch_warnings():
            # a closed-over real tensor that is not a leaf and requires grad (a slice of a
            # differentiated input) is made fake on first use, and the conversion reads its
            # `.grad`, which torch warns about: the read is the fake mode's, not the user's
            warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf", category=UserWarning)
            out = fn(*tree_unflatten(treedef, fake_leaves))
        out_leaves, out_def = tree_flatten(out)
        if snap is not None:
            problems = snap.changes(fn) + torch_state_changes(state)
            if problems:
                _raise_side_effects(op or "tfun", role or "function", fn, problems)
    except TfunError:
        raise
    except AbstractEvalUnavailable:
        raise
    except Exception as e:
        if is_fake_limitation(e):
            raise AbstractEvalUnavailable(f"{type(e).__name__}: {e}") from e
        if op is not None and hasattr(e, "add_note"):
            who = report_fn if report_fn is not None else fn
            e.add_note(
                format_message(
                    f"{op}: the {role or 'function'} raised this when tfun evaluated it on fake tensors "
                    f"(dtypes and shapes, no values) {why}; JAX raises it too, as it traces every function "
                    "an op is given.",
                    function=_funcinfo.describe(who),
                    revise=f"Revise `{_funcinfo.short_name(who)}` so that it accepts inputs of these types, "
                    "even where it is not run.",
                )
            )
        raise
    finally:
        _QUIET.local.depth -= 1
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
    "structure_message",
    "tensor_message",
    "structure_bullet",
    "tensor_bullet",
    "description_mismatch",
    "skeleton_node_text",
    "skeleton_leaf_paths",
    "leaf_desc_text",
    "tensor_text",
    "scalar_text",
    "check_tensors",
    "as_tensor_leaves",
    "as_tensor_tree",
    "scalar_dtype",
    "normalize_weak_outputs",
    "dtype_category",
    "promote_weak_init",
    "check_callable",
    "check_scalar_predicate",
    "check_concrete",
    "check_int",
    "canonical_axis",
    "leading_length",
    "leaf_signature",
    "fn_key",
    "seen",
    "remember",
    "first_call",
    "FirstCall",
    "clear_cache",
    "static_side_effects",
    "check_static_side_effects",
    "static_code_side_effects",
    "global_names",
    "checked_call",
    "side_effect_message",
    "Snapshot",
    "abstract_eval",
    "AbstractEvalUnavailable",
    "is_fake_limitation",
    "LeafMeta",
    "leaf_metas",
    "empty_like_fake",
    "tree_flatten_with_path",
]
