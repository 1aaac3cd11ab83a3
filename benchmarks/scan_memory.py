"""Memory: what `tfun.lax.scan` keeps for backward, with and without `tfun.checkpoint` on the body.

An RNN whose body is wide: the carry `h` is `(batch, width)`, and each step computes
several `(batch, 4*width)` intermediates before projecting back to `width`. For each
sequence length T, counts the unique bytes of tensors autograd saves for backward
(`saved_tensors_hooks`, deduplicated by storage `data_ptr`, so a tensor saved by several
ops, or the slices of `xs` that share one storage, count once), and times forward+backward.

With a plain body the saved state is ~T x (the body's intermediates); with the body wrapped
in `tfun.checkpoint` only each step's inputs (carry and x_t) are kept, so saved bytes per
T*|carry| stay roughly constant. Run:

    .venv/bin/python benchmarks/scan_memory.py [--width 256] [--batch 8] [--T 64 256 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tfun


def saved_bytes(fn):
    seen: dict[int, int] = {}

    def pack(x):
        s = x.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn()
    return out, sum(seen.values())


def make_rnn(width: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w_in = (torch.randn(width, 4 * width, generator=g, dtype=dtype) / width**0.5).requires_grad_(True)
    u_in = (torch.randn(width, 4 * width, generator=g, dtype=dtype) / width**0.5).requires_grad_(True)
    w_mid = (torch.randn(4 * width, 4 * width, generator=g, dtype=dtype) / (4 * width) ** 0.5).requires_grad_(True)
    w_out = (torch.randn(4 * width, width, generator=g, dtype=dtype) / (4 * width) ** 0.5).requires_grad_(True)
    params = [w_in, u_in, w_mid, w_out]

    def step(h, x):
        u = h @ w_in + x @ u_in  # (B, 4W)
        a = torch.tanh(u)
        b = torch.sigmoid(u) * a  # (B, 4W)
        c = torch.nn.functional.gelu(b @ w_mid)  # (B, 4W)
        h = torch.tanh(c @ w_out + h)  # (B, W)
        return h, h

    return step, params


def loss_fn(step, h0, xs):
    h, ys = tfun.lax.scan(step, h0, xs)
    return h.sum() + ys.pow(2).mean()


def measure(step, params, h0, xs):
    _, nbytes = saved_bytes(lambda: loss_fn(step, h0, xs))
    return nbytes


def timeit(step, params, h0, xs, reps: int) -> tuple[float, float]:
    """Median (wall, process CPU) seconds of forward+backward over `reps` runs, after one
    untimed warm-up. CPU time is the steadier number on a shared, loaded machine."""
    ts, cs = [], []
    for k in range(reps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        loss_fn(step, h0, xs).backward()
        if k:
            ts.append(time.perf_counter() - t0)
            cs.append(time.process_time() - c0)
        for p in params:
            p.grad = None
    return statistics.median(ts), statistics.median(cs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--T", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    step, params = make_rnn(a.width)
    ck_step = tfun.checkpoint(step)
    h0 = torch.randn(a.batch, a.width)
    carry_bytes = h0.numel() * h0.element_size()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), float32, batch={a.batch} width={a.width} "
        f"(intermediates {a.batch}x{4 * a.width}), |carry| = {carry_bytes / 2**10:.0f} KiB, "
        f"weights = {param_bytes / 2**20:.1f} MiB (saved by both variants, counted)"
    )
    print()
    print("| T | plain saved MiB | checkpoint saved MiB | plain / ckpt | plain / (T·\\|carry\\|) "
          "| ckpt / (T·\\|carry\\|) | (ckpt − weights) / (T·\\|carry\\|) "
          "| plain fwd+bwd wall / CPU s | ckpt fwd+bwd wall / CPU s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T in a.T:
        xs = torch.randn(T, a.batch, a.width)
        plain = measure(step, params, h0, xs)
        ck = measure(ck_step, params, h0, xs)
        tp = timeit(step, params, h0, xs, a.reps)
        tc = timeit(ck_step, params, h0, xs, a.reps)
        tc_bytes = T * carry_bytes
        print(
            f"| {T} | {plain / 2**20:.1f} | {ck / 2**20:.1f} | {plain / ck:.2f} | {plain / tc_bytes:.1f} "
            f"| {ck / tc_bytes:.2f} | {(ck - param_bytes) / tc_bytes:.2f} "
            f"| {tp[0]:.2f} / {tp[1]:.2f} | {tc[0]:.2f} / {tc[1]:.2f} |"
        )


if __name__ == "__main__":
    main()
