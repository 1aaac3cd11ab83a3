"""`associative_scan`: an inclusive prefix scan with an associative operator, in log depth."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .. import _compat, _context, _funcinfo, _rules
from .._errors import ArgumentValueError, format_message
from .._tree import PyTreeSpec, tree_flatten, tree_leaves, tree_structure, tree_unflatten, unflatten_kept
from . import _hop
from ._scan import scan, xs_leaves

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
    # (compared pairwise, not through a set: under `torch.export` with a dynamic length the
    # sizes are SymInts, which do not hash)
    length = leaves[0].shape[ax]
    if any(x.shape[a] != length for a, x in zip(axes, leaves)):
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
        return _lower_associative_scan(fn, elems, bool(reverse), ax)
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


def _sequential_scan(
    combine: Callable[[list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]],
    leaves: list[torch.Tensor],
    axis: int,
    reverse: bool,
) -> list[torch.Tensor]:
    """The inclusive scan of `leaves` along `axis` one element at a time, as one `tfun.lax.scan`
    (`out[0] = x[0]`, `out[t] = combine(out[t-1], x[t])`, in the flipped order when `reverse`):
    a graph that does not depend on the length, for a length that is a symbol under
    `torch.export`. `combine` gets slices that keep the axis, with size 1, as in the log-depth
    algorithm's calls."""
    moved = [x.movedim(axis, 0) for x in leaves]
    if reverse:
        moved = [x.flip(0) for x in moved]
    first = [x[:1].movedim(0, axis) for x in moved]

    def step(carry: list[torch.Tensor], x: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        new = combine(carry, [xi.unsqueeze(axis) for xi in x])
        return new, [y.squeeze(axis) for y in new]

    # No slice of length T - 1 (`x[1:]`): its strides make export guard `T - 1 != 1`, which a
    # `Dim` with min=2 does not imply ("Constraints violated"; hunt 24, finding 4). The scan
    # runs over `x[1], ..., x[T-1], x[0]`; its last step is not used, and its output's
    # rotation puts `x[0]` in front.
    _, ys = scan(step, first, [x.roll(-1, 0) for x in moved])
    t = torch.arange(moved[0].shape[0], device=moved[0].device)
    out = [
        torch.where((t == 0).reshape(-1, *[1] * (y.dim() - 1)), f.movedim(axis, 0), y.roll(1, 0))
        for f, y in zip(first, ys)
    ]
    if reverse:
        out = [x.flip(0) for x in out]
    return [x.movedim(0, axis) for x in out]


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
        if n == 2:
            # nothing to fix up: no combine of empty slices, whose backward Inductor could not
            # compile for complex leaves (hunt 35 F1: every power-of-two length, and any whose
            # halving reaches 2, under tfun.jit with gradients)
            even = [_take(x, a, 0, 1) for x, a in zip(elems, axes)]
        else:
            if n % 2 == 0:
                even = combine([_take(x, a, 0, -1) for x, a in zip(odd, axes)], [_take(x, a, 2, None, 2) for x, a in zip(elems, axes)])
            else:
                even = combine(odd, [_take(x, a, 2, None, 2) for x, a in zip(elems, axes)])
            even = [torch.cat([_take(x, a, 0, 1), e], dim=a) for x, e, a in zip(elems, even, axes)]
        return [_interleave(e, o, a) for e, o, a in zip(even, odd, axes)]

    out = scan_rec(leaves)
    # Traced with a symbolic length `s`, the interleaved result's length is an expression of
    # `s` (`2*((s + 1)//2) - ...`), equal to it but not it: a loop later scanning or mapping
    # over the result then had a length Inductor could not rebuild ("KeyError: s12", hunt 35
    # F2). Traced, each output is copied into a tensor of its input's length along the
    # scanned axis, by `index_copy` (a reshape, a full `slice_scatter` or a `copy` would not
    # do: torch or Inductor sees the sizes equal and keeps the expression).
    if _context.is_tracing() and len(out[0].shape) > 0:
        index = torch.arange(leaves[0].shape[axes[0]], device=leaves[0].device)
        out = [
            o.new_empty(o.shape[:a] + x.shape[a : a + 1] + o.shape[a + 1 :]).index_copy(a, index, o)
            for o, x, a in zip(out, leaves, axes)
        ]
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
# Lowering under tfun.jit / torch.export (see `_combine_mode`)
# ----------------------------------------------------------------------------------------


#: Use the fused "pointwise" mode of torch's associative_scan for CUDA inputs traced with
#: gradients off (see `_combine_mode`). The combine function must then contain only pointwise
#: ops; set to False to always lower to tfun's log-depth algorithm.
POINTWISE_ON_CUDA = True
#: the devices where torch's fused mode runs (tests add the CPU, with a stand-in for the HOP)
_FUSED_DEVICES = ("cuda",)


def _combine_mode(on_cuda: bool, grad_possible: bool) -> str:
    """How a traced associative_scan is lowered: "pointwise" (torch's associative_scan HOP in
    its fused mode: one kernel, CUDA only) where the trace runs with gradients off
    (`torch.no_grad()`, `torch.inference_mode()`) and no `torch.func` transform; else
    "generic": tfun's own log-depth algorithm (`_log_depth_scan`, the eager path's) as plain
    tensor ops in the graph, differentiated by AOTAutograd like any ops, on every device.

    Why not torch's HOP in its "generic" mode (a log-depth tree of combine calls, which tfun
    lowered to on the CPU up to session 18):

    - Under Inductor its gradients through a complex scan were wrong (relative error ~1 at
      length >= 4; torch 2.11 and 2.13, CPU), so tfun refused complex scans with gradients
      under Inductor (S5, LRU, S4D's scan mode). tfun's algorithm in plain ops gives eager's
      gradients there (tests/lax/test_associative_scan.py).
    - On CUDA, `tfun.jit(tfun.value_and_grad(f))` under Inductor returned wrong scan *values*
      with it (relative error 2.3, right gradients; H100, torch 2.11, 2026-11-27).
    - Dynamo traces it as a `torch.vmap` of the combine function per level: 5 s to trace a
      length-4096 pair scan on a 2-core CPU, 12 s with its gradient, against 0.2-0.4 s for
      the plain ops; first calls went from 8.0 to 4.7 s (forward) and 20 to 11.5 s (with
      the gradient), and the compiled gradient ran in 3.0 ms instead of 5.0 (torch 2.13).

    And torch's fused "pointwise" mode is kept to traces where autograd cannot run at all,
    because (measured on CUDA with torch 2.11, tests/gpu/check_cuda.py, the pair scan of the
    differential suite, T=37, reversed, axis 1):

    - torch's autograd for that mode (`AssociativeScanAutogradOp`) treats each leaf's
      per-step Jacobian as its own and drops the cross terms between leaves, so a pair scan such
      as the linear recurrence `(a1 * a2, a2 * b1 + b2)` gets wrong gradients with right
      outputs: relative gradient error 0.74 under `tfun.jit` with both backends, on an H100
      (reported upstream in pytorch/pytorch#172568).
    - With "pointwise" only where no input required grad, `tfun.jit(tfun.value_and_grad(f))`
      under Inductor returned a wrong *value* (relative error 5.3, gradients right) on an H200:
      its graph held both modes (tfun.grad's probe call runs `f` on detached inputs)."""
    return "pointwise" if (on_cuda and POINTWISE_ON_CUDA and not grad_possible) else "generic"


def _lower_associative_scan(fn: Callable[[Any, Any], Any], elems: Any, reverse: bool, axis: int) -> Any:
    """The traced associative_scan (`axis` non-negative): torch's fused HOP on CUDA without
    gradients, else tfun's log-depth algorithm as plain ops (see `_combine_mode`)."""
    op = "tfun.lax.associative_scan"
    leaves, td = tree_flatten(elems)
    n = len(leaves)
    if leaves[0].shape[axis] == 0:
        return elems  # nothing to combine (torch's associative_scan rejects length 0), as in eager
    # complex leaves (S5's and LRU's scans) never take the fused mode: Triton has no complex type
    cuda = all(x.device.type in _FUSED_DEVICES and not x.is_complex() for x in leaves)
    hop = not _hop.unrolled_steps() and _combine_mode(cuda, torch.is_grad_enabled() or _context.functorch_active()) == "pointwise"
    carrier = _hop.carrier(td, leaves)
    # The rules are checked on the first combine call: the others differ only in the length
    # of their slices (as eagerly, where `_rules.first_call` checks the first). Dynamo traces
    # each check again at each call, so this keeps a long scan's trace short.
    checked = [False]

    def combine(a: list[Any], b: list[Any]) -> Any:
        if hop:
            # a HOP body: Dynamo refuses a write to `checked`, a variable from outside the body
            # ("HOP: Unsafe side effect", found on CUDA by benchmarks/vs_jax.py, session 34).
            # torch traces the body once, so each rule is checked once anyway.
            return checked_combine(a, b)
        if checked[0]:
            # (inline in the caller's trace, not a HOP body: `td` may be used, kept across a
            # graph break in `fn`)
            out_leaves = tree_leaves(fn(unflatten_kept(td, a, elems), unflatten_kept(td, b, elems)))
            return [x if isinstance(x, torch.Tensor) else _hop.as_tensor(x, r) for x, r in zip(out_leaves, a)]
        out = checked_combine(a, b)
        checked[0] = True
        return out

    def checked_combine(a: list[Any], b: list[Any]) -> Any:
        # the call with the rules checked, which a HOP body may make: it sets nothing outside
        # and builds its treedef in the trace (`carrier`)
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
        # the eager check's rules, with the sizes as this call has them (symbolic sizes are
        # neither compared nor written in traced code: `_hop.trace_sizes`; hunt 28 F3)
        described_in, described_out = _hop.describe(td_in, a), _hop.describe(out_td, out_leaves)
        if not _rules.descriptions_agree(described_in, described_out):
            _hop.raise_mismatch(op, what, "elems", names, described_in, described_out, fn, _REVISE_COMBINE)
        # a HOP body may not return an alias of its inputs; plain ops may
        return _hop.unalias(out_leaves, list(a) + list(b)) if hop else out_leaves

    if _hop.exported_length_may_be_symbolic(leaves[0].shape[axis]):
        # a length that is a symbol (`torch.export` with a `Dim`): the log-depth algorithm's
        # graph depends on the length, so export would have to specialize it and refuse the
        # Dim. Strict export's Dynamo answers `isinstance(size, int)` with True for a symbolic
        # size too (torch's AssertionError "Cannot create Dim with inconsistent min=2, max=2"
        # from its suggested fixes, hunt 26), so under strict export every length is scanned.
        # A static length under non-strict export keeps the log-depth algorithm, which, unlike
        # a `scan`, may read closed-over tensors there.
        out_leaves = _sequential_scan(checked_combine, list(leaves), axis, reverse)
        return unflatten_kept(td, out_leaves, elems)
    if not hop:
        # Also inside a traced derivative that is differentiated again: plain ops have second
        # derivatives, torch's HOPs none (see _hop.unroll_scope).
        out_leaves = _log_depth_scan(combine, list(leaves), [axis] * n, reverse)
        return unflatten_kept(td, out_leaves, elems)
    _hop.begin_lowering()
    out = _hop.call_hop(
        _hop.torch_associative_scan(), combine, _hop.distinct(leaves), dim=axis, reverse=reverse, combine_mode="pointwise"
    )
    return tree_unflatten(td, list(out))


__all__ = ["associative_scan"]
