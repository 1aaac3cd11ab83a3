"""Ways to run a tfun loop on CUDA without paying the host per step, side by side (issue 15).

    python benchmarks/cuda_graphs.py                       # every program and strategy (CUDA)
    python benchmarks/cuda_graphs.py --only rnn_small      # programs whose name contains this
    python benchmarks/cuda_graphs.py --strategies eager graph_eager

A loop of small steps on a GPU is bound by the host: each step's kernels are launched from
Python (eager) or from Inductor's wrapper, which for a loop higher-order op also reads the
loop's predicate back every step. A CUDA graph records the kernels of one whole call and
replays them with one launch. For each program (the tanh RNN and LSTM of benchmarks/vs_jax.py,
a fori_loop, a while_loop) this prints, per strategy, the median milliseconds of a call, the
first call's seconds, whether the call synchronizes with the host (run once under
`torch.cuda.set_sync_debug_mode("error")`) and the largest difference from tfun eager:

- `eager`, `jit` (tfun.jit, Inductor defaults, `cuda_graphs=False`), `jit_reduce_overhead` (Inductor with its
  CUDA graph trees), `jit_cudagraphs` (Dynamo's `cudagraphs` backend: AOTAutograd graphs run
  eagerly under CUDA graph trees);
- `graph_eager`, `graph_jit_aot_eager`, `graph_jit`: one whole call (forward, or the gradient
  program `tfun.grad(loss)`) captured by hand in a `torch.cuda.CUDAGraph`, then replayed after
  copying the inputs into the captured ones;
- `tfun_cuda_graphs`: `tfun.jit(fn, cuda_graphs="auto")`, which replays a recorded graph
  where that is safe (tfun/_cuda_graphs.py);
- `jax`: `jax.jit`, for the ratio.

A strategy that fails prints its error's first line instead of a time: this is a probe, run
on the device machine (benchmarks/gpu_session.sh) to choose what tfun.jit does on CUDA.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import tfun  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import vs_jax  # noqa: E402

try:
    import jax  # noqa: E402
except ImportError:  # pragma: no cover
    jax = None  # type: ignore[assignment]

PROGRAMS = [  # the most telling first
    "rnn_small fwd",
    "rnn_large fwd+bwd",
    "lstm_step fwd+bwd",
    "while_loop fwd",
    "rnn_small fwd+bwd",
    "rnn_large fwd",
    "fori_loop fwd",
]
STRATEGIES = [
    "eager",
    "jit",
    "graph_eager",
    "graph_jit_aot_eager",
    "graph_jit",
    "tfun_cuda_graphs",
    "jax",
    "jit_cudagraphs",  # last: a failure here may leave the CUDA context unusable
    "jit_reduce_overhead",
]


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout("no result within the time limit")


def capture(fn: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any]:
    """`fn` recorded in a CUDA graph on copies of `args`; the returned callable copies its
    arguments in, replays and returns the captured outputs (overwritten by the next call)."""
    leaves, treedef = tfun.tree.tree_flatten(args)
    static = [t.clone() for t in leaves]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*tfun.tree.tree_unflatten(treedef, static))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*tfun.tree.tree_unflatten(treedef, static))

    def replay(*a: Any) -> Any:
        for s, t in zip(static, tfun.tree.tree_leaves(a)):
            s.copy_(t)
        graph.replay()
        return out

    return replay


def syncs(fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    """'yes' if one call synchronizes with the host (`set_sync_debug_mode`)."""
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(*args)
        return "no"
    except RuntimeError as e:
        return "yes" if "synchroniz" in str(e) else f"? {str(e).splitlines()[0][:60]}"
    finally:
        torch.cuda.set_sync_debug_mode(old)
        torch.cuda.synchronize()


def _diff(a: Any, b: Any) -> float:
    la, lb = tfun.tree.tree_leaves(a), tfun.tree.tree_leaves(b)
    return max(float((x.float() - y.float()).abs().max() / (y.float().abs().max() + 1e-30)) for x, y in zip(la, lb))


def build(strategy: str, t_fn: Callable[..., Any], args: tuple[Any, ...], forward: bool) -> Callable[..., Any]:
    def ng(f: Callable[..., Any]) -> Callable[..., Any]:
        return vs_jax._no_grad(f) if forward else f

    if strategy == "eager":
        return ng(t_fn)
    if strategy == "jit":
        return ng(tfun.jit(t_fn, cuda_graphs=False))
    if strategy == "jit_reduce_overhead":
        return ng(tfun.jit(t_fn, mode="reduce-overhead"))
    if strategy == "jit_cudagraphs":
        return ng(tfun.jit(t_fn, backend="cudagraphs"))
    if strategy == "graph_eager":
        return ng(capture(ng(t_fn), args))
    if strategy == "graph_jit_aot_eager":
        f = ng(tfun.jit(t_fn, backend="aot_eager", cuda_graphs=False))
        f(*args)
        return capture(f, args)
    if strategy == "graph_jit":
        f = ng(tfun.jit(t_fn, cuda_graphs=False))
        f(*args)
        return capture(f, args)
    if strategy == "tfun_cuda_graphs":
        return ng(tfun.jit(t_fn, cuda_graphs="auto"))
    raise ValueError(strategy)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="")
    ap.add_argument("--strategies", nargs="*", default=STRATEGIES)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--max-seconds", type=int, default=60, help="per strategy and program")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_graphs.py: no CUDA device; nothing to measure")
        return 0
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, jax {getattr(jax, '__version__', '-')}")
    print("| program | strategy | ms per call | first call (s) | syncs | max rel diff vs eager |")
    print("|---|---|---:|---:|---|---:|")
    signal.signal(signal.SIGALRM, _alarm)
    for name in [p for p in PROGRAMS if args.only in p]:
        t_fn, t_args, j_fn, j_args = vs_jax.PROGRAMS[name](True)
        t_args = vs_jax._to(t_args, dev)
        forward = not name.endswith("bwd")
        ref = None
        for strategy in args.strategies:
            torch._dynamo.reset()
            signal.alarm(args.max_seconds)
            try:
                if strategy == "jax":
                    if jax is None:
                        continue
                    ja = vs_jax._jax_args(vs_jax._to(t_args, torch.device("cpu")), jax.devices("gpu")[0])
                    first, med = vs_jax.time_jax(jax.jit(j_fn), ja, args.repeat)
                    print(f"| {name} | jax | {med * 1e3:.2f} | {first:.2f} | - | - |", flush=True)
                    continue
                t = time.perf_counter()
                fn = build(strategy, t_fn, t_args, forward)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = fn(*t_args)
                    torch.cuda.synchronize()
                    first = time.perf_counter() - t
                    out = tfun.tree.tree_map(lambda x: x.clone(), out)
                    if ref is None:
                        ref = out
                    s = syncs(fn, t_args)
                    _, med = vs_jax.time_torch(fn, t_args, dev, args.repeat)
                print(f"| {name} | {strategy} | {med * 1e3:.2f} | {first:.1f} | {s} | {_diff(out, ref):.1e} |", flush=True)
            except BaseException as e:  # noqa: BLE001 - a probe reports every failure and goes on
                if isinstance(e, KeyboardInterrupt):
                    raise
                line = next((ln for ln in str(e).splitlines() if ln.strip()), "")[:150]
                print(f"| {name} | {strategy} | FAILED | - | - | {type(e).__name__}: {line} |", flush=True)
                try:
                    torch.cuda.synchronize()
                except BaseException as e2:  # noqa: BLE001
                    print(f"| {name} | {strategy} | CUDA context broken: {e2} |", flush=True)
                    return 1
            finally:
                signal.alarm(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
