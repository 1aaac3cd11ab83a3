"""Benchmark tfun.lax.linear_scan's implementations: time, GB/s and fraction of peak bandwidth.

Usage:

    python benchmarks/linear_scan.py            # the full grid (slow on a CPU)
    python benchmarks/linear_scan.py --quick    # B*D in {1k, 16k}, T in {256, 4096}
    python benchmarks/linear_scan.py --bd 1024 --T 65536 --dtypes fp32 --modes fwd
    python benchmarks/linear_scan.py --bd 65536 --T 4096 --modes fwd+bwd --sweep   # Triton tiles x warps (CUDA)

Shapes are `(B*D, T)` scanned along the last (contiguous) axis. Bytes are the minimum traffic:
read `a`, `b`, write `h` in the forward (12 bytes per element in fp32, 6 in bf16); the backward
reads `a`, `h`, `dh` and writes `da`, `db` (20 and 10), so fwd+bwd moves 32 (16). "peak" is the
measured bandwidth of a large tensor copy on the same device (read + write), not a datasheet.

Paths: the sequential torch loop, the log-depth torch scan, the chunked torch scan, torch's
`associative_scan` higher-order op (CUDA only, pointwise combine), the Triton kernel (CUDA only:
the CPU interpreter is a correctness tool, not a speed one), and `accelerated_scan` when installed.
A row is skipped (and says so) when its tensors would exceed --max-gib or one call would take
longer than --max-seconds (estimated from a smaller run).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tfun.kernels import _linear_scan_ref as ref  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BYTES = {("fwd", "fp32"): 12, ("fwd+bwd", "fp32"): 32, ("fwd", "bf16"): 6, ("fwd+bwd", "bf16"): 16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], device: torch.device, reps: int, max_seconds: float) -> float:
    """Median seconds per call, after one warm-up call; fewer reps when a call is slow."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - t0
    reps = max(1, min(reps, int(max_seconds / max(first, 1e-9))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 256 MiB copy (read + write)."""
    x = torch.empty(64 * 2**20, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    t = measure(lambda: y.copy_(x), device, 10, 5.0)
    return 2 * x.numel() * 4 / t


def torch_paths(device: torch.device) -> dict[str, Callable]:
    paths: dict[str, Callable] = {
        "sequential": lambda a, b, h0: ref.linear_scan_sequential(a, b, h0, 1, False),
        "logdepth": lambda a, b, h0: ref.linear_scan_logdepth(a, b, h0, 1, False),
        "chunked": lambda a, b, h0: ref.linear_scan_chunked(a, b, h0, 1, False),
        "auto (impl=None)": lambda a, b, h0: ref.linear_scan_torch(a, b, h0, 1, False),
    }
    if device.type == "cuda":
        from torch._higher_order_ops.associative_scan import associative_scan

        def combine(x, y):
            return x[0] * y[0], y[0] * x[1] + y[1]

        def hop(a, b, h0):
            b = torch.cat([(a[:, :1] * h0[:, None] + b[:, :1]), b[:, 1:]], 1)
            return associative_scan(combine, (a, b), dim=1, combine_mode="pointwise")[1]

        paths["torch associative_scan"] = hop
        from tfun.kernels._linear_scan_triton import linear_scan_triton

        paths["triton"] = lambda a, b, h0: linear_scan_triton(a, b, h0, 1, False)
    try:
        from accelerated_scan.warp import scan as accelerated  # type: ignore[import-not-found]

        if device.type == "cuda":
            paths["accelerated-scan"] = lambda a, b, h0: accelerated(a[None], b[None])[0]
    except ImportError:
        pass
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="B*D in {1k, 16k}, T in {256, 4096}")
    p.add_argument("--bd", type=int, nargs="*", help="B*D values (default 1024 16384 65536)")
    p.add_argument("--T", type=int, nargs="*", help="T values (default 256 4096 65536)")
    p.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--modes", nargs="*", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--paths", nargs="*", help="only these paths (names as printed)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-seconds", type=float, default=20.0, help="skip a row whose one call would take longer")
    p.add_argument("--max-gib", type=float, default=2.0, help="skip sizes whose b tensor is larger")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sweep", action="store_true",
                   help="the Triton kernel only, once per tile (BLOCK_C x BLOCK_T) and warp count (the kernel "
                   "knobs block_c, block_t, num_warps), at the first --bd and --T")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "linear_scan.png"))
    args = p.parse_args()
    device = torch.device(args.device)
    bds = args.bd or ([1024, 16384] if args.quick else [1024, 16384, 65536])
    Ts = args.T or ([256, 4096] if args.quick else [256, 4096, 65536])
    peak = peak_bandwidth(device)
    if args.sweep:
        sweep(device, bds[0], Ts[0], args.dtypes, args.modes, args.reps, args.max_seconds, peak)
        return
    paths = torch_paths(device)
    if args.paths:
        paths = {k: v for k, v in paths.items() if k in args.paths}
    print(f"device: {device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"measured copy bandwidth (peak): {peak / 1e9:.1f} GB/s")
    header = f"| {'path':24s} | dtype | mode    | B*D   | T     | time (ms) | GB/s   | % peak |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    rows = []
    slow: dict[tuple, float] = {}  # (path, dtype, mode, bd) -> seconds per element seen so far
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for mode in args.modes:
            for bd in bds:
                for T in Ts:
                    if bd * T * dtype.itemsize / 2**30 > args.max_gib:
                        print(f"| {'(all)':24s} | {dname:5s} | {mode:7s} | {bd:5d} | {T:5d} | skipped: b would be "
                              f"{bd * T * dtype.itemsize / 2**30:.0f} GiB > --max-gib |")
                        continue
                    g = torch.Generator(device="cpu").manual_seed(0)
                    a = (0.5 + 0.49 * torch.rand(bd, T, generator=g)).to(device, dtype)
                    b = torch.randn(bd, T, generator=g).to(device, dtype)
                    h0 = torch.zeros(bd, device=device, dtype=dtype)
                    for name, fn in paths.items():
                        key = (name, dname, mode, bd)
                        if mode != "fwd" and name == "torch associative_scan":
                            # its autograd drops the cross-leaf terms of a pair scan (wrong
                            # gradients; pytorch/pytorch#172568) and torch 2.11 refuses it here
                            print(f"| {name:24s} | {dname:5s} | {mode:7s} | {bd:5d} | {T:5d} | skipped: torch's "
                                  "pointwise-mode gradient is wrong for pair scans |")
                            continue
                        if key in slow and slow[key] * T > args.max_seconds:
                            print(f"| {name:24s} | {dname:5s} | {mode:7s} | {bd:5d} | {T:5d} | skipped: est. "
                                  f"{slow[key] * T:.0f} s per call > --max-seconds |")
                            continue
                        if mode == "fwd":
                            def call(fn=fn):
                                with torch.no_grad():
                                    return fn(a, b, h0)
                        else:
                            ar, br = a.detach().requires_grad_(), b.detach().requires_grad_()
                            dh = torch.ones_like(b)

                            def call(fn=fn, ar=ar, br=br, dh=dh):
                                torch.autograd.grad(fn(ar, br, h0), (ar, br), dh)
                        t = measure(call, device, args.reps, args.max_seconds)
                        slow[key] = max(slow.get(key, 0.0), t / T)
                        gbs = BYTES[(mode, dname)] * bd * T / t
                        rows.append((name, dname, mode, bd, T, t, gbs))
                        print(f"| {name:24s} | {dname:5s} | {mode:7s} | {bd:5d} | {T:5d} | {t * 1e3:9.2f} | "
                              f"{gbs / 1e9:6.2f} | {100 * gbs / peak:5.1f}% |", flush=True)
    _plot(rows, args.out, device, peak)


#: the tiles and warp counts `--sweep` tries (the default plan: BLOCK_C 16, BLOCK_T 128, 4 warps)
SWEEP = [(c, t, w) for c in (8, 16, 32) for t in (64, 128, 256) for w in (2, 4, 8)]


def sweep(device: torch.device, bd: int, T: int, dtypes: list[str], modes: list[str], reps: int,
          max_seconds: float, peak: float) -> None:
    """The Triton kernel at one size, once per (BLOCK_C, BLOCK_T, num_warps) of `SWEEP`, through
    the launchers' knobs; the best row per dtype and mode last."""
    from tfun.kernels import _linear_scan_triton as K

    print(f"sweep: B*D {bd}, T {T}, device {device}")
    print("| dtype | mode    | BLOCK_C | BLOCK_T | warps | time (ms) | GB/s   | % peak |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    best: dict[tuple[str, str], tuple[float, tuple[int, int, int]]] = {}
    for dname in dtypes:
        dtype = DTYPES[dname]
        g = torch.Generator(device="cpu").manual_seed(0)
        a = (0.5 + 0.49 * torch.rand(bd, T, generator=g)).to(device, dtype)
        b = torch.randn(bd, T, generator=g).to(device, dtype)
        h0 = torch.zeros(bd, device=device, dtype=dtype)
        ar, br = a.detach().requires_grad_(), b.detach().requires_grad_()
        dh = torch.ones_like(b)
        for mode in modes:
            for c, t, w in SWEEP:
                with K.knobs(block_c=c, block_t=t, num_warps=w):
                    if mode == "fwd":
                        def call():
                            with torch.no_grad():
                                return K.linear_scan_triton(a, b, h0, 1, False)
                    else:
                        def call():
                            torch.autograd.grad(K.linear_scan_triton(ar, br, h0, 1, False), (ar, br), dh)
                    try:
                        sec = measure(call, device, reps, max_seconds)
                    except Exception as e:  # noqa: BLE001 - a tile Triton cannot compile here is a row, said
                        print(f"| {dname} | {mode:7s} | {c} | {t} | {w} | failed: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:80] if str(e) else ''} |", flush=True)
                        continue
                gbs = BYTES[(mode, dname)] * bd * T / sec
                print(f"| {dname} | {mode:7s} | {c} | {t} | {w} | {sec * 1e3:.3f} | {gbs / 1e9:.0f} | "
                      f"{100 * gbs / peak:.1f}% |", flush=True)
                if (dname, mode) not in best or sec < best[(dname, mode)][0]:
                    best[(dname, mode)] = (sec, (c, t, w))
    for (dname, mode), (sec, (c, t, w)) in best.items():
        gbs = BYTES[(mode, dname)] * bd * T / sec
        print(f"best {dname} {mode}: BLOCK_C {c}, BLOCK_T {t}, {w} warps: {sec * 1e3:.3f} ms, {100 * gbs / peak:.1f}% of copy")


def _plot(rows: list[tuple], out: str, device: torch.device, peak: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    os.makedirs(os.path.dirname(out), exist_ok=True)
    groups = sorted({(r[1], r[2]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (dname, mode) in zip(axes[0], groups):
        for name in sorted({r[0] for r in rows}):
            pts = sorted((r[3] * r[4], r[6] / 1e9) for r in rows if r[0] == name and (r[1], r[2]) == (dname, mode))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
        ax.axhline(peak / 1e9, color="k", ls="--", lw=0.8, label="copy bandwidth")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("elements (B*D*T)")
        ax.set_ylabel("GB/s (minimum traffic)")
        ax.set_title(f"linear_scan {dname} {mode} on {device.type}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"plot: {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
