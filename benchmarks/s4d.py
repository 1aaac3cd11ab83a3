"""tfun.nn.S4D: the FFT convolution mode (`mode="conv"`, the default) against the recurrence
(`mode="scan"`, a complex `associative_scan`), forward and forward+backward.

    python benchmarks/s4d.py                      # CPU, L = 1024 and 4096, batch 2, 16 channels
    python benchmarks/s4d.py --quick              # fewer repeats
    python benchmarks/s4d.py --threads 1          # one intra-op thread (steadier on a shared CPU)
    python benchmarks/s4d.py --device cuda --batch 8 --channels 64 --lengths 1024 4096 16384

Times are medians over repeats after one warm-up call (CUDA: synchronized). forward+backward is
`y.sum().backward()` with the input requiring a gradient, so every parameter's and the input's
gradient is computed. The "kernel" column is `S4D.kernel(L)` alone (forward), the part of the
conv mode that does not depend on the batch.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tfun  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds per call after one warm-up call."""
    fn()
    _sync(device)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads, {os.cpu_count()} cores)"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--d-state", type=int, default=64)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    repeats = 3 if args.quick else 7
    print(f"device: {device_name(device)}; torch {torch.__version__}")
    print(f"tfun.nn.S4D, float32, batch {args.batch}, d_model {args.channels}, d_state {args.d_state} "
          f"({args.d_state // 2} complex modes); median of {repeats}\n")
    print("| L | mode | fwd ms | fwd+bwd ms | kernel ms |")
    print("|---:|---|---:|---:|---:|")
    for L in args.lengths:
        torch.manual_seed(0)
        m = tfun.nn.S4D(args.channels, args.d_state, device=device)
        x = torch.randn(args.batch, L, args.channels, device=device, requires_grad=True)
        times = {}
        for mode in ("conv", "scan"):
            m.mode = mode

            def fwd() -> None:
                with torch.no_grad():
                    m(x)

            def fwd_bwd() -> None:
                m(x).sum().backward()

            times[mode] = (measure(fwd, device, repeats), measure(fwd_bwd, device, repeats))
        with torch.no_grad():
            k_ms = 1e3 * measure(lambda: m.kernel(L), device, repeats)
        for mode, (f, fb) in times.items():
            kernel = f"{k_ms:.2f}" if mode == "conv" else "-"
            print(f"| {L} | {mode} | {1e3 * f:.2f} | {1e3 * fb:.2f} | {kernel} |")
        c, s = times["conv"], times["scan"]
        print(f"| {L} | scan / conv | {s[0] / c[0]:.1f}x | {s[1] / c[1]:.1f}x | |")


if __name__ == "__main__":
    main()
