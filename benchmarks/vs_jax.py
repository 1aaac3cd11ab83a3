"""The same programs in tfun and in JAX, side by side, in one run: tfun eager, `tfun.jit` and
`jax.jit`, with the ratio `tfun.jit / jax.jit` (the issue's target: at most 2x on CPU, 1x on CUDA)
and each compiled path's first call (trace + compile + one run).

    python benchmarks/vs_jax.py                    # every program, CPU (and CUDA when present)
    python benchmarks/vs_jax.py --quick            # fewer repeats
    python benchmarks/vs_jax.py --only rnn_small   # one program (a substring of its name)
    python benchmarks/vs_jax.py --record           # append the table to benchmarks/RESULTS.md
    python benchmarks/vs_jax.py --unroll 8         # unroll= of every scan/fori_loop, in both frameworks
    python benchmarks/vs_jax.py --jit-options '{"cpp_wrapper": true}'   # Inductor options to try
    python benchmarks/vs_jax.py --device cuda                    # tfun.jit's default, cuda_graphs="auto"
    python benchmarks/vs_jax.py --device cuda --no-cuda-graphs   # tfun.jit(..., cuda_graphs=False)

Programs (each written once per framework, the same arithmetic, float32):

- `rnn_small` / `rnn_large`: the tanh RNN `h = tanh(h @ W + x)` over T=1024 steps by `scan`
  (B=4, H=32 and B=64, H=256), forward (`fwd`) and the gradient of a loss w.r.t. W (`fwd+bwd`).
- `fori_loop`: 1000 steps of `x = 0.99 * x + 0.01 * sin(x @ W)` on a (16, 64) state.
- `while_loop`: the same step until the state's norm falls under a threshold (data-dependent
  trip count, 1000 steps here), forward only (JAX has no reverse mode through while_loop).
- `associative_scan`: the linear recurrence `h_t = a_t h_{t-1} + b_t` as a pair scan over
  (T=4096, C=256), fwd and fwd+bwd.
- `lstm_step`: an LSTM (H=128, B=16, T=256) written as a `scan` over its cell, the gradient of a
  loss w.r.t. all its parameters (a training step without the optimizer).
- `vmap_rnn`: the tanh RNN written for one sequence (H=32, T=256) and batched by `vmap` over 16
  sequences with W shared: `jit(vmap(f))` of a scan, fwd and the gradient w.r.t. W (`fwd+bwd`).
- `per_example`: the same RNN's loss per sequence, and the gradient w.r.t. W of each of the 16
  sequences (per-example gradients, `jit(vmap(grad(loss), in_axes=(None, 0)))`).

Timings are the median of `--repeat` calls after two warm-up calls; on CUDA each call is
synchronized. JAX results are blocked on (`block_until_ready`); tfun's forward programs run
under `torch.no_grad()`, as inference does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share a GPU with torch

import torch  # noqa: E402

import tfun  # noqa: E402

try:
    import jax  # noqa: E402
    import jax.numpy as jnp  # noqa: E402
except ImportError:  # pragma: no cover
    jax = None  # type: ignore[assignment]

lax = tfun.lax
UNROLL = 1  # --unroll: steps per compiled loop iteration, the same in both frameworks


# ----------------------------------------------------------------------------------------
# The programs: (tfun fn, tfun args, jax fn, jax args), one builder per program and mode
# ----------------------------------------------------------------------------------------


def _data(seed: int, *shapes: tuple[int, ...], scale: float = 1.0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) * scale for s in shapes]


def rnn(B: int, H: int, T: int, backward: bool):
    W, xs = _data(0, (H, H), (T, B, H))
    W = W / H**0.5
    h0 = torch.zeros(B, H)

    def t_loss(W, xs, h0):
        h, ys = lax.scan(lambda h, x: (lambda n: (n, n))(torch.tanh(h @ W + x)), h0, xs, unroll=UNROLL)
        return ys.sum()

    def j_loss(W, xs, h0):
        h, ys = jax.lax.scan(lambda h, x: (lambda n: (n, n))(jnp.tanh(h @ W + x)), h0, xs, unroll=UNROLL)
        return ys.sum()

    if backward:
        return tfun.grad(t_loss), (W, xs, h0), jax.grad(j_loss), (W, xs, h0)
    return t_loss, (W, xs, h0), j_loss, (W, xs, h0)


def fori(n: int):
    W, x = _data(1, (64, 64), (16, 64))
    W = W / 8

    def t(W, x):
        return lax.fori_loop(0, n, lambda i, x: 0.99 * x + 0.01 * torch.sin(x @ W), x, unroll=UNROLL)

    def j(W, x):
        return jax.lax.fori_loop(0, n, lambda i, x: 0.99 * x + 0.01 * jnp.sin(x @ W), x, unroll=UNROLL)

    return t, (W, x), j, (W, x)


def while_(n: int):
    W, x = _data(2, (64, 64), (16, 64))
    W = W / 8

    def t(W, x):
        def body(c):
            i, x = c
            return i + 1, 0.99 * x + 0.01 * torch.sin(x @ W)

        return lax.while_loop(lambda c: c[0] < n, body, (torch.zeros((), dtype=torch.int64), x))[1]

    def j(W, x):
        def body(c):
            i, x = c
            return i + 1, 0.99 * x + 0.01 * jnp.sin(x @ W)

        return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.zeros((), dtype=jnp.int32), x))[1]

    return t, (W, x), j, (W, x)


def assoc(T: int, C: int, backward: bool):
    a, b = _data(3, (T, C), (T, C))
    a = torch.sigmoid(a)

    def t_loss(a, b):
        _, h = lax.associative_scan(lambda x, y: (x[0] * y[0], x[1] * y[0] + y[1]), (a, b))
        return h.sum()

    def j_loss(a, b):
        _, h = jax.lax.associative_scan(lambda x, y: (x[0] * y[0], x[1] * y[0] + y[1]), (a, b))
        return h.sum()

    if backward:
        return tfun.grad(t_loss, argnums=(0, 1)), (a, b), jax.grad(j_loss, argnums=(0, 1)), (a, b)
    return t_loss, (a, b), j_loss, (a, b)


def lstm(B: int, H: int, T: int):
    Wx, Wh, bias, xs = _data(4, (H, 4 * H), (H, 4 * H), (4 * H,), (T, B, H))
    Wx, Wh = Wx / H**0.5, Wh / H**0.5
    params = {"Wx": Wx, "Wh": Wh, "b": bias}

    def t_loss(p, xs):
        h0 = xs.new_zeros(B, H)  # on the device of the inputs
        def cell(c, x):
            h, s = c
            i, f, g, o = torch.chunk(x @ p["Wx"] + h @ p["Wh"] + p["b"], 4, dim=-1)
            s = torch.sigmoid(f) * s + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(s)
            return (h, s), h

        _, hs = lax.scan(cell, (h0, h0), xs, unroll=UNROLL)
        return (hs**2).mean()

    def j_loss(p, xs):
        def cell(c, x):
            h, s = c
            i, f, g, o = jnp.split(x @ p["Wx"] + h @ p["Wh"] + p["b"], 4, axis=-1)
            s = jax.nn.sigmoid(f) * s + jax.nn.sigmoid(i) * jnp.tanh(g)
            h = jax.nn.sigmoid(o) * jnp.tanh(s)
            return (h, s), h

        _, hs = jax.lax.scan(cell, (h0j, h0j), xs, unroll=UNROLL)
        return (hs**2).mean()

    h0j = torch.zeros(B, H).numpy()
    return tfun.grad(t_loss), (params, xs), jax.grad(j_loss), (params, xs)


def vmap_rnn(B: int, H: int, T: int, backward: bool):
    """The tanh RNN written for one sequence (a vector state) and batched by `vmap` over B
    independent sequences, W shared (`in_axes=None`): `jit(vmap(f))` of a scan."""
    W, xs = _data(5, (H, H), (B, T, H))
    W = W / H**0.5

    def t_seq(W, x):
        _, ys = lax.scan(lambda h, xt: (lambda n: (n, n))(torch.tanh(h @ W + xt)), torch.zeros_like(x[0]), x, unroll=UNROLL)
        return ys

    def j_seq(W, x):
        _, ys = jax.lax.scan(lambda h, xt: (lambda n: (n, n))(jnp.tanh(h @ W + xt)), jnp.zeros_like(x[0]), x, unroll=UNROLL)
        return ys

    def t_loss(W, xs):
        return tfun.vmap(t_seq, in_axes=(None, 0))(W, xs).sum()

    def j_loss(W, xs):
        return jax.vmap(j_seq, in_axes=(None, 0))(W, xs).sum()

    if backward:
        return tfun.grad(t_loss), (W, xs), jax.grad(j_loss), (W, xs)
    return t_loss, (W, xs), j_loss, (W, xs)


def per_example(B: int, H: int, T: int):
    """Per-example gradients: the gradient w.r.t. the shared W of each sequence's loss,
    `vmap(grad(loss), in_axes=(None, 0))` (under tfun.jit: `_vmap._per_example_gradients`)."""
    W, xs = _data(6, (H, H), (B, T, H))
    W = W / H**0.5

    def t_loss(W, x):
        _, ys = lax.scan(lambda h, xt: (lambda n: (n, n))(torch.tanh(h @ W + xt)), torch.zeros_like(x[0]), x, unroll=UNROLL)
        return (ys * ys).sum()

    def j_loss(W, x):
        _, ys = jax.lax.scan(lambda h, xt: (lambda n: (n, n))(jnp.tanh(h @ W + xt)), jnp.zeros_like(x[0]), x, unroll=UNROLL)
        return (ys * ys).sum()

    return tfun.vmap(tfun.grad(t_loss), in_axes=(None, 0)), (W, xs), jax.vmap(jax.grad(j_loss), in_axes=(None, 0)), (W, xs)


PROGRAMS: dict[str, Callable[[bool], tuple]] = {
    "rnn_small fwd": lambda q: rnn(4, 32, 1024, False),
    "rnn_small fwd+bwd": lambda q: rnn(4, 32, 1024, True),
    "rnn_large fwd": lambda q: rnn(64, 256, 1024, False),
    "rnn_large fwd+bwd": lambda q: rnn(64, 256, 1024, True),
    "fori_loop fwd": lambda q: fori(1000),
    "while_loop fwd": lambda q: while_(1000),
    "associative_scan fwd": lambda q: assoc(4096, 256, False),
    "associative_scan fwd+bwd": lambda q: assoc(4096, 256, True),
    "lstm_step fwd+bwd": lambda q: lstm(16, 128, 256),
    "vmap_rnn fwd": lambda q: vmap_rnn(16, 32, 256, False),
    "vmap_rnn fwd+bwd": lambda q: vmap_rnn(16, 32, 256, True),
    "per_example fwd+bwd": lambda q: per_example(16, 32, 256),
}


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------


def _to(tree: Any, device: torch.device) -> Any:
    return tfun.tree.tree_map(lambda t: t.to(device), tree)


def _jax_args(tree: Any, device: Any) -> Any:
    return jax.tree_util.tree_map(lambda t: jax.device_put(jnp.asarray(t.numpy() if isinstance(t, torch.Tensor) else t), device), tree)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _no_grad(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        with torch.no_grad():
            return fn(*args)

    return call


def time_torch(fn: Callable[..., Any], args: tuple, device: torch.device, repeat: int) -> tuple[float, float]:
    """(first call seconds, median seconds of later calls)."""
    t = time.perf_counter()
    fn(*args)
    _sync(device)
    first = time.perf_counter() - t
    fn(*args)
    _sync(device)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        _sync(device)
        times.append(time.perf_counter() - t)
    return first, statistics.median(times)


def time_jax(fn: Callable[..., Any], args: tuple, repeat: int) -> tuple[float, float]:
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return first, statistics.median(times)


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        model = [line.split(":", 1)[1].strip() for line in out if line.startswith("Model name")][0]
    except Exception:  # noqa: BLE001 - a description only
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores"


CUDA_GRAPHS: bool | str = "auto"  # tfun.jit's cuda_graphs= (its default; --no-cuda-graphs: False)


def run(device: torch.device, names: list[str], repeat: int, jit_options: dict[str, Any]) -> list[dict[str, Any]]:
    jdev = jax.devices("gpu")[0] if device.type == "cuda" else jax.devices("cpu")[0]
    rows = []
    for name in names:
        t_fn, t_args, j_fn, j_args = PROGRAMS[name](False)
        t_args = _to(t_args, device)
        j_args = _jax_args(t_args if device.type == "cpu" else _to(t_args, torch.device("cpu")), jdev)
        torch._dynamo.reset()
        row: dict[str, Any] = {"program": name, "device": device.type}
        extra: dict[str, Any] = {"options": jit_options} if jit_options else {}
        jitted = tfun.jit(t_fn, cuda_graphs=CUDA_GRAPHS, **extra)
        if not name.endswith("bwd"):
            # forward programs run as inference does, under no_grad (on CUDA, tfun's traced
            # associative_scan is torch's fused kernel only with gradients off)
            t_fn, jitted = _no_grad(t_fn), _no_grad(jitted)
        _, row["eager"] = time_torch(t_fn, t_args, device, max(3, repeat // 4))
        row["jit first"], row["jit"] = time_torch(jitted, t_args, device, repeat)
        row["jax first"], row["jax"] = time_jax(jax.jit(j_fn), j_args, repeat)
        rows.append(row)
        print(_row_text(row), flush=True)
    return rows


HEADER = (
    "| program | device | tfun eager (ms) | tfun.jit (ms) | jax.jit (ms) | tfun.jit / jax.jit | "
    "tfun.jit / eager | first call tfun.jit (s) | first call jax.jit (s) |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|"
)


def _row_text(r: dict[str, Any]) -> str:
    return (
        f"| {r['program']} | {r['device']} | {r['eager'] * 1e3:.2f} | {r['jit'] * 1e3:.2f} | {r['jax'] * 1e3:.2f} | "
        f"{r['jit'] / r['jax']:.1f}x | {r['jit'] / r['eager']:.2f} | {r['jit first']:.1f} | {r['jax first']:.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--only", default="", help="run the programs whose name contains this")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    ap.add_argument("--jit-options", default="", help="Inductor options for tfun.jit, as JSON")
    ap.add_argument("--unroll", type=int, default=1, help="unroll= of every scan and fori_loop, in both frameworks")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help='tfun.jit(..., cuda_graphs="auto"), the default: replay CUDA calls from a graph')
    ap.add_argument("--no-cuda-graphs", action="store_true", help="tfun.jit(..., cuda_graphs=False)")
    ap.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    global UNROLL, CUDA_GRAPHS
    UNROLL = args.unroll
    CUDA_GRAPHS = False if args.no_cuda_graphs else "auto"
    if jax is None:
        print("jax is not installed: pip install jax")
        return 1
    repeat = args.repeat or (5 if args.quick else 20)
    names = [n for n in PROGRAMS if args.only in n]
    devices = [torch.device("cpu")] if args.device in ("cpu", "all") else []
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    jit_options = json.loads(args.jit_options) if args.jit_options else {}
    print(HEADER)
    rows = [r for d in devices for r in run(d, names, repeat, jit_options)]
    if args.record:
        gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
        opts = f" with Inductor options `{json.dumps(jit_options)}`" if jit_options else ""
        opts += f", `unroll={UNROLL}` in both" if UNROLL != 1 else ""
        opts += ", `cuda_graphs=False`" if not CUDA_GRAPHS else ""
        with open(os.path.join(os.path.dirname(__file__), "RESULTS.md"), "a") as fh:
            fh.write(
                f"\n## tfun vs JAX, the same programs (`python benchmarks/vs_jax.py{' --quick' if args.quick else ''}`){opts}\n\n"
                f"{datetime.date.today()}, {machine()}{gpu}; torch {torch.__version__}, jax {jax.__version__}; "
                f"median of {repeat} calls after two warm-up calls.\n\n" + HEADER + "\n" + "\n".join(_row_text(r) for r in rows) + "\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
