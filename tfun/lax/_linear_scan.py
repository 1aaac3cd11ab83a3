"""`linear_scan`: the first-order linear recurrence `h_t = a_t * h_{t-1} + b_t`.

This module validates arguments and dispatches to an implementation. The implementations live
in `tfun.kernels` (a higher layer), which registers them here at import time with
`register_linear_scan_impl`: `"torch"` (pure torch, any device) and `"triton"` (fused kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from .. import _rules
from .._errors import ArgumentTypeError, ArgumentValueError, TensorMismatchError, format_message

__all__ = ["linear_scan", "register_linear_scan_impl"]

_OP = "tfun.lax.linear_scan"

#: impl(a, b, h0, axis, reverse) -> h, with a and b of one shape and dtype, h0 of b's shape
#: without axis, 0 <= axis < b.ndim
LinearScanImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, bool], torch.Tensor]
#: unavailable(device) -> None when the impl can run on device now, else why not and how to fix it
Availability = Callable[[torch.device], Optional[str]]

_IMPLS: dict[str, tuple[LinearScanImpl, Availability | None]] = {}
_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def register_linear_scan_impl(name: str, fn: LinearScanImpl, *, unavailable: Availability | None = None) -> None:
    """Make `fn` available as `linear_scan(..., impl=name)`.

    **Arguments:**

    - `name`: the value of `impl` that selects `fn`.
    - `fn`: `fn(a, b, h0, axis, reverse) -> h`. It gets validated inputs: `a` and `b` of one
      shape and floating dtype (`a` possibly an expanded view), `h0` of `b`'s shape without
      `axis`, `0 <= axis < b.ndim`. It must return a tensor of `b`'s shape and dtype, and be
      differentiable in `a`, `b` and `h0`.
    - `unavailable`: `unavailable(device) -> str | None`, the reason `fn` cannot run on
      `device` right now (with how to fix it), or `None` when it can.

    **Returns:** `None`.
    """
    _IMPLS[name] = (fn, unavailable)


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ("," if t.dim() == 1 else "") + ")"


def _check_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(
            format_message(
                f"{_OP}: `{name}` must be a tensor, but it is {_rules.describe_leaf(x)}.",
                revise=f"Pass `{name}` as a floating-point torch.Tensor.",
            )
        )
    if x.dtype not in _FLOATING:
        raise ArgumentTypeError(
            format_message(
                f"{_OP}: `{name}` must have a floating dtype (float16, bfloat16, float32 or float64), "
                f"but it is {_rules.describe_leaf(x)}.",
                revise=f"Convert `{name}` with `.float()` (or another floating dtype).",
            )
        )
    return x


def _pick_impl(impl: object, device: torch.device) -> LinearScanImpl:
    if impl is not None and not isinstance(impl, str):
        raise ArgumentTypeError(f'{_OP}: impl must be None, "torch" or "triton", but got {_rules.describe_leaf(impl)}.')
    if impl is None:
        triton = _IMPLS.get("triton")
        if device.type == "cuda" and triton is not None and (triton[1] is None or triton[1](device) is None):
            return triton[0]
        impl = "torch"
    if impl not in _IMPLS:
        known = ", ".join(f'"{k}"' for k in sorted(_IMPLS)) or "none; `import tfun` registers them"
        hint = " (the triton package is not installed)" if impl == "triton" and _IMPLS else ""
        raise ArgumentValueError(
            format_message(
                f'{_OP}: unknown impl "{impl}"{hint}.',
                [f"registered impls: {known}"],
                revise='Pass impl=None (the fastest available), "torch" or "triton".',
            )
        )
    fn, unavailable = _IMPLS[impl]
    reason = unavailable(device) if unavailable is not None else None
    if reason is not None:
        raise ArgumentValueError(
            format_message(
                f'{_OP}: impl="{impl}" cannot run here: {reason}.',
                revise='Pass impl=None or impl="torch" to use the pure-torch path.',
            )
        )
    return fn


def linear_scan(
    a: torch.Tensor,
    b: torch.Tensor,
    init: torch.Tensor | None = None,
    *,
    axis: int = 0,
    reverse: bool = False,
    impl: str | None = None,
) -> torch.Tensor:
    """Every state of the linear recurrence `h_t = a_t * h_{t-1} + b_t` along `axis`.

    The inner loop of diagonal state-space models and linear RNNs (S4D, S5, LRU, minGRU,
    Mamba's selective scan). Semantics, as a Python loop (indices along `axis`):

    ```python
    def linear_scan(a, b, init=None, axis=0, reverse=False):
        a = broadcast_to(a, b.shape)
        h = zeros(b.shape without axis) if init is None else init
        out = empty_like(b)
        for t in (reversed(range(T)) if reverse else range(T)):
            h = a[t] * h + b[t]          # elementwise
            out[t] = h
        return out
    ```

    Type: `(a[T,...], b[T,...], h0[...]) -> h[T,...]` (shown for `axis=0`).

    `a` may broadcast to `b` (e.g. one decay per channel, shared over the batch); its gradient
    is summed back to its shape. Everything is differentiable in `a`, `b` and `init`, and
    composes with `torch.func.grad`, `vmap` and `jvp`, `torch.compile(fullgraph=True)` and
    `torch.export` (the Triton path is one `torch.ops.tfun.linear_scan` node in the graph).
    float16/bfloat16 inputs are accumulated in float32.

    **Arguments:**

    - `a`: the decay, a floating tensor broadcastable to `b`'s shape.
    - `b`: the input, a floating tensor with at least one dim; `axis` is its time axis.
    - `init`: the state before the first step, broadcastable to `b`'s shape without `axis`;
      zeros if `None`.
    - `axis`: the time axis of `b` (negative counts from the end).
    - `reverse`: run `h_t = a_t * h_{t+1} + b_t` from the last step to the first.
    - `impl`: `None` picks the fastest correct path for the device (the Triton kernel on CUDA,
      else the fastest pure-torch algorithm for the shape, measured in `benchmarks/`);
      `"triton"` forces the Triton kernel (CUDA, or the CPU interpreter with
      `TRITON_INTERPRET=1`); `"torch"` forces the pure-torch path.

    **Returns:** a tensor of `b`'s shape and the promoted dtype of `a`, `b` and `init` holding
    every `h_t`.
    """
    a = _check_tensor("a", a)
    b = _check_tensor("b", b)
    if init is not None:
        init = _check_tensor("init", init)
    if not isinstance(reverse, bool):
        raise ArgumentTypeError(f"{_OP}: reverse must be a Python bool, but got {_rules.describe_leaf(reverse)}.")
    if b.dim() == 0:
        raise ArgumentValueError(
            format_message(
                f"{_OP}: `b` must have at least one dim (the time axis), but it is a scalar.",
                revise="Give `b` a time axis, e.g. `b.reshape(1)`.",
            )
        )
    ax = _rules.canonical_axis(_OP, axis, b.dim())
    for name, x in (("a", a), ("init", init)):
        if x is not None and x.device != b.device:
            raise TensorMismatchError(
                format_message(
                    f"{_OP}: `{name}` and `b` must be on the same device, but they differ:",
                    [f"{name}: {_rules.describe_leaf(x)}, b: {_rules.describe_leaf(b)}"],
                    revise=f"Move `{name}` to {b.device} (or `b` to {x.device}).",
                )
            )
    try:
        ok = torch.broadcast_shapes(a.shape, b.shape) == b.shape
    except RuntimeError:
        ok = False
    if not ok:
        raise TensorMismatchError(
            format_message(
                f"{_OP}: `a` must broadcast to the shape of `b`, but it does not:",
                [f"a: shape {_shape(a)}, b: shape {_shape(b)}"],
                revise=f"Revise `a` so that its shape broadcasts to {_shape(b)}.",
            )
        )
    state_shape = b.shape[:ax] + b.shape[ax + 1 :]
    if init is not None:
        try:
            ok = torch.broadcast_shapes(init.shape, state_shape) == state_shape
        except RuntimeError:
            ok = False
        if not ok:
            want = "(" + ", ".join(str(s) for s in state_shape) + ("," if len(state_shape) == 1 else "") + ")"
            raise TensorMismatchError(
                format_message(
                    f"{_OP}: `init` must broadcast to the state shape, `b`'s shape without axis {ax}, "
                    "but it does not:",
                    [f"init: shape {_shape(init)}, state: shape {want} (b: shape {_shape(b)})"],
                    revise=f"Revise `init` so that its shape broadcasts to {want}.",
                )
            )
    fn = _pick_impl(impl, b.device)
    dtype = torch.promote_types(a.dtype, b.dtype)
    if init is not None:
        dtype = torch.promote_types(dtype, init.dtype)
    if b.dtype != dtype:
        b = b.to(dtype)
    if a.dtype != dtype:
        a = a.to(dtype)
    if a.shape != b.shape:
        a = a.expand(b.shape)  # its gradient is summed back to a's shape by expand's backward
    if init is None:
        h0 = b.new_zeros(state_shape)
    else:
        h0 = init if init.dtype == dtype else init.to(dtype)
        if h0.shape != state_shape:
            h0 = h0.expand(state_shape)
    return fn(a, b, h0, ax, reverse)
