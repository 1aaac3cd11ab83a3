"""Check every tfun.lax op and tfun.nn layer on a device against float64 on the CPU, as a table.

One command for anyone with a CUDA machine (from the repository root):

    python -m tests.gpu.check_cuda                 # CUDA, every path, float32 and bfloat16
    python -m tests.gpu.check_cuda --quick         # eager paths and the kernels only
    python -m tests.gpu.check_cuda --shard 0/3     # every third row, from the first (run the
                                                   # shards side by side on a many-core machine)
    python -m tests.gpu.check_cuda --only nn.LSTM  # the cases whose name contains this
    python -m tests.gpu.check_cuda --paths inductor+grad+graphs  # the rows of these paths

For each case it runs the op (or the layer's forward) and the gradient of a fixed random
weighting of every output with respect to every input and parameter, on the device, and compares
both with the same case built in float64 and run eagerly on the CPU. Paths: eager, `tfun.jit`
with `aot_eager` and with Inductor, forward-jitted and `value_and_grad`-jitted, forward-jitted
under `torch.no_grad()` (`+nograd`, inference: outputs only; CUDA's fused `associative_scan`
runs only there), and the Inductor training step replayed from a CUDA graph
(`inductor+grad+graphs`: `cuda_graphs=True`, the third call compared; on the CPU it runs without
a graph); the Triton `linear_scan` eagerly on the shapes where a GPU splits time into segments,
and along every jit path on two of them. A row is `ok`, `REFUSED` (a tfun
error, printed), `WRONG` (numbers off beyond the dtype's tolerance) or `CRASH` (any other
exception). The exit status is 1 if any row is WRONG or CRASH. `--device cpu` runs the same
checks on the CPU (CI does, with `--quick`, so this script cannot rot).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import tfun
from tfun.errors import TfunError

from ..differential import harness
from ..differential.cases import CASES

LAX_SPECS: dict[str, list[dict[str, Any]]] = {
    name: [{"T": 1, "C": 1, "seed": 1}, {"T": 37, "C": 5, "seed": 2, "reverse": True, "axis": -1, "batch_size": 4}]
    for name in CASES
}
# the shapes of the 2026-11-23 CUDA report, where the kernel split time into segments
KERNEL_SPECS = [
    {"T": 1024, "C": 4, "seed": 3, "impl": "triton"},
    {"T": 2048, "C": 4, "seed": 4, "impl": "triton", "reverse": True},
    {"T": 4097, "C": 64, "seed": 5, "impl": "triton"},
    {"T": 8192, "C": 1, "seed": 6, "impl": "triton"},
    {"T": 65536, "C": 4, "seed": 7, "impl": "triton", "reverse": True},
    {"T": 5000, "C": 2, "seed": 8, "impl": None},  # the default: Triton on CUDA
]
# the kernels under every jit path: one length split into segments, one reversed and not
KERNEL_JIT_SPECS = [
    {"T": 4097, "C": 64, "seed": 5, "impl": "triton"},
    {"T": 1000, "C": 3, "seed": 9, "impl": "triton", "reverse": True},
]


def nn_cases() -> dict[str, Callable[[torch.dtype, torch.device], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]]:
    def make(ctor: Callable[[], torch.nn.Module], *shape: int) -> Callable[..., Any]:
        def build(dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
            torch.manual_seed(0)
            m = ctor().to(torch.float64)
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
            return m.to(device=device, dtype=dtype), (x.to(device=device, dtype=dtype),)

        return build

    nn = tfun.nn
    return {
        "RNN 2-layer": make(lambda: nn.RNN(4, 8, num_layers=2, batch_first=True), 2, 9, 4),
        "LSTM 2-layer": make(lambda: nn.LSTM(4, 8, num_layers=2, batch_first=True), 2, 9, 4),
        "LSTM bidirectional": make(lambda: nn.LSTM(4, 8, bidirectional=True, batch_first=True), 2, 9, 4),
        "GRU 2-layer": make(lambda: nn.GRU(4, 8, num_layers=2, batch_first=True), 2, 9, 4),
        "LSTMCell": make(lambda: nn.LSTMCell(4, 8), 3, 4),
        "GRUCell": make(lambda: nn.GRUCell(4, 8), 3, 4),
        "S4D": make(lambda: nn.S4D(6, 8), 2, 33, 6),
        "S5": make(lambda: nn.S5(6, 4), 2, 33, 6),
        "LRU": make(lambda: nn.LRU(6, 4), 2, 33, 6),
        "MinGRU": make(lambda: nn.MinGRU(6, 8), 2, 33, 6),
        "Mamba L=1200": make(lambda: nn.Mamba(8, d_state=4, expand=2), 2, 1200, 8),
    }


def _nn_result(build: Callable[..., Any], dtype: torch.dtype, device: torch.device, path: str) -> harness.Result | harness.Refused:
    m, xs = build(dtype, device)
    backend, _, mode = path.partition("+")
    if mode == "nograd":  # inference: outputs only
        try:
            with torch.no_grad():
                return harness.Result(harness._cpu64(tfun.tree.tree_leaves(tfun.jit(m, backend=backend)(*xs))), [])
        except TfunError as e:
            return harness.Refused(e)
    xs = tuple(x.detach().requires_grad_() for x in xs)
    params = [p for p in m.parameters()]
    fn: Callable[..., Any] = m if path == "eager" else tfun.jit(m, backend=path)
    try:
        outs = tfun.tree.tree_leaves(fn(*xs))
    except TfunError as e:
        return harness.Refused(e)
    weights = harness._weights(harness._cpu64(outs))
    grads = torch.autograd.grad(harness._loss(outs, weights), [*xs, *params], allow_unused=True)
    wrt = [*xs, *params]
    return harness.Result(harness._cpu64(outs), harness._cpu64([torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads)]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="eager paths and the kernels only")
    ap.add_argument("--shard", default="0/1", help="K/N: only the rows whose index is K modulo N")
    ap.add_argument("--only", default="", help="only the cases whose name contains this (e.g. associative_scan)")
    ap.add_argument("--paths", nargs="*", default=None, help="only these paths (e.g. eager inductor+grad+graphs)")
    args = ap.parse_args(argv)
    try:
        shard, shards = (int(x) for x in args.shard.split("/"))
        if not 0 <= shard < shards:
            raise ValueError
    except ValueError:
        ap.error(f"--shard takes K/N with 0 <= K < N, got {args.shard!r}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device is available; pass --device cpu to run the checks on the CPU", file=sys.stderr)
        return 2
    # tfun.nn's RNN layers run cuDNN on CUDA, as torch.nn.LSTM does, and cuDNN computes float32
    # RNNs in TF32 (10-bit mantissas) on Ampere and later at torch's default; float32 is checked
    # at float32's tolerance, so TF32 is off here (tests/nn/test_rnn_cuda.py does the same)
    torch.backends.cudnn.allow_tf32 = False
    jit_paths = [] if args.quick else [
        "aot_eager", "inductor", "aot_eager+grad", "inductor+grad", "inductor+grad+graphs", "aot_eager+nograd", "inductor+nograd",
    ]
    dtypes = [torch.float32] if args.quick else [torch.float32, torch.bfloat16]
    rows: list[tuple[str, ...]] = []
    bad = 0
    index = -1

    def record(what: str, path: str, dtype: torch.dtype, fn: Callable[[], Any]) -> None:
        nonlocal bad, index
        index += 1
        if index % shards != shard or args.only not in what or (args.paths is not None and path not in args.paths):
            return
        t0 = time.perf_counter()
        full = ""  # a refusal's or crash's whole message, printed under its row
        try:
            res = fn()
        except Exception as e:  # a crash is a result here: reported as a row, counted as bad
            status, detail = "CRASH", f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            full = str(e)
            if "-v" in sys.argv:
                traceback.print_exc()
        else:
            if isinstance(res, harness.Refused):
                status, detail = "REFUSED", str(res.error).splitlines()[0][:120]
                full = str(res.error)
            else:
                out_err, grad_err = res
                out_tol, grad_tol = harness.TOLERANCE[dtype]
                ok = out_err <= out_tol and grad_err <= grad_tol
                status, detail = ("ok" if ok else "WRONG"), f"out {out_err:.1e}  grad {grad_err:.1e}"
        bad += status in ("WRONG", "CRASH")
        rows.append((what, path, str(dtype).replace("torch.", ""), status, f"{time.perf_counter() - t0:.1f}s", detail))
        print(" | ".join(rows[-1]), flush=True)
        if full:  # the whole reason, for whoever reads the log off the GPU machine
            print("".join(f"    {line}\n" for line in full.splitlines()[:30]), end="", flush=True)

    print(f"tfun {tfun.__version__}, torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print("case | path | dtype | status | time | detail")
    for spec in KERNEL_SPECS:
        for dtype in dtypes:
            record(f"linear_scan impl={spec['impl']} T={spec['T']} C={spec['C']}", "eager", dtype,
                   lambda spec=spec, dtype=dtype: harness.compare("linear_scan", spec, "eager", dtype, device))
    # the kernels compiled into a graph (on CUDA Inductor writes them into its own module; a
    # helper left unbound there failed every compiled MinGRU and Mamba until session 34)
    for spec in KERNEL_JIT_SPECS:
        for path in jit_paths:
            def kernel_case(spec: dict[str, Any] = spec, path: str = path) -> Any:
                torch._dynamo.reset()
                return harness.compare("linear_scan", spec, path, torch.float32, device)

            record(f"linear_scan impl={spec['impl']} T={spec['T']} C={spec['C']}", path, torch.float32, kernel_case)
    for name, specs in LAX_SPECS.items():
        for spec in specs:
            for path in ["eager", *jit_paths]:
                def case(name: str = name, spec: dict[str, Any] = spec, path: str = path) -> Any:
                    torch._dynamo.reset()
                    return harness.compare(name, spec, path, torch.float32, device)

                record(f"lax.{name} T={spec['T']} C={spec['C']}", path, torch.float32, case)
    for name, build in nn_cases().items():
        for path in ["eager", *[p for p in jit_paths if "+" not in p or p.endswith("+nograd")]]:
            def run(build: Any = build, path: str = path) -> Any:
                torch._dynamo.reset()
                oracle = _nn_result(build, torch.float64, torch.device("cpu"), "eager")
                got = _nn_result(build, torch.float32, device, path)
                if isinstance(got, harness.Refused):
                    return got
                return harness.max_rel_error(got.outs, oracle.outs), harness.max_rel_error(got.grads, oracle.grads[: len(got.grads)])

            record(f"nn.{name}", path, torch.float32, run)
    counts = {s: sum(r[3] == s for r in rows) for s in ("ok", "REFUSED", "WRONG", "CRASH")}
    print("summary: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
