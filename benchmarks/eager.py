"""Eager speed of tfun.lax.scan: forward+backward against a hand-written loop and against
torch's own `scan` higher-order op run eagerly; and first-call latency of a new body.

    python benchmarks/eager.py            # full table
    python benchmarks/eager.py --quick    # fewer sizes and repeats

Prints a Markdown table; `--record` appends it to benchmarks/RESULTS.md with machine and date.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import sys
import time

import torch

from tfun import lax
from tfun._rules import clear_cache

try:
    from torch._higher_order_ops.scan import scan as torch_scan
except ImportError:  # pragma: no cover
    torch_scan = None


def make_rnn(hidden: int, batch: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    W = (torch.randn(hidden, hidden, generator=g) / hidden**0.5).requires_grad_()
    U = (torch.randn(hidden, hidden, generator=g) / hidden**0.5).requires_grad_()
    xs = torch.randn(length, batch, hidden, generator=g)
    h0 = torch.zeros(batch, hidden)

    def step(h, x):
        h = torch.tanh(h @ W + x @ U)
        return h, h

    def hand():
        h, ys = h0, []
        for x in xs:
            h, y = step(h, x)
            ys.append(y)
        return h, torch.stack(ys)

    def tfun_scan():
        return lax.scan(step, h0, xs)

    def hop_scan():
        # torch's HOP wants fresh outputs that do not alias inputs
        return torch_scan(lambda h, x: (lambda n: (n, n.clone()))(torch.tanh(h @ W + x @ U)), h0, xs)

    return (W, U), {"hand loop": hand, "tfun.lax.scan": tfun_scan, "torch HOP scan (eager)": hop_scan}


def fwd_bwd_time(fn, params, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        for p in params:
            p.grad = None
        t = time.perf_counter()
        h, ys = fn()
        (h.sum() + ys.sum()).backward()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def first_call_ms(repeats: int = 5) -> float:
    """Latency of the first call of a brand-new body (rules run, nothing cached)."""
    W = torch.randn(32, 32)
    xs = torch.randn(16, 4, 32)
    out = []
    for _ in range(repeats):
        clear_cache()
        t = time.perf_counter()
        lax.scan(lambda h, x: (torch.tanh(h @ W + x), h), torch.zeros(4, 32), xs)
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def machine() -> str:
    try:
        model = [l.split(":", 1)[1].strip() for l in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines() if l.startswith("Model name")][0]
    except Exception:
        model = platform.processor()
    return f"{model}, {torch.get_num_threads()} threads, torch {torch.__version__}, Python {platform.python_version()}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args()
    sizes = [(64, 8, 100), (256, 32, 100)] if args.quick else [(16, 1, 100), (64, 8, 100), (64, 8, 1000), (256, 32, 200), (512, 64, 100)]
    repeats = 5 if args.quick else 15
    rows = []
    for hidden, batch, length in sizes:
        params, fns = make_rnn(hidden, batch, length)
        res = {}
        for name, fn in fns.items():
            if name.startswith("torch HOP") and torch_scan is None:
                continue
            fwd_bwd_time(fn, params, 2)  # warm up
            res[name] = fwd_bwd_time(fn, params, repeats)
        rows.append((hidden, batch, length, res))
    lines = [
        "| hidden | batch | T | hand loop (ms) | tfun.lax.scan (ms) | tfun / hand | torch HOP scan eager (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for hidden, batch, length, res in rows:
        hand, tf = res["hand loop"], res["tfun.lax.scan"]
        hop = res.get("torch HOP scan (eager)")
        lines.append(
            f"| {hidden} | {batch} | {length} | {hand*1e3:.2f} | {tf*1e3:.2f} | {tf/hand:.3f} | "
            + (f"{hop*1e3:.2f} |" if hop is not None else "n/a |")
        )
    fc = first_call_ms()
    text = "\n".join(lines) + f"\n\nFirst call of a new scan body (rules run, 16 steps, hidden 32): {fc:.1f} ms (median of 5).\n"
    print(text)
    if args.record:
        with open("benchmarks/RESULTS.md", "a") as fh:
            fh.write(
                f"\n## Eager scan, forward+backward (`python benchmarks/eager.py`)\n\n"
                f"{datetime.date.today()}, {machine()}. RNN step `h = tanh(h @ W + x @ U)`, loss = sum of final h and all ys, "
                f"median of {repeats} runs.\n\n{text}"
            )


if __name__ == "__main__":
    sys.exit(main())
