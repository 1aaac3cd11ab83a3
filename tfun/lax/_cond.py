"""`cond`, `switch` and `select`: choosing between computations."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .. import _context, _funcinfo, _rules
from .._closures import ClosureCells, Rebound
from .._errors import ArgumentTypeError, ArgumentValueError, format_message
from .._tree import tree_flatten, tree_map, tree_structure, tree_unflatten
from . import _batching, _hop
from ._scan import _encodes_bits, _mark_bits, _unmark

T = TypeVar("T")

_no_operand = object()


def _normalize_operands(op: str, operands: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(_rules.as_tensor_tree(op, f"operands[{i}]", o) for i, o in enumerate(operands))


def _branch_output(op: str, fn: Callable[..., Any], out: Any) -> tuple[Any, list[Any], Any]:
    leaves, treedef = tree_flatten(out)
    if not all(type(x) is torch.Tensor or isinstance(x, torch.Tensor) for x in leaves):
        _hop.check_output_leaves(op, "the branch output", fn, out)
        leaves, treedef = _rules.as_tensor_leaves(op, "the branch output", out)
        out = tree_unflatten(treedef, leaves)
    return out, leaves, treedef


_REVISE_BRANCHES = (
    "Revise the branches so that they all return the same pytree structure with tensors of the same dtype, "
    "shape and device."
)


def _abstract_branch(op: str, b: Callable[..., Any], operands: tuple[Any, ...], name: str) -> tuple[list[Any], Any]:
    """The branch `b` on fake tensors: its output leaves and structure. Python scalars in
    the output stand for the 0-d tensors they become when the branch is taken."""
    leaves, treedef = _rules.abstract_eval(
        b, operands, op=op, role=f"branch {name}", why="to check it against the branch taken", side_effects=True
    )
    return [_rules.LeafMeta.of(torch.tensor(x)) if isinstance(x, (bool, int, float, complex)) else x for x in leaves], treedef


def _check_arity(op: str, branches: Sequence[Callable[..., Any]], operands: tuple[Any, ...], branch_names: Sequence[str]) -> None:
    """Every branch must accept the operands (JAX traces every branch, so it raises too)."""
    for name, b in zip(branch_names, branches):
        try:
            sig = inspect.signature(b)
        except (TypeError, ValueError):  # a builtin without a signature: its call will tell
            continue
        try:
            sig.bind(*operands)
        except TypeError as e:
            n = len(operands)
            raise ArgumentTypeError(
                format_message(
                    f"{op}: every branch must accept the {n} operand{'s' if n != 1 else ''} given, but {name} "
                    "does not:",
                    [f"{name}{sig}: {e}"],
                    function=_funcinfo.describe(b),
                    revise=f"Revise `{_funcinfo.short_name(b)}` to take the operands as positional arguments, "
                    "as every other branch does.",
                )
            ) from None


def _check_branches(
    op: str,
    branches: Sequence[Callable[..., Any]],
    taken: int,
    operands: tuple[Any, ...],
    out_leaves: Sequence[Any],
    out_def: Any,
    branch_names: Sequence[str],
) -> None:
    """First trace: every branch must return the structure and types the taken one did.

    The branches not taken are evaluated on fake tensors; an error of theirs propagates
    (as JAX's tracing raises it), one that only says fake tensors cannot follow them
    (`.item()`, data-dependent shapes) leaves them to be checked when they are taken.
    """
    branch_names = list(branch_names)
    for i, b in enumerate(branches):
        _rules.check_static_side_effects(op, f"{branch_names[i]}", b)
    for i, b in enumerate(branches):
        if i == taken:
            continue
        try:
            other_leaves, other_def = _abstract_branch(op, b, operands, branch_names[i])
        except _rules.AbstractEvalUnavailable:
            continue  # checked later, when this branch is taken (see the cached signature)
        names = (branch_names[taken] + " output", branch_names[i] + " output")
        if taken < i:
            _rules.check_structure(op, "branch outputs", out_def, other_def, root="output", names=names, fn=b, revise=_REVISE_BRANCHES)
            _rules.check_tensors(op, "branch outputs", out_leaves, other_leaves, out_def, root="output", names=names, fn=b, revise=_REVISE_BRANCHES)
        else:
            names = (names[1], names[0])
            _rules.check_structure(op, "branch outputs", other_def, out_def, root="output", names=names, fn=branches[taken], revise=_REVISE_BRANCHES)
            _rules.check_tensors(op, "branch outputs", other_leaves, out_leaves, other_def, root="output", names=names, fn=branches[taken], revise=_REVISE_BRANCHES)


def _run_branch(
    op: str,
    branches: Sequence[Callable[..., Any]],
    taken: int,
    operands: tuple[Any, ...],
    branch_names: Sequence[str],
) -> Any:
    branch_names = list(branch_names)
    op_leaves, op_def = tree_flatten(operands)
    rules = _rules.first_call(op, tuple(branches), _rules.leaf_signature(op_leaves), op_def)
    expected = rules.recorded
    branch = branches[taken]
    if expected is None:
        _check_arity(op, branches, operands, branch_names)
        out = _rules.checked_call(op, branch_names[taken], branch, operands)
        out, leaves, treedef = _branch_output(op, branch, out)
        _check_branches(op, branches, taken, operands, leaves, treedef, branch_names)
        # Only metadata: the cache must not keep the output (and its autograd graph) alive.
        rules.record((taken, treedef, _rules.leaf_metas(leaves)))
        return out
    out = branch(*operands)
    out, leaves, treedef = _branch_output(op, branch, out)
    first_taken, exp_def, exp_metas = expected
    if treedef != exp_def or _rules.leaf_signature(leaves) != _rules.leaf_signature(exp_metas):
        # Either a closure of the same code returns something else (then check this call's
        # branches afresh), or the branches really disagree (then that check raises).
        _check_arity(op, branches, operands, branch_names)
        _check_branches(op, branches, taken, operands, leaves, treedef, branch_names)
        if taken != first_taken:
            names = (branch_names[first_taken] + " output", branch_names[taken] + " output")
            other = branches[first_taken]
            try:
                o_leaves, o_def = _abstract_branch(op, other, operands, branch_names[first_taken])
            except _rules.AbstractEvalUnavailable:
                o_leaves, o_def = list(exp_metas), exp_def
            _rules.check_structure(op, "branch outputs", o_def, treedef, root="output", names=names, fn=branch, revise=_REVISE_BRANCHES)
            _rules.check_tensors(op, "branch outputs", o_leaves, leaves, treedef, root="output", names=names, fn=branch, revise=_REVISE_BRANCHES)
        rules.record((taken, treedef, _rules.leaf_metas(leaves)))
    return out


def _as_pred(op: str, pred: Any) -> Any:
    """JAX's `cond` predicate: a scalar bool, or a real scalar number meaning `pred != 0`
    (so NaN is true), exactly as JAX converts it; a complex or non-numeric pred is refused.
    A numpy scalar is taken as the Python scalar it holds."""
    given = pred
    pred = _rules.from_numpy(pred)
    if isinstance(pred, bool):
        return pred
    if isinstance(pred, (int, float)):
        return pred != 0
    if isinstance(pred, torch.Tensor):
        if pred.dim() != 0:
            raise ArgumentTypeError(
                format_message(
                    f"{op}: pred must be a scalar (shape ()), but it is {_rules.describe_leaf(pred)}.",
                    revise="Reduce it to one value, e.g. with `.all()` or `.any()`; for elementwise choice use "
                    "`tfun.lax.select` or `torch.where`.",
                )
            )
        if pred.dtype == torch.bool:
            return pred
        if pred.is_complex():
            raise ArgumentTypeError(
                format_message(
                    f"{op}: pred must be a boolean or a real number (JAX: \"Pred type must be either boolean or "
                    f"number\"), but it is {_rules.describe_leaf(pred)}.",
                    revise="Compare it explicitly, e.g. `x != 0` or `x.real > 0`.",
                )
            )
        # A number means `pred != 0`, as in JAX. The comparison has no derivative, so a
        # pred that requires grad contributes none.
        return pred != 0
    raise ArgumentTypeError(
        format_message(
            f"{op}: pred must be a boolean or a real number (JAX: \"Pred type must be either boolean or number\"): "
            f"a Python bool, int or float, or a tensor of shape (), but got {_rules.describe_leaf(given)}.",
            revise="Pass a bool tensor of shape (), e.g. `x > 0`.",
        )
    )


def cond(pred: Any, true_fun: Callable[..., T], false_fun: Callable[..., T], *operands: Any, operand: Any = _no_operand) -> T:
    """Apply `true_fun` or `false_fun` to `operands`, depending on `pred`.

    Semantics, as a Python function:

    ```python
    def cond(pred, true_fun, false_fun, *operands):
        if pred:
            return true_fun(*operands)
        else:
            return false_fun(*operands)
    ```

    Type: `bool -> (a... -> b) -> (a... -> b) -> a... -> b`.

    Both branches must return the same pytree structure, with leaves of the same dtype,
    shape and device (checked the first time the branches are seen with operands of a
    given signature, by evaluating the branch not taken on fake tensors; an error it raises
    there is raised, as JAX's tracing raises it, unless it only says that the branch needs
    values, as `.item()` does: then the branch is checked when it is taken). Under
    `tfun.jit` / `torch.export` this lowers to `torch.cond`, and only then is `pred`
    allowed to depend on traced data without a device sync.

    **Arguments:**

    - `pred`: a scalar: a Python bool, int or float, or a tensor of shape `()` of dtype
      bool, an integer or a floating dtype. A number means `pred != 0`, as in JAX (so NaN
      is true); it gets no derivative. Complex preds are refused, as in JAX.
    - `true_fun`, `false_fun`: functions of `*operands` with matching outputs.
    - `*operands`: pytrees passed to the branch (Python scalars become 0-d tensors).
    - `operand`: the deprecated single-operand keyword form of JAX, accepted for porting.
      So is JAX's older five-argument form, `cond(pred, true_operand, true_fun,
      false_operand, false_fun)`.

    **Returns:** the output of the branch taken.
    """
    op = "tfun.lax.cond"
    if not callable(true_fun) and callable(false_fun) and len(operands) == 2 and callable(operands[1]):
        # JAX's older five-argument form, which JAX still accepts:
        # cond(pred, true_operand, true_fun, false_operand, false_fun)
        x_true, f_true, x_false, f_false = true_fun, false_fun, *operands
        return cond(pred, lambda x, _: f_true(x), lambda _, x: f_false(x), x_true, x_false)
    if operand is not _no_operand:
        if operands:
            raise ArgumentTypeError(f"{op}: pass operands positionally or as `operand=`, not both.")
        operands = (operand,)
    _rules.check_callable(op, "true_fun", true_fun)
    _rules.check_callable(op, "false_fun", false_fun)
    p = _as_pred(op, pred)
    operands = _normalize_operands(op, operands)
    if _context.is_tracing():
        _hop.refuse_unrolled(op, true_fun)
        _hop.check_side_effects(op, "true_fun", true_fun)
        _hop.check_side_effects(op, "false_fun", false_fun)
        if _hop.vmap_traced() and _hop.outer_batched(p):
            return _lower_selected(op, (true_fun, false_fun), ("true_fun", "false_fun"), (p, ~p), operands)
        _hop.refuse_cond_in_vmapped_grad_body(op, true_fun)
        if not isinstance(p, torch.Tensor):
            p = torch.tensor(p)
        return _lower_cond(p, _hop.remat_body(true_fun), _hop.remat_body(false_fun), operands)
    if _batching.is_batched(p):
        # vmap over a data-dependent predicate: both branches, then a per-example select.
        names = ("true_fun", "false_fun")
        outs = [_run_guarded(op, (true_fun, false_fun), k, operands, names, p if k == 0 else ~p) for k in (0, 1)]
        return _select_tree(p, outs[0], outs[1])
    _rules.check_concrete(op, "pred", p)
    try:
        taken = 0 if bool(p) else 1
    except RuntimeError as e:
        _rules.raise_if_unreadable(op, "pred", p, e)
        raise
    return _run_branch(op, (true_fun, false_fun), taken, operands, ("true_fun", "false_fun"))


def _may_be_differentiated(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and (t.requires_grad or _context.functorch_level(t) != -1)


def _run_guarded(
    op: str,
    branches: Sequence[Callable[..., Any]],
    k: int,
    operands: tuple[Any, ...],
    names: Sequence[str],
    taken: torch.Tensor,
) -> Any:
    """Branch `k` under a batched predicate, evaluated for every example, where `taken`
    (batched) says which examples take it. As JAX does (google/jax#1052), the branch sees
    its operands, and the tensors it closes over, with their derivatives stopped for the
    examples that do not take it: the untaken branch's output is discarded by the select,
    and its derivative, multiplied by zero there, would otherwise still be NaN where it is
    infinite (`grad(vmap(cond(x < eps, ..., sqrt(x))))` at 0). Outputs that are a guarded
    tensor itself are returned as the original (forwarded, as without the guard)."""
    back: dict[int, torch.Tensor] = {}

    def guard(x: Any) -> Any:
        if not (isinstance(x, torch.Tensor) and _may_be_differentiated(x)):
            return x
        g = torch.where(taken, x, x.detach())
        back[id(g)] = x
        return g

    guarded = tuple(tree_map(guard, o) for o in operands)
    cells = ClosureCells([branches[k]], _may_be_differentiated)
    values = [guard(t) for t in cells.tensors]
    with Rebound(cells if cells.tensors else None, values):
        out = _run_branch(op, branches, k, guarded, names)
    if not back:
        return out
    return tree_map(lambda o: back.get(id(o), o) if isinstance(o, torch.Tensor) else o, out)


def _select_tree(pred: torch.Tensor, on_true: Any, on_false: Any) -> Any:
    t_leaves, treedef = tree_flatten(on_true)
    f_leaves = tree_flatten(on_false)[0]
    # Where both branches return the same tensor (an operand they forward), there is nothing
    # to select: it is returned as it is, unbatched if it was (as JAX forwards it).
    return tree_unflatten(treedef, [a if a is b else torch.where(pred, a, b) for a, b in zip(t_leaves, f_leaves)])


def switch(index: Any, branches: Sequence[Callable[..., T]], *operands: Any, operand: Any = _no_operand) -> T:
    """Apply `branches[index]` to `operands`, with `index` clamped into range.

    Semantics, as a Python function:

    ```python
    def switch(index, branches, *operands):
        index = min(max(index, 0), len(branches) - 1)
        return branches[index](*operands)
    ```

    Type: `int -> [a... -> b] -> a... -> b`.

    All branches must return the same pytree structure with leaves of the same dtype, shape
    and device. Out-of-range indices are clamped, exactly as in JAX.

    **Arguments:**

    - `index`: a Python int, or an integer tensor of shape `()`.
    - `branches`: a non-empty sequence of functions of `*operands`.
    - `*operands`: pytrees passed to the chosen branch.

    **Returns:** the output of the chosen branch.
    """
    op = "tfun.lax.switch"
    if operand is not _no_operand:
        if operands:
            raise ArgumentTypeError(f"{op}: pass operands positionally or as `operand=`, not both.")
        operands = (operand,)
    if not isinstance(branches, Sequence) or isinstance(branches, (str, bytes)):
        raise ArgumentTypeError(
            f"{op}: branches must be a sequence (list or tuple) of functions, but got {_rules.describe_leaf(branches)}."
        )
    branches = tuple(branches)
    if len(branches) == 0:
        raise ArgumentValueError(f"{op}: branches must not be empty.")
    for i, b in enumerate(branches):
        _rules.check_callable(op, f"branches[{i}]", b)
    given = index
    index = _rules.from_numpy(index)
    if isinstance(index, bool) or not isinstance(index, (int, torch.Tensor)):
        raise ArgumentTypeError(f"{op}: index must be an integer scalar, but got {_rules.describe_leaf(given)}.")
    if isinstance(index, torch.Tensor) and (index.dim() != 0 or index.is_floating_point() or index.is_complex() or index.dtype == torch.bool):
        raise ArgumentTypeError(
            f"{op}: index must be an integer scalar (an integer tensor of shape ()), but it is "
            f"{_rules.describe_leaf(given)}."
        )
    operands = _normalize_operands(op, operands)
    n = len(branches)
    if _context.is_tracing():
        _hop.refuse_unrolled(op, branches[0])
        for k, b in enumerate(branches):
            _hop.check_side_effects(op, f"branches[{k}]", b)
        if _hop.vmap_traced() and _hop.outer_batched(index):
            idx = index.clamp(0, n - 1)
            names = tuple(f"branches[{k}]" for k in range(n))
            return _lower_selected(op, tuple(branches), names, tuple(idx == k for k in range(n)), operands)
        _hop.refuse_cond_in_vmapped_grad_body(op, branches[0])
        # A Python index (e.g. a static argument of tfun.jit) is lowered like a tensor one,
        # as cond lowers a Python pred: the eager path's caches are not traceable.
        idx = index if isinstance(index, torch.Tensor) else torch.tensor(index)
        return _lower_switch(idx.clamp(0, n - 1), tuple(_hop.remat_body(b) for b in branches), operands)
    names = [f"branches[{k}]" for k in range(n)]
    if _batching.is_batched(index):
        # vmap over a data-dependent index: every branch, then a per-example select.
        idx = index.clamp(0, n - 1)
        outs = [_run_guarded(op, branches, k, operands, names, idx == k) for k in range(n)]
        result = outs[0]
        for k in range(1, n):
            result = _select_tree(idx == k, outs[k], result)
        return result
    _rules.check_concrete(op, "index", index)
    try:
        i = min(max(int(index), 0), n - 1)
    except RuntimeError as e:
        _rules.raise_if_unreadable(op, "index", index, e)
        raise
    return _run_branch(op, branches, i, operands, names)


def select(pred: Any, on_true: T, on_false: T) -> T:
    """Choose elementwise between `on_true` and `on_false`.

    Semantics (per leaf, elementwise):

    ```python
    def select(pred, on_true, on_false):
        return on_true if pred else on_false
    ```

    Type: `bool[*s] -> a[*s] -> a[*s] -> a[*s]` (JAX's `lax.select`, extended to pytrees:
    `pred` applies to every leaf).

    **Arguments:**

    - `pred`: a bool tensor of the leaves' shape, or of shape `()` (scalar).
    - `on_true`, `on_false`: pytrees of the same structure whose corresponding leaves
      have the same dtype and shape.

    **Returns:** a pytree of the structure of `on_true`.
    """
    op = "tfun.lax.select"
    if isinstance(pred, bool):
        pred = torch.tensor(pred)
    if not isinstance(pred, torch.Tensor) or pred.dtype != torch.bool:
        raise ArgumentTypeError(
            f"{op}: pred must be a bool tensor, but got {_rules.describe_leaf(pred)}.\n"
            "Compare it explicitly, e.g. `x > 0`."
        )
    t_leaves, t_def = _rules.as_tensor_leaves(op, "on_true", on_true)
    f_leaves, f_def = _rules.as_tensor_leaves(op, "on_false", on_false)
    revise = "Pass on_true and on_false with the same structure and matching tensors."
    _rules.check_structure(op, "on_true and on_false", t_def, f_def, root="", names=("on_true", "on_false"), fn=None, revise=revise)
    _rules.check_tensors(op, "on_true and on_false", t_leaves, f_leaves, t_def, root="", names=("on_true", "on_false"), fn=None, revise=revise)
    out = []
    for path, a, b in zip(t_def.accessors(), t_leaves, f_leaves):
        if pred.dim() != 0 and pred.shape != a.shape:
            raise ArgumentValueError(
                f"{op}: pred must be a scalar or have the shape of every leaf, but pred is "
                f"{_rules.tensor_type(pred)} and on_true{path.codify('')} is {_rules.tensor_type(a)}."
            )
        out.append(torch.where(pred, a, b))
    return tree_unflatten(t_def, out)


# ----------------------------------------------------------------------------------------
# Lowering under tfun.jit / torch.export: torch.cond (see `_hop`)
# ----------------------------------------------------------------------------------------


def _checked_leaves(op: str, fn: Any, key: int, label: str, out: Any) -> tuple[list[Any], Any]:
    """Traced: branch `label`'s output `out` flattened, its leaves as tensors, once its leaf
    types are checked and its structure and tensors (dtype, sizes as this call has them,
    device) agree with the other branches of call `key`, as eagerly."""
    _hop.check_output_leaves(op, "the branch output", fn, out)
    leaves, td = tree_flatten(out)
    leaves = [_hop.as_tensor(x) for x in leaves]
    bad = _hop.escape_exchange(key, label, _hop.describe(td, leaves), _hop.code_of(fn), op, "branch outputs", "output", _REVISE_BRANCHES)
    if bad is not None:
        _hop.raise_result(bad)
    return leaves, td


def _branch(op: str, fn: Any, key: int, label: str, op_carrier: Any, encode: bool = False) -> Callable[..., Any]:
    """Branch `fn` as a `torch.cond` branch. `encode` (grad mode): integer and bool outputs
    leave as float64 tensors that hold them exactly, as a scan's do (`_scan._lower_scan`,
    workaround 3: torch's cond autograd asks a tangent of every output but differentiates only
    the floating ones, "outs_to_grad length (1) != tangents length (2)"); `_unmark` after the
    HOP gives them back."""
    def branch(*flat: Any) -> Any:
        # Each operand through a view made inside the branch: Dynamo reads an attribute of the
        # branch's own argument (`a.T`, `a.mT`) outside the branch and lifts it as a second
        # input that shares memory with the first, which torch.cond refuses (hunt 25, F7).
        flat = tuple(x.view_as(x) if isinstance(x, torch.Tensor) else x for x in flat)
        operands = tree_unflatten(tree_structure(op_carrier), list(flat))
        state = _hop.torch_state()
        reverse = _hop.func_reverse_modes()
        with _hop.body_scope():
            out = fn(*operands)
        _hop.check_state(op, label, fn, state)
        if _hop.func_reverse_modes() != reverse:
            _hop.refuse_func_reverse_if_differentiated(op, "branch", fn, [*flat, *tree_flatten(out)[0]])
        leaves, td = _checked_leaves(op, fn, key, label, out)
        # which output is an operand returned unchanged (the same tensor): see `_forward`
        forwarded = tuple(next((j for j, x in enumerate(flat) if x is leaf), -1) for leaf in leaves)
        _escape_forwarded(key, label, forwarded)
        # Contiguous: torch.cond asks every branch for one memory layout per output, where
        # JAX has none (`a * 3` against `a.T * 1`). Every output is a copy: torch.cond refuses
        # an output that is a tensor the branch closes over (`cond(p, lambda: W1, lambda:
        # W2)`; Dynamo's check under grad mode, the lowering's under `torch.no_grad()`, hunt 27),
        # and Dynamo does not let tfun tell one from a tensor the branch computes; Inductor
        # removes the copies it does not need (`remove_noop_ops`).
        leaves = _hop.unalias([x.contiguous() for x in leaves], flat, clone_all=True)
        if encode:
            leaves, td = _mark_bits(leaves, td)
        return _hop.pack(key, td, leaves)

    return branch


_FORWARDED: dict[int, dict[str, tuple[int, ...]]] = {}


@_hop.assume_constant
def _escape_forwarded(key: int, label: str, forwarded: tuple[int, ...]) -> int:
    """Trace time: record, for branch `label` of the HOP call `key`, which operand each
    output returns unchanged (-1: none)."""
    _FORWARDED.setdefault(key, {})[label] = tuple(forwarded)
    while len(_FORWARDED) > 256:  # calls whose trace failed before `_escape_forwarded_by_all`
        del _FORWARDED[next(iter(_FORWARDED))]
    return 0


@_hop.assume_constant
def _escape_forwarded_by_all(key: int) -> tuple[int, ...]:
    """Trace time: for each output, the operand every branch of call `key` returns unchanged
    there (-1 where some branch computes it); forgets the call."""
    seen = list(_FORWARDED.pop(key, {}).values())
    if not seen:
        return ()
    return tuple(js[0] if len(set(js)) == 1 else -1 for js in zip(*seen))


def _forward(key: int, out: Any, flat: Sequence[Any]) -> Any:
    """`out`, the HOP's outputs, where an output that every branch returns unchanged (an operand
    they forward) is that operand itself, as JAX's cond forwards it and as the eager path
    returns it: under `tfun.vmap` with an unbatched predicate it then stays unbatched (torch.cond
    batches every output once an operand is batched), so `out_axes=None` applies to it."""
    forwarded = _escape_forwarded_by_all(key)
    if not any(j >= 0 for j in forwarded):
        return out
    leaves, td = tree_flatten(out)
    if len(leaves) != len(forwarded):  # pragma: no cover - defensive: the trees always agree
        return out
    return tree_unflatten(td, [flat[j] if j >= 0 else x for x, j in zip(leaves, forwarded)])


def _lower_cond(pred: Any, true_fun: Callable[..., Any], false_fun: Callable[..., Any], operands: tuple[Any, ...]) -> Any:
    """`torch.cond` with tfun pytrees, tfun's branch rules and alias-free outputs."""
    _hop.begin_lowering()
    flat, op_td = tree_flatten(tuple(operands))
    flat = _hop.distinct(flat)  # e.g. cond(p, f, g, x[0], x[1]): views of one tensor
    key = _hop.escape_new_key()
    # Branch outputs are compared with their sizes as this call has them (`_hop.trace_sizes`):
    # torch.cond accepts branches of different sizes and gives a data-dependent size
    # (hunt 28 F3), where eager tfun and JAX refuse them.
    encode = _encodes_bits()
    t = _branch("tfun.lax.cond", true_fun, key, "true_fun", _hop.carrier(op_td, flat), encode)
    f = _branch("tfun.lax.cond", false_fun, key, "false_fun", _hop.carrier(op_td, flat), encode)
    return _forward(key, _unmark(_hop.unpack(key, _hop.call_hop(_hop.torch_cond(), pred, t, f, tuple(flat)))), flat)


def _lower_selected(
    op: str,
    branches: Sequence[Callable[..., Any]],
    names: Sequence[str],
    takens: Sequence[torch.Tensor],
    operands: tuple[Any, ...],
) -> Any:
    """Traced under a traced `tfun.vmap` (`tfun.jit(tfun.vmap(f))`) with a batched predicate
    or index: every branch, inline, then a per-example select, as eagerly (`_run_guarded`,
    `_select_tree`) and as JAX's batching rule for `cond` does. Not `torch.cond`: its vmap
    rule for a batched predicate keeps only the first output of the branches (torch 2.13 and
    2.14.1), which left tfun with fewer leaves than the branches return.

    Branch `k` sees its operands with their derivative stopped for the examples that do not
    take it (`takens[k]` false), so that an untaken branch's infinite derivative does not
    make a gradient NaN. Eagerly the tensors a branch closes over are guarded too; traced,
    Dynamo does not let tfun read or rebind a function's closure cells, so they are not."""
    flat, op_td = tree_flatten(tuple(operands))
    key = _hop.escape_new_key()
    outs: list[list[Any]] = []
    out_td: Any = None
    for fn, label, taken in zip(branches, names, takens):
        guarded = [
            torch.where(taken, x, x.detach()) if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) else x
            for x in flat
        ]
        state = _hop.torch_state()
        out = fn(*tree_unflatten(op_td, guarded))
        _hop.check_state(op, label, fn, state)
        leaves, td = _checked_leaves(op, fn, key, label, out)  # (sizes too: `_hop.trace_sizes`)
        # an output that is one of its (guarded) operands: that operand itself, as eagerly
        outs.append([next((o for o, g in zip(flat, guarded) if leaf is g), leaf) for leaf in leaves])
        out_td = td
    result = outs[0]
    for k in range(1, len(outs)):
        result = [a if a is b else torch.where(takens[k], b, a) for a, b in zip(result, outs[k])]
    return tree_unflatten(out_td, result)


def _lower_switch(index: Any, branches: Sequence[Callable[..., Any]], operands: tuple[Any, ...]) -> Any:
    """`branches[index](*operands)` as a balanced tree of `torch.cond`s (depth log2 n)."""
    _hop.begin_lowering()
    branches = tuple(branches)
    flat, op_td = tree_flatten(tuple(operands))
    flat = _hop.distinct(flat)  # (see `_lower_cond`)
    key = _hop.escape_new_key()
    encode = _encodes_bits()
    wrapped = [
        _branch("tfun.lax.switch", b, key, f"branches[{i}]", _hop.carrier(op_td, flat), encode)
        for i, b in enumerate(branches)
    ]
    cond_ = _hop.torch_cond()

    def build(lo: int, hi: int) -> Callable[..., Any]:
        if hi - lo == 1:
            return wrapped[lo]
        mid = (lo + hi) // 2
        left, right = build(lo, mid), build(mid, hi)

        def node(*args: Any) -> Any:
            return cond_(index < mid, left, right, tuple(args))

        return node

    if len(wrapped) == 1:
        return _unmark(_hop.unpack(key, wrapped[0](*flat)))
    return _forward(key, _unmark(_hop.unpack(key, _hop.call_hop(build(0, len(wrapped)), *flat))), flat)


__all__ = ["cond", "switch", "select"]
