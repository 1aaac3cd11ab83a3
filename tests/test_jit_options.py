"""tfun._jit_options: the Inductor options tfun.jit adds by default, and when it adds none."""

from __future__ import annotations

import math

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import tfun
from tfun import _compat, _jit_options
from tfun._inductor_pass import PostGradPass
from tfun._scan_in_place import ScanInPlacePass


def test_the_defaults_go_only_to_inductor_in_its_default_mode():
    added = _jit_options.compile_options({})["options"]
    assert isinstance(added["post_grad_custom_pre_pass"], PostGradPass)
    assert isinstance(added["post_grad_custom_post_pass"], ScanInPlacePass)
    assert added["cpp.min_chunk_size"] >= 512
    marks = added["unsafe_marked_cacheable_functions"]
    assert {"torch.ops.higher_order.scan", "torch.ops.higher_order.while_loop", "torch.ops.higher_order.cond"} <= set(marks)
    assert len(set(marks.values())) == 1 and torch.__version__ in next(iter(marks.values()))
    assert _compat.loop_hop_cache_marks("k") == dict.fromkeys(marks, "k")
    kept = _jit_options.compile_options({"options": {"cpp_wrapper": True}, "dynamic": True})
    assert kept["options"]["cpp_wrapper"] is True and kept["dynamic"] is True
    assert isinstance(kept["options"]["post_grad_custom_pre_pass"], PostGradPass)
    assert "cpp.min_chunk_size" in _jit_options.compile_options({"backend": "inductor"})["options"]
    for untouched in (
        {"backend": "aot_eager"},
        {"mode": "max-autotune"},
        {"mode": "default"},  # torch.compile takes mode or options, never both
        # the caller's own
        {"options": {"post_grad_custom_pre_pass": None, "post_grad_custom_post_pass": None, "cpp.min_chunk_size": 512, "unsafe_marked_cacheable_functions": {}}},
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


def _cache_programs():
    lax = tfun.lax

    def scan(W, xs):  # rewritten in place (a while_loop), forward and backward
        return lax.scan(lambda h, x: (torch.tanh(h @ W + x),) * 2, torch.zeros_like(xs[0]), xs)[1]

    def reverse_scan(W, xs):
        return lax.scan(lambda h, x: (torch.sin(h * W[0] + x), h), xs[0], xs, reverse=True)[1]

    def while_loop(W, xs):  # a differentiated while_loop: `while_loop_stack_output`
        return lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, torch.tanh(c[1] @ W)), (torch.tensor(0), xs[0]))[1]

    def cond(W, xs):
        return lax.cond(xs.sum() > 0, lambda a: torch.tanh(a @ W), lambda a: a * 2 - W[0], xs[1])

    def map_(W, xs):
        return lax.map(lambda x: torch.sigmoid(x @ W), xs)

    def scan_in_cond(W, xs):  # a HOP in another's body: its backward's entry rebuilds it
        return lax.cond(W[0, 0] > -5, lambda a: scan(W, a), lambda a: a * 0.5, xs)

    def cond_in_scan(W, xs):
        step = lambda h, x: (lax.cond(x.sum() > 0, lambda h: torch.tanh(h @ W + x), lambda h: h * 0.9 - x, h),) * 2  # noqa: E731
        return lax.scan(step, xs[0], xs)[1]

    return {f.__name__.rstrip("_"): f for f in (scan, reverse_scan, while_loop, cond, map_, scan_in_cond, cond_in_scan)}


_CACHE_PROGRAMS = _cache_programs()


@pytest.mark.parametrize("name", list(_CACHE_PROGRAMS))
def test_loop_graphs_are_taken_from_inductors_caches_with_eagers_values_and_gradients(name, tmp_path, monkeypatch):
    """torch bypasses Inductor's FX graph cache and AOTAutograd's cache for every graph holding
    a control-flow HOP; tfun.jit marks its loops' HOPs cacheable (`unsafe_marked_cacheable_
    functions`, `_compat.loop_hop_cache_marks`), so a second compile of the same program (a new
    process, or after `torch._dynamo.reset()`) takes the compiled forward and backward from the
    caches instead of compiling them again. Both the first and the cached compile give eager
    float64's values and gradients; with the option set to `{}` the caches are bypassed again
    (checked for the first program)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # an empty cache
    f = _CACHE_PROGRAMS[name]
    g = torch.Generator().manual_seed(3)
    W0, xs0 = torch.randn(3, 3, generator=g, dtype=torch.float64) * 0.5, torch.randn(7, 2, 3, generator=g, dtype=torch.float64)
    W64, xs64 = W0.clone().requires_grad_(), xs0.clone().requires_grad_()
    want = f(W64, xs64)
    want.pow(2).sum().backward()

    def run(**jit_kwargs):
        torch._dynamo.reset()
        counters.clear()
        W, xs = W0.float().requires_grad_(), xs0.float().requires_grad_()
        out = tfun.jit(f, **jit_kwargs)(W, xs)
        out.pow(2).sum().backward()
        torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(W.grad.double(), W64.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(xs.grad.double(), xs64.grad, rtol=1e-4, atol=1e-5)
        return dict(counters["inductor"]), dict(counters["aot_autograd"])

    inductor, aot = run()
    assert inductor.get("fxgraph_cache_miss", 0) >= 2 and "fxgraph_cache_bypass" not in inductor, inductor
    assert aot.get("autograd_cache_saved", 0) >= 1 and "autograd_cache_bypass" not in aot, aot
    inductor, aot = run()
    # (an entry that fails to load counts as a miss: `_compat.hop_calls_take_proxies`)
    assert aot.get("autograd_cache_hit", 0) >= 1 and "autograd_cache_miss" not in aot, aot
    assert "fxgraph_cache_miss" not in inductor and "fxgraph_cache_bypass" not in inductor, inductor
    if name == "scan":  # (one program suffices for torch's own choice)
        inductor, aot = run(options={"unsafe_marked_cacheable_functions": {}})
        assert inductor.get("fxgraph_cache_bypass", 0) >= 1 and aot.get("autograd_cache_bypass", 0) >= 1, (inductor, aot)
