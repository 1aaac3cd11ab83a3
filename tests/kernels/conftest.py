"""Kernel tests run the Triton kernels on the CPU in Triton's interpreter.

The linear_scan launcher reads `TRITON_INTERPRET` at every launch (not when `@triton.jit`
decorates, which is when triton 3.6 itself reads it), so setting it per test with monkeypatch
works whatever imported torch/triton/tfun first, and does not leak into other test directories
when the whole suite runs in one process. `TFUN_KERNELS_NAN_FILL=1` makes the launchers allocate
NaN-filled outputs, so a kernel that skips a store fails the comparison.
"""

import pytest


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TFUN_KERNELS_NAN_FILL", "1")
    from tfun.kernels import _linear_scan_triton

    monkeypatch.setattr(_linear_scan_triton, "FORCE_SEGMENT", None)
