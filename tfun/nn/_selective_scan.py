"""`selective_scan`: the selective state-space scan of Mamba (Gu & Dao 2023), on `linear_recurrence`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._errors import ArgumentValueError, format_message
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
    h = zeros(batch, channels, state)
    for l in range(length):
        Bl = B if B.dim() == 2 else B[:, None, :, l]      # (d, n) or (b, 1, n)
        Cl = C if C.dim() == 2 else C[:, None, :, l]
        h = exp(delta[..., l, None] * A) * h + delta[..., l, None] * Bl * u[..., l, None]
        y[..., l] = (h * Cl).sum(-1)
    out = y + D[:, None] * u  if D is given
    out = out * silu(z)       if z is given
    return out (u's dtype), and h if return_last_state
    ```

    Computed in parallel over time with `linear_recurrence` (`tfun.lax.linear_scan`, or
    `associative_scan` until it is available) over the flattened batch·channels·state
    recurrences, in float32 or wider.

    **Arguments:**

    - `u`: input, `(batch, channels, length)`.
    - `delta`: step sizes, `(batch, channels, length)`.
    - `A`: state matrix diagonal, `(channels, state)` (real).
    - `B`, `C`: `(channels, state)` (constant) or `(batch, state, length)` (input-dependent).
    - `D`: skip, `(channels,)`, optional.
    - `z`: gate, `(batch, channels, length)`, optional; the output is multiplied by `silu(z)`.
    - `delta_bias`: `(channels,)`, added to `delta`, optional.
    - `delta_softplus`: apply softplus to `delta` (after the bias).
    - `return_last_state`: also return the final state.

    **Returns:** `out` `(batch, channels, length)`, or `(out, last_state)` with
    `last_state` `(batch, channels, state)`.
    """
    for name, t in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C)):
        check_tensor(_OP, name, t)
    if u.dim() != 3:
        raise _bad("u must be (batch, channels, length):", [f"u: got shape {tuple(u.shape)}"])
    b, d, L = u.shape
    if A.dim() != 2 or A.shape[0] != d:
        raise _bad("A must be (channels, state):", [f"A: expected ({d}, state), got {tuple(A.shape)}"])
    n = A.shape[1]
    if tuple(delta.shape) != (b, d, L):
        raise _bad("delta must have u's shape:", [f"delta: expected {(b, d, L)}, got {tuple(delta.shape)}"])
    for name, t in (("B", B), ("C", C)):
        if not (tuple(t.shape) == (d, n) or tuple(t.shape) == (b, n, L)):
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
    A_ = A.to(ct)
    # Time-last layout (b, d, n, l): the recurrence runs along the last axis.
    dA = torch.exp(dt.unsqueeze(2) * A_[None, :, :, None])
    dtu = (dt * u_).unsqueeze(2)  # (b, d, 1, l)
    if B.dim() == 2:
        dBu = dtu * B.to(ct)[None, :, :, None]
    else:
        dBu = dtu * B.to(ct).unsqueeze(1)  # (b, 1, n, l)
    h = linear_recurrence(dA, dBu, axis=-1)  # (b, d, n, l)
    if C.dim() == 2:
        y = torch.einsum("bdnl,dn->bdl", h, C.to(ct))
    else:
        y = torch.einsum("bdnl,bnl->bdl", h, C.to(ct))
    out = y if D is None else y + u_ * D.to(ct)[:, None]
    if z is not None:
        out = out * F.silu(z.to(ct))
    out = out.to(dtype_in)
    if return_last_state:
        return out, h[..., -1] if L > 0 else h.new_zeros(b, d, n)
    return out
