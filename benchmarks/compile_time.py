"""Compile time of tfun.lax.scan under tfun.jit (one `scan` HOP) against an unrolled loop
under torch.compile, and runtime per step of the compiled scan vs eager vs jax.jit.

Every compile-time point runs in a fresh subprocess with an empty Inductor cache
(TORCHINDUCTOR_CACHE_DIR is a new temp dir); the subprocess first compiles an unrelated
function so that the C++ toolchain's fixed start-up cost is not counted.

    .venv/bin/python benchmarks/compile_time.py            # full run (~10 min on 2 cores)
    .venv/bin/python benchmarks/compile_time.py --quick    # small points only (~2 min)

Prints tables, saves docs/assets/compile_time.png and appends a section to
benchmarks/RESULTS.md (unless --no-write).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H, D_IN = 32, 32  # RNN sizes
CE_TOKENS, CE_D, CE_V = 2048, 64, 512  # chunked cross-entropy sizes


# ----------------------------------------------------------------------------------------
# Workloads (run inside the worker process)
# ----------------------------------------------------------------------------------------


def _rnn_params(torch):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(H, H, generator=g) * 0.2
    U = torch.randn(D_IN, H, generator=g) * 0.2
    return W, U


def rnn_scan(W, U):
    import torch

    from tfun import lax

    def run(h0, xs):
        def step(h, x):
            h = torch.tanh(h @ W + x @ U)
            return h, h * 1.0

        return lax.scan(step, h0, xs)

    return run


def rnn_unrolled(W, U):
    import torch

    def run(h0, xs):
        h = h0
        ys = []
        for t in range(xs.shape[0]):
            h = torch.tanh(h @ W + xs[t] @ U)
            ys.append(h * 1.0)
        return h, torch.stack(ys)

    return run


def _ce_params(torch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(CE_TOKENS, CE_D, generator=g)
    W = torch.randn(CE_V, CE_D, generator=g) * 0.1
    b = torch.zeros(CE_V)
    target = torch.randint(0, CE_V, (CE_TOKENS,), generator=g)
    return x, W, b, target


def ce_scan(chunks):
    import torch
    import torch.nn.functional as F

    from tfun import lax

    def run(x, W, b, target):
        xc = x.view(chunks, -1, x.shape[-1])
        tc = target.view(chunks, -1)

        def step(acc, xt):
            xi, ti = xt
            logits = torch.addmm(b, xi, W.t())
            return acc + F.cross_entropy(logits, ti), None

        acc, _ = lax.scan(step, torch.zeros(()), (xc, tc))
        return acc / chunks

    return run


def ce_unrolled(chunks):
    import torch
    import torch.nn.functional as F

    def run(x, W, b, target):
        xc = x.view(chunks, -1, x.shape[-1])
        tc = target.view(chunks, -1)
        acc = torch.zeros(())
        for i in range(chunks):
            acc = acc + F.cross_entropy(torch.addmm(b, xc[i], W.t()), tc[i])
        return acc / chunks

    return run


def worker(kind: str, n: int, cpp_wrapper: bool) -> dict:
    import torch

    import tfun

    if os.environ.get("TFUN_BENCH_NO_LOOP_CACHE"):
        # the caches as torch leaves them: bypassed for any graph with a loop (`--warm`'s baseline)
        tfun._compat.loop_hop_cache_marks = lambda key: {}
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    # warm the C++ toolchain / inductor imports with an unrelated compile
    torch.compile(lambda a: (a.sin() + 1).sum())(torch.randn(16))
    if cpp_wrapper:
        torch._inductor.config.cpp_wrapper = True
    if kind in ("rnn_grad_param", "rnn_vjp_closure", "rnn_grad_no_grad"):
        return _grad_worker(kind, n)
    if kind == "rnn_jacrev":
        return _jacrev_worker(n)
    with torch.no_grad():
        if kind in ("rnn_scan", "rnn_unrolled"):
            W, U = _rnn_params(torch)
            h0, xs = torch.zeros(H), torch.randn(n, D_IN)
            if kind == "rnn_scan":
                fn = tfun.jit(rnn_scan(W, U))
            else:
                fn = torch.compile(rnn_unrolled(W, U), fullgraph=True)
            args = (h0, xs)
            ref = rnn_scan(W, U)(h0, xs)
        else:
            x, W, b, target = _ce_params(torch)
            if kind == "ce_scan":
                fn = tfun.jit(ce_scan(n))
            else:
                fn = torch.compile(ce_unrolled(n), fullgraph=True)
            args = (x, W, b, target)
            ref = ce_unrolled(n)(*args)
        t0 = time.perf_counter()
        out = fn(*args)
        compile_s = time.perf_counter() - t0
        ok = all(torch.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(tfun.tree.tree_leaves(out), tfun.tree.tree_leaves(ref)))
        # steady-state runtime of the compiled function
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        run_s = (time.perf_counter() - t0) / reps
    return {"kind": kind, "n": n, "compile_s": compile_s, "run_s": run_s, "ok": bool(ok), "cpp_wrapper": cpp_wrapper}


def _grad_worker(kind: str, n: int) -> dict:
    """First call of the training step's gradient, `tfun.jit(tfun.value_and_grad(loss))(W, ...)`,
    with `W` an `nn.Parameter` under grad mode ("rnn_grad_param": the gradient is kept
    first-order, `tfun/_first_order.py`) or the same call under `torch.no_grad()`
    ("rnn_grad_no_grad"), Inductor, against eager's gradient; or ("rnn_vjp_closure") the input's
    cotangent from `tfun.vjp` of a loss that closes over the `nn.Parameter` (kept first-order too)."""
    import torch

    import tfun
    from tfun import lax

    W0, U = _rnn_params(torch)
    h0, xs = torch.zeros(4, H), torch.randn(n, 4, D_IN, generator=torch.Generator().manual_seed(1))

    def loss(W, xs):
        def step(h, x):
            h = torch.tanh(h @ W + x @ U)
            return h, h

        return (lax.scan(step, h0, xs)[1] ** 2).mean()

    P = torch.nn.Parameter(W0.clone())
    if kind == "rnn_vjp_closure":

        def input_grad(xs):
            out, pull = tfun.vjp(lambda xs: loss(P, xs), xs)
            return out, pull(torch.ones_like(out))[0]

        want = tfun.grad(lambda xs: loss(W0, xs))(xs)
        fn, args = tfun.jit(input_grad), (xs,)
    else:
        want = tfun.grad(loss)(W0, xs)
        fn, args = tfun.jit(tfun.value_and_grad(loss)), (P, xs)
    with torch.no_grad() if kind == "rnn_grad_no_grad" else torch.enable_grad():
        t0 = time.perf_counter()
        _, g = fn(*args)
        compile_s = time.perf_counter() - t0
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        run_s = (time.perf_counter() - t0) / reps
    ok = torch.allclose(g.detach(), want, rtol=1e-3, atol=1e-5)
    return {"kind": kind, "n": n, "compile_s": compile_s, "run_s": run_s, "ok": bool(ok), "cpp_wrapper": False}


def _jacrev_worker(n: int) -> dict:
    """First call of `tfun.jit(tfun.jacrev(last))(W)`: the Jacobian of a tanh RNN's last state
    (`n` units, so `n` output elements, 50 steps) in its (n, n) weight, Inductor, against eager's
    Jacobian. Under tfun.jit a jacrev with a loop inside pulls back one cotangent per output
    element, so the graph holds `n` backwards of the loop."""
    import torch

    import tfun
    from tfun import lax

    g = torch.Generator().manual_seed(2)
    W, xs = torch.randn(n, n, generator=g) * (0.5 / n**0.5), torch.randn(50, n, generator=g)

    def last(W):
        return lax.scan(lambda h, x: (torch.tanh(h @ W + x), None), torch.zeros(n), xs)[0]

    want = tfun.jacrev(last)(W)
    fn = tfun.jit(tfun.jacrev(last))
    t0 = time.perf_counter()
    J = fn(W)
    compile_s = time.perf_counter() - t0
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(W)
    run_s = (time.perf_counter() - t0) / reps
    ok = torch.allclose(J, want, rtol=1e-3, atol=1e-5)
    return {"kind": "rnn_jacrev", "n": n, "compile_s": compile_s, "run_s": run_s, "ok": bool(ok), "cpp_wrapper": False}


def run_point(kind: str, n: int, cpp_wrapper: bool = False, timeout: int = 600) -> dict:
    with tempfile.TemporaryDirectory(prefix="tfun-inductor-cache-") as cache:
        return _run_in(cache, kind, n, cpp_wrapper, timeout)


def _run_in(cache: str, kind: str, n: int, cpp_wrapper: bool = False, timeout: int = 600, **env_extra: str) -> dict:
    """One worker process with Inductor's caches in `cache`."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"), **env_extra)
    env.pop("TORCHINDUCTOR_FX_GRAPH_CACHE", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, str(n)]
    if cpp_wrapper:
        cmd.append("--cpp-wrapper")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"kind": kind, "n": n, "error": " | ".join(tail)[:300], "cpp_wrapper": cpp_wrapper}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_s"] = wall
    return res


# ----------------------------------------------------------------------------------------
# Runtime per step: compiled scan vs eager vs jax.jit(lax.scan)
# ----------------------------------------------------------------------------------------


def runtime_per_step(T: int) -> dict:
    import numpy as np
    import torch

    import tfun

    out = {}
    W, U = _rnn_params(torch)
    h0, xs = torch.zeros(H), torch.randn(T, D_IN)
    f = rnn_scan(W, U)

    def bench(fn, reps=5):
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps / T * 1e6

    with torch.no_grad():
        out["tfun eager (Python loop)"] = bench(lambda: f(h0, xs))
        jf = tfun.jit(f)
        out["tfun.jit scan (inductor)"] = bench(lambda: jf(h0, xs))
        try:
            torch._inductor.config.cpp_wrapper = True
            jw = tfun.jit(rnn_scan(W, U))
            out["tfun.jit scan (inductor, cpp_wrapper)"] = bench(lambda: jw(h0, xs))
        except Exception as e:  # noqa: BLE001
            out["tfun.jit scan (inductor, cpp_wrapper)"] = f"failed: {type(e).__name__}"
        finally:
            torch._inductor.config.cpp_wrapper = False
        ju = torch.compile(rnn_unrolled(W, U), fullgraph=True) if T <= 256 else None
        if ju is not None:
            out[f"torch.compile unrolled loop (T={T})"] = bench(lambda: ju(h0, xs))
    try:
        import jax
        import jax.numpy as jnp

        Wj, Uj = jnp.asarray(W.numpy()), jnp.asarray(U.numpy())

        def jstep(h, x):
            h = jnp.tanh(h @ Wj + x @ Uj)
            return h, h * 1.0

        jrun = jax.jit(lambda h0, xs: jax.lax.scan(jstep, h0, xs))
        h0j, xsj = jnp.zeros(H), jnp.asarray(xs.numpy())
        out["jax.jit(lax.scan) (XLA CPU)"] = bench(lambda: jax.block_until_ready(jrun(h0j, xsj)))
        np.testing.assert_allclose(np.asarray(jrun(h0j, xsj)[1]), f(h0, xs)[1].numpy(), rtol=1e-4, atol=1e-5)
    except ImportError:
        out["jax.jit(lax.scan) (XLA CPU)"] = "jax not installed"
    return out


# ----------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def table(rows: list[list], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--worker", nargs=2)
    ap.add_argument("--cpp-wrapper", action="store_true")
    ap.add_argument("--grad", action="store_true", help="only the jitted gradient of parameters (the training step)")
    ap.add_argument("--jacrev", action="store_true", help="only the jitted jacrev of a loop, by output size")
    ap.add_argument("--warm", action="store_true", help="only the first call in a second process (a warm cache)")
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], int(a.worker[1]), a.cpp_wrapper)))
        return

    import torch

    if a.grad:
        grad_section(a.no_write)
        return
    if a.jacrev:
        jacrev_section(a.no_write)
        return
    if a.warm:
        warm_section(a.no_write)
        return

    if a.quick:
        scan_T, unrolled_T, chunks, unrolled_chunks, rt_T = [16, 64, 256], [16, 64], [2, 8], [2, 8], 256
    else:
        scan_T = [16, 64, 256, 1024, 2048]
        unrolled_T = [16, 64, 256, 1024]  # 2048 unrolled: several minutes; skipped
        chunks, unrolled_chunks, rt_T = [2, 8, 32, 64], [2, 8, 32, 64], 1024

    results = []
    for T in scan_T:
        results.append(run_point("rnn_scan", T))
        print(results[-1], flush=True)
    for T in unrolled_T:
        results.append(run_point("rnn_unrolled", T))
        print(results[-1], flush=True)
    for c in chunks:
        results.append(run_point("ce_scan", c))
        print(results[-1], flush=True)
    for c in unrolled_chunks:
        results.append(run_point("ce_unrolled", c))
        print(results[-1], flush=True)
    cpp = run_point("rnn_scan", 256, cpp_wrapper=True)
    print(cpp, flush=True)
    rt = runtime_per_step(rt_T)

    def get(kind, n, key="compile_s"):
        for r in results:
            if r["kind"] == kind and r["n"] == n:
                return r.get(key, r.get("error", "-"))
        return "-"

    t1 = table([[T, get("rnn_scan", T), get("rnn_unrolled", T)] for T in scan_T],
               ["T", "tfun.jit(lax.scan) compile s", "torch.compile unrolled compile s"])
    t2 = table([[c, get("ce_scan", c), get("ce_unrolled", c)] for c in chunks],
               ["chunks", "chunked CE, lax.scan: compile s", "chunked CE, unrolled: compile s"])
    t3 = table([[k, v] for k, v in rt.items()], [f"RNN H={H}, T={rt_T}, forward", "us per step"])
    cpp_line = (f"scan T=256 compile with inductor `cpp_wrapper=True`: {fmt(cpp.get('compile_s', cpp.get('error')))} s "
                f"(default wrapper: {fmt(get('rnn_scan', 256))} s).")
    print("\n" + t1 + "\n\n" + t2 + "\n\n" + t3 + "\n\n" + cpp_line)

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        for kind, label, xs in (("rnn_scan", "tfun.jit + lax.scan", scan_T), ("rnn_unrolled", "torch.compile, unrolled", unrolled_T)):
            pts = [(n, get(kind, n)) for n in xs if isinstance(get(kind, n), float)]
            ax[0].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        ax[0].set_xscale("log", base=2)
        ax[0].set_xlabel("sequence length T")
        ax[0].set_ylabel("compile time (s, cold cache)")
        ax[0].set_title(f"RNN (H={H})")
        ax[0].legend()
        for kind, label in (("ce_scan", "lax.scan over chunks"), ("ce_unrolled", "unrolled loop")):
            pts = [(n, get(kind, n)) for n in chunks if isinstance(get(kind, n), float)]
            ax[1].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        ax[1].set_xscale("log", base=2)
        ax[1].set_xlabel("number of chunks")
        ax[1].set_title("chunked cross-entropy")
        ax[1].legend()
        fig.suptitle(f"Inductor compile time, {machine()}, torch {torch.__version__}")
        fig.tight_layout()
        if not a.no_write:
            os.makedirs(os.path.join(ROOT, "docs", "assets"), exist_ok=True)
            fig.savefig(os.path.join(ROOT, "docs", "assets", "compile_time.png"), dpi=110)
    except ImportError:
        pass

    if a.no_write:
        return
    try:
        import jax

        jv = jax.__version__
    except ImportError:
        jv = "not installed"
    section = f"""
## Compile time: tfun.lax.scan under tfun.jit vs an unrolled loop (issue 4)

Machine: {machine()}; date: {datetime.date.today().isoformat()}; torch {torch.__version__}; jax {jv}.
Run: `.venv/bin/python benchmarks/compile_time.py{' --quick' if a.quick else ''}`. Each compile point is a fresh
process with an empty Inductor cache, after an unrelated warm-up compile; "compile s" is the
wall time of the first call (trace + compile + one run). Forward only (`torch.no_grad`).

{t1}

{t2}

{t3}

{cpp_line}

![compile time](../docs/assets/compile_time.png)
"""
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as fh:
        fh.write(section)


def grad_section(no_write: bool) -> None:
    """First call and steady-state time of a jitted gradient of an `nn.Parameter` (grad mode)
    against the same call under `torch.no_grad()`, fresh process and empty cache per point."""
    import torch

    rows = []
    for T in (16, 64, 256, 1024):
        cells = [T]
        for kind in ("rnn_grad_param", "rnn_vjp_closure", "rnn_grad_no_grad"):
            r = run_point(kind, T)
            print(r, flush=True)
            if "error" in r:
                cells += [r["error"][:60], "-"]
            else:
                cells += [f"{r['compile_s']:.2f}" + ("" if r["ok"] else " (WRONG)"), f"{r['run_s'] * 1e3:.2f}"]
        rows.append(cells)
    t = table(
        rows,
        [
            "T",
            "nn.Parameter, grad mode: first call s",
            "ms per call",
            "tfun.vjp, loss closing over it: first call s",
            "ms per call",
            "under torch.no_grad(): first call s",
            "ms per call",
        ],
    )
    print("\n" + t)
    if no_write:
        return
    section = f"""
## First call of a jitted gradient of parameters (the training step)

Machine: {machine()}; date: {datetime.date.today().isoformat()}; torch {torch.__version__}.
Run: `.venv/bin/python benchmarks/compile_time.py --grad`. `tfun.jit(tfun.value_and_grad(loss))(W, xs)`
for a tanh RNN (B=4, H={H}, input {D_IN}, T steps, float32, Inductor), `W` an `nn.Parameter`:
under grad mode (the gradient is kept first-order with the loop as one loop op,
`tfun/_first_order.py`) and under `torch.no_grad()`; and the input's cotangent,
`tfun.jit(lambda xs: tfun.vjp(lambda xs: loss(W, xs), xs))` then the pullback of ones inside, with
the loss closing over `W` (kept first-order as well). Each point is a fresh process with an empty
Inductor cache after an unrelated warm-up compile; "first call" is trace + compile + one run,
checked against eager's gradient.

{t}
"""
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as fh:
        fh.write(section)


def jacrev_section(no_write: bool) -> None:
    """First call of a jitted jacrev of a loop by the number of output elements (one backward
    of the loop each in the graph), fresh process and empty cache per point."""
    import torch

    rows = []
    for n in (4, 16, 32, 64):
        r = run_point("rnn_jacrev", n)
        print(r, flush=True)
        if "error" in r:
            rows.append([n, r["error"][:60], "-"])
        else:
            rows.append([n, f"{r['compile_s']:.2f}" + ("" if r["ok"] else " (WRONG)"), f"{r['run_s'] * 1e3:.2f}"])
    t = table(rows, ["output elements", "first call s", "ms per call"])
    print("\n" + t)
    if no_write:
        return
    section = f"""
### A jitted jacrev of a loop, by output size

Machine: {machine()}; date: {datetime.date.today().isoformat()}; torch {torch.__version__}.
Run: `.venv/bin/python benchmarks/compile_time.py --jacrev`. `tfun.jit(tfun.jacrev(last))(W)`, `last`
the final state of a tanh RNN of 50 steps with `n` units (so `n` output elements), `W` its (n, n)
weight, float32, Inductor. Under tfun.jit a jacrev with a loop inside pulls back one basis
cotangent per output element (torch.compile cannot trace a vmap around a loop op), so the graph
holds `n` backwards of the loop; past 32 elements (`tfun._grad.WARN_JACREV_ROWS`) it warns. Each
point is a fresh process with an empty Inductor cache after an unrelated warm-up compile; "first
call" is trace + compile + one run, checked against eager's Jacobian.

{t}
"""
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as fh:
        fh.write(section)


def warm_section(no_write: bool) -> None:
    """The first call in a fresh process whose Inductor cache an earlier process filled with
    the same program, with tfun.jit's loop graphs cached (its default) and as torch leaves them
    (bypassed for any graph with a loop)."""
    import torch

    rows = []
    for kind, n in (("rnn_scan", 256), ("rnn_scan", 1024), ("rnn_grad_param", 256), ("rnn_grad_param", 1024)):
        cells = [kind, n]
        for baseline in (True, False):
            extra = {"TFUN_BENCH_NO_LOOP_CACHE": "1"} if baseline else {}
            with tempfile.TemporaryDirectory(prefix="tfun-inductor-cache-") as cache:
                cold = _run_in(cache, kind, n, **extra)
                warm = _run_in(cache, kind, n, **extra)
            print(cold, warm, flush=True)
            for r in (cold, warm):
                cells.append(r.get("error", "")[:40] or f"{r['compile_s']:.2f}" + ("" if r["ok"] else " (WRONG)"))
        rows.append(cells)
    t = table(rows, ["program", "T", "torch's caching: first process s", "second process s",
                     "tfun.jit's: first process s", "second process s"])
    print("\n" + t)
    if no_write:
        return
    section = f"""
### The first call in a second process (a warm Inductor cache)

Machine: {machine()}; date: {datetime.date.today().isoformat()}; torch {torch.__version__}.
Run: `.venv/bin/python benchmarks/compile_time.py --warm`. Two processes one after the other with
one Inductor cache directory, each timing the first call (trace + compile + one run, checked
against eager) of the same program: `rnn_scan`, the tanh RNN's forward (`tfun.jit`, no grad);
`rnn_grad_param`, its training step `tfun.jit(tfun.value_and_grad(loss))(W, xs)` with `W` an
`nn.Parameter`. "torch's caching": Inductor's FX graph cache and AOTAutograd's cache bypass every
graph holding a loop (`TFUN_BENCH_NO_LOOP_CACHE=1`, the state before); "tfun.jit's": its loops'
HOPs marked cacheable (`tfun._compat.loop_hop_cache_marks`), so the second process takes the
compiled graphs from the cache and still traces with Dynamo.

{t}
"""
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as fh:
        fh.write(section)


if __name__ == "__main__":
    main()
