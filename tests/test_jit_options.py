"""tfun._jit_options: the Inductor options tfun.jit adds by default, and when it adds none."""

from __future__ import annotations

import math

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import tfun
from tfun import _jit_options
from tfun._inductor_pass import PostGradPass
from tfun._scan_in_place import ScanInPlacePass


def test_the_defaults_go_only_to_inductor_in_its_default_mode():
    added = _jit_options.compile_options({})["options"]
    assert isinstance(added["post_grad_custom_pre_pass"], PostGradPass)
    assert isinstance(added["post_grad_custom_post_pass"], ScanInPlacePass)
    assert added["cpp.min_chunk_size"] >= 512
    kept = _jit_options.compile_options({"options": {"cpp_wrapper": True}, "dynamic": True})
    assert kept["options"]["cpp_wrapper"] is True and kept["dynamic"] is True
    assert isinstance(kept["options"]["post_grad_custom_pre_pass"], PostGradPass)
    assert "cpp.min_chunk_size" in _jit_options.compile_options({"backend": "inductor"})["options"]
    for untouched in (
        {"backend": "aot_eager"},
        {"mode": "max-autotune"},
        {"mode": "default"},  # torch.compile takes mode or options, never both
        {"options": {"post_grad_custom_pre_pass": None, "post_grad_custom_post_pass": None, "cpp.min_chunk_size": 512}},  # the caller's own
    ):
        assert _jit_options.compile_options(untouched) == untouched
    mine = _jit_options.compile_options({"options": {"cpp.min_chunk_size": 7}})["options"]
    assert mine["cpp.min_chunk_size"] == 7 and isinstance(mine["post_grad_custom_pre_pass"], PostGradPass)


def test_the_chunk_size_makes_kernels_under_the_limit_serial_for_any_thread_count():
    from torch._inductor import config

    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 16, 64):
            torch.set_num_threads(n)
            chunk = _jit_options._min_chunk_size()
            assert chunk >= config.cpp.min_chunk_size
            # Inductor parallelizes a loop nest of `seq` elements when seq // threads >= chunk
            assert (_jit_options.SERIAL_ELEMENTS - 1) // n < chunk
            assert chunk == max(config.cpp.min_chunk_size, math.ceil(_jit_options.SERIAL_ELEMENTS / n))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("state", [32, 128])
def test_a_small_loop_body_kernel_runs_on_one_thread(state):
    # 4 x 32 states: every kernel is under the limit (the fused product: 4,096 multiply-adds,
    # which torch's default chunk would fork for on 2 threads) and has no OpenMP region; 4 x 128
    # still fuses its product (65,536 multiply-adds) but forks for it: 65,536 elements
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        W = torch.randn(state, state, generator=g, dtype=torch.float64) / state**0.5
        xs = torch.randn(6, 4, state, generator=g, dtype=torch.float64)

        def f(W, xs):
            return tfun.lax.scan(lambda h, x: (torch.tanh(h @ W + x),) * 2, torch.zeros_like(xs[0]), xs)[1]

        torch._dynamo.reset()
        got, codes = run_and_get_code(tfun.jit(f), W.float(), xs.float())
        torch.testing.assert_close(got.double(), f(W, xs), rtol=1e-4, atol=1e-5)
        kernels = "\n".join(codes)
        kernels = kernels[: kernels.index("def while_loop_body_graph")]
        assert ("#pragma omp parallel" in kernels) == (state == 128)
    finally:
        torch.set_num_threads(threads)
