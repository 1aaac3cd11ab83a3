"""`associative_scan`: an inclusive prefix scan with an associative operator, in log depth."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .. import _compat, _context, _funcinfo, _rules
from .._errors import ArgumentValueError, JitError, format_message
from .._tree import PyTreeSpec, tree_flatten, tree_structure, tree_unflatten
from . import _hop
from ._scan import xs_leaves

T = TypeVar("T")

#: What to revise where the combine function's output does not match its inputs (eagerly
#: and traced; `{name}` is the function's name).
_REVISE_COMBINE = "Revise `{name}` to return a pytree like its inputs, combining them elementwise."


def associative_scan(fn: Callable[[T, T], T], elems: T, reverse: bool = False, axis: int = 0) -> T:
    """Inclusive scan of `elems` along `axis` with the associative operator `fn`.

    Semantics, as a Python function (JAX's `lax.associative_scan`; `fn` need not be
    commutative, and the order of its arguments is JAX's):

    ```python
    def associative_scan(fn, elems, reverse=False, axis=0):
        # along `axis`, for every leaf of the pytree `elems` at once:
        if not reverse:
            out[0] = elems[0]
            for i in range(1, n):
                out[i] = fn(out[i - 1], elems[i])
        else:
            out[n - 1] = elems[n - 1]
            for i in reversed(range(n - 1)):
                out[i] = fn(out[i + 1], elems[i])
        return out
    ```

    Type: `(a -> a -> a) -> [a] -> [a]`.

    It is computed in parallel form, with O(log n) sequential calls of `fn` on slices of
    `elems` (each call combines many pairs at once), which is why `fn` must be
    associative, and must work elementwise on a batch of pairs: it receives pytrees whose
    leaves are slices of `elems` along `axis`, and must return a pytree of the same
    structure and leaf shapes. For the linear recurrence `h = a * h + b`, prefer
    `tfun.lax.linear_scan`, which has a fused kernel.

    **Arguments:**

    - `fn`: the associative operator, `fn(a, b) -> c` on pytrees of `elems`'s structure.
    - `elems`: a pytree of tensors sharing the size of `axis`.
    - `reverse`: scan from the end of `axis` to its start.
    - `axis`: the axis to scan along (negative counts from the end).

    **Returns:** a pytree like `elems` holding the scan.
    """
    op = "tfun.lax.associative_scan"
    _rules.check_callable(op, "fn", fn)
    leaves, treedef = xs_leaves(op, elems, "elems")
    if not leaves:
        raise ArgumentValueError(f"{op}: elems must have at least one tensor leaf.")
    # As in JAX, `axis` is resolved against the first leaf and used for every leaf.
    ax = _rules.canonical_axis(op, axis, leaves[0].dim())
    axes = [ax] * len(leaves)
    for p, x in zip(treedef.accessors(), leaves):
        if x.dim() <= ax:
            raise ArgumentValueError(
                f"{op}: axis={axis} (axis {ax} of the first leaf) is out of range for "
                f"elems{p.codify('')}, which is {_rules.describe_leaf(x)}."
            )
    sizes = {x.shape[a] for a, x in zip(axes, leaves)}
    if len(sizes) > 1:
        bullets = [f"elems{p.codify('')}: {_rules.describe_leaf(x)} (size {x.shape[a]})" for p, x, a in zip(treedef.accessors(), leaves, axes)]
        raise ArgumentValueError(
            format_message(
                f"{op}: every leaf of elems must have the same size along axis {axis}, but they do not:",
                bullets,
                revise="Make the leaves the same length along the scan axis.",
            )
        )
    elems = tree_unflatten(treedef, leaves)
    if _context.is_tracing():
        _hop.check_side_effects(op, "combine function", fn)
        return _lower_associative_scan(fn, elems, bool(reverse), axis)
    return _assoc_eager(op, fn, leaves, treedef, axes, bool(reverse))


def _take(x: torch.Tensor, axis: int, start: int | None, stop: int | None, step: int | None = None) -> torch.Tensor:
    idx: list[Any] = [slice(None)] * axis
    idx.append(slice(start, stop, step))
    return x[tuple(idx)]


def _assoc_eager(
    op: str, fn: Callable[..., Any], leaves: list[torch.Tensor], treedef: PyTreeSpec, axes: list[int], reverse: bool
) -> Any:
    rules = _rules.first_call(op, fn, treedef, _rules.leaf_signature(leaves), tuple(axes))
    state = {"checking": rules.first}

    def combine(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
        ta = tree_unflatten(treedef, a)
        tb = tree_unflatten(treedef, b)
        if state["checking"]:
            out = _rules.checked_call(op, "combine function", fn, (ta, tb))
            out_leaves, out_def = tree_flatten(out)
            revise = _REVISE_COMBINE.format(name=_funcinfo.short_name(fn))
            _rules.check_structure(op, "combine function input and output", treedef, out_def, root="elems",
                                   names=("input", "output"), fn=fn, revise=revise)
            _rules.check_tensors(op, "combine function input and output", a, out_leaves, treedef, root="elems",
                                 names=("input", "output"), fn=fn, revise=revise)
            state["checking"] = False
            rules.record()
            return out_leaves
        out_leaves, out_def = tree_flatten(fn(ta, tb))
        if out_def != treedef:
            _rules.check_structure(op, "combine function input and output", treedef, out_def, root="elems",
                                   names=("input", "output"), fn=fn, revise="Return a pytree like the inputs.")
        return out_leaves

    return tree_unflatten(treedef, _log_depth_scan(combine, leaves, axes, reverse))


def _log_depth_scan(
    combine: Callable[[list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]],
    leaves: list[torch.Tensor],
    axes: list[int],
    reverse: bool,
) -> list[torch.Tensor]:
    """The inclusive scan of `leaves` along `axes` by `combine` (on flat lists of leaves) in
    O(log n) rounds of tensor ops (the eager path; traced, inside a derivative that is
    differentiated again, where no HOP may be lowered)."""
    if reverse:
        leaves = [x.flip(a) for x, a in zip(leaves, axes)]

    def scan_rec(elems: list[torch.Tensor]) -> list[torch.Tensor]:
        n = elems[0].shape[axes[0]]
        if n < 2:
            return elems
        # Combine adjacent pairs (0,1), (2,3), ...; scan the half-length result recursively;
        # then fix up the even positions from the odd prefix results.
        pairs = combine(
            [_take(x, a, 0, n - 1, 2) for x, a in zip(elems, axes)],
            [_take(x, a, 1, None, 2) for x, a in zip(elems, axes)],
        )
        odd = scan_rec(pairs)
        if n % 2 == 0:
            even = combine([_take(x, a, 0, -1) for x, a in zip(odd, axes)], [_take(x, a, 2, None, 2) for x, a in zip(elems, axes)])
        else:
            even = combine(odd, [_take(x, a, 2, None, 2) for x, a in zip(elems, axes)])
        even = [torch.cat([_take(x, a, 0, 1), e], dim=a) for x, e, a in zip(elems, even, axes)]
        return [_interleave(e, o, a) for e, o, a in zip(even, odd, axes)]

    out = scan_rec(leaves)
    if reverse:
        out = [x.flip(a) for x, a in zip(out, axes)]
    return out


def _interleave(even: torch.Tensor, odd: torch.Tensor, axis: int) -> torch.Tensor:
    """Merge two tensors along `axis`: even[0], odd[0], even[1], odd[1], ..."""
    n_even = even.shape[axis]
    n_odd = odd.shape[axis]
    if n_even == n_odd:
        return torch.stack([even, odd], dim=axis + 1).flatten(axis, axis + 1)
    # one more even than odd
    head = torch.stack([_take(even, axis, 0, n_odd), odd], dim=axis + 1).flatten(axis, axis + 1)
    return torch.cat([head, _take(even, axis, n_odd, None)], dim=axis)


# ----------------------------------------------------------------------------------------
# Lowering under tfun.jit / torch.export: torch's associative_scan (see `_hop`)
# ----------------------------------------------------------------------------------------


#: Use the fused "pointwise" mode of torch's associative_scan for CUDA inputs traced with
#: gradients off (see `_combine_mode`). The combine function must then contain only pointwise
#: ops; set to False to always use "generic".
POINTWISE_ON_CUDA = True


#: How a CUDA associative_scan is lowered where gradients may be taken (mode "generic"):
#: "tfun", the log-depth algorithm of the eager path as plain tensor ops in the graph
#: (differentiated by AOTAutograd like any ops), or "hop", torch's associative_scan HOP in its
#: "generic" mode. With the HOP, `tfun.jit(tfun.value_and_grad(f))` under Inductor returned
#: wrong *values* of the scan (relative error 2.3, gradients right; H100, torch 2.11,
#: 2026-11-27, tests/gpu/check_cuda.py, the pair scan T=37 C=5 reversed along axis 1), while
#: aot_eager and the forward-only Inductor graph were right.
CUDA_GRAD_LOWERING = "tfun"


def _tfun_algorithm(on_cuda: bool, mode: str) -> bool:
    """Whether the lowering writes tfun's log-depth algorithm as plain ops instead of torch's
    HOP (see `CUDA_GRAD_LOWERING`)."""
    return on_cuda and mode == "generic" and CUDA_GRAD_LOWERING == "tfun"


def _combine_mode(on_cuda: bool, grad_possible: bool) -> str:
    """torch's `combine_mode` for a scan: "pointwise" (one fused kernel, CUDA only) where the
    trace runs with gradients off (`torch.no_grad()`, `torch.inference_mode()`) and no
    `torch.func` transform, else "generic" (a log-depth tree of combine calls, differentiated
    through its ops), as on the CPU.

    Measured on CUDA with torch 2.11 (2026-11-26, tests/gpu/check_cuda.py, the pair scan of the
    differential suite, T=37, reversed, axis 1):

    - torch's autograd for the "pointwise" mode (`AssociativeScanAutogradOp`) treats each leaf's
      per-step Jacobian as its own and drops the cross terms between leaves, so a pair scan such
      as the linear recurrence `(a1 * a2, a2 * b1 + b2)` gets wrong gradients with right
      outputs: relative gradient error 0.74 under `tfun.jit` with both backends, on an H100
      (reported upstream in pytorch/pytorch#172568).
    - With "pointwise" only where no input required grad, `tfun.jit(tfun.value_and_grad(f))`
      under Inductor returned a wrong *value* (relative error 5.3, gradients right) on an H200:
      its graph held both modes (tfun.grad's probe call runs `f` on detached inputs), and no
      other path did.

    So the fused mode is kept to traces where autograd cannot run at all."""
    return "pointwise" if (on_cuda and POINTWISE_ON_CUDA and not grad_possible) else "generic"


def _lower_associative_scan(fn: Callable[[Any, Any], Any], elems: Any, reverse: bool, axis: int) -> Any:
    """`torch._higher_order_ops.associative_scan` with tfun pytrees (inside a derivative that
    is differentiated again, the eager algorithm instead: see the end)."""
    if not _hop.unrolled_steps():
        _hop.begin_lowering()
    op = "tfun.lax.associative_scan"
    leaves, td = tree_flatten(elems)
    n = len(leaves)
    cuda = all(x.device.type == "cuda" for x in leaves)
    mode = _combine_mode(cuda, torch.is_grad_enabled() or _context.functorch_active())

    carrier = _hop.carrier(td, leaves)
    if leaves and leaves[0].shape[axis] == 0:
        return elems  # nothing to combine (torch's associative_scan rejects length 0), as in eager
    if torch.is_grad_enabled() and not _hop.is_exporting() and any(x.is_complex() for x in leaves):
        # Inductor (torch 2.13) computes wrong gradients through a complex associative_scan
        # (S4D/S5/LRU, length >= 4; the outputs are right): refuse rather than return them.
        # without sizes: under Dynamo a symbolic size (automatic dynamic shapes) cannot be told
        # from a concrete one, and cannot be passed to an escape hatch (see cond)
        msg = _escape_complex_scan_refusal(_hop.describe(td, leaves, False), _hop.code_of(fn))
        if msg is not None:
            raise JitError(msg)

    def combine(a: list[Any], b: list[Any]) -> Any:
        td_in = tree_structure(carrier)
        state = _hop.torch_state()
        out = fn(tree_unflatten(td_in, list(a)), tree_unflatten(td_in, list(b)))
        _hop.check_state(op, "combine function", fn, state)
        out_leaves, out_td = tree_flatten(out)
        what, names = "combine function input and output", ("input", "output")
        if not _compat.same_treedef(out_td, td_in) or len(out_leaves) != n:
            _hop.raise_mismatch(
                op, what, "elems", names, _hop.describe(td_in, a), _hop.describe(out_td, out_leaves), fn, _REVISE_COMBINE
            )
        out_leaves = [_hop.as_tensor(t, r) for t, r in zip(out_leaves, a)]
        if any(
            isinstance(t, torch.Tensor) and (t.dtype != r.dtype or t.device != r.device or t.dim() != r.dim())
            for t, r in zip(out_leaves, a)
        ):
            # the dtype, device and rank rules of the eager check (sizes may be symbolic
            # here: they are neither compared nor written)
            _hop.raise_mismatch(
                op, what, "elems", names, _hop.describe(td_in, a, False), _hop.describe(out_td, out_leaves, False), fn,
                _REVISE_COMBINE,
            )
        return _hop.unalias(out_leaves, list(a) + list(b))

    if _hop.unrolled_steps() or _tfun_algorithm(cuda, mode):
        # inside a traced derivative that is differentiated again: the eager algorithm's tensor
        # ops in the graph, no HOP (torch's have no second derivative; see _hop.unroll_scope).
        # Likewise on CUDA where gradients may be taken (see CUDA_GRAD_LOWERING).
        return tree_unflatten(td, _log_depth_scan(combine, list(leaves), [axis] * n, reverse))
    out = _hop.torch_associative_scan()(combine, _hop.distinct(leaves), dim=axis, reverse=reverse, combine_mode=mode)
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


@_hop.assume_constant
def _escape_complex_scan_refusal(desc: Any, code: Any) -> str | None:
    """None if the backend being compiled for differentiates a complex associative_scan
    correctly; else the message of the JitError that refuses it."""
    backend = _compiling_backend()
    if backend in _COMPLEX_SCAN_GRAD_BACKENDS:
        return None
    sk, leaf_descs = desc
    bullets = [
        f"elems{p}: a {_rules.dtype_name(d[0])} tensor on {d[2]}"
        for p, d in zip(_rules.skeleton_leaf_paths(sk), leaf_descs)
        if len(d) == 3 and d[0].is_complex
    ]
    bullets.append(f"backend: {backend or 'not one of ' + ', '.join(_COMPLEX_SCAN_GRAD_BACKENDS)}")
    return format_message(
        "tfun.lax.associative_scan: complex elems must be compiled with a backend whose gradients are right, "
        f"but Inductor (torch {torch.__version__}; measured on 2.11 and 2.13) computes wrong gradients through "
        "a complex associative_scan (its outputs are right), so this is refused:",
        bullets,
        function=_hop.fn_text(code),
        revise='Compile with tfun.jit(..., backend="aot_eager") (exact), or run the compiled function under '
        "torch.no_grad() if no gradient is needed.",
    )


__all__ = ["associative_scan"]
