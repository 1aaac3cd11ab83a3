"""tfun.nn on the CPU: forward+backward time of the recurrent and SSM layers, and the memory of
`chunked_cross_entropy` against the naive loss on full logits.

    python benchmarks/nn.py             # full tables
    python benchmarks/nn.py --quick     # fewer repeats
    python benchmarks/nn.py --record    # also append the tables to benchmarks/RESULTS.md
    python benchmarks/nn.py --only lstm --threads 1   # one section, one intra-op thread
    python benchmarks/nn.py --device cuda --only lstm  # the layers on CUDA (cuDNN), eager and jitted

Times are medians over repeats of forward + backward (after warm-up). Memory: bytes of tensors
saved for backward (counted with `torch.autograd.graph.saved_tensors_hooks`, unique storages),
the size of the full logits, and the growth of the peak RSS of a fresh subprocess running one
forward + backward after a warm-up call (VmHWM after resetting it via /proc/self/clear_refs; includes transient buffers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import tfun
from tfun.nn._common import linear_scan_backend


DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _sizes() -> list[tuple[int, int, int, int]]:
    """(T, B, in, hidden) of the LSTM and GRU rows: on CUDA, also the issue's H100 size."""
    sizes = [(64, 16, 64, 128), (256, 8, 32, 64)]
    return sizes + [(256, 32, 128, 256)] if DEVICE.type == "cuda" else sizes


def fwd_bwd(model, x):
    def run():
        out = model(x)
        out = out[0] if isinstance(out, tuple) else out
        out.sum().backward()
    return run


def bench_lstm(repeats: int) -> list[str]:
    rows = ["| layer | T | B | in | hidden | fwd+bwd ms |", "|---|---|---|---|---|---|"]
    cuda = DEVICE.type == "cuda"
    for T, B, I, H in _sizes():
        torch.manual_seed(0)
        ref = torch.nn.LSTM(I, H).to(DEVICE)
        ours = tfun.nn.LSTM(I, H).to(DEVICE)
        ours.load_state_dict(ref.state_dict())
        scan = tfun.nn.LSTM(I, H, fused=False).to(DEVICE)
        scan.load_state_dict(ref.state_dict())
        x = torch.randn(T, B, I, device=DEVICE, requires_grad=True)
        variants = [("torch.nn.LSTM", ref), ("tfun.nn.LSTM (eager, fused: torch._VF.lstm)", ours),
                    ("tfun.nn.LSTM (eager, fused=False: tfun.lax.scan)", scan)]
        if hasattr(tfun, "jit"):
            # traced, the default layer runs the fused kernels through opaque ops (forward and
            # backward; tfun::rnn_fused for a forward alone): oneDNN's layer kernels on the CPU
            # (tfun::lstm_onednn, float32), cuDNN's on CUDA (tfun::rnn_cudnn); fused=False
            # compiles the scan (on the CPU: on CUDA its compile takes minutes)
            jits = [("fused: tfun::rnn_cudnn op" if cuda else "fused: tfun::lstm_onednn op", ours)]
            jits += [] if cuda else [("fused=False: scan", scan)]
            for label, layer in jits:
                try:
                    jitted = tfun.jit(layer)
                    t0 = time.perf_counter()
                    fwd_bwd(jitted, x)()
                    _sync()
                    compile_s = time.perf_counter() - t0
                    variants.append((f"tfun.nn.LSTM (tfun.jit, {label}; first call {compile_s:.1f} s)", jitted))
                except Exception as e:  # noqa: BLE001 - report, do not fail the benchmark
                    rows.append(f"| tfun.jit(tfun.nn.LSTM, {label}) failed: {type(e).__name__}: "
                                f"{str(e).splitlines()[0][:80]} | {T} | {B} | {I} | {H} | - |")
        for name, m in variants:
            ms = 1e3 * _time(fwd_bwd(m, x), repeats)
            rows.append(f"| {name} | {T} | {B} | {I} | {H} | {ms:.2f} |")
            if m is ref and not cuda and torch.backends.mkldnn.is_available():
                # torch's CPU LSTM runs oneDNN's fused RNN kernel (mkldnn_rnn_layer); without it,
                # ATen's per-step cell: the same ops per step as tfun's scan body, run from C++
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # a TF32 note about Intel GPUs
                    with torch.backends.mkldnn.flags(enabled=False):
                        ms = 1e3 * _time(fwd_bwd(m, x), repeats)
                rows.append(f"| torch.nn.LSTM (oneDNN off: per-step ATen cell) | {T} | {B} | {I} | {H} | {ms:.2f} |")
    return rows


def bench_gru(repeats: int) -> list[str]:
    rows = ["| layer | T | B | in | hidden | fwd+bwd ms |", "|---|---|---|---|---|---|"]
    for T, B, I, H in _sizes():
        torch.manual_seed(0)
        ref = torch.nn.GRU(I, H).to(DEVICE)
        ours = tfun.nn.GRU(I, H).to(DEVICE)
        scan = tfun.nn.GRU(I, H, fused=False).to(DEVICE)
        ours.load_state_dict(ref.state_dict())
        scan.load_state_dict(ref.state_dict())
        x = torch.randn(T, B, I, device=DEVICE, requires_grad=True)
        variants = [("torch.nn.GRU", ref), ("tfun.nn.GRU (eager, fused: torch._VF.gru)", ours),
                    ("tfun.nn.GRU (eager, fused=False: tfun.lax.scan)", scan)]
        if DEVICE.type == "cuda":  # traced on CUDA: cuDNN's GRU through tfun::rnn_cudnn
            jitted = tfun.jit(ours)
            t0 = time.perf_counter()
            fwd_bwd(jitted, x)()
            _sync()
            variants.append((f"tfun.nn.GRU (tfun.jit, fused: tfun::rnn_cudnn op; first call "
                             f"{time.perf_counter() - t0:.1f} s)", jitted))
        for name, m in variants:
            ms = 1e3 * _time(fwd_bwd(m, x), repeats)
            rows.append(f"| {name} | {T} | {B} | {I} | {H} | {ms:.2f} |")
    return rows


def bench_ssm(repeats: int, length: int = 256) -> list[str]:
    B, L, D = 8, length, 64
    rows = [f"SSM layers, batch {B}, length {L}, d_model {D}, float32; real recurrences via {linear_scan_backend()}.", "",
            "| layer | config | eager fwd+bwd ms | tfun.jit fwd+bwd ms (first call s) |", "|---|---|---:|---:|"]
    torch.manual_seed(0)
    layers = [
        ("S4D", "d_state 64 (32 complex modes)", tfun.nn.S4D(D, 64)),
        ("S5", "d_state 32 complex", tfun.nn.S5(D, 32)),
        ("LRU", "d_state 64 complex", tfun.nn.LRU(D, 64)),
        ("MinGRU", "d_hidden 64", tfun.nn.MinGRU(D, 64)),
        ("Mamba", "d_state 16, expand 2, d_conv 4", tfun.nn.Mamba(D)),
    ]
    x = torch.randn(B, L, D, device=DEVICE, requires_grad=True)
    for name, cfg, m in layers:
        m.to(DEVICE)
        ms = 1e3 * _time(fwd_bwd(m, x), repeats)
        try:  # the training step compiled (Inductor): S5 and LRU scan complex tensors
            jitted = tfun.jit(m)
            t0 = time.perf_counter()
            fwd_bwd(jitted, x)()
            _sync()
            first = time.perf_counter() - t0
            jit_ms = f"{1e3 * _time(fwd_bwd(jitted, x), repeats):.2f} ({first:.1f})"
        except Exception as e:  # noqa: BLE001 - report, do not fail the benchmark
            jit_ms = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        rows.append(f"| tfun.nn.{name} | {cfg} | {ms:.2f} | {jit_ms} |")
    return rows


_CE_CHILD = r"""
import json, resource, sys, torch, torch.nn.functional as F, tfun
mode, N, H, V, chunk = sys.argv[1], *map(int, sys.argv[2:6])
torch.manual_seed(0)
h = torch.randn(N, H, requires_grad=True); w = torch.randn(V, H, requires_grad=True) * 0.02
w = w.detach().requires_grad_(); b = torch.zeros(V, requires_grad=True); t = torch.randint(0, V, (N,))
def run():
    if mode == "naive":
        return F.cross_entropy(h @ w.T + b, t)
    return tfun.nn.chunked_cross_entropy(h, w, t, b, chunk_size=chunk)
saved = {}
def pack(x):
    saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    return x
def rss_kb(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field))
run().backward()  # warm-up: one-time costs (first-call checks, lazy init) are not counted
h.grad = w.grad = b.grad = None
saved.clear()
before = rss_kb("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
    loss = run()
loss.backward()
after = rss_kb("VmHWM:")
print(json.dumps({"saved": sum(saved.values()), "rss_kb": after - before}))
"""


def bench_ce() -> list[str]:
    N, H, V = 4096, 256, 16384
    rows = [f"hidden {N}x{H}, vocab {V}, float32; full logits would be {N * V * 4 / 2**20:.0f} MiB.", "",
            "| loss | chunk | saved for backward MiB | peak RSS growth MiB (fwd+bwd) | fwd+bwd ms |", "|---|---|---|---|---|"]
    for mode, chunk in [("naive", 0), ("chunked", 1024), ("chunked", 256)]:
        res = subprocess.run([sys.executable, "-c", _CE_CHILD, mode, str(N), str(H), str(V), str(chunk)],
                             capture_output=True, text=True, check=True)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        torch.manual_seed(0)
        h = torch.randn(N, H, requires_grad=True)
        w = (torch.randn(V, H) * 0.02).requires_grad_()
        b = torch.zeros(V, requires_grad=True)
        t = torch.randint(0, V, (N,))
        if mode == "naive":
            fn = lambda: F.cross_entropy(h @ w.T + b, t).backward()  # noqa: E731
        else:
            fn = lambda: tfun.nn.chunked_cross_entropy(h, w, t, b, chunk_size=chunk).backward()  # noqa: E731
        ms = 1e3 * _time(fn, 3, warmup=1)
        name = "F.cross_entropy(h @ W.T + b)" if mode == "naive" else "tfun.nn.chunked_cross_entropy"
        rows.append(f"| {name} | {chunk or '-'} | {r['saved'] / 2**20:.1f} | {r['rss_kb'] / 1024:.0f} | {ms:.0f} |")
    return rows


def machine() -> str:
    if DEVICE.type == "cuda":
        return (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Python {platform.python_version()}, "
                f"{datetime.date.today().isoformat()}; float32 matmuls and cuDNN at torch's defaults "
                f"(cuDNN TF32 {'on' if torch.backends.cudnn.allow_tf32 else 'off'})")
    try:
        model = next(line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        model = platform.processor() or "unknown CPU"
    return (f"{model}, {torch.get_num_threads()} threads ({__import__('os').cpu_count()} cores), "
            f"torch {torch.__version__}, Python {platform.python_version()}, {datetime.date.today().isoformat()}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--record", action="store_true")
    p.add_argument("--only", choices=["lstm", "ssm", "ce"], help="run one section")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the ce section is CPU-only: it reads the RSS)")
    p.add_argument("--ssm-length", type=int, default=256, help="sequence length of the ssm section")
    args = p.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 10
    sections = {
        "lstm": lambda: ["### LSTM forward+backward (float32, 1 layer)", "", *bench_lstm(repeats), "",
                         "### GRU forward+backward (float32, 1 layer)", "", *bench_gru(repeats), ""],
        "ssm": lambda: ["### SSM layers forward+backward", "", *bench_ssm(repeats, args.ssm_length), ""],
        "ce": lambda: ["### chunked_cross_entropy memory", "", *bench_ce(), ""],
    }
    out = ["## tfun.nn (benchmarks/nn.py)", "", f"Machine: {machine()}.", ""]
    for name, section in sections.items():
        if args.only in (None, name) and not (name == "ce" and DEVICE.type != "cpu"):
            out += section()
    text = "\n".join(out)
    print(text)
    if args.record:
        with open(__file__.rsplit("/", 1)[0] + "/RESULTS.md", "a") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
