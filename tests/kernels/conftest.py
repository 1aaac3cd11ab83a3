"""Kernel tests run the Triton kernels on the CPU in Triton's interpreter, or on a real GPU.

`TFUN_KERNEL_DEVICE=cuda python -m pytest tests/kernels` runs the same tests compiled for CUDA
instead (benchmarks/gpu_session.sh does, on the device machine): inputs are made on the CPU from
the same seeds and moved to the GPU, the plans are the GPU's own, and the interpreter-only tests
are skipped with the reason.

The linear_scan launcher reads `TRITON_INTERPRET` at every launch (not when `@triton.jit`
decorates, which is when triton 3.6 itself reads it), so setting it per test with monkeypatch
works whatever imported torch/triton/tfun first, and does not leak into other test directories
when the whole suite runs in one process. The launchers' private knob `nan_fill` makes them
allocate NaN-filled outputs, so a kernel that skips a store fails the comparison.

Two ways the interpreter differs from a GPU are closed here, so that what passes on the CPU
also holds on CUDA:

- Plans. On the CPU the launcher never splits time into segments (the interpreter runs programs
  one by one). `gpu_plans` makes it plan as an H100 would, so the segmented
  plans a GPU picks for few channels x long sequences run here too (the knob `simulate_sms`;
  `force_segment` forces a segment length on any input).
- Reduction order. `tl.reduce` on a GPU reduces in-thread, then with butterfly shuffles across
  lanes, so it may reassociate and *commute* the combine's operands (triton-lang/triton#4962);
  the interpreter folds strictly left to right. `_reversed_reduce` (autouse) makes the
  interpreter fold right to left, which changes the result of any non-commutative combine, so
  a kernel that relies on the interpreter's order fails here instead of only on CUDA.
  (`tl.associative_scan` keeps the order on GPUs too, and is left as it is.)
"""

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

#: an H100's streaming multiprocessors (the machine the GPU bug was measured on)
H100_SMS = 132

#: where the kernels run: "cpu" (Triton's interpreter, the default) or "cuda"
DEVICE = torch.device(os.environ.get("TFUN_KERNEL_DEVICE", "cpu"))
ON_GPU = DEVICE.type != "cpu"
if ON_GPU and not torch.cuda.is_available():
    raise pytest.UsageError(f"TFUN_KERNEL_DEVICE={DEVICE} but no CUDA device is available")

#: marks a test that checks the interpreter itself
interpreter_only = pytest.mark.skipif(ON_GPU, reason="checks Triton's CPU interpreter; TFUN_KERNEL_DEVICE is a GPU")


def _reverse_generic_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.ReduceOps.generic_reduce

    def reversed_order(self, input):  # type: ignore[no-untyped-def]
        if self.axis is None:
            return original(self, input)
        flipped = tuple(
            tl.core.tensor(
                interpreter.TensorHandle(np.ascontiguousarray(np.flip(t.handle.data, self.axis)), t.handle.dtype),
                t.type,
            )
            for t in input
        )
        return original(self, flipped)

    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", reversed_order)


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from tfun.kernels import _linear_scan_triton

    if ON_GPU:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    with _linear_scan_triton.knobs(nan_fill=True, force_segment=None, simulate_sms=None, reverse_tiles=None):
        if not ON_GPU:
            _reverse_generic_reduce(monkeypatch)
        yield


@pytest.fixture
def gpu_plans(monkeypatch: pytest.MonkeyPatch) -> int:
    """Plan every launch as on an H100 (on a real GPU: as that GPU); returns the SM count."""
    from tfun.kernels import _linear_scan_triton

    if ON_GPU:
        return torch.cuda.get_device_properties(DEVICE).multi_processor_count
    monkeypatch.setattr(_linear_scan_triton.KNOBS, "simulate_sms", H100_SMS)
    return H100_SMS
