"""`selective_scan`: the selective state-space scan of Mamba (Gu & Dao 2023), on `linear_recurrence`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._errors import ArgumentTypeError, ArgumentValueError, format_message
from ._common import check_tensor, linear_recurrence

_OP = "tfun.nn.selective_scan"


def _bad(msg: str, bullets: list[str]) -> ArgumentValueError:
    return ArgumentValueError(format_message(f"{_OP}: {msg}", bullets, revise="Revise the shapes to the layout above."))


def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The selective scan (S6) of Mamba (Gu & Dao 2023, Algorithm 2), with the reference signature.

    Semantics, as a Python loop (`b` batch, `d` channel, `n` state, `l` time):

    ```python
    if delta_bias is not None: delta = delta + delta_bias[:, None]
    if delta_softplus: delta = softplus(delta)
    h = zeros(batch, channels, state)                     # complex if A is
    for l in range(length):
        Bl = B if B.dim() == 2 else B[:, None, :, l]      # (d, n) or (b, 1, n)
        Cl = C if C.dim() == 2 else C[:, None, :, l]
        h = exp(delta[..., l, None] * A) * h + delta[..., l, None] * Bl * u[..., l, None]
        y[..., l] = (h * Cl).sum(-1)                      # 2 * (h * Cl).sum(-1).real if A is complex
    out = y + D[:, None] * u  if D is given
    out = out * silu(z)       if z is given
    return out (u's dtype), and h if return_last_state
    ```

    Computed in parallel over time with `linear_recurrence` (`tfun.lax.linear_scan`, or
    `associative_scan` until it is available) over the flattened batch·channels·state
    recurrences, in float32 or wider.

    A complex `A` (S4D-style diagonal, e.g. `-1/2 + i*pi*n`) follows mamba_ssm's
    `selective_scan_ref`: the state is complex, `B` and `C` may be complex, and the output
    is real, twice the real part of `(h * Cl).sum(-1)` (each state stands for a conjugate
    pair). The complex recurrence runs on `tfun.lax.associative_scan` in complex64 or
    wider.

    **Arguments:**

    - `u`: input, `(batch, channels, length)`.
    - `delta`: step sizes, `(batch, channels, length)`.
    - `A`: state matrix diagonal, `(channels, state)`, real or complex.
    - `B`, `C`: `(channels, state)` (constant) or `(batch, state, length)` (input-dependent).
      Complex only with a complex `A`; then an input-dependent one may also be real of
      shape `(batch, state, 2 * length)`, the real and imaginary parts interleaved along
      time (mamba_ssm's layout).
    - `D`: skip, `(channels,)`, optional.
    - `z`: gate, `(batch, channels, length)`, optional; the output is multiplied by `silu(z)`.
    - `delta_bias`: `(channels,)`, added to `delta`, optional.
    - `delta_softplus`: apply softplus to `delta` (after the bias).
    - `return_last_state`: also return the final state.

    **Returns:** `out` `(batch, channels, length)` (real, u's dtype), or `(out, last_state)`
    with `last_state` `(batch, channels, state)` (complex if `A` is).
    """
    for name, t in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C)):
        check_tensor(_OP, name, t)
    if u.dim() != 3:
        raise _bad("u must be (batch, channels, length):", [f"u: got shape {tuple(u.shape)}"])
    b, d, L = u.shape
    if A.dim() != 2 or A.shape[0] != d:
        raise _bad("A must be (channels, state):", [f"A: expected ({d}, state), got {tuple(A.shape)}"])
    n = A.shape[1]
    cplx = A.is_complex()
    real_only = [
        f"{name}: a {t.dtype} tensor of shape {tuple(t.shape)}"
        for name, t in (("u", u), ("delta", delta), ("B", B), ("C", C), ("D", D), ("z", z), ("delta_bias", delta_bias))
        if isinstance(t, torch.Tensor) and t.is_complex() and (name not in ("B", "C") or not cplx)
    ]
    if real_only:
        raise ArgumentTypeError(
            format_message(
                f"{_OP}: only A, B and C may be complex, and B and C only with a complex A (as in "
                "mamba_ssm's selective_scan_ref).",
                real_only,
                revise="Make A complex for a complex state, or pass real tensors there.",
            )
        )
    if tuple(delta.shape) != (b, d, L):
        raise _bad("delta must have u's shape:", [f"delta: expected {(b, d, L)}, got {tuple(delta.shape)}"])
    for name, t in (("B", B), ("C", C)):
        interleaved = cplx and not t.is_complex() and tuple(t.shape) == (b, n, 2 * L) and L > 0
        if not (tuple(t.shape) == (d, n) or tuple(t.shape) == (b, n, L) or interleaved):
            if cplx:
                raise _bad(f"{name} must be (channels, state), (batch, state, length), or real (batch, state, "
                           "2 * length) with real and imaginary parts interleaved:",
                           [f"{name}: expected {(d, n)}, {(b, n, L)} or {(b, n, 2 * L)}, got {tuple(t.shape)}"])
            raise _bad(f"{name} must be (channels, state) or (batch, state, length):",
                       [f"{name}: expected {(d, n)} or {(b, n, L)}, got {tuple(t.shape)}"])
    if D is not None and tuple(check_tensor(_OP, "D", D).shape) != (d,):
        raise _bad("D must be (channels,):", [f"D: expected {(d,)}, got {tuple(D.shape)}"])
    if z is not None and tuple(check_tensor(_OP, "z", z).shape) != (b, d, L):
        raise _bad("z must have u's shape:", [f"z: expected {(b, d, L)}, got {tuple(z.shape)}"])
    if delta_bias is not None and tuple(check_tensor(_OP, "delta_bias", delta_bias).shape) != (d,):
        raise _bad("delta_bias must be (channels,):", [f"delta_bias: expected {(d,)}, got {tuple(delta_bias.shape)}"])

    dtype_in = u.dtype
    ct = torch.promote_types(torch.promote_types(u.dtype, delta.dtype), torch.float32)
    u_ = u.to(ct)
    # Contiguous: softplus's gradient then meets its input in one layout. Mamba's `delta` is a
    # transposed view; with mixed layouts torch 2.13's fake-tensor strides for
    # softplus_backward differ from the real kernel's, and the compiled backward (tfun.jit,
    # aot_eager) fails with "view size is not compatible with input tensor's size and stride".
    dt = delta.to(ct).contiguous()
    if delta_bias is not None:
        dt = dt + delta_bias.to(ct)[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    # the state's dtype: complex64/complex128 beside float32/float64 when A is complex
    st = (torch.complex128 if ct == torch.float64 else torch.complex64) if cplx else ct

    def state_coeff(t: Tensor) -> Tensor:
        if t.is_complex():
            return t.to(st)
        if t.dim() == 3 and t.shape[-1] == 2 * L and cplx and L > 0:
            # mamba_ssm's layout: (real, imag) pairs interleaved along time
            return torch.view_as_complex(t.to(ct).reshape(b, n, L, 2).contiguous())
        return t.to(ct)

    A_ = A.to(st)
    # Time-last layout (b, d, n, l): the recurrence runs along the last axis.
    dA = torch.exp(dt.unsqueeze(2) * A_[None, :, :, None])
    dtu = (dt * u_).unsqueeze(2)  # (b, d, 1, l)
    B_, C_ = state_coeff(B), state_coeff(C)
    if B.dim() == 2:
        dBu = dtu * B_[None, :, :, None]
    else:
        dBu = dtu * B_.unsqueeze(1)  # (b, 1, n, l)
    if cplx:
        dBu = dBu.to(st)
    h = linear_recurrence(dA, dBu, axis=-1)  # (b, d, n, l)
    if C.dim() == 2:
        y = torch.einsum("bdnl,dn->bdl", h, C_.to(h.dtype))
    else:
        y = torch.einsum("bdnl,bnl->bdl", h, C_.to(h.dtype))
    if cplx:
        y = 2 * y.real  # each complex state stands for a conjugate pair
    out = y if D is None else y + u_ * D.to(ct)[:, None]
    if z is not None:
        out = out * F.silu(z.to(ct))
    out = out.to(dtype_in)
    if return_last_state:
        return out, h[..., -1] if L > 0 else h.new_zeros(b, d, n)
    return out
