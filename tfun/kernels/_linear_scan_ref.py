"""Pure-torch implementations of the linear recurrence `h_t = a_t * h_{t-1} + b_t`.

Every function here has the signature of the Triton launcher
(`tfun.kernels._linear_scan_triton.linear_scan_fwd`):

    fn(a, b, h0, axis, reverse) -> h

with `a` and `b` of the same shape (`a` may be an expanded view), `h0` of `b`'s shape without
`axis`, all of one floating dtype, `0 <= axis < b.ndim`. They are differentiable with plain
torch autograd, so `torch.func.grad`/`vmap`/`jvp` compose with them without custom rules.
float16/bfloat16 inputs are accumulated in float32 and rounded once at the end, like the kernel.

* `linear_scan_sequential`: one Python step per time step. The test oracle, and the fastest CPU
  path when there are many channels and few time steps.
* `linear_scan_logdepth`: Hillis-Steele doubling, `ceil(log2 T)` full-size passes.
* `linear_scan_chunked`: two levels. Time is cut into `n` chunks of `L`; a sequential pass over the
  `L` positions runs all chunks at once, a sequential pass over the `n` chunk ends carries the
  state, and one fused multiply-add applies it. `L + n` Python steps instead of `T`.
* `linear_scan_loop`: the sequential recurrence as one `tfun.lax.scan`, for traced code.
* `linear_scan_torch`: picks one of the above by shape (`choose_torch_algorithm`), from the
  measurements in `benchmarks/RESULTS.md` (section "linear_scan"); traced on the CPU, the
  loop op instead of a Python loop that would be unrolled into the graph.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "linear_scan_sequential",
    "linear_scan_logdepth",
    "linear_scan_chunked",
    "linear_scan_loop",
    "linear_scan_torch",
    "choose_torch_algorithm",
]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _to_time_major(a: Tensor, b: Tensor, h0: Tensor, axis: int, reverse: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(T, C) views in accumulation dtype, time flipped when `reverse`."""
    acc = _acc_dtype(b.dtype)
    T = b.shape[axis]
    # contiguous (T, C), so every step reads a dense row (one copy when the input is not)
    at = a.movedim(axis, 0).reshape(T, -1).to(acc)
    bt = b.movedim(axis, 0).reshape(T, -1).to(acc)
    if reverse:
        at = at.flip(0)
        bt = bt.flip(0)
    return at.contiguous(), bt.contiguous(), h0.reshape(-1).to(acc)


def _from_time_major(h: Tensor, b: Tensor, axis: int, reverse: bool) -> Tensor:
    if reverse:
        h = h.flip(0)
    shape = (b.shape[axis], *b.shape[:axis], *b.shape[axis + 1 :])
    return h.reshape(shape).movedim(0, axis).to(b.dtype)


def _empty_result(a: Tensor, b: Tensor, h0: Tensor) -> Tensor:
    """The (empty) states of a recurrence with no steps or no channels, joined to the graph of
    every input that requires grad through an empty slice of it (a zero derivative, no
    arithmetic), as torch's own ops on empty tensors are: `h.sum().backward()` then runs."""
    out = torch.empty_like(b)
    linked = [x for x in (a, b, h0) if isinstance(x, Tensor) and x.requires_grad]
    if linked and torch.is_grad_enabled():
        out = out + sum(x.reshape(-1)[:0].sum() for x in linked).to(out.dtype)
    return out


def linear_scan_sequential(a: Tensor, b: Tensor, h0: Tensor, axis: int, reverse: bool) -> Tensor:
    """`T` Python steps, each a fused multiply-add over all channels."""
    if b.shape[axis] == 0 or b.numel() == 0:
        return _empty_result(a, b, h0)
    at, bt, h = _to_time_major(a, b, h0, axis, reverse)
    hs = []
    # unbind, not at[t]: the backward of T selects would build T full-size gradients
    for a_t, b_t in zip(torch.unbind(at, 0), torch.unbind(bt, 0)):
        h = torch.addcmul(b_t, a_t, h)
        hs.append(h)
    return _from_time_major(torch.stack(hs, 0), b, axis, reverse)


def _logdepth_time_major(at: Tensor, bt: Tensor, h: Tensor) -> Tensor:
    T = at.shape[0]
    # fold the initial state into the first step: h_0 = a_0 * init + b_0
    bt = torch.cat([torch.addcmul(bt[:1], at[:1], h.unsqueeze(0)), bt[1:]], 0)
    d = 1
    while d < T:
        bt = torch.cat([bt[:d], torch.addcmul(bt[d:], at[d:], bt[:-d])], 0)
        if 2 * d < T:
            at = torch.cat([at[:d], at[d:] * at[:-d]], 0)
        d *= 2
    return bt


def linear_scan_logdepth(a: Tensor, b: Tensor, h0: Tensor, axis: int, reverse: bool) -> Tensor:
    """Hillis-Steele scan over the pairs `(a, b)`: `ceil(log2 T)` passes of `O(T)` work each."""
    if b.shape[axis] == 0 or b.numel() == 0:
        return _empty_result(a, b, h0)
    at, bt, h = _to_time_major(a, b, h0, axis, reverse)
    return _from_time_major(_logdepth_time_major(at, bt, h), b, axis, reverse)


def linear_scan_chunked(
    a: Tensor, b: Tensor, h0: Tensor, axis: int, reverse: bool, chunk: int | None = None
) -> Tensor:
    """Two-level scan: chunks of `chunk` steps (default about `sqrt(T)`) scanned side by side."""
    if b.shape[axis] == 0 or b.numel() == 0:
        return _empty_result(a, b, h0)
    at, bt, h = _to_time_major(a, b, h0, axis, reverse)
    T, C = at.shape
    L = chunk if chunk is not None else max(1, math.isqrt(T))
    n = -(-T // L)
    pad = n * L - T
    if pad:
        at = torch.cat([at, at.new_ones(pad, C)], 0)
        bt = torch.cat([bt, bt.new_zeros(pad, C)], 0)
    # (L, n, C): position in chunk, chunk, channel; contiguous per position
    A = at.reshape(n, L, C).transpose(0, 1).contiguous()
    B = bt.reshape(n, L, C).transpose(0, 1).contiguous()
    loc = B.new_zeros(n, C)
    locs = []
    for a_i, b_i in zip(torch.unbind(A, 0), torch.unbind(B, 0)):
        loc = torch.addcmul(b_i, a_i, loc)
        locs.append(loc)
    hloc = torch.stack(locs, 0)  # (L, n, C), zero initial state per chunk
    P = torch.cumprod(A, 0)  # (L, n, C), products of a within each chunk
    carries = []
    for p_k, h_k in zip(torch.unbind(P[-1], 0), torch.unbind(hloc[-1], 0)):
        carries.append(h)
        h = torch.addcmul(h_k, p_k, h)
    cin = torch.stack(carries, 0)  # (n, C): the state entering each chunk
    out = torch.addcmul(hloc, P, cin.unsqueeze(0))  # (L, n, C)
    out = out.transpose(0, 1).reshape(n * L, C)[:T]
    return _from_time_major(out, b, axis, reverse)


def choose_torch_algorithm(T: int, C: int, device_type: str = "cpu") -> str:
    """The torch algorithm for `T` steps of `C` channels on a `device_type` device, from
    measurements.

    Measured forward and forward+backward on a 2-core Xeon (`benchmarks/linear_scan.py`, and
    `benchmarks/RESULTS.md` section "linear_scan"): the sequential loop costs a fixed few us of
    dispatch per step plus one pass over the channels, so it wins for short sequences and for
    many channels (>= 1k); the log-depth scan pays `log2(T)` full passes and wins while the
    problem is small (few channels, < 64k elements); the chunked scan pays ~4 passes but only
    `2*sqrt(T)` steps and wins for few channels (<= 256) over long sequences.

    On CUDA (where `impl=None` uses the Triton kernel; this is `impl="torch"`, or no Triton) a
    step costs a kernel launch whatever its size, so the sequential loop loses beyond a few
    steps. Measured on an H100 (torch 2.11, 2026-11-26, forward fp32, B*D x T): 1k x 256:
    sequential 2.79 ms, log-depth 0.54, chunked 0.60; 1k x 4096: 70.9, 1.22, 2.48; 16k x 256:
    4.31, 0.83, 0.87; 16k x 4096: 69.6, 11.4, 3.31. The log-depth scan's `log2(T)` passes win up
    to about 16M elements, the chunked scan beyond.
    """
    if device_type == "cuda":
        if T <= 8:
            return "sequential"
        return "logdepth" if C * T <= 1 << 24 else "chunked"
    if T <= 32:
        return "sequential"
    if C <= 64 and C * T < 1 << 16:
        return "logdepth"
    if C <= 256:
        return "chunked"
    return "sequential"


_ALGORITHMS = {
    "sequential": linear_scan_sequential,
    "logdepth": linear_scan_logdepth,
    "chunked": linear_scan_chunked,
}


def linear_scan_loop(a: Tensor, b: Tensor, h0: Tensor, axis: int, reverse: bool) -> Tensor:
    """The sequential recurrence as one `tfun.lax.scan` (a loop op in a traced graph, not `T`
    unrolled steps): what `linear_scan_torch` runs on the CPU under `tfun.jit`/`torch.export`
    where the eager choice would unroll a Python loop into the graph."""
    from ..lax import scan

    if b.shape[axis] == 0 or b.numel() == 0:
        return _empty_result(a, b, h0)
    at, bt, h = _to_time_major(a, b, h0, axis, False)

    def step(h: Tensor, ab: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        h = torch.addcmul(ab[1], ab[0], h)
        return h, h

    _, hs = scan(step, h, (at, bt), reverse=reverse)
    return _from_time_major(hs, b, axis, False)


def _traced_loop_wanted(algorithm: str, device: torch.device) -> bool:
    """Whether a traced call runs `linear_scan_loop` instead of `algorithm`.

    Traced, the sequential and chunked algorithms are Python loops that Dynamo unrolls into
    the graph: `T` (or `2 sqrt(T)`) steps, each compiled. Measured on a 2-core CPU (torch
    2.13, one thread, `tfun.jit(tfun.grad(...))` of a linear_scan, first call / fwd+bwd):
    (C, T) = (512, 256), sequential: 57.6 s / 1.75 ms unrolled, 4.0 s / 0.34 ms as a loop;
    (256, 1024), chunked: 15.2 s / 9.0 ms against 4.6 s / 4.2 ms; (64, 4096), chunked: 29.0 s
    / 14.4 ms against 4.6 s / 5.9 ms; `tfun.nn.MinGRU` (B=8, L=256, d 64) 75.7 s / 3.0 ms
    against 7.3 s / 2.0 ms, `tfun.nn.Mamba` 123 s / 69 ms against 12.8 s / 62 ms. The
    log-depth algorithm (log2 T full-size passes) stays: at (8, 2048) it ran in 0.53 ms
    against the loop's 0.96. Only on the CPU (on CUDA a loop step is a kernel launch: not
    measured there), and not where a loop op cannot go: inside a `torch.func` transform
    (torch's loop ops do not run on batched tensors under Dynamo) or a traced derivative that
    is differentiated again (they have no second derivative), nor inside another control-flow
    op's body (torch cannot differentiate a scan nested in a `cond` branch or a `map` body:
    "cannot register a hook on a tensor that doesn't require gradient"; the Python loop is
    unrolled into the body there, as before)."""
    from .. import _context
    from ..lax import _hop

    return (
        algorithm != "logdepth"
        and device.type == "cpu"
        and _context.is_tracing()
        and not _context.functorch_active()
        and not _hop.unrolled_steps()
        and not _hop.in_body()
    )


def _exported_loop_wanted() -> bool:
    """Whether a call that `torch.export` traces runs `linear_scan_loop`, whatever the shape:
    the one algorithm that holds for every length without asking what it is. Choosing by
    shape (`choose_torch_algorithm`) puts a guard on the length (`T <= 32`), which export
    refuses for a dynamic one (`Dim`: "Constraints violated"; hunt 24, finding 5), and the
    log-depth and chunked algorithms loop in Python over `log2(T)` or `sqrt(T)` steps. Not
    where a loop op cannot go (see `_traced_loop_wanted`)."""
    from .. import _compat, _context
    from ..lax import _hop

    return _compat.is_exporting() and not _context.functorch_active() and not _hop.unrolled_steps() and not _hop.in_body()


def linear_scan_torch(a: Tensor, b: Tensor, h0: Tensor, axis: int, reverse: bool) -> Tensor:
    """The pure-torch path: the measured-fastest torch algorithm for this shape (traced on
    the CPU, `linear_scan_loop` in place of a Python loop: see `_traced_loop_wanted`; under
    `torch.export`, always the loop: `_exported_loop_wanted`)."""
    if _exported_loop_wanted():
        return linear_scan_loop(a, b, h0, axis, reverse)
    T = b.shape[axis]
    C = b.numel() // T if T else 0
    algorithm = choose_torch_algorithm(T, C, b.device.type)
    if _traced_loop_wanted(algorithm, b.device):
        return linear_scan_loop(a, b, h0, axis, reverse)
    return _ALGORITHMS[algorithm](a, b, h0, axis, reverse)
