"""JAX-signature autodiff transforms over `torch.func`: `grad`, `value_and_grad`, `jvp`,
`vjp`, `jacfwd`, `jacrev`, `hessian`, `stop_gradient`.

Every transform takes and returns pytrees in tfun's registry (namespace "tfun"), so
registered dataclasses and `None` subtrees behave as in JAX. Arguments are flattened with
`tfun.tree` into tensor leaves, the flat function is handed to `torch.func`, and results
are rebuilt with the argument and output structures. Differences from `torch.func` that
follow JAX: `grad` requires a scalar real output; integer inputs may not be differentiated;
`vjp`'s pullback returns a tuple; `jvp` takes tuples of primals and tangents.

Complex numbers follow JAX's convention, not torch's. A reverse-mode cotangent in JAX is
the transpose of the (R-linear) tangent map, in torch its adjoint (conjugate transpose), so
for every function `jax_vjp(ct) = conj(torch_vjp(conj(ct)))`: the pullbacks here conjugate
the cotangents going in and the cotangents coming out. For a real loss `L` of complex `z`,
`grad(L)(z)` is the conjugate of what `.backward()` leaves in `z.grad` (e.g.
`grad(lambda z: abs(z)**2)(3+4j) == 6-8j`, where torch gives 6+8j). Forward mode (`jvp`)
is the same in both. As in JAX, `grad`/`jacrev` differentiate complex outputs and `jacfwd`
complex inputs only with `holomorphic=True`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.func

from . import _compat, _context, _first_order, _funcinfo
from ._compat import forward_ad_ready, grad_leaf
from ._errors import (
    ArgumentTypeError,
    ArgumentValueError,
    JitError,
    PerformanceWarning,
    StructureMismatchError,
    TensorMismatchError,
    format_message,
)
from ._funcinfo import describe
from ._tree import (
    NAMESPACE,
    Partition,
    keystr,
    partition,
    register_pytree_node,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_unflatten,
)
from .lax import _hop

__all__ = [
    "grad",
    "value_and_grad",
    "jvp",
    "linearize",
    "vjp",
    "jacfwd",
    "jacrev",
    "hessian",
    "stop_gradient",
]


# --------------------------------------------------------------------------------------
# shared helpers (also used by _vmap, _custom_derivatives, _checkpoint)
# --------------------------------------------------------------------------------------


def describe_value(x: Any, shapes: bool = True) -> str:
    """A short description of a pytree node or leaf for error bullets. `shapes=False` in
    messages built in traced code too: under Dynamo a size may be symbolic (automatic dynamic
    shapes), which cannot be told from a concrete one, and the message must read the same
    eagerly and under tfun.jit."""
    if isinstance(x, torch.Tensor):
        if not shapes:
            return f"a tensor of dtype {x.dtype}"
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    if x is None:
        return "None"
    if isinstance(x, dict):
        return f"a {type(x).__name__} with keys {sorted(x.keys(), key=repr)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} children"
    if _is_node(x):
        return f"a {type(x).__name__} node"
    return f"a {type(x).__name__} leaf ({x!r})" if isinstance(x, (int, float, complex, bool, str)) else (
        f"a {type(x).__name__} leaf"
    )


def _is_node(x: Any) -> bool:
    if x is None:
        return True
    # tree_is_leaf consults the registry only; Dynamo traces it for constants too, where
    # flattening a constant dict (a dict in_axes) constant-folds to optree metadata that
    # Dynamo cannot represent.
    return not optree.tree_is_leaf(x, none_is_leaf=True, namespace=NAMESPACE)


def _one_level(x: Any) -> tuple[Any, list[tuple[str, Any]]]:
    """(one-level key, [(accessor string, child), ...]) of a pytree node.

    Two nodes have the same one-level structure when their keys compare equal: the node
    type, its metadata (the sorted keys of a dict, a namedtuple class, a custom node's aux
    data) and the number of children. Traceable by Dynamo, including on constants such as
    `in_axes=(0,)` or `in_axes={"a": 0}` inside `tfun.jit`: no `is_leaf` callback (one that
    tells the root from its children, `c is not x`, misjudges a constant tuple under Dynamo)
    and no optree flattening of dicts (Dynamo's stand-in returns other metadata than
    optree's, and fails on a constant dict). Accessor strings (`[0]`, `['a']`, `.field`) come
    from the node type's registered path entry type, as in `tree_flatten_with_accessor`.
    """
    node_type = type(x)
    handler = optree.register_pytree_node.get(node_type, namespace=NAMESPACE)
    if node_type is dict or node_type is collections.defaultdict:
        # optree's order for dict children: the keys sorted (by a total order for mixed key types)
        keys = optree.utils.total_order_sorted(x)
        children: list[Any] = [x[k] for k in keys]
        metadata: Any = (getattr(x, "default_factory", None), tuple(keys))
        entries: Sequence[Any] = keys
    else:
        children, metadata, entries, _ = optree.tree_flatten_one_level(x, none_is_leaf=True, namespace=NAMESPACE)
    accessors = [handler.path_entry_type(e, node_type, handler.kind).codify("") for e in entries]
    return (node_type, metadata, len(children)), list(zip(accessors, children))


class PrefixMismatch(Exception):
    """Internal: `prefix` is not a tree prefix of `full` at `path`.

    Raised as `PrefixMismatch(path, prefix_node, full_node)`. No `__init__` of its own:
    Dynamo (inside `tfun.jit`) cannot trace an exception's `super().__init__`, so the fields
    are read back from `args`.
    """

    @property
    def path(self) -> str:
        return self.args[0]

    @property
    def prefix_node(self) -> Any:
        return self.args[1]

    @property
    def full_node(self) -> Any:
        return self.args[2]


def broadcast_prefix(
    prefix: Any, full: Any, is_prefix_leaf: Callable[[Any], bool], path: str = ""
) -> list[tuple[str, Any, Any]]:
    """Broadcast a prefix tree against `full`.

    Returns `[(path, prefix_leaf, full_leaf), ...]` in `full`'s flattening order (None is
    an empty subtree of `full`). Raises `PrefixMismatch` at the first node that differs.
    """
    if is_prefix_leaf(prefix):
        pl, _ = tree_flatten_with_path(full)
        return [(path + keystr(p), prefix, leaf) for p, leaf in pl]
    if prefix is None and full is None:
        return []  # the same empty subtree on both sides
    if full is None or not _is_node(full) or not _is_node(prefix) or prefix is None:
        raise PrefixMismatch(path, prefix, full)
    pspec, pchildren = _one_level(prefix)
    fspec, fchildren = _one_level(full)
    if pspec != fspec:
        raise PrefixMismatch(path, prefix, full)
    out: list[tuple[str, Any, Any]] = []
    for (acc, pc), (_, fc) in zip(pchildren, fchildren):
        out.extend(broadcast_prefix(pc, fc, is_prefix_leaf, path + acc))
    return out


def is_inexact(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _as_diff_leaf(op: str, fun: Callable[..., Any], path: str, leaf: Any) -> torch.Tensor:
    """A leaf of a differentiated argument, as an inexact tensor (else a tfun error)."""
    if isinstance(leaf, torch.Tensor):
        if is_inexact(leaf):
            return leaf
        raise ArgumentTypeError(
            format_message(
                f"{op}: {op.split('.')[-1]} requires real- or complex-valued inputs (floating-point or "
                "complex dtype), but an argument it differentiates has an integer or boolean leaf.",
                [f"{path}: a tensor of shape {tuple(leaf.shape)} and dtype {leaf.dtype}"],
                function=describe(fun),
                revise="Pass a floating-point tensor there, or leave that argument out of `argnums` "
                "(arguments not in `argnums` are constants).",
            )
        )
    if isinstance(leaf, bool) or isinstance(leaf, int):
        raise ArgumentTypeError(
            format_message(
                f"{op}: {op.split('.')[-1]} requires real- or complex-valued inputs (floating-point or "
                "complex dtype), but an argument it differentiates has an integer or boolean leaf.",
                [f"{path}: a Python {type(leaf).__name__} ({leaf!r})"],
                function=describe(fun),
                revise="Pass a float (e.g. `2.0`) or a floating-point tensor there, or leave that argument "
                "out of `argnums`.",
            )
        )
    if isinstance(leaf, float):
        return torch.tensor(leaf, dtype=torch.get_default_dtype())
    if isinstance(leaf, complex):
        return torch.tensor(leaf)
    raise ArgumentTypeError(
        format_message(
            f"{op}: every leaf of a differentiated argument must be a tensor or a Python number.",
            [f"{path}: {describe_value(leaf)}"],
            function=describe(fun),
            revise="Make that leaf a tensor, or move it to an argument that is not in `argnums`.",
        )
    )


def normalize_argnums(op: str, argnums: Any) -> tuple[tuple[int, ...], bool]:
    """Validate `argnums` (an int or a tuple of ints); returns (tuple, was_int)."""
    if isinstance(argnums, bool):
        pass
    elif isinstance(argnums, int):
        return (argnums,), True
    elif isinstance(argnums, (tuple, list)) and all(
        isinstance(a, int) and not isinstance(a, bool) for a in argnums
    ):
        if len(argnums) == 0:
            raise ArgumentValueError(
                format_message(
                    f"{op}: argnums must not be empty.",
                    revise="Pass an int or a non-empty tuple of ints.",
                )
            )
        if len(set(argnums)) != len(argnums):
            raise ArgumentValueError(
                format_message(
                    f"{op}: argnums must not repeat an argument, got {tuple(argnums)}.",
                    revise="List each argument index once.",
                )
            )
        return tuple(argnums), False
    raise ArgumentTypeError(
        format_message(
            f"{op}: argnums must be an int or a tuple of ints, got {argnums!r}.",
            revise="Pass e.g. `argnums=0` or `argnums=(0, 2)`.",
        )
    )


def resolve_argnums(op: str, fun: Callable[..., Any], argnums: tuple[int, ...], nargs: int) -> tuple[int, ...]:
    """Normalize negative argnums against the call's arity; a tfun error when out of range."""
    shown: Any = argnums[0] if len(argnums) == 1 else argnums
    out = []
    for a in argnums:
        if not -nargs <= a < nargs:
            raise ArgumentValueError(
                format_message(
                    f"{op}: argnums={shown} refers to positional "
                    f"argument {a}, but the function was called with {nargs} positional argument"
                    f"{'' if nargs == 1 else 's'}.",
                    function=describe(fun),
                    revise=f"Pass argnums within range({nargs}), or call the function with more "
                    "positional arguments (keyword arguments cannot be differentiated).",
                )
            )
        out.append(a % nargs)
    if len(set(out)) != len(out):
        raise ArgumentValueError(
            format_message(f"{op}: argnums {argnums} name the same argument twice.", function=describe(fun))
        )
    return tuple(out)


class _DiffArgs:
    """The positional arguments `argnums` names, as one `Partition` whose leaves are all dynamic:
    each an inexact tensor (a Python float or complex becomes one; anything else is a tfun error
    naming its path). The other arguments are passed through as they are.

    - `leaves`, `paths`: the differentiated leaves in order, and each one's path (`args[i]...`);
    - `rebuild_args(flat)`: the positional arguments with `flat` in place of those leaves;
    - `split(flat)`: one tree per entry of `argnums` (the gradients' structure).

    With `allow_int` (JAX's `grad(..., allow_int=True)`), integer and boolean leaves are
    not differentiated: they stay constants, and their gradient is a zero tensor of their
    own dtype (torch has no `float0`)."""

    def __init__(
        self, op: str, fun: Callable[..., Any], args: Sequence[Any], argnums: tuple[int, ...], allow_int: bool = False
    ):
        self.args = tuple(args)
        self.argnums = argnums
        diff_args = tuple(args[i] for i in argnums)
        pl, treedef = tree_flatten_with_path(diff_args)
        paths = [f"args[{argnums[p[0].entry]}]{keystr(p[1:])}" for p, _ in pl]
        all_leaves: list[Any] = []
        zeros: list[Any] = []
        dyn: list[int] = []
        for k, (path, (_, leaf)) in enumerate(zip(paths, pl)):
            if allow_int and _is_int_leaf(leaf):
                all_leaves.append(leaf)
                zeros.append(torch.zeros_like(leaf) if isinstance(leaf, torch.Tensor) else torch.zeros((), dtype=torch.bool if isinstance(leaf, bool) else torch.int64))
                continue
            all_leaves.append(_as_diff_leaf(op, fun, path, leaf))
            zeros.append(None)
            dyn.append(k)
        self.dyn = tuple(dyn)
        self.paths = [paths[k] for k in dyn]
        self.leaves = [all_leaves[k] for k in dyn]
        self.part = Partition(treedef, tuple(all_leaves), tuple(dyn), diff_args)
        self.grad_part = Partition(treedef, tuple(zeros), tuple(dyn), diff_args)

    def split(self, flat: Sequence[Any]) -> list[Any]:
        return list(self.grad_part.combine(flat))

    def rebuild_args(self, flat: Sequence[Any]) -> list[Any]:
        new_args = list(self.args)
        for i, tree in zip(self.argnums, self.part.combine(flat)):
            new_args[i] = tree
        return new_args


def _is_int_leaf(leaf: Any) -> bool:
    if isinstance(leaf, torch.Tensor):
        return not is_inexact(leaf)
    return isinstance(leaf, (bool, int))


def _check_allow_int_flag(op: str, allow_int: Any) -> None:
    if not isinstance(allow_int, bool):
        raise ArgumentTypeError(format_message(f"{op}: allow_int must be a bool, got {describe_value(allow_int)}."))


def require_pair(op: str, fn: Callable[..., Any], value: Any, what: str, names: str, revise: str) -> tuple[Any, Any]:
    """`value` as `(first, second)`, else the error of every "must return a pair" rule (a
    `has_aux` function, a custom_vjp `fwd`, a custom_jvp rule): "`op`: `what` must return a
    pair (`names`)", what it returned, the user's function and `revise`."""
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise StructureMismatchError(
            format_message(
                f"{op}: {what} must return a pair ({names}).",
                [f"returned: {describe_value(value)}"],
                function=describe(fn),
                revise=revise,
            )
        )
    return value[0], value[1]


def _split_aux(op: str, fun: Callable[..., Any], out: Any) -> tuple[Any, Any]:
    return require_pair(
        op, fun, out, "with has_aux=True the function", "output, aux", "Return `(output, aux)`, or pass has_aux=False."
    )


_forward_ad_ready = forward_ad_ready  # torch's forward-AD import warns once; tfun._compat


def _pack_aux(box: dict[str, Any], aux: Any) -> list[torch.Tensor]:
    """torch.func passes only tensors through `aux`; keep the other leaves aside."""
    box["aux"] = partition(aux)
    return box["aux"].dynamic


def _unpack_aux(box: dict[str, Any], tensors: Sequence[torch.Tensor]) -> Any:
    return box["aux"].combine(tensors)


def conj_ct(t: Any) -> Any:
    """Between torch's and JAX's reverse-mode conventions (an involution): the conjugate of
    a complex tensor, anything else unchanged. The conjugate is materialized (no conj bit
    left set), so results convert to NumPy."""
    if isinstance(t, torch.Tensor) and t.is_complex():
        return t.conj().resolve_conj()
    return t


def _check_scalar_output(op: str, fun: Callable[..., Any], out: Any, holomorphic: bool = False) -> torch.Tensor:
    ok = isinstance(out, torch.Tensor) and out.ndim == 0 and (out.is_complex() if holomorphic else out.is_floating_point())
    if ok:
        return out
    if isinstance(out, torch.Tensor):
        what = f"output: a tensor of shape {tuple(out.shape)} and dtype {out.dtype}"
    else:
        what = f"output: {describe_value(out)}"
    if holomorphic:
        raise ArgumentTypeError(
            format_message(
                f"{op}: with holomorphic=True the function must return a scalar (shape ()) complex tensor.",
                [what],
                function=describe(fun),
                revise="Return a complex scalar, or pass holomorphic=False for a real-valued function.",
            )
        )
    complex_scalar = isinstance(out, torch.Tensor) and out.ndim == 0 and out.is_complex()
    raise ArgumentTypeError(
        format_message(
            f"{op}: the function must return a scalar (shape ()) real floating-point tensor.",
            [what],
            function=describe(fun),
            revise=(
                "For a holomorphic function pass holomorphic=True; otherwise differentiate a real "
                "scalar (e.g. `.real` or `abs(...)**2`), or use `tfun.vjp` for complex outputs, as in JAX."
                if complex_scalar
                else "Reduce the output to a scalar (e.g. `.sum()`), or use `tfun.vjp` / `tfun.jacrev` "
                "for non-scalar or complex outputs."
            ),
        )
    )


def _check_complex_inputs(op: str, fun: Callable[..., Any], paths: Sequence[str], leaves: Sequence[torch.Tensor]) -> None:
    """With holomorphic=True every differentiated input must be complex (as in JAX)."""
    bad = [
        f"{p}: a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
        for p, x in zip(paths, leaves)
        if not x.is_complex()
    ]
    if bad:
        raise ArgumentTypeError(
            format_message(
                f"{op}: with holomorphic=True every differentiated input must be complex.",
                bad,
                function=describe(fun),
                revise="Pass complex tensors there (e.g. `x.to(torch.complex128)`), or pass holomorphic=False.",
            )
        )


def _check_holomorphic_flag(op: str, holomorphic: Any) -> None:
    if not isinstance(holomorphic, bool):
        raise ArgumentTypeError(
            format_message(f"{op}: holomorphic must be a bool, got {describe_value(holomorphic)}.")
        )


# --------------------------------------------------------------------------------------
# grad / value_and_grad
# --------------------------------------------------------------------------------------


def _value_and_grad_call(
    op: str,
    fun: Callable[..., Any],
    argnums: tuple[int, ...],
    single: bool,
    has_aux: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    holomorphic: bool = False,
    allow_int: bool = False,
) -> tuple[Any, Any, Any]:
    argnums = resolve_argnums(op, fun, argnums, len(args))
    fl = _DiffArgs(op, fun, args, argnums, allow_int)
    if holomorphic:
        _check_complex_inputs(op, fun, fl.paths, fl.leaves)
    box: dict[str, Any] = {}

    def f_flat(*flat: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out = fun(*fl.rebuild_args(flat), **kwargs)
        aux = None
        if has_aux:
            out, aux = _split_aux(op, fun, out)
        out = _check_scalar_output(op, fun, out, holomorphic)
        return out, _pack_aux(box, aux)

    # Under torch.compile / tfun.jit, torch.func.grad cannot trace tfun's control-flow ops
    # (torch 2.13 asserts "Expected FakeTensor"), but reverse-mode autograd can: tfun.jit
    # lets Dynamo trace torch.autograd.grad, so jit(grad(loss)) is one graph.
    #
    # A tensor the function closes over may require grad (a module's parameter): then the
    # gradient depends on it, and an outer .backward() (a gradient penalty) must reach it
    # through the gradient's graph, as it does eagerly. Reverse-mode autograd on fresh leaves
    # cannot return such a gradient from a compiled region, so torch.func.grad (which
    # Dynamo traces when there is no control flow) takes that case; with control flow
    # inside, torch has no second derivative of a HOP, so it is refused, never dropped.
    # Whether the function closes over such a tensor is learned at trace time by a probe
    # (`_probe`); its ops feed nothing and AOTAutograd drops them before anything runs.
    # (`len(...) > 0`, not `bool(list)`: Dynamo 2.11 cannot trace the builtin `bool` of a list)
    #
    # Inside a torch.func transform (`tfun.vmap`, `tfun.jacfwd`, `tfun.jvp` around the
    # gradient) autograd would see the transform's wrapped tensors, which Dynamo cannot trace
    # it through ("Expected FakeTensor"): torch.func.grad there, as `tfun.vjp` does
    # (`_traced_reverse_mode`), which Dynamo traces when there is no control flow inside.
    #
    # Inside a HOP body (a lowered loop's body or a branch, `_hop.in_body`) autograd is off
    # while the HOP runs the body: torch.func.grad there too, traced into the body's graph.
    tracing = (
        len(fl.leaves) > 0 and _context.is_tracing() and not _context.functorch_active() and not _hop.in_body()
    )
    closed = False
    # A traced gradient whose result stays differentiable only because its arguments or the
    # tensors it closes over require grad (an nn.Parameter: a training step), where no traced
    # derivative encloses it (nothing in the trace differentiates it again), is computed
    # first-order with its loops kept as loop ops, and a backward that reaches it later is
    # refused at run time (`_first_order`). Enclosed, or without loop ops or custom rules
    # inside, it is exact: loops unrolled (`_hop.unroll_scope`) and `create_graph=True`.
    outermost = tracing and not _hop.in_derivative()
    first_order_closure = False
    if tracing and torch.is_grad_enabled() and not any(x.requires_grad for x in fl.leaves):
        closed, lowered_ops, custom_ops = _probe(f_flat, fl.leaves, derivative=True)
        first_order_closure = closed and outermost and (lowered_ops or custom_ops)
    if tracing and (not closed or first_order_closure):
        # Like torch.func's, the results stay differentiable by an outer autograd (a
        # .backward() of a loss built on the gradient, tfun.grad of tfun.grad): with grad
        # mode on, an argument that requires grad stays connected (through a view of its
        # own, so that one tensor passed twice gets a gradient per position) and the graph
        # of the gradient is kept. Detaching them would drop those derivatives without an error.
        outer = torch.is_grad_enabled() and any(x.requires_grad for x in fl.leaves)
        may_keep_loops = outer and outermost
        with torch.enable_grad():
            leaves = [x.view_as(x) if outer and x.requires_grad else grad_leaf(x) for x in fl.leaves]
            lowered, customs = _hop.lowerings(), _hop.custom_rules()
            cause = requires_grad_cause(op, fl.paths, fl.leaves) if outer else None
            # the gradient stays differentiable: loops unrolled, unless it may be kept first-order
            with _hop.unroll_scope(outer and not may_keep_loops, derivative=True, cause=cause):
                value, aux_leaves = f_flat(*leaves)
            kept_ops = _hop.lowerings() != lowered or _hop.custom_rules() != customs
            first_order = first_order_closure or (may_keep_loops and kept_ops)
            if outer and not first_order and _hop.lowerings() != lowered:  # (every lowering refuses it first)
                _refuse_second_order(op, fun)
            if outer and not first_order and _hop.custom_rules() != customs:
                _refuse_custom_second_order(op, fun)
            if value.requires_grad:
                found = torch.autograd.grad(
                    value,
                    leaves,
                    grad_outputs=torch.ones_like(value),
                    allow_unused=True,
                    create_graph=outer and not first_order,
                    retain_graph=True if first_order else None,  # (first-order: the value stays differentiable)
                )
            else:
                # the value does not depend on the arguments (the gradient of a linear function,
                # differentiated again): zeros, as eagerly. (Inside a torch.func transform this
                # branch is not reached: torch.func.grad below. A custom rule's traced backward,
                # which has no graph, is refused before this: `_refuse_custom_second_order`.)
                found = (None,) * len(leaves)
        grads = tuple(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, found))
        if first_order:
            # (the views of the arguments that require grad; not the fresh leaves of the rest)
            anchors = [x for x, a in zip(leaves, fl.leaves) if a.requires_grad] if outer else [value]
            why = cause if outer else closure_cause(fun)
            grads = _keep_first_order(op, fun, grads, anchors, why)
        if not outer and not first_order_closure:
            value = value.detach()
            aux_leaves = [a.detach() if isinstance(a, torch.Tensor) else a for a in aux_leaves]
    elif fl.leaves and holomorphic:
        # torch.func.grad wants a real output: pull back the cotangent 1 instead
        _hop.note_func_reverse()
        with _hop.unroll_scope(closed, derivative=True, cause=closure_cause(fun) if closed else None):  # (traced: see below)
            value, pull, aux_leaves = torch.func.vjp(f_flat, *fl.leaves, has_aux=True)  # type: ignore[misc]
        grads = pull(torch.ones_like(value))
    elif fl.leaves:
        # traced with `closed`: the gradient depends on a closed-over tensor that requires
        # grad and stays differentiable, so the loops inside are unrolled (`_hop.unroll_scope`)
        _hop.note_func_reverse()
        with _hop.unroll_scope(closed, derivative=True, cause=closure_cause(fun) if closed else None):
            grads, (value, aux_leaves) = torch.func.grad_and_value(
                f_flat, argnums=tuple(range(len(fl.leaves))), has_aux=True
            )(*fl.leaves)
    else:
        value, aux_leaves = f_flat()
        grads = ()
    # torch's gradient of a real loss is the conjugate of JAX's (see the module docstring);
    # the cotangent 1 of a holomorphic output is its own conjugate.
    grads = tuple(conj_ct(g) for g in grads)
    per_arg = fl.split(list(grads))
    g = per_arg[0] if single else tuple(per_arg)
    aux = _unpack_aux(box, aux_leaves) if has_aux else None
    return value, g, aux


def _keep_first_order(
    op: str, fun: Callable[..., Any], grads: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor], why: str
) -> tuple[torch.Tensor, ...]:
    """A traced gradient with loop ops or custom rules inside, kept first-order: the inexact
    ones through `_first_order.keep_first_order` (differentiable with respect to `anchors`,
    with a derivative refused at run time where a nonzero cotangent reaches it)."""
    if not anchors:
        return tuple(grads)
    message = format_message(
        f"{op}: under tfun.jit, this gradient was computed first-order, with the loops, custom rules and fused "
        f"layers inside kept as single ops ({why}; torch {torch.__version__} has no second derivative of such an "
        "op), and a backward has reached it (a gradient penalty, or an update such as `W - lr * g` "
        "differentiated later), which needs its derivative.",
        function=describe(fun),
        revise="To differentiate the gradient under tfun.jit, pass unroll=True to each tfun.lax.scan and fori_loop "
        "inside (their steps are then unrolled into the graph, which differentiates exactly; map, cond, switch, "
        "while_loop, custom rules and tfun.nn's fused layers have no such form), or take the second-order term "
        "outside tfun.jit. If the gradient is only meant to be read, update under `torch.no_grad()` or pass "
        "the parameters detached (`p.detach()`).",
    )
    pos = [k for k, g in enumerate(grads) if is_inexact(g)]
    kept = _first_order.keep_first_order([grads[k] for k in pos], anchors, message)
    out = list(grads)
    for k, g in zip(pos, kept):
        out[k] = g
    return tuple(out)


def requires_grad_cause(op: str, paths: Sequence[str], leaves: Sequence[torch.Tensor]) -> str:
    """Why a traced derivative's result stays differentiable, for `_hop.unroll_scope`: the
    differentiated arguments that require grad, by path."""
    names = [p for p, x in zip(paths, leaves) if x.requires_grad]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{op}'s argument{'s' if len(names) > 1 else ''} {shown} require{'' if len(names) > 1 else 's'} grad"


def closure_cause(fun: Callable[..., Any]) -> str:
    """Why a traced derivative's result stays differentiable, for `_hop.unroll_scope`: the
    function closes over a tensor that requires grad."""
    return f"{describe(fun)} closes over a tensor that requires grad (a module's parameter)"


def _probe(f_flat: Callable[..., Any], leaves: Sequence[torch.Tensor], derivative: bool) -> tuple[bool, bool, bool]:
    """Traced code only: evaluate `f_flat` once on detached arguments (`f_flat(*leaves)`
    returns `(outputs, rest)`, the outputs a tensor or a sequence of them; the probe's ops feed
    nothing and AOTAutograd drops them). Returns whether an output requires grad all the same
    (through a closed-over tensor that requires grad: a module's parameter, a captured
    weight), whether it lowered loop or branch ops, and whether it applied custom rules or
    opaque ops. With `derivative`, it runs inside a traced derivative, as the real pass does
    (a loop with unroll=True then runs its steps in Python). (Not a `with` block: a graph break
    in the function would then abandon the whole frame, and torch.func.grad after it failed on
    functorch's layer stack, "dynamicLayerStack.size()".)"""
    lowered, customs = _hop.lowerings(), _hop.custom_rules()
    if derivative:
        _hop.derivative_depth(1)
    with torch.enable_grad():
        outs, _ = f_flat(*[x.detach() for x in leaves])
    if derivative:
        _hop.derivative_depth(-1)
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    closed = any(isinstance(o, torch.Tensor) and o.requires_grad for o in outs)
    return closed, _hop.lowerings() != lowered, _hop.custom_rules() != customs


def _refuse_custom_second_order(op: str, fun: Callable[..., Any]) -> None:
    """Under tfun.jit, a gradient through a custom function's rule that something outside may
    differentiate again: Dynamo compiles the rule's `autograd.Function` backward once, and its
    result carries no graph, so the second-order term would be zero without an error."""
    raise JitError(
        format_message(
            f"{op}: under tfun.jit, a gradient through a tfun.custom_jvp or tfun.custom_vjp function cannot "
            "itself be differentiated (an argument it differentiates requires grad, so an outer .backward() or "
            f"tfun.grad could reach it): torch.compile (torch {torch.__version__}) traces the rule's backward "
            "once, without a graph of its own, so the second-order term would be zero.",
            function=describe(fun),
            revise="Pass arguments that do not require grad (e.g. `p.detach()`) when only the first-order gradient "
            "is wanted, or take the higher-order derivative outside tfun.jit (eagerly it uses the rule at every "
            "order), or tfun.jit the function and differentiate around it: tfun.grad(tfun.grad(tfun.jit(f))).",
        )
    )


def _refuse_second_order(op: str, fun: Callable[..., Any]) -> None:
    """Under tfun.jit, a gradient that something outside may differentiate again must stay
    differentiable, but torch's control-flow HOPs have no double backward: their gradient
    would silently stop there. Refused instead."""
    why = "an argument it differentiates requires grad, so an outer .backward() or tfun.grad could reach it"
    revise = (
        "Pass arguments that do not require grad (e.g. `p.detach()`) when only the first-order "
        "gradient is wanted, or take the higher-order derivative outside tfun.jit."
    )
    raise JitError(
        format_message(
            f"{op}: under tfun.jit, the gradient of a function with tfun.lax control flow cannot itself be "
            f"differentiated ({why}), and torch {torch.__version__} has no second derivative of a "
            "control-flow op.",
            function=describe(fun),
            revise=revise,
        )
    )


class GradSpec:
    """What `tfun.grad` / `tfun.value_and_grad` made a function from, kept on it as
    `_tfun_grad_spec` so that `tfun.vmap` of it can compute per-example gradients under
    `tfun.jit` (`_vmap._per_example_gradients`). `wrapper` is the gradient function itself:
    `functools.wraps` copies the attribute onto any wrapper of it, which must not be taken
    for it."""

    __slots__ = ("op", "fun", "argnums", "single", "has_aux", "holomorphic", "allow_int", "wrapper")

    def __init__(
        self,
        op: str,
        fun: Callable[..., Any],
        argnums: tuple[int, ...],
        single: bool,
        has_aux: bool,
        holomorphic: bool,
        allow_int: bool,
        wrapper: Callable[..., Any],
    ):
        self.op, self.fun, self.argnums, self.single = op, fun, argnums, single
        self.has_aux, self.holomorphic, self.allow_int, self.wrapper = has_aux, holomorphic, allow_int, wrapper


def grad_spec(fun: Any) -> GradSpec | None:
    """The `GradSpec` of a function `tfun.grad` or `tfun.value_and_grad` returned, else None."""
    spec = getattr(fun, "_tfun_grad_spec", None)
    return spec if isinstance(spec, GradSpec) and spec.wrapper is fun else None


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
) -> Callable[..., Any]:
    """The function's value and its gradient, as `jax.value_and_grad`.

    **Arguments:**

    - `fun`: a function whose output is a scalar (shape `()`) real floating-point tensor
      (or `(output, aux)` with `has_aux=True`). Arguments may be pytrees of tensors.
    - `argnums`: an int or a tuple of ints: which positional arguments to differentiate.
      Their leaves must be floating-point or complex tensors (or Python floats).
    - `has_aux`: whether `fun` returns `(output, aux)`; `aux` is returned, not
      differentiated.
    - `holomorphic`, `allow_int`: as in `grad`.

    **Returns:** a function with `fun`'s signature returning `(value, grads)`, or
    `((value, aux), grads)` with `has_aux=True`. `grads` has the structure of argument
    `argnums` (a tuple of such structures when `argnums` is a tuple).
    """
    op = "tfun.value_and_grad"
    nums, single = normalize_argnums(op, argnums)
    _check_holomorphic_flag(op, holomorphic)
    _check_allow_int_flag(op, allow_int)

    @_compat.wraps(fun)
    def value_and_grad_fun(*args: Any, **kwargs: Any) -> Any:
        value, g, aux = _value_and_grad_call(op, fun, nums, single, has_aux, args, kwargs, holomorphic, allow_int)
        return ((value, aux), g) if has_aux else (value, g)

    value_and_grad_fun._tfun_grad_spec = GradSpec(  # type: ignore[attr-defined]
        op, fun, nums, single, has_aux, holomorphic, allow_int, value_and_grad_fun
    )
    return value_and_grad_fun


def grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
) -> Callable[..., Any]:
    """The gradient of a scalar function, as `jax.grad`.

    Composes with itself (`grad(grad(f))`), with `tfun.vmap` and with `torch.func`.

    Complex inputs follow JAX's convention: for a real loss `L(z)` the gradient is
    `dL/dx + i dL/dy`'s conjugate, `dL/dx - i dL/dy` (`grad(lambda z: abs(z)**2)(3+4j)`
    is `6-8j`), the conjugate of what torch's `.backward()` leaves in `z.grad`.

    **Arguments:**

    - `fun`: a function whose output is a scalar (shape `()`) real floating-point tensor
      (or `(output, aux)` with `has_aux=True`). Arguments may be pytrees of tensors.
    - `argnums`: an int or a tuple of ints: which positional arguments to differentiate.
      Their leaves must be floating-point or complex tensors (or Python floats, which
      become 0-d tensors of the default dtype); integer leaves raise `ArgumentTypeError`
      unless `allow_int`.
    - `has_aux`: whether `fun` returns `(output, aux)`.
    - `holomorphic`: whether `fun` is holomorphic (complex inputs, complex scalar output);
      the gradient is then the complex derivative `f'(z)` (`grad(lambda z: z**2,
      holomorphic=True)(z) == 2*z`), as in JAX. Without it the output must be real.
    - `allow_int`: as in JAX, accept integer (and boolean) leaves in the arguments
      `argnums` names: they are not differentiated, and their gradient is a zero tensor of
      their dtype (JAX gives `float0` zeros, a dtype torch does not have).

    **Returns:** a function with `fun`'s signature returning the gradient, with the
    structure of argument `argnums` (a tuple of those when `argnums` is a tuple), or
    `(gradient, aux)` with `has_aux=True`.
    """
    op = "tfun.grad"
    nums, single = normalize_argnums(op, argnums)
    _check_holomorphic_flag(op, holomorphic)
    _check_allow_int_flag(op, allow_int)

    @_compat.wraps(fun)
    def grad_fun(*args: Any, **kwargs: Any) -> Any:
        _, g, aux = _value_and_grad_call(op, fun, nums, single, has_aux, args, kwargs, holomorphic, allow_int)
        return (g, aux) if has_aux else g

    grad_fun._tfun_grad_spec = GradSpec(op, fun, nums, single, has_aux, holomorphic, allow_int, grad_fun)  # type: ignore[attr-defined]
    return grad_fun


# --------------------------------------------------------------------------------------
# jvp / vjp
# --------------------------------------------------------------------------------------


def _check_same_tree(op: str, what: str, fun: Callable[..., Any], a: Any, b: Any, names: tuple[str, str]) -> None:
    mismatch = None
    try:
        broadcast_prefix(a, b, lambda x: not _is_node(x))
    except PrefixMismatch as e:
        mismatch = (e.path, e.prefix_node, e.full_node)
    if mismatch is None:
        try:
            broadcast_prefix(b, a, lambda x: not _is_node(x))
        except PrefixMismatch as e:
            mismatch = (e.path, e.full_node, e.prefix_node)
    if mismatch is not None:
        path, node_a, node_b = mismatch
        raise StructureMismatchError(
            format_message(
                f"{op}: {names[0]} and {names[1]} must have the same pytree structure.",
                [f"{what}{path}: {names[0]} has {describe_value(node_a)}, {names[1]} has {describe_value(node_b)}"],
                function=describe(fun),
                revise=f"Give {names[1]} the structure of {names[0]}.",
            )
        )


def _call_flat(
    op: str,
    fun: Callable[..., Any],
    has_aux: bool,
    box: dict[str, Any],
    primals: Partition,
    diff: Sequence[torch.Tensor],
) -> tuple[list[Any], list[Any]]:
    """Call `fun` on the primals with their differentiated (dynamic) leaves replaced by `diff`:
    its flat outputs and packed aux (the output structure is left in `box["out_td"]`)."""
    out = fun(*primals.combine(diff))
    aux = None
    if has_aux:
        out, aux = _split_aux(op, fun, out)
    ol, box["out_td"] = tree_flatten(out)
    return list(ol), list(_pack_aux(box, aux))


def jvp(
    fun: Callable[..., Any], primals: Sequence[Any], tangents: Sequence[Any], has_aux: bool = False
) -> tuple[Any, ...]:
    """Forward-mode Jacobian-vector product, as `jax.jvp`.

    **Arguments:**

    - `fun`: a function of `len(primals)` positional pytree arguments.
    - `primals`: a tuple or list of the arguments.
    - `tangents`: a tuple or list with the structure of `primals`; each tangent leaf has
      its primal's shape and dtype. Tangents of integer or boolean primals are ignored
      (those primals are constants).
    - `has_aux`: whether `fun` returns `(output, aux)`.

    **Returns:** `(primals_out, tangents_out)`, or `(primals_out, tangents_out, aux)` with
    `has_aux=True`; `tangents_out` has the structure of `primals_out`.
    """
    return _jvp("tfun.jvp", fun, primals, tangents, has_aux)


def _jvp(op: str, fun: Callable[..., Any], primals: Sequence[Any], tangents: Sequence[Any], has_aux: bool) -> tuple[Any, ...]:
    for name, v in (("primals", primals), ("tangents", tangents)):
        if not isinstance(v, (tuple, list)):
            raise ArgumentTypeError(
                format_message(
                    f"{op}: {name} must be a tuple or list of the function's arguments, got {describe_value(v)}.",
                    function=describe(fun),
                    revise=f"Wrap a single argument as `({name[:-1]},)`.",
                )
            )
    primals, tangents = tuple(primals), tuple(tangents)
    _check_same_tree(op, "primals", fun, primals, tangents, ("primals", "tangents"))
    pl, ptd = tree_flatten_with_path(primals)
    tl, _ = tree_flatten(tangents)
    diff_idx: list[int] = []
    leaves: list[Any] = []
    diff_tangents: list[torch.Tensor] = []
    bullets = []
    for k, ((p, x), t) in enumerate(zip(pl, tl)):
        path = f"primals{keystr(p)}"
        if isinstance(x, (float, complex)) and not isinstance(x, bool):
            x = _as_diff_leaf(op, fun, path, x)
        leaves.append(x)
        if isinstance(x, torch.Tensor) and is_inexact(x):
            if not isinstance(t, torch.Tensor):
                t = torch.as_tensor(t, dtype=x.dtype)
            if t.shape != x.shape or t.dtype != x.dtype:
                bullets.append(
                    f"{path}: primal is a tensor of shape {tuple(x.shape)} and dtype {x.dtype}, tangent is a "
                    f"tensor of shape {tuple(t.shape)} and dtype {t.dtype}"
                )
            diff_idx.append(k)
            diff_tangents.append(t)
    if bullets:
        raise TensorMismatchError(
            format_message(
                f"{op}: each tangent must have the shape and dtype of its primal.",
                bullets,
                function=describe(fun),
                revise="Give each tangent its primal's shape and dtype.",
            )
        )
    prim = Partition(ptd, tuple(leaves), tuple(diff_idx), primals)
    box: dict[str, Any] = {}

    def f_flat(*diff: torch.Tensor) -> tuple[list[Any], list[Any]]:
        return _call_flat(op, fun, has_aux, box, prim, diff)

    diff_primals = tuple(_without_overlap(x) for x in prim.dynamic)
    _forward_ad_ready()
    if diff_primals:
        out_l, tan_l, aux_l = torch.func.jvp(f_flat, diff_primals, tuple(diff_tangents), has_aux=True)  # type: ignore[misc]
    else:
        out_l, aux_l = f_flat()
        tan_l = [torch.zeros_like(o) if isinstance(o, torch.Tensor) else o for o in out_l]
    out = tree_unflatten(box["out_td"], out_l)
    tan = tree_unflatten(box["out_td"], tan_l)
    if has_aux:
        return out, tan, _unpack_aux(box, aux_l)
    return out, tan


def linearize(fun: Callable[..., Any], *primals: Any, has_aux: bool = False) -> tuple[Any, ...]:
    """`fun`'s value at `primals`, and its Jacobian-vector product there as a function of the
    tangents, as `jax.linearize`.

    Type: `(a -> b) -> a -> (b, T a -> T b)`. Semantics, as a Python function:

    ```python
    def linearize(fun, *primals):
        out = fun(*primals)
        f_jvp = lambda *tangents: jvp(fun, primals, tangents)[1]
        return out, f_jvp
    ```

    **Arguments:**

    - `fun`: a function of `len(primals)` positional pytree arguments.
    - `*primals`: the point to linearize at.
    - `has_aux`: whether `fun` returns `(output, aux)`.

    **Returns:** `(primals_out, f_jvp)`, or `(primals_out, f_jvp, aux)` with `has_aux=True`.
    `f_jvp(*tangents)` takes one tangent per primal, each with its primal's structure, shapes
    and dtypes (as `jvp`'s `tangents`), and returns the tangent of the output.

    Unlike JAX, which evaluates `fun` once and keeps its linearization, `f_jvp` runs `fun`'s
    forward again with each call (a forward-mode `jvp` at `primals`): the same values, and
    no graph is kept between calls. So `fun`'s control flow reads data as it does eagerly,
    and `f_jvp` composes with `tfun.vmap` (`tfun.vmap(f_jvp)(basis)` is the Jacobian) and
    `tfun.jit`. (`torch.func.linearize` traces `fun` with `make_fx`, which cannot read a
    predicate's value: a data-dependent `tfun.lax.cond` there is refused with an error that
    names this function.)
    """
    op = "tfun.linearize"
    primals = tuple(primals)
    if not isinstance(has_aux, bool):
        raise ArgumentTypeError(format_message(f"{op}: has_aux must be a bool, got {describe_value(has_aux)}."))
    out = fun(*primals)
    aux = None
    if has_aux:
        out, aux = _split_aux(op, fun, out)

    def f_jvp(*tangents: Any) -> Any:
        return _jvp(op, fun, primals, tangents, has_aux)[1]

    f_jvp.__wrapped__ = fun  # type: ignore[attr-defined]  # (errors name the user's function)
    return (out, f_jvp, aux) if has_aux else (out, f_jvp)


def _traced_reverse_mode(
    op: str, fun: Callable[..., Any], f_flat: Callable[..., Any], leaves: Sequence[torch.Tensor]
) -> tuple[bool, bool]:
    """Whether `tfun.vjp` differentiates with `torch.autograd.grad` (as `tfun.grad` does when
    traced, see `_value_and_grad_call`) rather than `torch.func.vjp`, and whether it does so
    first-order for a closed-over tensor: `(autograd, first_order_closure)`.

    Autograd when traced by Dynamo, which cannot trace a torch.func transform around tfun's
    control-flow ops or a custom function's rule, but not inside a torch.func transform or a
    HOP body. A function that closes over a tensor that requires grad (a module's parameter)
    has cotangents that depend on that tensor and stay differentiable (torch.func keeps them
    so, with the loops inside unrolled: `_hop.unroll_scope`), unless no traced derivative
    encloses this one and the function has loop ops or custom rules inside: then autograd
    computes them first-order, with the loops kept as loop ops, as `tfun.grad`'s training step
    (`_first_order`). `f_flat(*leaves)` returns `(differentiable outputs, rest)`."""
    if not (len(leaves) > 0 and _context.is_tracing()) or _context.functorch_active() or _hop.in_body():
        # inside a torch.func transform (`vmap` of `vjp` under tfun.jit) autograd would see
        # the transform's wrapped tensors, whose graph it cannot follow; inside a HOP body
        # autograd is off: torch.func.vjp there
        return False, False
    if torch.is_grad_enabled() and not any(x.requires_grad for x in leaves):
        outermost = not _hop.in_derivative()
        closed, lowered_ops, custom_ops = _probe(f_flat, leaves, derivative=True)
        if closed:
            return (True, True) if outermost and (lowered_ops or custom_ops) else (False, False)
    return True, False


def _traced_vjp(
    op: str, fun: Callable[..., Any], f_flat: Callable[..., Any], primals: Sequence[torch.Tensor], closure: bool = False
) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], list[torch.Tensor]], Any]:
    """`torch.func.vjp(f_flat, *primals, has_aux=True)` by reverse-mode autograd, for traced
    code: `f_flat` runs once, on fresh leaves (or, where a primal requires grad and grad mode
    is on, on a view of it, so that an outer `.backward()` reaches it through the cotangents,
    as with torch.func); the returned function pulls back with `torch.autograd.grad`, keeping
    the graph so that it may be called more than once. Custom functions use their rules
    (`custom_vjp`'s bwd, `custom_jvp`'s transposed rule), and tfun.lax control flow lowers to
    torch's HOPs, which autograd differentiates. With `closure` (`_traced_reverse_mode`), the
    function closes over a tensor that requires grad: its outputs stay attached to it and the
    cotangents are kept first-order, anchored on those outputs."""
    outer = torch.is_grad_enabled() and any(x.requires_grad for x in primals)
    # outermost, with loop ops or custom rules inside: kept first-order (see `_value_and_grad_call`)
    may_keep_loops = outer and not _hop.in_derivative()
    with torch.enable_grad():
        leaves = [x.view_as(x) if outer and x.requires_grad else grad_leaf(x) for x in primals]
        lowered, customs = _hop.lowerings(), _hop.custom_rules()
        cause = f"a primal of {op} requires grad" if outer else None
        # the cotangents stay differentiable: loops unrolled, unless they may be kept first-order
        with _hop.unroll_scope(outer and not may_keep_loops, derivative=True, cause=cause):
            diff_out, rest_aux = f_flat(*leaves)
        kept_ops = _hop.lowerings() != lowered or _hop.custom_rules() != customs
        first_order = closure or (may_keep_loops and kept_ops)
        if outer and not first_order and _hop.lowerings() != lowered:  # (every lowering refuses it first)
            _refuse_second_order(op, fun)
        if outer and not first_order and _hop.custom_rules() != customs:
            _refuse_custom_second_order(op, fun)
    # outputs that do not depend on the primals (no graph) get no cotangent: their
    # contribution is zero
    live = [k for k, o in enumerate(diff_out) if o.requires_grad]
    graph_out = [diff_out[k] for k in live]

    def pull(cts: list[torch.Tensor]) -> list[torch.Tensor]:
        # A cotangent that requires grad (under grad mode) makes the result differentiable in
        # it too (the pullback is linear in it): exact through plain ops, but through a loop op
        # that derivative is a second one, so it is kept first-order there, as the primals'.
        ct_grad = torch.is_grad_enabled() and any(c.requires_grad for c in cts)
        keep = first_order or (ct_grad and kept_ops)
        found: Sequence[torch.Tensor | None] = [None] * len(leaves)
        if len(graph_out) > 0:
            with torch.enable_grad():
                found = torch.autograd.grad(
                    graph_out,
                    leaves,
                    [cts[k] for k in live],
                    allow_unused=True,
                    retain_graph=True,
                    create_graph=(outer or ct_grad) and not keep,
                )
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, found)]
        if keep:
            # (the views of the primals that require grad, or the outputs, through which the
            # closed-over tensor's graph runs; and the cotangents that require grad)
            anchors = [x for x, p in zip(leaves, primals) if p.requires_grad] if outer else []
            anchors += (graph_out if closure else []) + [c for c in cts if c.requires_grad]
            why = cause if outer else closure_cause(fun) if closure else f"a cotangent given to {op}'s pullback requires grad"
            grads = list(_keep_first_order(op, fun, grads, anchors, why or ""))
        return grads

    if not outer and not closure:
        diff_out = [o.detach() for o in diff_out]
        rest_aux = tree_map(lambda a: a.detach() if isinstance(a, torch.Tensor) else a, rest_aux)
    return diff_out, pull, rest_aux


def vjp(fun: Callable[..., Any], *primals: Any, has_aux: bool = False) -> tuple[Any, ...]:
    """Reverse-mode vector-Jacobian product, as `jax.vjp`.

    **Arguments:**

    - `fun`: a function of `len(primals)` positional pytree arguments.
    - `*primals`: the arguments. Integer and boolean leaves are constants; their
      cotangents are zero tensors of their dtype (JAX returns `float0` zeros).
    - `has_aux`: whether `fun` returns `(output, aux)`.

    **Returns:** `(primals_out, vjp_fn)`, or `(primals_out, vjp_fn, aux)` with
    `has_aux=True`. `vjp_fn(cotangent)` takes a pytree with the structure, shapes and
    dtypes of `primals_out` and returns a tuple with one cotangent per primal, each with
    that primal's structure. `vjp_fn` may be called more than once. With complex values it
    is JAX's pullback, the transpose of the tangent map (for a holomorphic `f`,
    `vjp_fn(ct) = ct * f'(z)`), not torch's conjugate transpose.

    `vjp_fn` is a pytree, as JAX's: its leaves are the primals' leaves (`fun` and `has_aux`
    are static), so it may be returned from `tfun.jit`, be part of a `custom_vjp` `fwd`'s
    residuals (JAX's nestable-vjp idiom), or go through `tfun.tree` functions.

    Inside `tfun.jit`, `tfun.vjp` differentiates with autograd, as `tfun.grad` does, so
    `tfun.lax` control flow and custom rules compile into one graph with it when `vjp_fn` is
    called inside the same jitted function. Anywhere else, a `vjp_fn` made in traced code
    no longer has that graph, and one rebuilt from its leaves has none: it **recomputes**,
    running `tfun.vjp(fun, *primals, has_aux=has_aux)` on the primals it holds (the forward
    runs again, as under `tfun.checkpoint`) and pulling back with that. Called eagerly
    (`tfun.jit(partial(tfun.vjp, f))(x)` and then `vjp_fn(ct)`) the forward runs eagerly
    once, at the first call, and later calls reuse that pullback; called inside another
    jitted function, or in a `custom_vjp`'s `bwd`, the forward is traced into that graph.
    The recomputation reads the primals' values at the time of the call.
    """
    op = "tfun.vjp"
    pl, ptd = tree_flatten_with_path(primals)
    diff_idx: list[int] = []
    leaves: list[Any] = []
    for k, (p, x) in enumerate(pl):
        if isinstance(x, (float, complex)) and not isinstance(x, bool):
            x = _as_diff_leaf(op, fun, f"primals{keystr(p)}", x)
        leaves.append(x)
        if isinstance(x, torch.Tensor) and is_inexact(x):
            diff_idx.append(k)
    prim = Partition(ptd, tuple(leaves), tuple(diff_idx), primals)
    box: dict[str, Any] = {}

    def f_flat(*diff: torch.Tensor) -> tuple[list[Any], Any]:
        ol, al = _call_flat(op, fun, has_aux, box, prim, diff)
        _check_tensor_outputs(op, fun, tree_unflatten(box["out_td"], ol))
        # torch.func.vjp differentiates inexact tensor outputs only; the rest ride along as aux.
        box["inexact"] = [isinstance(o, torch.Tensor) and is_inexact(o) for o in ol]
        diff_out = [o for o, d in zip(ol, box["inexact"]) if d]
        rest = [o for o, d in zip(ol, box["inexact"]) if not d]
        if not diff_out and diff:
            # torch.func.vjp refuses a function without differentiable outputs; JAX's vjp of
            # one is fine (every cotangent is zero): a zero output tied to the inputs stands in
            box["anchor"] = True
            diff_out = [sum((d.real if d.is_complex() else d).sum() * 0 for d in diff)]
        return diff_out, (rest, list(al))

    diff_primals = prim.dynamic
    torch_vjp_fn: Callable[[list[torch.Tensor]], Sequence[Any]] | None
    autograd, first_order_closure = _traced_reverse_mode(op, fun, f_flat, diff_primals)
    if autograd:
        diff_out, torch_vjp_fn, (rest, aux_l) = _traced_vjp(op, fun, f_flat, diff_primals, first_order_closure)
    elif diff_primals:
        # traced, the cotangents depend on a closed-over tensor that requires grad: they stay
        # differentiable, so the loops inside are unrolled (torch's HOPs have no second derivative)
        _hop.note_func_reverse()
        traced_closure = _context.is_tracing() and not _context.functorch_active()
        with _hop.unroll_scope(
            traced_closure, derivative=True, cause=closure_cause(fun) if traced_closure else None
        ):
            diff_out, torch_vjp_fn, (rest, aux_l) = torch.func.vjp(f_flat, *diff_primals, has_aux=True)  # type: ignore[misc]
    else:
        (diff_out, (rest, aux_l)), torch_vjp_fn = f_flat(), None
    anchor = diff_out[0] if box.get("anchor") else None
    if anchor is not None:
        diff_out = []
    it_d, it_r = iter(diff_out), iter(rest)
    out_l = [next(it_d) if d else next(it_r) for d in box["inexact"]]
    out = tree_unflatten(box["out_td"], out_l)

    def vjp_fn(ct: Any) -> tuple[Any, ...]:
        _check_same_tree(op, "cotangent", fun, out, ct, ("primals_out", "cotangent"))
        cl = tree_flatten(ct)[0]
        ol_paths = tree_flatten_with_path(out)[0]
        bullets = []
        cts = []
        for (p, o), c in zip(ol_paths, cl):
            if isinstance(o, torch.Tensor):
                c = torch.as_tensor(c, dtype=o.dtype) if not isinstance(c, torch.Tensor) else c
                if c.shape != o.shape or (is_inexact(o) and c.dtype != o.dtype):
                    bullets.append(
                        f"cotangent{keystr(p)}: output is a tensor of shape {tuple(o.shape)} and dtype {o.dtype}, "
                        f"cotangent is a tensor of shape {tuple(c.shape)} and dtype {c.dtype}"
                    )
            cts.append(c)
        if bullets:
            raise TensorMismatchError(
                format_message(
                    f"{op}: the cotangent must have the shapes and dtypes of the function's output.",
                    bullets,
                    function=describe(fun),
                    revise="Pass a cotangent with the output's shapes and dtypes.",
                )
            )
        diff_cts = [conj_ct(c) for c, d in zip(cts, box["inexact"]) if d]
        if anchor is not None:
            diff_cts = [torch.zeros_like(anchor)]
        grads = [conj_ct(g) for g in torch_vjp_fn(diff_cts)] if torch_vjp_fn is not None else []
        # the constants' cotangents: zeros of their dtype (JAX's float0 zeros); the rest as they are
        zeros = prim.map_static(lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x)
        return tuple(zeros.combine(grads))

    pullback = _VjpFunction(fun, primals, has_aux, vjp_fn, _note_live_pullback(_hop.trace_key()))
    if has_aux:
        return out, pullback, _unpack_aux(box, aux_l)
    return out, pullback


class _VjpFunction:
    """The `vjp_fn` that `tfun.vjp` returns: callable on a cotangent, and a pytree (as JAX's
    `Partial`) whose leaves are the primals' leaves, its function and `has_aux` static.

    It pulls back with the pullback built when `tfun.vjp` ran (`pull`), where that pullback
    still holds its autograd graph: always for one built eagerly (`trace == 0`), and in the
    same trace for one built in traced code. Elsewhere (returned from `tfun.jit`, called
    in another jitted function, or rebuilt from its leaves by `tree_unflatten`, as a
    `custom_vjp` residual is) it recomputes: `tfun.vjp(fun, *primals)` runs the forward
    again and pulls back with that, as `tfun.checkpoint` recomputes. Outside traced code
    the recomputed pullback is kept, so the forward runs again once.
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        primals: tuple[Any, ...],
        has_aux: bool,
        pull: Callable[[Any], tuple[Any, ...]] | None,
        trace: int,
    ) -> None:
        self.fun = fun
        self.primals = primals
        self.has_aux = has_aux
        self._pull = pull
        self._trace = trace
        self._recomputed: Any = None

    def __call__(self, ct: Any) -> tuple[Any, ...]:
        pull = self._pull
        if pull is not None and (self._trace == 0 or _hop.trace_key() == self._trace):
            return pull(ct)
        if _context.is_tracing():
            # in another trace: the forward is traced again there (a pullback kept from an
            # eager call holds an eager graph, which that trace cannot follow)
            return vjp(self.fun, *self.primals, has_aux=self.has_aux)[1](ct)
        if self._recomputed is None:
            self._recomputed = vjp(self.fun, *self.primals, has_aux=self.has_aux)[1]
        return self._recomputed(ct)

    def __repr__(self) -> str:
        return f"<tfun.vjp function of {describe(self.fun)}>"


def _flatten_vjp_function(v: _VjpFunction) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    return (v.primals,), (v.fun, v.has_aux)


def _unflatten_vjp_function(meta: tuple[Any, ...], children: Any) -> _VjpFunction:
    (primals,) = children
    return _VjpFunction(meta[0], tuple(primals), meta[1], None, 0)


register_pytree_node(_VjpFunction, _flatten_vjp_function, _unflatten_vjp_function)


def _is_vjp_function(v: Any) -> bool:
    return isinstance(v, _VjpFunction)


#: The traces (by `_hop.trace_key`) in which `tfun.vjp` built a pullback; the newest few.
_LIVE_PULLBACK_TRACES: collections.OrderedDict[int, None] = collections.OrderedDict()


@_hop.assume_constant
def _note_live_pullback(key: int) -> int:
    """`key`, noting that trace `key` built a pullback. Run for real while Dynamo traces (an
    assumed constant), so `_drop_live_pullbacks` knows it without guards."""
    if key:
        _LIVE_PULLBACK_TRACES[key] = None
        while len(_LIVE_PULLBACK_TRACES) > 64:
            _LIVE_PULLBACK_TRACES.popitem(last=False)
    return key


@_hop.assume_constant
def _built_live_pullbacks() -> bool:
    """Whether the trace running now built a pullback. An assumed constant, run for real at
    trace time (as `_hop.trace_key`'s own escape hatch): no guard, and no trace of
    `_context.is_tracing`."""
    return _hop.escaped_trace_key() in _LIVE_PULLBACK_TRACES


def _drop_live_pullbacks(out: Any) -> Any:
    """Traced, at the end of a `tfun.jit` function: its vjp functions without their pullback
    (it holds the trace's autograd graph, which Dynamo would otherwise return as tensors:
    torch 2.13's AOTAutograd fails on some, as a scan's). Outside, they recompute. A trace that
    built none skips the walk over `out`: walking it traces optree's registry, whose guards
    cost every call of the compiled function about 25 µs."""
    if not _built_live_pullbacks():
        return out
    if not any(_is_vjp_function(v) for v in tree_leaves(out, is_leaf=_is_vjp_function)):
        return out
    return tree_map(
        lambda v: _VjpFunction(v.fun, v.primals, v.has_aux, None, 0) if _is_vjp_function(v) else v,
        out,
        is_leaf=_is_vjp_function,
    )


_hop.JIT_OUTPUT_HOOKS.append(_drop_live_pullbacks)


# --------------------------------------------------------------------------------------
# jacfwd / jacrev / hessian
# --------------------------------------------------------------------------------------


def _check_tensor_outputs(op: str, fun: Callable[..., Any], out: Any) -> None:
    """Every output leaf of a differentiated function must be a tensor (torch.func would
    otherwise fail inside with "Expected tensors, got unsupported type")."""
    bad = [(p, o) for p, o in tree_flatten_with_path(out)[0] if not isinstance(o, torch.Tensor)]
    if bad:
        raise ArgumentTypeError(
            format_message(
                f"{op}: every output leaf of the function must be a tensor, but some are not:",
                [f"output{keystr(p)}: {_describe_value(o)}" for p, o in bad],
                function=describe(fun),
                revise="Return tensors there (`torch.as_tensor(v)` for a constant, whose derivative is zero), or "
                "return the other values as aux with has_aux=True.",
            )
        )


def _describe_value(v: Any) -> str:
    if isinstance(v, bool):
        return f"a Python bool ({v!r})"
    if isinstance(v, (int, float, complex)):
        return f"a Python {type(v).__name__} ({v!r})"
    return f"a {type(v).__qualname__}"


def _check_jac_outputs(op: str, fun: Callable[..., Any], out: Any, forward: bool, holomorphic: bool) -> None:
    """JAX's rules: holomorphic=True wants complex outputs; jacrev without it, real ones."""
    _check_tensor_outputs(op, fun, out)
    pl = tree_flatten_with_path(out)[0]
    if holomorphic:
        bad = [(p, o) for p, o in pl if isinstance(o, torch.Tensor) and not o.is_complex()]
        head = f"{op}: with holomorphic=True every output must be complex."
        revise = "Return complex tensors, or pass holomorphic=False for a function with real outputs."
    elif not forward and any(isinstance(o, torch.Tensor) and not is_inexact(o) for _, o in pl):
        # (torch.func.vjp's raw RuntimeError otherwise, hunt 29 F7; JAX: a TypeError)
        bad = [(p, o) for p, o in pl if isinstance(o, torch.Tensor) and not is_inexact(o)]
        head = f"{op}: every output must be a floating-point tensor, as in JAX (an integer or bool output has no derivative)."
        revise = (
            "Return floating-point tensors (`.to(torch.get_default_dtype())`), or return the integer outputs "
            "as auxiliary data (`has_aux=True`)."
        )
    elif not forward:
        bad = [(p, o) for p, o in pl if isinstance(o, torch.Tensor) and o.is_complex()]
        head = f"{op}: without holomorphic=True every output must be real, as in JAX."
        revise = (
            "Pass holomorphic=True for a holomorphic function; otherwise differentiate the real and "
            "imaginary parts (`torch.view_as_real`) or use `tfun.vjp` directly."
        )
    else:
        return
    if bad:
        raise ArgumentTypeError(
            format_message(
                head,
                [f"output{keystr(p)}: a tensor of shape {tuple(o.shape)} and dtype {o.dtype}" for p, o in bad],
                function=describe(fun),
                revise=revise,
            )
        )


def _without_overlap(x: torch.Tensor) -> torch.Tensor:
    """A primal for torch's forward mode, which copies the tangent into the primal's layout
    and refuses one whose elements share memory (an expanded, stride-0 view: "more than one
    element of the written-to tensor refers to a single memory location"). Such a primal is
    made contiguous (same values; JAX takes any array, hunt 30 F2); others are kept as they are."""
    if any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
        return x.contiguous()
    return x


def _basis(like: torch.Tensor) -> torch.Tensor:
    """The standard basis of `like`'s space, stacked: shape `(numel,) + like.shape`."""
    n = like.numel()
    return torch.eye(n, dtype=like.dtype, device=like.device).reshape((n, *like.shape))


def _jacfwd_flat(f_flat: Callable[..., Any], leaves: Sequence[torch.Tensor]) -> tuple[list[list[Any]], Any]:
    """`jac[k][i]` (output k by input i, shape `out_k.shape + in_i.shape`) by forward mode:
    one `vmap` over the basis tangents of each input. Works for complex values."""
    _forward_ad_ready()
    leaves = tuple(_without_overlap(x) for x in leaves)
    outs, aux = f_flat(*leaves)
    cols: list[list[torch.Tensor]] = []  # cols[i][k]
    for i, x in enumerate(leaves):
        zeros = tuple(torch.zeros_like(y) for y in leaves)

        def tangent_out(t: torch.Tensor, i: int = i, zeros: tuple[torch.Tensor, ...] = zeros) -> tuple[Any, ...]:
            tans = zeros[:i] + (t,) + zeros[i + 1 :]
            return tuple(torch.func.jvp(lambda *p: f_flat(*p)[0], leaves, tans)[1])

        if x.numel() == 0:
            per_out = [torch.zeros((0, *o.shape), dtype=o.dtype, device=o.device) for o in outs]
        else:
            per_out = list(torch.func.vmap(tangent_out)(_basis(x)))
        cols.append([c.movedim(0, -1).reshape((*o.shape, *x.shape)) for c, o in zip(per_out, outs)])
    return [[cols[i][k] for i in range(len(leaves))] for k in range(len(outs))], aux


def _jacrev_flat(f_flat: Callable[..., Any], leaves: Sequence[torch.Tensor]) -> tuple[list[list[Any]], Any]:
    """`jac[k][i]` by reverse mode with torch's pullback (the caller conjugates it to
    JAX's): one `vmap` over the basis cotangents of each output. Works for complex values."""
    outs, pull, aux = torch.func.vjp(f_flat, *leaves, has_aux=True)  # type: ignore[misc]
    outs = list(outs)
    rows: list[list[Any]] = []
    for k, o in enumerate(outs):
        if o.numel() == 0:
            rows.append([torch.zeros((*o.shape, *x.shape), dtype=x.dtype, device=x.device) for x in leaves])
            continue

        def pull_k(c: torch.Tensor, k: int = k) -> tuple[Any, ...]:
            cts = [torch.zeros_like(p) for p in outs]
            cts[k] = c
            return tuple(pull(tuple(cts)))

        per_in = torch.func.vmap(pull_k)(_basis(o))
        rows.append([g.reshape((*o.shape, *x.shape)) for g, x in zip(per_in, leaves)])
    return rows, aux


def _jac(op: str, forward: bool, fun: Callable[..., Any], argnums: Any, has_aux: bool, holomorphic: bool) -> Callable[..., Any]:
    """`jacfwd` (`forward`) or `jacrev`. (A flag, not `torch.func.jacfwd` compared by identity:
    Dynamo cannot trace `is` between two functions, and `tfun.jacrev(f)` may be called inside
    `tfun.jit`.)"""
    nums, single = normalize_argnums(op, argnums)
    _check_holomorphic_flag(op, holomorphic)

    @_compat.wraps(fun)
    def jac_fun(*args: Any, **kwargs: Any) -> Any:
        argnums_r = resolve_argnums(op, fun, nums, len(args))
        fl = _DiffArgs(op, fun, args, argnums_r)
        if holomorphic:
            _check_complex_inputs(op, fun, fl.paths, fl.leaves)
        elif forward:
            bad = [
                f"{p}: a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
                for p, x in zip(fl.paths, fl.leaves)
                if x.is_complex()
            ]
            if bad:
                raise ArgumentTypeError(
                    format_message(
                        f"{op}: without holomorphic=True every differentiated input must be real, as in JAX "
                        "(forward mode gives only the derivative along the real axis of a complex input).",
                        bad,
                        function=describe(fun),
                        revise="Pass holomorphic=True for a holomorphic function; otherwise differentiate with "
                        "respect to the real and imaginary parts (`torch.view_as_real`), or use `tfun.jvp` "
                        "directly.",
                    )
                )
        box: dict[str, Any] = {}

        def f_flat(*flat: torch.Tensor) -> tuple[tuple[Any, ...], list[Any]]:
            out = fun(*fl.rebuild_args(flat), **kwargs)
            aux = None
            if has_aux:
                out, aux = _split_aux(op, fun, out)
            _check_jac_outputs(op, fun, out, forward, holomorphic)
            ol, box["out_td"] = tree_flatten(out)
            al = _pack_aux(box, aux)
            return tuple(ol), list(al)

        if forward:
            # torch.func.jacfwd refuses complex inputs and outputs, which JAX allows
            jac, aux_l = _jacfwd_flat(f_flat, fl.leaves)
        elif any(x.is_complex() for x in fl.leaves):
            _hop.note_func_reverse()
            jac, aux_l = _jacrev_flat(f_flat, fl.leaves)  # torch.func.jacrev refuses complex inputs
        elif _has_traced_loops(f_flat, fl.leaves):
            jac, aux_l = _traced_jacrev(op, fun, f_flat, fl.leaves)
        else:
            _hop.note_func_reverse()
            jac, aux_l = torch.func.jacrev(f_flat, argnums=tuple(range(len(fl.leaves))), has_aux=True)(*fl.leaves)
        per_out = []
        for row in jac:
            if not forward:
                # each row is a pullback of a (real) basis cotangent: JAX's is its conjugate
                row = [conj_ct(r) for r in row]
            per_arg = fl.split(list(row))
            per_out.append(per_arg[0] if single else tuple(per_arg))
        result = tree_unflatten(box["out_td"], per_out)
        if has_aux:
            return result, _unpack_aux(box, aux_l)
        return result

    return jac_fun


_JAC_DOC = """

    **Arguments:**

    - `fun`: a function of pytree arguments returning a pytree of tensors (or
      `(output, aux)` with `has_aux=True`).
    - `argnums`: an int or a tuple of ints: which positional arguments to differentiate
      (floating-point or complex leaves only).
    - `has_aux`: whether `fun` returns `(output, aux)`.
    - `holomorphic`: whether `fun` is holomorphic: complex inputs and outputs, and the
      Jacobian holds the complex derivatives. Without it, as in JAX, `jacrev` needs real
      outputs (complex inputs are fine: for a real output its row is JAX's gradient, the
      conjugate of torch's) and `jacfwd` real inputs; other cases raise `ArgumentTypeError`.

    **Returns:** a function returning the Jacobian, a pytree with the output's
    structure whose every leaf is replaced by a pytree with the structure of argument
    `argnums` (a tuple of such when `argnums` is a tuple) holding tensors of shape
    `out.shape + in.shape`; or `(jacobian, aux)` with `has_aux=True`.
    """


def _has_traced_loops(f_flat: Callable[..., Any], leaves: Sequence[torch.Tensor]) -> bool:
    """Traced code outside torch.func transforms and HOP bodies only: whether `f_flat` lowers a
    loop or branch op (a probe on detached leaves; its ops feed nothing and AOTAutograd drops
    them). torch.func.jacrev cannot be traced around such an op; `_traced_jacrev` takes it."""
    if not (len(leaves) > 0 and _context.is_tracing()) or _context.functorch_active() or _hop.in_body():
        return False
    return _probe(f_flat, leaves, derivative=False)[1]


#: Most output elements whose Jacobian a traced `tfun.jacrev` with a loop or branch inside
#: builds without a `PerformanceWarning`: it pulls back one basis cotangent per output element,
#: so the compiled graph holds that many backwards of the loop. Measured on a 2-core CPU, torch
#: 2.13, Inductor (`benchmarks/compile_time.py --jacrev`, benchmarks/RESULTS.md): the first call
#: for a tanh RNN of 50 steps takes 6.2 s at 4 output elements, 22.1 s at 32 and 40.2 s at 64.
WARN_JACREV_ROWS = 32


@_hop.assume_constant
def _escape_warn_jacrev_rows(op: str, fn: str, where: tuple[str, int] | None, rows: int) -> None:
    """Plain Python at trace time: the `PerformanceWarning` of a traced jacrev of many output
    elements, at the function's own file:line."""
    message = (
        f"{op} ({fn}): under tfun.jit, with a loop or branch inside, the Jacobian of these {rows} output "
        "elements pulls back one basis cotangent per element (torch.compile cannot trace the vmap JAX uses "
        f"around a loop op), so the compiled graph holds {rows} backwards of the loop and its compile time "
        "grows with them (about half a second each with Inductor for a small RNN on a CPU). If the Jacobian is not "
        "needed inside the compiled function, call tfun.jacrev outside tfun.jit (eagerly it vmaps one "
        "pullback); if only some rows are, pull back those cotangents with tfun.vjp; for a gradient of a "
        "scalar, use tfun.grad (one backward)."
    )
    _funcinfo.warn_at(where, message, PerformanceWarning)


def _traced_jacrev(
    op: str, fun: Callable[..., Any], f_flat: Callable[..., Any], leaves: Sequence[torch.Tensor]
) -> tuple[list[list[torch.Tensor]], Any]:
    """`jac[k][i]` of real outputs by reverse mode in traced code with control flow inside:
    `tfun.vjp`'s traced pullback (`_traced_vjp`, autograd through the HOPs, which Dynamo
    traces) applied to one basis cotangent per output element, so the graph holds one backward
    per output element (JAX's jacrev vmaps one pullback instead). Arguments or closed-over
    tensors that require grad are handled as in `tfun.vjp`: kept first-order with loop ops,
    or exact with the loops unrolled."""

    def f_vjp(*ls: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
        outs, aux = f_flat(*ls)
        return list(outs), aux

    autograd, first_order_closure = _traced_reverse_mode(op, fun, f_vjp, leaves)
    if not autograd:
        # a closed-over tensor that requires grad, inside another traced derivative (or with
        # `unroll=True` loops): exact, with the loops unrolled (`_hop.unroll_scope`)
        _hop.note_func_reverse()
        with _hop.unroll_scope(True, derivative=True, cause=closure_cause(fun)):
            return torch.func.jacrev(f_flat, argnums=tuple(range(len(leaves))), has_aux=True)(*leaves)  # type: ignore[no-any-return]
    outs, pull, aux = _traced_vjp(op, fun, f_vjp, leaves, first_order_closure)
    rows = sum(o.numel() for o in outs)
    if rows > WARN_JACREV_ROWS:
        _escape_warn_jacrev_rows(op, describe(fun), _funcinfo.location(fun), rows)
    jac: list[list[torch.Tensor]] = []
    for k, o in enumerate(outs):
        n = o.numel()
        if n == 0:
            jac.append([torch.zeros((*o.shape, *x.shape), dtype=x.dtype, device=x.device) for x in leaves])
            continue
        basis = torch.eye(n, dtype=o.dtype, device=o.device)
        rows = []
        for j in range(n):
            cts = [basis[j].reshape(o.shape) if m == k else torch.zeros_like(q) for m, q in enumerate(outs)]
            rows.append(pull(cts))
        jac.append([torch.stack([r[i] for r in rows]).reshape((*o.shape, *x.shape)) for i, x in enumerate(leaves)])
    return jac, aux


def jacfwd(
    fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False, holomorphic: bool = False
) -> Callable[..., Any]:
    return _jac("tfun.jacfwd", True, fun, argnums, has_aux, holomorphic)


def jacrev(
    fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False, holomorphic: bool = False
) -> Callable[..., Any]:
    return _jac("tfun.jacrev", False, fun, argnums, has_aux, holomorphic)


jacfwd.__doc__ = "The Jacobian by forward mode (`vmap` of `jvp`), as `jax.jacfwd`." + _JAC_DOC
jacrev.__doc__ = (
    "The Jacobian by reverse mode (`vmap` of `vjp`), as `jax.jacrev`. Under `tfun.jit`, with a loop or "
    "branch inside `fun`, it pulls back one basis cotangent per output element instead (torch.compile cannot "
    "trace a `vmap` around a loop op), so the compiled graph grows with the output's size; past 32 output elements "
    "it warns (`tfun.errors.PerformanceWarning`). Outside `tfun.jit` it always vmaps one pullback." + _JAC_DOC
)


def hessian(
    fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False, holomorphic: bool = False
) -> Callable[..., Any]:
    """The Hessian of a scalar function, as `jax.hessian`: `jacfwd(jacrev(fun))`.

    **Arguments:**

    - `fun`: a function returning a scalar tensor (or `(output, aux)` with
      `has_aux=True`).
    - `argnums`: an int or a tuple of ints: which positional arguments to differentiate.
    - `has_aux`: whether `fun` returns `(output, aux)`.
    - `holomorphic`: for a holomorphic `fun` of complex inputs (the second complex
      derivative); without it the inputs must be real, as in JAX.

    **Returns:** a function returning the Hessian: for `argnums=0` and an argument with
    structure `T`, a `T`-of-`T` pytree of tensors of shape `in_i.shape + in_j.shape`
    (output shape first, as in JAX); `(hessian, aux)` with `has_aux=True`.
    """
    inner = _jac("tfun.hessian", False, fun, argnums, has_aux, holomorphic)
    return _jac("tfun.hessian", True, inner, argnums, has_aux, holomorphic)


def stop_gradient(x: Any) -> Any:
    """Stop gradients through every tensor leaf of a pytree, as `jax.lax.stop_gradient`.

    **Arguments:**

    - `x`: a pytree; its tensor leaves are detached (other leaves pass through).

    **Returns:** `x` with every tensor leaf replaced by `leaf.detach()`; works under
    `torch.func` transforms as well as `.backward()`.
    """
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, x)
