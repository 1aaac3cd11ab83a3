"""`map`: apply a function to each slice of the leading axis and stack the results."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .. import _compat, _context, _funcinfo, _rules
from .._tree import tree_flatten, tree_structure, tree_unflatten
from . import _hop
from ._scan import _encodes_bits, _from_real, _mark_bits, _mark_complex, _to_real, _unmark, empty_outputs, lower_splitting_complex, scan, stack_outputs, xs_leaves, zero_length_outputs

X = TypeVar("X")
Y = TypeVar("Y")


def map(f: Callable[[X], Y], xs: X, *, batch_size: int | None = None) -> Y:  # noqa: A001
    """Map `f` over the leading axis of `xs`.

    Semantics, as a Python function (JAX's `lax.map`):

    ```python
    def map(f, xs):
        return tree_map(lambda *ys: torch.stack(ys), *[f(x) for x in xs])
    ```

    Type: `(a -> b) -> [a] -> [b]`.

    With `batch_size`, `xs` is split into batches of that size (and a smaller remainder),
    and `f` is applied to each batch under `torch.func.vmap`, as JAX does: it trades the
    memory of a full vmap for the speed of a batched body.

    **Arguments:**

    - `f`: applied to each slice `x` of `xs`.
    - `xs`: a pytree of tensors sharing the size of their leading axis.
    - `batch_size`: optional positive int; see above.

    **Returns:** the stacked outputs, a pytree of `f`'s output structure.
    """
    op = "tfun.lax.map"
    _rules.check_callable(op, "f", f)
    leaves, treedef = xs_leaves(op, xs)
    n = _rules.leading_length(op, "xs", leaves, treedef, None)
    xs = tree_unflatten(treedef, leaves)
    if batch_size is not None:
        batch_size = _rules.check_int(op, "batch_size", batch_size, minimum=1)
        if _context.is_tracing() and _compat.is_exporting():
            # Under torch.export, the rows one at a time (the same values: `batch_size` only
            # trades memory for speed). The batched map runs `torch.func.vmap` inside a scan
            # body, which strict export let through into a program that failed at every call
            # (a vmap level of the trace), and which non-strict export refused.
            batch_size = None
    if batch_size is not None:
        if n > 0:
            if _context.is_tracing():
                _hop.check_side_effects(op, "function", f)
                if _hop.unrolled_steps():
                    return _unrolled_map(op, f, xs, n)  # (the same rows, one at a time)
                # a static length (`len(range(n))`: Dynamo specializes `range`, so each length
                # is a graph of its own, as under jax.jit): with a symbolic one, Inductor failed
                # to lower the batches' `(n // batch_size, batch_size, ...)` view (a jitted
                # map's second length: "KeyError" on a shape symbol; hunts 24 and 26)
                return _batched_map(f, leaves, treedef, len(range(n)), batch_size)
            # the rules hold for `f` as without batch_size (the scan below checks only its
            # own body, which calls `f` through vmap)
            rules = _rules.first_call(op, f, treedef, tuple((x.dtype, x.shape, x.device) for x in leaves), batch_size)
            xs0 = tree_unflatten(treedef, leaves)
            out = rules.call(op, "function", f, (xs0,), call=lambda: _batched_map(f, leaves, treedef, n, batch_size))
            rules.record()
            return out
    if _context.is_tracing():
        _hop.check_side_effects(op, "function", f)
        if _hop.unrolled_steps():
            # inside a traced derivative that is differentiated again: no HOP (see _hop)
            return _unrolled_map(op, f, xs, n)
        if _hop.vmap_traced():
            # torch's map has no vmap rule; its scan has one (`_scan.scan`)
            return scan(lambda c, x: (c, f(x)), (), xs)[1]
        return _lower_map(_hop.remat_body(f), xs)
    rules = _rules.first_call(op, f, treedef, tuple((x.dtype, x.shape[1:], x.device) for x in leaves))
    if n == 0:
        x0 = tree_unflatten(treedef, [torch.empty(x.shape[1:], dtype=x.dtype, device=x.device) for x in leaves])
        y_leaves, y_def = tree_flatten(zero_length_outputs(op, "function", f, (x0,), rules))
        return tree_unflatten(y_def, empty_outputs(y_leaves, leaves))
    slices = [x.unbind(0) for x in leaves]
    is_leaf = treedef.is_leaf()
    first_x: Any = slices[0][0] if is_leaf else tree_unflatten(treedef, [s[0] for s in slices])
    y = rules.call(op, "function", f, (first_x,))
    _hop.check_output_leaves(op, "the output", f, y)
    rules.record()
    y_leaves, y_def = tree_flatten(y)
    y_lists = [[v] for v in y_leaves]
    for i in range(1, n):
        x_i: Any = slices[0][i] if is_leaf else tree_unflatten(treedef, [s[i] for s in slices])
        y = f(x_i)
        leaves_i, d = tree_flatten(y)
        if d != y_def:
            _rules.check_structure(
                op, "the outputs of every step", y_def, d, root="y", names=("step 0", f"step {i}"), fn=f,
                revise=f"Revise `{_funcinfo.short_name(f)}` so that every step returns outputs of one structure.",
            )
        for lst, v in zip(y_lists, leaves_i):
            lst.append(v)
    return stack_outputs(op, f, y_lists, y_def, False)


def _unrolled_map(op: str, f: Callable[..., Any], xs: Any, n: int) -> Any:
    """Traced `map` inside a derivative that is differentiated again: each row in the graph
    (`_scan._unrolled_in_python`), no HOP."""
    from ._scan import _unrolled_in_python

    n = len(range(n))  # (a symbolic length specialized, as Dynamo does `range`: each length its own graph)
    _hop.check_unrolled_length(op, f, n, None)
    return _unrolled_in_python(lambda c, x: (c, f(x)), None, xs, n, False)[1]


def _batched_map(f: Callable[..., Any], leaves: list[torch.Tensor], treedef: Any, n: int, batch_size: int) -> Any:
    # torch.func.vmap knows torch's pytrees, not tfun's: give it flat tuples of tensors.
    out_def: list[Any] = []
    if _context.is_tracing():
        # A traced scan body may not write to `out_def` (a side effect outside the HOP, which
        # Dynamo refuses): learn the output structure from one row first. Only the structure
        # is used, so the graph drops that call's ops as dead code.
        out_def.append(tree_structure(f(tree_unflatten(treedef, [x[0] for x in leaves]))))

    def flat_f(*x_leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = f(tree_unflatten(treedef, x_leaves))
        _hop.check_output_leaves("tfun.lax.map", "the output", f, y)
        y_leaves, y_def = tree_flatten(y)
        if not out_def:
            out_def.append(y_def)
        # a Python (or numpy) scalar leaf as the tensor it becomes without batch_size
        # (`_scan.stack_outputs`): torch.func.vmap takes only tensors (hunt 29 F1)
        return tuple(v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in y_leaves)

    vf = torch.func.vmap(flat_f)
    # (`//` and `%`, not `divmod`, which Dynamo does not take for a symbolic `n`: a jitted map
    # called with a second length, compiled with a symbolic one)
    num_batches, rem = n // batch_size, n % batch_size
    parts: list[tuple[torch.Tensor, ...]] = []
    if num_batches:
        main = [x[: num_batches * batch_size].reshape(num_batches, batch_size, *x.shape[1:]) for x in leaves]
        _, ys = scan(lambda c, xb: (c, vf(*xb)), (), tuple(main))
        parts.append(tuple(y.reshape(num_batches * batch_size, *y.shape[2:]) for y in ys))
    if rem:
        parts.append(tuple(vf(*[x[num_batches * batch_size :] for x in leaves])))
    flat = parts[0] if len(parts) == 1 else tuple(torch.cat([a, b]) for a, b in zip(parts[0], parts[1]))
    return tree_unflatten(out_def[0], list(flat))


# ----------------------------------------------------------------------------------------
# Lowering under tfun.jit / torch.export: torch's map (see `_hop`)
# ----------------------------------------------------------------------------------------


def _lower_map(f: Callable[[Any], Any], xs: Any) -> Any:
    """`torch._higher_order_ops.map` over the leading axis of every leaf of `xs`. Inductor
    (2.11-2.14.1) cannot compile a map with a complex `xs` or output ("map is not lowered to
    while_loop", hunt 34 F3): such leaves cross the HOP as real pairs where the map is not
    differentiated (`_scan.lower_splitting_complex`)."""
    return lower_splitting_complex(lambda split: _lower_map_as(f, xs, split), xs)


def _lower_map_as(f: Callable[[Any], Any], xs: Any, split_complex: bool) -> Any:
    """`_lower_map`, complex leaves crossing the HOP as `view_as_real` pairs where `split_complex`."""
    _hop.begin_lowering()
    x_leaves, x_td = tree_flatten(xs)
    # torch's map traces the body on a contiguous slice and runs it on `xs[i]`: a strided `xs`
    # made a `reshape` traced as a view fail at run time (see `_scan._lower_scan`)
    x_leaves = [x.contiguous() for x in x_leaves]

    x_carrier = _hop.carrier(x_td, x_leaves)
    if x_leaves and x_leaves[0].shape[0] == 0:
        # torch's map rejects zero rows: the output structure comes from one call on a zero row
        y = f(tree_unflatten(x_td, [x.new_zeros(x.shape[1:]) for x in x_leaves]))
        y_leaves, y_td = tree_flatten(y)
        y_leaves = [_hop.as_tensor(v) for v in y_leaves]
        # joined to the graph of `xs` and of what `f` closes over (through this call), as
        # eagerly: `.backward()` of the empty output failed under tfun.jit (hunt 27)
        return tree_unflatten(y_td, empty_outputs(y_leaves, [*x_leaves, *y_leaves]))

    x_cplx = [split_complex and isinstance(t, torch.Tensor) and t.is_complex() for t in x_leaves]

    def body(x_flat: list[Any]) -> Any:
        if any(x_cplx):
            x_flat = _from_real(list(x_flat), x_cplx)
        state = _hop.torch_state()
        reverse = _hop.func_reverse_modes()
        with _hop.body_scope():
            y = f(tree_unflatten(tree_structure(x_carrier), list(x_flat)))
        _hop.check_state("tfun.lax.map", "function", f, state)
        if _hop.func_reverse_modes() != reverse:
            _hop.refuse_func_reverse_if_differentiated("tfun.lax.map", "function", f, [*x_flat, *tree_flatten(y)[0]])
        _hop.check_output_leaves("tfun.lax.map", "the output", f, y)
        y_leaves, y_td = tree_flatten(y)
        # every output a copy: torch's map refuses one that is a tensor the body closes over
        # (`map(lambda r: (r @ W, W), xs)`), which Dynamo does not let tfun tell from a tensor
        # the body computes; Inductor removes the copies it does not need
        y_leaves = _hop.unalias([_hop.as_tensor(t) for t in y_leaves], x_flat, clone_all=True)
        if encode:  # integer and bool outputs as exact float64, as a cond's (`_scan._mark_bits`)
            y_leaves, y_td = _mark_bits(y_leaves, y_td)
        if split_complex and any(isinstance(t, torch.Tensor) and t.is_complex() for t in y_leaves):
            y_leaves, y_td = _mark_complex(y_leaves, y_td)
        return _hop.pack(key, y_td, y_leaves)

    key = _hop.escape_new_key()
    encode = _encodes_bits()
    # copies: torch's map refuses `xs` that is also a tensor the function closes over, or a
    # view of one ("Encountered aliasing during higher order op tracing": `map(lambda r: r *
    # x.sum(0), x)`; hunt 28), and which tensors it closes over is not known here (Dynamo
    # lifts them). One copy of `xs` per call (Inductor fuses it into the kernel that
    # computes `xs` where there is one)
    x_leaves = [t.clone() if isinstance(t, torch.Tensor) else t for t in x_leaves]
    x_leaves = _to_real(x_leaves, x_cplx)
    return _unmark(_hop.unpack(key, _hop.call_hop(_hop.torch_map(), body, _hop.distinct(x_leaves))))  # e.g. xs=(x, x)


__all__ = ["map"]

