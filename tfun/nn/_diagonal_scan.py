"""The time-invariant complex diagonal recurrence of `S4D` (scan mode), `S5` and `LRU`.

`h_t = λ ⊙ h_{t-1} + u_t` along axis 1 of `u` (shape `(batch, length, n)`), `h_{-1} = 0`,
with a complex `λ = exp(z)` of shape `(n,)` that does not depend on `t`. Everything is passed
and returned as real/imaginary pairs, so the layers' projections around it are real matrix
products (a complex product of a real input costs twice the real one, and `Re(h Cᵀ)` half the
complex one).

Two algorithms compute it, chosen by context (both differentiable by autograd, both checked
against each other and against the float64 recurrence in tests/nn/test_diagonal_scan.py):

- eagerly, `_log_depth`: the pairwise-combining log-depth scan on complex tensors, carrying only
  `u` (a time-invariant `λ` needs no running products: level `k` multiplies by
  `λ^(2^k) = exp(2^k z)`). About `4 log2(T)` complex kernels, each over at most half the
  sequence.
- traced (`tfun.jit`, `torch.export`), `_chunked`: real arithmetic only, since Inductor
  generates no code for complex ops (it runs each as a fallback kernel). The sequence is cut
  into chunks of `_CHUNK` steps; the steps inside each chunk run as `_CHUNK` unrolled
  multiply-adds over all chunks at once (Inductor fuses them), the chunk ends are scanned
  the same way with `λ^_CHUNK` (recursively), and each chunk adds `λ^(t+1)` times the state
  its predecessor ended in (the two-level scheme of `tfun.kernels._linear_scan_ref.
  linear_scan_chunked`, in complex arithmetic on real pairs). Traced, the log-depth form of these real pairs took Inductor 37 s
  to compile at `T=256` (its interleaving views nest), the chunked one a few seconds.

Measured (2-core CPU, torch 2.13, one thread; `S5(64, 32)`, batch 8, forward + backward,
`benchmarks/nn.py`): see `benchmarks/RESULTS.md`, "CPU, session 19".
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _context
from ..lax import _hop, scan

#: Steps per chunk of the traced algorithm (unrolled in the graph: `_CHUNK` multiply-adds per
#: level of `ceil(log_CHUNK(T))` levels). 8 and 16 ran alike at T=256 and T=4096 on the CPU;
#: 8 compiles a shorter graph.
_CHUNK = 8


def diagonal_scan(zr: Tensor, zi: Tensor, ur: Tensor, ui: Tensor) -> tuple[Tensor, Tensor]:
    """All states of `h_t = exp(z) ⊙ h_{t-1} + u_t` along axis 1, `h_{-1} = 0`.

    **Arguments:**

    - `zr`, `zi`: `(n,)`, the real and imaginary parts of `z = log λ`.
    - `ur`, `ui`: `(batch, length, n)`, the real and imaginary parts of `u`.

    **Returns:** `(hr, hi)`, each `(batch, length, n)`.

    Half-precision inputs (bfloat16, float16) are scanned in float32 on both paths and the
    states returned in their dtype: torch has no complex bfloat16 for the eager algorithm (nor
    complex float16 kernels on the CPU), and a long recurrence in 8 bits of mantissa loses
    what the float32 one keeps.
    """
    if ur.shape[1] < 2:
        return ur, ui
    if ur.dtype not in (torch.float32, torch.float64):
        hr, hi = diagonal_scan(zr.float(), zi.float(), ur.float(), ui.float())
        return hr.to(ur.dtype), hi.to(ui.dtype)
    if _context.is_tracing():
        if _hop.exported_length_may_be_symbolic(ur.shape[1]):
            return _loop(zr, zi, ur, ui)
        # `_chunked` nests one padded reshape per factor of `_CHUNK`, a depth that depends on
        # the length: with a symbolic length (tfun.jit's second length, which Dynamo makes
        # dynamic and shows traced code as an int) torch's guards on those nested floor
        # divisions were wrong ("Guard failed on the same frame it was created", S5 at 257
        # then 1000 steps, hunt 27). `len(range(n))` makes the length static: each length is
        # a graph of its own, as under jax.jit
        length = len(range(ur.shape[1]))
        return _chunked(zr, zi, ur[:, :length], ui[:, :length])
    return _log_depth(zr, zi, ur, ui)


def _power(zr: Tensor, zi: Tensor, k: Tensor | float) -> tuple[Tensor, Tensor]:
    """`λ^k = exp(k z)` as a real/imaginary pair (evaluated directly, not by repeated products)."""
    mag = torch.exp(k * zr)
    return mag * torch.cos(k * zi), mag * torch.sin(k * zi)


def _log_depth(zr: Tensor, zi: Tensor, ur: Tensor, ui: Tensor) -> tuple[Tensor, Tensor]:
    z = torch.complex(zr, zi)

    def level(u: Tensor, k: int) -> Tensor:
        # u: the level's elements (each the sum of a segment of 2^k inputs); returns their
        # inclusive scan. Pairs (0,1), (2,3), ... combine into the next level; its scan gives
        # the odd positions; the even ones add their own element to the odd prefix before.
        n = u.shape[1]
        if n < 2:
            return u
        p = torch.exp(z * float(2**k))
        odd = level(p * u[:, 0 : n - 1 : 2] + u[:, 1::2], k + 1)
        m = (n - 1) // 2  # even positions after the first
        even = torch.cat([u[:, :1], p * odd[:, :m] + u[:, 2::2]], dim=1)
        n_odd = odd.shape[1]
        pairs = torch.stack([even[:, :n_odd], odd], dim=2).flatten(1, 2)
        return pairs if even.shape[1] == n_odd else torch.cat([pairs, even[:, n_odd:]], dim=1)

    h = level(torch.complex(ur, ui), 0)
    return h.real, h.imag


def _loop(zr: Tensor, zi: Tensor, ur: Tensor, ui: Tensor) -> tuple[Tensor, Tensor]:
    """One step at a time, in real arithmetic, as one `tfun.lax.scan`: what `torch.export`
    takes for a length that is a symbol (`Dim`). The other two algorithms' graphs depend on
    the length (`_chunked` nests one level per factor of `_CHUNK`), so export would have to
    specialize it and refuses the `Dim`."""
    pr, pi = _power(zr, zi, 1.0)

    def step(h: tuple[Tensor, Tensor], u: tuple[Tensor, Tensor]) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        hr, hi = pr * h[0] - pi * h[1] + u[0], pr * h[1] + pi * h[0] + u[1]
        return (hr, hi), (hr, hi)

    zero = ur.new_zeros(ur.shape[0], ur.shape[2])
    _, (hr, hi) = scan(step, (zero, zero.clone()), (ur.transpose(0, 1), ui.transpose(0, 1)))
    return hr.transpose(0, 1), hi.transpose(0, 1)


def _chunked(zr: Tensor, zi: Tensor, ur: Tensor, ui: Tensor) -> tuple[Tensor, Tensor]:
    b, length, n = ur.shape
    k = _CHUNK  # a constant, not a function of `length` (symbolic under dynamic shapes)
    chunks = -(-length // k)
    pad = chunks * k - length  # zeros after the end change no earlier state
    ur = torch.nn.functional.pad(ur, (0, 0, 0, pad)).reshape(b, chunks, k, n)
    ui = torch.nn.functional.pad(ui, (0, 0, 0, pad)).reshape(b, chunks, k, n)
    pr, pi = _power(zr, zi, 1.0)
    hr, hi = ur[:, :, 0], ui[:, :, 0]
    out_r, out_i = [hr], [hi]
    for t in range(1, k):  # every chunk at once, each from a zero state
        hr, hi = pr * hr - pi * hi + ur[:, :, t], pr * hi + pi * hr + ui[:, :, t]
        out_r.append(hr)
        out_i.append(hi)
    hr_all, hi_all = torch.stack(out_r, dim=2), torch.stack(out_i, dim=2)
    if chunks > 1:
        # the state each chunk ends in: the same recurrence over the chunks' own ends, by λ^k
        er, ei = _chunked(zr * k, zi * k, hr, hi)
        er = torch.nn.functional.pad(er[:, :-1], (0, 0, 1, 0)).unsqueeze(2)  # the state before each chunk
        ei = torch.nn.functional.pad(ei[:, :-1], (0, 0, 1, 0)).unsqueeze(2)
        steps = torch.arange(1, k + 1, dtype=zr.dtype, device=zr.device).unsqueeze(-1)
        qr, qi = _power(zr, zi, steps)  # λ^(t+1), (k, n)
        hr_all, hi_all = hr_all + qr * er - qi * ei, hi_all + qr * ei + qi * er
    return hr_all.reshape(b, chunks * k, n)[:, :length], hi_all.reshape(b, chunks * k, n)[:, :length]
