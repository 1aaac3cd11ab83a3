"""What `tfun.jit` asks of Inductor beyond torch's defaults, for loops on the CPU.

A compiled loop on the CPU runs one iteration of Inductor's wrapper per step, and each step's
kernels are small: what a step costs is mostly fixed cost per kernel, not arithmetic. Three
defaults cut it (measured on a 2-core CPU, torch 2.13, `benchmarks/vs_jax.py`'s tanh RNN with a
batch of 4 and a state of 32, 1024 steps: forward 8.6 -> 3.5 ms, forward+backward 22.6 ->
8.5 ms; benchmarks/RESULTS.md):

- **Small matrix products as fused loops** (`tfun._small_matmul`), and **copying views as
  views** (`tfun._view_copies`: the `select_copy`s of a differentiated loop body would be
  ATen calls every step): `tfun._inductor_pass.PostGradPass`, as Inductor's
  `post_grad_custom_pre_pass`.
- **CPU loops that allocate nothing per step** (`tfun._scan_in_place`): a `scan` (or `map`)
  whose tensors are all on the CPU (static or symbolic shapes) becomes a `while_loop` that writes its
  carry, its stacked outputs, its counter and its condition in place, instead of allocating
  three buffers and reading the counter back with `.item()` every step; a `while_loop` of
  such tensors computes its condition inside the step and writes its state in place; as
  Inductor's `post_grad_custom_post_pass` (`{"post_grad_custom_post_pass": None}` turns it
  off).
- **Small kernels on one thread**: Inductor runs a CPU kernel as an OpenMP parallel region
  once each thread gets `cpp.min_chunk_size` elements of its loop nest (torch's default: 512,
  so with 2 threads a kernel of 1,024 elements already forks and joins). For a loop body's
  kernels, run once per step, that fork and join costs more than the work (4x32 states: 5.1 ->
  4.0 ms forward, 18 -> 10 ms forward+backward). tfun.jit raises `cpp.min_chunk_size` so that a
  kernel of fewer than `SERIAL_ELEMENTS` (16,384) elements runs on one thread, whatever the
  number of threads; larger kernels are split as torch would split them.

And one default for the first call, **loop graphs kept in Inductor's caches**: torch bypasses
its FX graph cache and AOTAutograd's cache for any graph holding a control-flow HOP; tfun.jit
marks the loop HOPs cacheable (`unsafe_marked_cacheable_functions`,
`_compat.loop_hop_cache_marks`, keyed by torch's version and tfun's source), so a second
process compiling the same program takes its compiled graphs from the cache (a small RNN's
training step: first call 2.6 -> 1.7 s; `benchmarks/compile_time.py --warm`).
`{"unsafe_marked_cacheable_functions": {}}` leaves torch's choice.

These apply when tfun.jit compiles with Inductor in its default mode: not with a `mode=`
(torch.compile takes `mode` or `options`, never both; `"max-autotune"` tunes the GEMMs the pass
would remove), not with another `backend=`, and each leaves an Inductor option the caller sets
in `options` alone (`{"post_grad_custom_pre_pass": None}` turns the pass off,
`{"cpp.min_chunk_size": 512}` restores torch's threading). The matmul rewrite and the chunk
size shape CPU kernels only; the view-copy rewrite applies on every device (on CUDA such an ATen
call is a kernel launch of its own per step; not yet measured on a GPU).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import _compat
from ._inductor_pass import PostGradPass, _source_hash
from ._scan_in_place import ScanInPlacePass

__all__ = ["SERIAL_ELEMENTS", "compile_options"]

SERIAL_ELEMENTS = 1 << 14


def _min_chunk_size() -> int:
    """`cpp.min_chunk_size` for kernels under `SERIAL_ELEMENTS` elements to run serially with
    Inductor's thread count (`cpp.threads`, or torch's intra-op threads), never below torch's."""
    from torch._inductor import config

    threads = config.cpp.threads if config.cpp.threads >= 1 else torch.get_num_threads()
    return max(int(config.cpp.min_chunk_size), math.ceil(SERIAL_ELEMENTS / max(1, threads)))


def compile_options(options: dict[str, Any]) -> dict[str, Any]:
    """`torch.compile` keyword arguments with tfun.jit's Inductor defaults added where they
    apply (see the module's docstring)."""
    if options.get("backend", "inductor") != "inductor" or options.get("mode") is not None:
        return options
    inductor = dict(options.get("options") or {})
    added = False
    if "post_grad_custom_pre_pass" not in inductor and _compat.CustomGraphPass is not object:
        inductor["post_grad_custom_pre_pass"] = PostGradPass()
        added = True
    if "post_grad_custom_post_pass" not in inductor and _compat.CustomGraphPass is not object:
        inductor["post_grad_custom_post_pass"] = ScanInPlacePass()
        added = True
    if "cpp.min_chunk_size" not in inductor:
        inductor["cpp.min_chunk_size"] = _min_chunk_size()
        added = True
    if "unsafe_marked_cacheable_functions" not in inductor:
        marks = _compat.loop_hop_cache_marks(f"torch {torch.__version__}, tfun {_source_hash()}")
        if marks:
            from torch._inductor import config

            inductor["unsafe_marked_cacheable_functions"] = {**config.unsafe_marked_cacheable_functions, **marks}
            added = True
    return {**options, "options": inductor} if added else options
