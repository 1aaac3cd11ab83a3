"""tfun.random.normal vs torch.randn: eager and under tfun.jit, a few sizes (CPU by default).

    PYTHONPATH=. python benchmarks/prng.py [--sizes 1000 100000 1000000] [--repeat 20]

Prints a Markdown table (median milliseconds per call). Not run by the tests.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder is sys.path[0], where "random.py" would shadow the
# standard library's `random` (imported by torch): drop it before importing anything else.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import tfun  # noqa: E402
import tfun.random as jr  # noqa: E402


def _time(fn, repeat: int) -> float:
    fn()  # warm up (and compile)
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000, 1_000_000])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    key = jr.PRNGKey(0)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, threads={torch.get_num_threads()}")
    print("| n | torch.randn | tfun.random.normal eager | tfun.jit (inductor) | eager / randn |")
    print("|---|---|---|---|---|")
    for n in args.sizes:
        t_randn = _time(lambda: torch.randn(n), args.repeat)
        t_eager = _time(lambda: jr.normal(key, (n,)), args.repeat)
        jitted = tfun.jit(lambda k: jr.normal(k, (n,)))
        t_jit = _time(lambda: jitted(key), args.repeat)
        print(f"| {n:,} | {t_randn:.3f} ms | {t_eager:.3f} ms | {t_jit:.3f} ms | {t_eager / t_randn:.1f}x |")


if __name__ == "__main__":
    main()
