"""`tfun.vmap`: JAX's `vmap` signature (pytree `in_axes`/`out_axes`, `axis_size`) over
`torch.func.vmap`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.func

from ._errors import ArgumentTypeError, ArgumentValueError, StructureMismatchError, format_message
from ._funcinfo import describe
from . import _compat, _context
from ._compat import grad_leaf
from ._grad import (
    GradSpec,
    PrefixMismatch,
    _check_scalar_output,
    _DiffArgs,
    _is_node,
    _one_level,
    _refuse_custom_second_order,
    _refuse_second_order,
    _split_aux,
    broadcast_prefix,
    conj_ct,
    describe_value,
    grad_spec,
    requires_grad_cause,
    resolve_argnums,
)
from ._tree import Partition, keystr, tree_flatten_with_path, tree_map, tree_structure, tree_unflatten
from .lax import _hop

__all__ = ["vmap"]


def _is_axis(x: Any) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool))


def _bad_axes_leaves(name: str, axes: Any, path: str = "") -> list[str]:
    """One bullet per leaf of `axes` (None a leaf) that is not an int or None, in optree's
    flattening order. Walked with `_one_level`, which Dynamo traces inside `tfun.jit`
    (optree cannot flatten a constant dict there)."""
    if axes is None or not _is_node(axes):
        return [] if _is_axis(axes) else [f"{name}{path}: {describe_value(axes)}"]
    bad: list[str] = []
    for acc, child in _one_level(axes)[1]:
        bad.extend(_bad_axes_leaves(name, child, path + acc))
    return bad


def _check_axes_leaves(name: str, axes: Any) -> None:
    bad = _bad_axes_leaves(name, axes)
    if bad:
        raise ArgumentTypeError(
            format_message(
                f"tfun.vmap: every leaf of {name} must be an int or None.",
                bad,
                revise=f"Give {name} an int axis (or None for an unmapped value) at each leaf.",
            )
        )


def vmap(
    fun: Callable[..., Any],
    in_axes: Any = 0,
    out_axes: Any = 0,
    axis_size: int | None = None,
) -> Callable[..., Any]:
    """Vectorize `fun` over an axis of its arguments, as `jax.vmap`.

    **Arguments:**

    - `fun`: a function of pytree arguments returning a pytree.
    - `in_axes`: an int, `None`, or a tuple with one entry per positional argument; each
      entry is a tree prefix of its argument whose leaves are an int (the mapped axis of
      every tensor below it) or `None` (broadcast: the value is passed unchanged to every
      call). A list at the top level is read as a tuple, as in JAX. Keyword arguments are
      always mapped over axis 0.
    - `out_axes`: a tree prefix of the output with an int (where the mapped axis goes) or
      `None` (the output must not depend on the mapped axis) at each leaf.
    - `axis_size`: the size of the mapped axis; required when no argument is mapped, and
      checked against the arguments otherwise.

    **Returns:** a function with `fun`'s signature that maps `fun` over the axis.
    Composes with `tfun.grad`, `tfun.vmap` and `torch.func`.
    """
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)
    if not (_is_axis(in_axes) or isinstance(in_axes, tuple)):
        raise ArgumentTypeError(
            format_message(
                "tfun.vmap: in_axes must be an int, None, or a tuple with one entry per positional argument, "
                f"got {describe_value(in_axes)}.",
                revise="Wrap the axes of a single argument in a 1-tuple: `in_axes=(spec,)`.",
            )
        )
    _check_axes_leaves("in_axes", in_axes)
    _check_axes_leaves("out_axes", out_axes)
    if axis_size is not None and (not isinstance(axis_size, int) or isinstance(axis_size, bool) or axis_size < 0):
        raise ArgumentValueError(
            format_message(f"tfun.vmap: axis_size must be None or a non-negative int, got {axis_size!r}.")
        )

    # updated=(): `fun`'s attributes stay its own (a `tfun.grad` function's `_tfun_grad_spec` is
    # not the vmapped function's), and nothing is copied that Dynamo would have to undo
    # (torch 2.11 cannot trace `dict.pop`)
    @_compat.wraps(fun, updated=())
    def vmapped(*args: Any, **kwargs: Any) -> Any:
        fn_desc = describe(fun)
        if isinstance(in_axes, tuple) and len(in_axes) != len(args):
            raise StructureMismatchError(
                format_message(
                    f"tfun.vmap: in_axes is a tuple of {len(in_axes)} entries, but the function was called with "
                    f"{len(args)} positional argument{'' if len(args) == 1 else 's'}.",
                    function=fn_desc,
                    revise="Give in_axes one entry per positional argument (None for an unmapped one).",
                )
            )
        try:
            per_leaf = broadcast_prefix(in_axes, tuple(args), _is_axis, "args")
        except PrefixMismatch as e:
            raise StructureMismatchError(
                format_message(
                    "tfun.vmap: in_axes must be a tree prefix of the positional arguments.",
                    [
                        f"{e.path}: in_axes has {describe_value(e.prefix_node)}, "
                        f"the arguments have {describe_value(e.full_node, shapes=False)}",
                        f"in_axes structure: {_structure_text(in_axes, True)}",
                        f"arguments structure: {_structure_text(_skeleton(tuple(args)), False)}",
                    ],
                    function=fn_desc,
                    revise="Revise in_axes to mirror the arguments' structure (an int or None may stand for a "
                    "whole subtree).",
                )
            ) from None
        # keyword arguments are mapped over axis 0, as in JAX; an empty dict is left out of the
        # tree (Dynamo's optree support, torch 2.13, fails on flattening one)
        kw_entries = [(f"kwargs{keystr(p)}", 0, x) for p, x in tree_flatten_with_path(kwargs)[0]] if kwargs else []
        entries = per_leaf + kw_entries

        mapped_pos: list[int] = []
        mapped_vals: list[torch.Tensor] = []
        in_dims: list[int] = []
        sizes: list[tuple[str, int, int, tuple[int, ...]]] = []
        for k, (path, ax, x) in enumerate(entries):
            if ax is None:
                continue
            if not isinstance(x, torch.Tensor):
                raise ArgumentTypeError(
                    format_message(
                        "tfun.vmap: a mapped argument leaf must be a tensor.",
                        [f"{path}: {describe_value(x)} with in_axes {ax}"],
                        function=fn_desc,
                        revise="Pass a tensor there, or give it in_axes None to broadcast it.",
                    )
                )
            if not -x.ndim <= ax < x.ndim:
                raise ArgumentValueError(
                    format_message(
                        f"tfun.vmap: in_axes {ax} is out of range for a tensor with {x.ndim} dimension"
                        f"{'' if x.ndim == 1 else 's'}.",
                        [f"{path}: a tensor of shape {tuple(x.shape)}"],
                        function=fn_desc,
                        revise="Pick an axis the tensor has, or None to broadcast it.",
                    )
                )
            ax = ax % x.ndim
            mapped_pos.append(k)
            mapped_vals.append(x)
            in_dims.append(ax)
            sizes.append((path, ax, x.shape[ax], tuple(x.shape)))
        distinct = {s for _, _, s, _ in sizes} | ({axis_size} if axis_size is not None else set())
        if len(distinct) > 1:
            bullets = [f"{p}: axis {ax} of a tensor of shape {shp} has size {s}" for p, ax, s, shp in sizes]
            if axis_size is not None:
                bullets.append(f"axis_size: {axis_size}")
            raise ArgumentValueError(
                format_message(
                    "tfun.vmap: the mapped axes of the arguments must all have the same size.",
                    bullets,
                    function=fn_desc,
                    revise="Make the mapped axes agree in size (or give the odd one in_axes None).",
                )
            )
        if not mapped_vals:
            if axis_size is None:
                raise ArgumentValueError(
                    format_message(
                        "tfun.vmap: no argument is mapped (every in_axes entry is None, or there are no tensor "
                        "arguments), so the size of the mapped axis is unknown.",
                        function=fn_desc,
                        revise="Pass axis_size=..., or map at least one argument.",
                    )
                )
            mapped_vals.append(torch.empty(axis_size, 0))  # a stand-in that carries axis_size
            in_dims.append(0)

        spec = grad_spec(fun)
        if spec is not None and _rewrites_per_example(spec, out_axes):
            size = next(iter(distinct)) if distinct else axis_size
            return _per_example_gradients(spec, in_axes, out_axes, axis_size, size, args, kwargs)

        # the mapped leaves cross torch.func.vmap; the rest is held here
        source = (tuple(args), kwargs) if kwargs else tuple(args)
        called = Partition(tree_structure(source), tuple(x for _, _, x in entries), tuple(mapped_pos), source)
        out_dims: list[Any] = []  # filled by f_flat: torch.func.vmap reads out_dims after the call
        box: dict[str, Any] = {}

        def f_flat(*vals: torch.Tensor) -> list[Any]:
            # with no mapped argument, `vals` is only the stand-in: `called` has no position for it
            rebuilt = called.combine(vals)
            new_args, new_kwargs = rebuilt if kwargs else (rebuilt, {})
            out = fun(*new_args, **new_kwargs)
            try:
                out_entries = broadcast_prefix(out_axes, out, _is_axis, "output")
            except PrefixMismatch as e:
                raise StructureMismatchError(
                    format_message(
                        "tfun.vmap: out_axes must be a tree prefix of the function's output.",
                        [
                            f"{e.path}: out_axes has {describe_value(e.prefix_node)}, "
                            f"the output has {describe_value(e.full_node, shapes=False)}",
                            f"out_axes structure: {_structure_text(out_axes, True)}",
                            f"output structure: {_structure_text(_skeleton(out), False)}",
                        ],
                        function=fn_desc,
                        revise="Revise out_axes to mirror the output's structure.",
                    )
                ) from None
            box["out_td"] = tree_structure(out)
            leaves = []
            box["paths"] = []
            for path, ax, leaf in out_entries:
                if ax is not None and not isinstance(leaf, torch.Tensor):
                    leaf = torch.as_tensor(leaf)
                if ax is not None:
                    nd = leaf.ndim + 1
                    if not -nd <= ax < nd:
                        raise ArgumentValueError(
                            format_message(
                                f"tfun.vmap: out_axes {ax} is out of range for an output with {nd} dimensions "
                                "(including the mapped one).",
                                [f"{path}: a tensor of shape {tuple(leaf.shape)} per element"],
                                function=fn_desc,
                            )
                        )
                    ax = ax % nd
                out_dims.append(ax)
                box["paths"].append((path, ax))
                leaves.append(leaf)
            return leaves

        try:
            if next(iter(distinct), axis_size) == 0:
                out_leaves = _empty_batch(f_flat, mapped_vals, in_dims, out_dims)
            else:
                out_leaves = torch.func.vmap(f_flat, in_dims=tuple(in_dims), out_dims=out_dims)(*mapped_vals)  # type: ignore[arg-type]
        except ValueError as e:
            if "when out_dim is None" not in str(e):
                raise
            raise ArgumentValueError(
                format_message(
                    "tfun.vmap: an output with out_axes None depends on the mapped axis.",
                    [f"{p}: out_axes None" for p, ax in box.get("paths", []) if ax is None],
                    function=fn_desc,
                    revise="Give that output an int out_axes, or make it independent of the mapped arguments.",
                )
            ) from None
        return tree_unflatten(box["out_td"], out_leaves)

    return vmapped


def _empty_batch(
    f_flat: Callable[..., list[Any]], mapped_vals: list[torch.Tensor], in_dims: list[int], out_dims: list[Any]
) -> list[Any]:
    """The outputs of a vmap whose mapped axis has size 0, as JAX gives them: empty, with the
    per-example shapes and dtypes of a batch of one example, found on fake tensors (nothing
    runs on values); torch's batching rules fail on size 0 (`r[0]`, `torch.cat`, `reshape(...,
    -1)`: hunt 30 F4). Where fake tensors cannot follow the function (`.item()`), or an output
    is not mapped (`out_axes` None: its value is needed), the example runs for real, on zeros;
    traced (`tfun.jit`), it is traced. Floating outputs stay connected to the mapped inputs that require grad (zero gradients)."""
    from ._rules import AbstractEvalUnavailable, abstract_eval

    ones = tuple(v.new_zeros((*v.shape[:d], 1, *v.shape[d + 1 :])) for v, d in zip(mapped_vals, in_dims))

    def run(*vals: torch.Tensor) -> list[Any]:
        out_dims.clear()  # (f_flat fills it on each call)
        return torch.func.vmap(f_flat, in_dims=tuple(in_dims), out_dims=out_dims)(*vals)  # type: ignore[arg-type]

    if _context.is_tracing():  # (Dynamo specializes a size of 0: this graph is for it) the example is traced
        outs, fake = run(*ones), False
    else:
        try:
            outs, _ = abstract_eval(run, ones)
            fake = True
        except AbstractEvalUnavailable:
            outs, fake = run(*ones), False
    if fake and any(ax is None for ax in out_dims):
        outs = run(*ones)
    link = [v.sum() * 0 for v in mapped_vals if v.requires_grad and (v.is_floating_point() or v.is_complex())]
    result = []
    for o, ax in zip(outs, out_dims):
        if ax is None:
            result.append(o)
            continue
        shape = list(o.shape)
        shape[ax] = 0
        e = torch.empty(shape, dtype=o.dtype, device=o.device)
        if link and (e.is_floating_point() or e.is_complex()):
            e = e + sum(link)
        result.append(e)
    return result


def _rewrites_per_example(spec: GradSpec, out_axes: Any) -> bool:
    """Whether `vmap(grad(f))` is computed as the gradient of `sum(vmap(f))`
    (`_per_example_gradients`): in traced code (`tfun.jit`, `torch.export`) outside any other
    torch.func transform and outside a loop body, where torch.func's grad cannot be traced
    around tfun's control flow, but autograd around a traced vmap can. With an int
    `out_axes` and a real output (`holomorphic=False`)."""
    return (
        not spec.holomorphic
        and isinstance(out_axes, int)
        and not isinstance(out_axes, bool)
        and _context.is_tracing()
        and not _context.functorch_active()
        and not _hop.in_body()
    )


def _per_example_gradients(
    spec: GradSpec,
    in_axes: Any,
    out_axes: int,
    axis_size: int | None,
    size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """`vmap(grad(f), in_axes, out_axes)(*args)` as reverse-mode autograd of one batched loss.

    Every leaf of a differentiated argument gets a batch dimension of its own in front (an
    unmapped one is expanded to `size` copies, a mapped one has its axis moved there), the
    differentiated ones as fresh leaves; `f` runs under `vmap` with those arguments mapped over
    axis 0, and the sum of the per-example losses is differentiated with respect to them.
    Example `b`'s loss reads only slice `b` of each copy, so the gradient's slice `b` is example
    `b`'s gradient, exactly: what `jax.vmap(jax.grad(f))` computes. torch.compile traces this
    where it cannot trace torch.func's grad around a control-flow op. The arguments are checked
    as the eager path checks them (`_DiffArgs`, the per-example scalar check)."""
    op, fun = spec.op, spec.fun
    argnums = resolve_argnums(op, fun, spec.argnums, len(args))
    fl = _DiffArgs(op, fun, args, argnums, spec.allow_int)
    axes_of = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
    axes = [ax for i in argnums for _, ax, _ in broadcast_prefix(axes_of[i], args[i], _is_axis, f"args[{i}]")]
    dyn = set(fl.dyn)

    def batch_first(x: torch.Tensor, ax: int | None) -> torch.Tensor:
        # (a moved axis is laid out first, as a batch of contiguous examples: torch's scan
        # autograd under vmap compares a carry made from it with the body's contiguous one)
        return x.unsqueeze(0).expand(size, *x.shape) if ax is None else x.movedim(ax % x.ndim, 0).contiguous()

    def per_example(*a: Any, **k: Any) -> Any:
        out = fun(*a, **k)
        aux = None
        if spec.has_aux:
            out, aux = _split_aux(op, fun, out)
        return _check_scalar_output(op, fun, out), aux

    # as `tfun.grad`'s traced path: where grad mode is on and a differentiated argument
    # requires grad, the gradient stays differentiable (its loops unrolled), else fresh leaves
    outer = torch.is_grad_enabled() and any(x.requires_grad for x in fl.leaves)
    with torch.enable_grad():
        leaves, batched = [], []
        for k, (x, ax) in enumerate(zip(fl.part.leaves, axes)):
            if k not in dyn:  # an integer leaf (`allow_int`), not differentiated
                leaves.append(batch_first(torch.as_tensor(x), ax))
                continue
            keep = outer and x.requires_grad
            b = batch_first(x.view_as(x) if keep else x.detach(), ax)
            b = b if keep else grad_leaf(b)
            leaves.append(b)
            batched.append(b)
        new_args = list(args)
        for i, tree in zip(argnums, fl.part.with_leaves(leaves).combine(())):
            new_args[i] = tree
        new_axes = tuple(0 if i in argnums else ax for i, ax in enumerate(axes_of))
        lowered, customs = _hop.lowerings(), _hop.custom_rules()
        cause = requires_grad_cause(op, fl.paths, fl.leaves) if outer else None
        with _hop.unroll_scope(outer, derivative=True, cause=cause):
            values, aux = vmap(per_example, in_axes=new_axes, axis_size=axis_size)(*new_args, **kwargs)
        if outer and _hop.lowerings() != lowered:
            _refuse_second_order(op, fun)
        if outer and _hop.custom_rules() != customs:
            _refuse_custom_second_order(op, fun)
        found: Any = (None,) * len(batched)
        if values.requires_grad:
            found = torch.autograd.grad(values.sum(), batched, allow_unused=True, create_graph=outer)
    grads = iter(conj_ct(torch.zeros(b.shape, dtype=b.dtype, device=b.device) if g is None else g) for b, g in zip(batched, found))
    # an integer leaf's gradient: zeros of its dtype and its per-example shape, per example
    flat = [next(grads) if k in dyn else torch.zeros(x.shape, dtype=x.dtype, device=x.device) for k, x in enumerate(leaves)]
    split = list(fl.part.with_leaves(flat).combine(()))
    if not outer:
        values = values.detach()
        aux = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux)
    g = split[0] if spec.single else tuple(split)
    if spec.op == "tfun.value_and_grad":
        out: Any = ((values, aux), g) if spec.has_aux else (values, g)
    else:
        out = (g, aux) if spec.has_aux else g
    # every output has its batch dimension first; `out_axes` places it (checked as eagerly)

    def place(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if not -t.ndim <= out_axes < t.ndim:
            raise ArgumentValueError(
                format_message(
                    f"tfun.vmap: out_axes {out_axes} is out of range for an output with {t.ndim} dimensions "
                    "(including the mapped one).",
                    [f"a tensor of shape {tuple(t.shape[1:])} per element"],
                    function=describe(fun),
                )
            )
        return t.movedim(0, out_axes % t.ndim)

    return tree_map(place, out)


def _skeleton(tree: Any) -> Any:
    """`tree` with every leaf replaced by 0: the same structure, made of Python constants, so
    that `_structure_text` runs as plain Python when Dynamo traces it (leaves may be tensors)."""
    return tree_map(lambda _: 0, tree)


def _structure_text(tree: Any, none_is_leaf: bool) -> str:
    """`str(tree_structure(tree))`, for error messages.

    Inside `tfun.jit` Dynamo can neither `str` a treespec nor flatten a constant dict (it
    constant-folds to optree metadata it cannot represent). Marked constant, this function
    runs as plain Python on constant arguments (an axes spec, or a `_skeleton`), so an error
    message inside `tfun.jit` reads as it does eagerly.
    """
    return str(tree_structure(tree, none_is_leaf=none_is_leaf))


_structure_text._dynamo_marked_constant = True  # type: ignore[attr-defined]
