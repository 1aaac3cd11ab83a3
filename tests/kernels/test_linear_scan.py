"""The Triton linear_scan kernels, run in Triton's CPU interpreter, or on CUDA with
`TFUN_KERNEL_DEVICE=cuda` (see conftest.py).

Every comparison is against a float64 Python-loop oracle (forward, and the gradient of every
input through the oracle's autograd). Every test checks the launch counter, so a silent fallback
to the torch path cannot pass, and outputs are NaN-filled before the kernels write them.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton.language as tl

import tfun
from tfun.kernels import _linear_scan_triton as K
from tfun.lax._linear_scan import linear_scan

from .conftest import DEVICE, ON_GPU, interpreter_only

TOL = {  # (rtol, atol relative to the largest |expected|)
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 4e-3),
    torch.bfloat16: (5e-2, 2e-2),
}


def oracle(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, axis: int, reverse: bool) -> torch.Tensor:
    """h_t = a_t * h_{t-1} + b_t, one step at a time (a broadcast to b)."""
    a = a.expand(b.shape)
    T = b.shape[axis]
    h = h0
    out = [None] * T
    for t in reversed(range(T)) if reverse else range(T):
        h = a.select(axis, t) * h + b.select(axis, t)
        out[t] = h
    return torch.stack(out, axis) if T else torch.empty_like(b)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    rtol, atol = TOL[dtype]
    assert actual.shape == expected.shape, what
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol * max(scale, 1.0), msg=lambda m: f"{what}: {m}")


def check(
    b_shape: tuple[int, ...],
    axis: int = 0,
    reverse: bool = False,
    dtype: torch.dtype = torch.float32,
    with_init: bool = True,
    a_shape: tuple[int, ...] | None = None,
    seed: int = 0,
    transpose_b: bool = False,
) -> None:
    g = torch.Generator().manual_seed(seed)
    ax = axis % len(b_shape)
    state = b_shape[:ax] + b_shape[ax + 1 :]
    # inputs rounded to `dtype` first, so the oracle sees exactly what the kernel sees
    a = (0.5 + 0.49 * torch.rand(a_shape or b_shape, generator=g, dtype=torch.float64)).to(dtype)
    b = torch.randn(b_shape, generator=g, dtype=torch.float64).to(dtype)
    if transpose_b:  # a non-contiguous b with the same values
        b = b.transpose(0, -1).contiguous().transpose(0, -1)
    h0 = torch.randn(state, generator=g, dtype=torch.float64).to(dtype) if with_init else None
    w = torch.randn(b_shape, generator=g, dtype=torch.float64)
    a, b, h0, w = (None if t is None else t.to(DEVICE) for t in (a, b, h0, w))

    before = K.LAUNCHES.copy()
    xs = [t.detach().clone().requires_grad_() for t in (a, b, h0) if t is not None]
    h = linear_scan(*xs[:2], xs[2] if with_init else None, axis=axis, reverse=reverse, impl="triton")
    assert h.dtype == dtype and h.shape == b.shape
    grads = torch.autograd.grad((h.double() * w).sum(), xs)
    assert K.LAUNCHES["scan_fwd"] == before["scan_fwd"] + 1, "the forward kernel did not launch"
    assert K.LAUNCHES["scan_bwd"] == before["scan_bwd"] + 1, "the backward kernel did not launch"

    ys = [t.detach().double().requires_grad_() for t in (a, b, h0) if t is not None]
    h0_ref = ys[2] if with_init else torch.zeros(state, dtype=torch.float64, device=DEVICE)
    h_ref = oracle(ys[0], ys[1], h0_ref, ax, reverse)
    grads_ref = torch.autograd.grad((h_ref * w).sum(), ys)
    _close(h, h_ref, dtype, "h")
    for name, gk, gr in zip("ab0", grads, grads_ref):
        _close(gk, gr, dtype, f"d{name if name != '0' else 'init'}")


def test_block_size_is_128_for_long_sequences():
    # the T values below straddle this tile size
    assert K.plan(3, 129, torch.device("cpu"))[1] == 128
    assert K.plan(3, 127, torch.device("cpu"))[1] == 128
    assert K.MAX_BLOCK_C == 16  # 20 channels span two channel tiles
    assert K.plan(2, 2100, torch.device("cpu"))[2] == 2100  # one segment unless forced, on the CPU


@pytest.mark.parametrize(
    ("block_c", "block_t", "num_warps", "segment", "dtype"),
    [
        (32, 256, 8, None, torch.float32),
        (32, 256, 8, None, torch.bfloat16),
        (4, 16, 2, None, torch.bfloat16),
        (8, 64, 4, 128, torch.float32),
        (1, 512, 1, None, torch.float32),
    ],
)
def test_tuning_knobs_tiles_and_warps(block_c, block_t, num_warps, segment, dtype, monkeypatch) -> None:
    # the tiles and warps `benchmarks/linear_scan.py --sweep` tries: same outputs and gradients
    # (odd lengths, channels spanning partial tiles, a forced multi-segment plan, both orders)
    for name, value in [("block_c", block_c), ("block_t", block_t), ("num_warps", num_warps), ("force_segment", segment)]:
        monkeypatch.setattr(K.KNOBS, name, value)
    for reverse in (False, True):
        check((37 if not segment else 11, 301 if not segment else 401), 1, reverse, dtype=dtype, seed=block_c + block_t)
    assert K.plan(37, 1000, torch.device("cpu"))[:2] == (block_c, block_t)


def test_tuning_knobs_refuse_what_is_not_a_tile(monkeypatch) -> None:
    monkeypatch.setattr(K.KNOBS, "block_t", 8)
    with pytest.raises(ValueError, match="block_t must be a power of two"):
        K.plan(3, 100, torch.device("cpu"))
    monkeypatch.setattr(K.KNOBS, "block_t", None)
    monkeypatch.setattr(K.KNOBS, "block_c", 12)
    with pytest.raises(ValueError, match="block_c must be a power of two"):
        K.plan(3, 100, torch.device("cpu"))


@pytest.mark.parametrize("T", [1, 7, 127, 128, 129])
@pytest.mark.parametrize("C", [1, 3])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_init", [False, True])
def test_short_and_block_edges(T: int, C: int, reverse: bool, with_init: bool) -> None:
    check((T, C), 0, reverse, with_init=with_init, seed=T * 100 + C)


@pytest.mark.parametrize("T", [7, 129])
@pytest.mark.parametrize("reverse", [False, True])
def test_two_channel_tiles(T: int, reverse: bool) -> None:
    check((T, 20), 0, reverse, seed=T)  # 20 channels: a full and a partial tile of 16


@pytest.mark.parametrize(("T", "C"), [(1000, 2), (5000, 1)])
@pytest.mark.parametrize("reverse", [False, True])
def test_long(T: int, C: int, reverse: bool) -> None:
    check((C, T), 1, reverse, seed=T)


@pytest.mark.parametrize("reverse", [False, True])
def test_long_multi_segment(reverse: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(K.KNOBS, "force_segment", 512)
    before = K.LAUNCHES.copy()
    check((2100, 2), 0, reverse, seed=7)  # 5 segments, the last one 52 long
    # the summary and carry kernels ran for the forward and for the backward
    assert K.LAUNCHES["summary"] == before["summary"] + 2
    assert K.LAUNCHES["scan_carry"] == before["scan_carry"] + 2


def test_multi_segment_uneven_last_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(K.KNOBS, "force_segment", 256)
    before = K.LAUNCHES.copy()
    check((3, 1000), 1, True, dtype=torch.float32, seed=3)  # 4 segments, the last one 232 long
    assert K.LAUNCHES["summary"] == before["summary"] + 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [7, 129, 1000])
@pytest.mark.parametrize("reverse", [False, True])
def test_half_dtypes(dtype: torch.dtype, T: int, reverse: bool) -> None:
    check((T, 3), 0, reverse, dtype=dtype, seed=T)


def test_float64() -> None:
    check((2, 200, 3), 1, False, dtype=torch.float64)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_each_axis(axis: int) -> None:
    check((4, 33, 5), axis, reverse=axis % 2 == 0, seed=axis + 10)


@pytest.mark.parametrize(
    "a_shape", [(1, 33, 1), (33, 1), (1, 1, 5), (4, 33, 1)], ids=["time-only", "right-aligned", "channel", "batch"]
)
def test_broadcast_a_gradient_is_reduced(a_shape: tuple[int, ...]) -> None:
    check((4, 33, 5), 1, False, a_shape=a_shape)


def test_non_contiguous_b() -> None:
    check((9, 6, 4), 1, True, transpose_b=True)


def test_zero_length() -> None:
    a = torch.rand(0, 3, device=DEVICE, requires_grad=True)
    b = torch.randn(0, 3, device=DEVICE, requires_grad=True)
    h = linear_scan(a, b, impl="triton")
    assert h.shape == (0, 3)
    h.sum().backward()
    assert a.grad is not None and a.grad.shape == (0, 3)


def test_nan_fill_catches_a_skipped_store(monkeypatch: pytest.MonkeyPatch) -> None:
    args = (torch.rand(5, 3), torch.randn(5, 3), torch.zeros(3))
    out = K.linear_scan_fwd(*(t.to(DEVICE) for t in args), 0, False)
    assert not out.isnan().any()
    monkeypatch.setattr(K, "_launch", lambda *args, **kw: None)  # a "kernel" that writes nothing
    out = K.linear_scan_fwd(*(t.to(DEVICE) for t in args), 0, False)
    assert out.isnan().all()


@interpreter_only
def test_interpreter_is_chosen_at_launch_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    assert isinstance(K._kernel("scan"), InterpretedFunction)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert isinstance(K._kernel("scan"), JITFunction)
    assert K.triton_unavailable_reason(torch.device("cpu")) is not None


def test_inductors_copy_of_each_kernel_binds_every_helper_it_names() -> None:
    """Inductor, compiling a graph that launches the kernels (on CUDA; on the CPU the op stays
    opaque), writes each kernel into a module of its own with every `JITFunction` the kernel
    names, each as its source (`user_defined_triton_kernel_transitive_closure_source_code`), so
    each helper is bound there under its `def` name. The kernels must name them by that name:
    `_combine_jit = JITFunction(_combine)` was written as `def _combine`, and every MinGRU and
    Mamba compiled by Inductor on CUDA was a NameError ('_combine_jit'; H200, session 34)."""
    import ast

    from triton.runtime.jit import JITFunction

    wrapper = pytest.importorskip("torch._inductor.codegen.wrapper")
    closure = getattr(wrapper, "user_defined_triton_kernel_transitive_closure_source_code", None)
    if closure is None:  # pragma: no cover - a torch that writes kernels another way
        pytest.skip("this torch's Inductor has no user_defined_triton_kernel_transitive_closure_source_code")
    for name in ("scan", "summary"):
        kernel = K._KERNELS[name][False]
        tree = ast.parse(closure(kernel))
        bound = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        bound |= {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
        helpers = {n for n in kernel.fn.__code__.co_names if isinstance(kernel.fn.__globals__.get(n), JITFunction)}
        assert helpers, f"the {name} kernel names no JITFunction: this test checks nothing"
        assert helpers <= bound, f"Inductor's copy of the {name} kernel leaves {sorted(helpers - bound)} unbound"


# ----------------------------------------------------------------------------------------------
# composition: torch.func, torch.compile, torch.export, opcheck


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(t.to(DEVICE) for t in (torch.rand(6, 3, generator=g), torch.randn(6, 3, generator=g), torch.randn(3, generator=g)))  # type: ignore[return-value]


def _loss(impl: str):
    return lambda a, b, h0: (linear_scan(a, b, h0, impl=impl, reverse=True) ** 2).sum()


def _quiet_jvp_decompositions() -> None:
    # torch loads its forward-AD decompositions with torch.jit.script on the first jvp, which
    # warns (DeprecationWarning, torch's own); load them once without the warning
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=DeprecationWarning)
        import torch._decomp.decompositions_for_jvp  # noqa: F401


def test_func_grad_vmap_jvp_match_torch_path() -> None:
    _quiet_jvp_decompositions()
    a, b, h0 = _inputs()
    before = K.LAUNCHES.copy()
    for fn in (
        lambda impl: torch.func.grad(_loss(impl), argnums=(0, 1, 2))(a, b, h0),
        lambda impl: torch.func.vmap(lambda a, b, h: linear_scan(a, b, h, impl=impl))(a.T, b.T, h0),
        lambda impl: torch.func.jvp(
            lambda a, b, h: linear_scan(a, b, h, impl=impl), (a, b, h0), (b.cos(), a.sin(), h0.exp())
        ),
        lambda impl: torch.func.vmap(torch.func.grad(lambda a, b: linear_scan(a, b, impl=impl).sum()))(a.T, b.T),
        lambda impl: torch.func.hessian(lambda a: _loss(impl)(a, b, h0))(a),
    ):
        got, want = fn("triton"), fn("torch")
        for x, y in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    assert K.LAUNCHES["scan_fwd"] > before["scan_fwd"]


def test_forward_over_forward_matches_torch_path() -> None:
    """`jvp` of `jvp` (and `jacfwd` of `jacfwd`): torch runs an autograd.Function's `jvp`
    outside the outer transform, which gave a zero second-order tangent on the Triton path
    without an error; it runs the pure-torch reference there. Mixed orders keep the kernels."""
    _quiet_jvp_decompositions()
    a, b, h0 = _inputs()
    a = a.sigmoid()  # a nonlinear use of the tangent direction below, so the second order is not zero

    def second(impl):
        f = lambda a: linear_scan(a * a, b, h0, impl=impl)
        inner = lambda a: torch.func.jvp(f, (a,), (b.cos(),))[1]
        return torch.func.jvp(inner, (a,), (b.sin(),))[1]

    want = second("torch")
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(second("triton"), want, rtol=1e-4, atol=1e-5)
    jac2 = lambda impl: torch.func.jacfwd(torch.func.jacfwd(lambda a: linear_scan(a * a, b, h0, impl=impl)))(a)
    torch.testing.assert_close(jac2("triton"), jac2("torch"), rtol=1e-4, atol=1e-5)


def test_compile_keeps_one_op_and_runs_the_kernels() -> None:
    a, b, h0 = _inputs(1)
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    f = torch.compile(lambda a, b, h0: linear_scan(a, b, h0, impl="triton"), backend=backend, fullgraph=True)
    f(a, b, h0)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.tfun.linear_scan.default) + targets.count(torch.ops.tfun.linear_scan) == 1

    torch._dynamo.reset()
    xs = [t.clone().requires_grad_() for t in (a, b, h0)]
    ys = [t.clone().requires_grad_() for t in (a, b, h0)]
    f = torch.compile(lambda a, b, h0: linear_scan(a, b, h0, impl="triton", reverse=True), backend="aot_eager", fullgraph=True)
    before = K.LAUNCHES.copy()
    out = f(*xs)
    (out * out).sum().backward()
    if ON_GPU:
        # compiled for CUDA, AOTAutograd traces the launchers into the graph (triton_op), twice
        # (a metadata pass, then the graph); the counter counts those traces, not the launches
        assert K.LAUNCHES["scan_fwd"] > before["scan_fwd"] and K.LAUNCHES["scan_bwd"] > before["scan_bwd"]
    else:
        assert K.LAUNCHES["scan_fwd"] == before["scan_fwd"] + 1
        assert K.LAUNCHES["scan_bwd"] == before["scan_bwd"] + 1
    ref = linear_scan(*ys, impl="torch", reverse=True)
    (ref * ref).sum().backward()
    torch.testing.assert_close(out, ref)
    for x, y in zip(xs, ys):
        torch.testing.assert_close(x.grad, y.grad)


def test_second_order_under_jit_goes_through_the_one_backward() -> None:
    """A gradient penalty through the kernel: eagerly the op's backward (registered autograd,
    the one `_backward`) must itself be differentiable when the graph is kept; under tfun.jit
    a traced derivative that is differentiated again runs the pure-torch reference (see
    `test_hessian_vector_product_under_jit`)."""
    a, b, h0 = (t.double() for t in _inputs(4))

    def penalty(a):
        g = tfun.grad(lambda a: _loss("triton")(a, b, h0))(a)
        return (g**2).sum()

    def penalty_ref(a):
        g = tfun.grad(lambda a: _loss("torch")(a, b, h0))(a)
        return (g**2).sum()

    want = tfun.grad(penalty_ref)(a)
    torch.testing.assert_close(tfun.grad(penalty)(a), want)  # eager: _LinearScanFunction
    torch.testing.assert_close(tfun.jit(tfun.grad(penalty), backend="aot_eager")(a), want)  # the reference


def test_first_order_backward_is_the_fused_kernel() -> None:
    a, b, h0 = (t.clone().requires_grad_() for t in _inputs(5))
    before = K.LAUNCHES.copy()
    linear_scan(a, b, h0, impl="triton").sum().backward()
    assert K.LAUNCHES["scan_bwd"] == before["scan_bwd"] + 1
    # with create_graph the backward is the differentiable reference: forward scans only
    a2 = a.detach().requires_grad_()
    before = K.LAUNCHES.copy()
    (g,) = torch.autograd.grad(linear_scan(a2, b.detach(), h0.detach(), impl="triton").sum(), a2, create_graph=True)
    assert K.LAUNCHES["scan_bwd"] == before["scan_bwd"] and K.LAUNCHES["scan_fwd"] == before["scan_fwd"] + 2
    torch.testing.assert_close(g, a.grad)


def test_export_shows_the_op() -> None:
    class M(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
            return tfun.lax.linear_scan(a, b, h0, axis=1, impl="triton") if hasattr(tfun.lax, "linear_scan") else linear_scan(a, b, h0, axis=1, impl="triton")

    a, b, h0 = _inputs(2)
    ep = torch.export.export(M(), (a.T.contiguous(), b.T.contiguous(), h0))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.tfun.linear_scan.default in targets
    torch.testing.assert_close(ep.module()(a.T, b.T, h0), linear_scan(a.T, b.T, h0, axis=1, impl="torch"))


# torch 2.14's opcheck reads `.grad` of a non-leaf tensor of its own making inside
# test_aot_dispatch_dynamic (our inputs are leaves), which warns; the warning is about torch's test
# utility, not the op.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_opcheck() -> None:
    a, b, h0 = _inputs(3)
    for reverse in (False, True):
        torch.library.opcheck(
            torch.ops.tfun.linear_scan.default,
            (a.requires_grad_(), b.requires_grad_(), h0.requires_grad_(), 0, reverse),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
        )


@interpreter_only
def test_default_impl_on_cpu_is_torch_even_when_interpreting() -> None:
    before = K.LAUNCHES.copy()
    linear_scan(*_inputs())
    assert K.LAUNCHES == before


@pytest.mark.skipif(not ON_GPU, reason="the default impl is the kernel only on a GPU")
def test_default_impl_on_cuda_is_the_kernel() -> None:
    before = K.LAUNCHES.copy()
    h = linear_scan(*_inputs())
    assert K.LAUNCHES["scan_fwd"] == before["scan_fwd"] + 1
    torch.testing.assert_close(h, linear_scan(*_inputs(), impl="torch"))


# ----------------------------------------------------------------------------------------------
# What a GPU runs: its segmented plans, and tl.reduce's freedom to commute (see conftest.py)


def _combine_first_kernel(X, Y, OUT, N: tl.constexpr):
    cols = tl.arange(0, N)
    x = tl.load(X + cols)[None, :]
    y = tl.load(Y + cols)[None, :]
    ra, rb = tl.reduce((x, y), 1, K._combine_jit)
    tl.store(OUT + tl.arange(0, 1), ra)
    tl.store(OUT + 1 + tl.arange(0, 1), rb)


@interpreter_only
def test_reduce_order_emulation_catches_a_non_commutative_reduce() -> None:
    """The autouse reversed-order reduce really changes a non-commutative tl.reduce (the bug
    that made the segmented plan wrong on CUDA), so the tests below would have caught it."""
    from triton.runtime.interpreter import InterpretedFunction

    kern = InterpretedFunction(_combine_first_kernel)
    a = torch.tensor([0.5, 0.9, 0.7, 0.6])
    b = torch.tensor([1.0, -2.0, 3.0, 0.5])
    out = torch.zeros(2)
    kern[(1,)](a, b, out, N=4)
    h = torch.zeros(())
    for a_t, b_t in zip(a, b):  # the in-order fold: h from a zero state, and prod(a)
        h = a_t * h + b_t
    assert out[0].item() == pytest.approx(a.prod().item())  # the product commutes
    assert abs(out[1].item() - h.item()) > 0.1, "the interpreter folded in order: emulation inactive"


_GPU_PLAN_SHAPES = [
    ((1024, 4), 0),  # shapes of the CUDA bug report (2026-11-23), where the H100 split time
    ((2048, 4), 0),
    ((8192, 1), 0),
    ((2, 3, 1537), -1),
    ((1031, 17), 0),  # two channel tiles, an odd length
]


@pytest.mark.parametrize(
    ("shape", "axis", "reverse"),
    [
        # CI's second torch phase runs every shape but the last forward and the first reversed (`heavy`)
        pytest.param(s, a, r, id=f"{r}-shape{i}-{a}", marks=[pytest.mark.heavy] if (i == 4 or (r and i > 0)) else [])
        for r in [False, True]
        for i, (s, a) in enumerate(_GPU_PLAN_SHAPES)
    ],
)
def test_gpu_plans_run_in_the_interpreter(shape: tuple[int, ...], axis: int, reverse: bool, gpu_plans: int) -> None:
    T = shape[axis]
    C = math.prod(shape) // T
    block_c, block_t, seg = K.plan(C, T, DEVICE)
    assert seg < T, f"an H100 plan for {shape} should split time; got one segment of {seg}"
    before = K.LAUNCHES.copy()
    check(shape, axis, reverse, seed=T + C)
    assert K.LAUNCHES["summary"] == before["summary"] + 2  # segmented forward and backward ran


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_gpu_plans_other_dtypes(dtype: torch.dtype, gpu_plans: int) -> None:
    check((1100, 3), 0, True, dtype=dtype, seed=11)


@pytest.mark.parametrize("T", [1, 63, 1000, 5000])
@pytest.mark.parametrize("seg", [128, 256])
def test_every_forced_segment_length(T: int, seg: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """fla-style odd lengths under forced small segments: every segment boundary case."""
    monkeypatch.setattr(K.KNOBS, "force_segment", seg)
    check((T, 2), 0, T % 2 == 1, seed=T + seg)


# ----------------------------------------------------------------------------------------------
# The two tile layouts of reverse order (`Knobs.reverse_tiles`): the forward of a reverse scan,
# the backward of an ordinary one, and the summary kernel of the segmented plans. The tests above
# run the default (or what TFUN_LINEAR_SCAN_REVERSE_TILES says); these run both, whatever it says.

REVERSE_TILES = ["falling", "rising"]


@pytest.fixture
def launch_meta(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool, bool]]:
    """(kernel name, REVERSE, RISING) of every launch from here on, as the launcher passed them
    to the kernel (compiled or interpreted) as constexprs."""
    launches: list[tuple[str, bool, bool]] = []
    original = K._launch

    def recording(name: str, grid: tuple[int, int], *args, **meta) -> None:  # type: ignore[no-untyped-def]
        launches.append((name, meta["REVERSE"], meta["RISING"]))
        original(name, grid, *args, **meta)

    monkeypatch.setattr(K, "_launch", recording)
    return launches


def _assert_variant(launches: list[tuple[str, bool, bool]], rising: bool) -> None:
    assert any(reverse for _, reverse, _ in launches), "no launch processed time in reverse order"
    for name, reverse, got in launches:
        assert got == (rising and reverse), f"{name} (REVERSE={reverse}) ran with RISING={got}"


# (id, b shape, axis, reverse, dtype, force_segment, with_init); CI's second phase keeps one
# case (`thinned_cell`, tests/conftest.py)
_REVERSE_TILE_CASES = [
    ("T1", (1, 3), 0, True, torch.float32, None, True),
    ("T63-bf16", (63, 3), 0, False, torch.bfloat16, None, True),
    ("T63-f64", (2, 63, 2), 1, True, torch.float64, None, False),
    ("T200-20ch", (20, 200), 1, False, torch.float32, None, True),  # two channel tiles
    # segmented: 4 segments of 256 (the last 232 long, its last tile partial), both directions
    ("T1000-seg256", (1000, 2), 0, True, torch.float32, 256, True),
    ("T1000-seg256-bf16", (2, 1000), 1, False, torch.bfloat16, 256, False),
    ("T600-seg512-f64", (600, 3), 0, True, torch.float64, 512, True),  # one segment and 88 steps
]


@pytest.mark.parametrize(
    ("variant", "shape", "axis", "reverse", "dtype", "seg", "with_init"),
    [pytest.param(v, *case[1:], id=f"{v}-{case[0]}") for v in REVERSE_TILES for case in _REVERSE_TILE_CASES],
)
def test_reverse_tiles_both_variants(
    variant: str, shape: tuple[int, ...], axis: int, reverse: bool, dtype: torch.dtype, seg: int | None,
    with_init: bool, launch_meta: list, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(K.KNOBS, "reverse_tiles", variant)
    monkeypatch.setattr(K.KNOBS, "force_segment", seg)
    check(shape, axis, reverse, dtype=dtype, with_init=with_init, seed=sum(shape) + axis)
    _assert_variant(launch_meta, variant == "rising")
    if seg is not None:
        assert [n for n, *_ in launch_meta].count("summary") == 2  # the forward's and the backward's


@pytest.mark.parametrize("variant", REVERSE_TILES)
def test_reverse_tiles_gpu_plan(variant: str, gpu_plans: int, launch_meta: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """The segments an H100 picks (not forced), forward and reverse, in both variants."""
    monkeypatch.setattr(K.KNOBS, "reverse_tiles", variant)
    assert K.plan(3, 1100, DEVICE)[2] < 1100
    for reverse in (False, True):
        check((1100, 3), 0, reverse, seed=12 + reverse)
    _assert_variant(launch_meta, variant == "rising")
    assert [n for n, *_ in launch_meta].count("summary") == 4


def test_reverse_tiles_knob_and_environment(launch_meta: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """The knob, else TFUN_LINEAR_SCAN_REVERSE_TILES, else "rising", reaches every launch as the
    constexpr RISING (reverse-order launches only); anything else raises at launch."""
    args = tuple(t.to(DEVICE) for t in (torch.rand(9, 2), torch.randn(9, 2), torch.zeros(2)))

    def rising_of_a_reverse_launch() -> bool:
        launch_meta.clear()
        K.linear_scan_fwd(*args, 0, True)
        ((name, reverse, rising),) = launch_meta
        assert name == "scan_fwd" and reverse
        return rising

    monkeypatch.setattr(K.KNOBS, "reverse_tiles", None)
    monkeypatch.delenv(K.REVERSE_TILES_ENV, raising=False)
    assert rising_of_a_reverse_launch() is True  # the default
    monkeypatch.setenv(K.REVERSE_TILES_ENV, "falling")
    assert rising_of_a_reverse_launch() is False
    monkeypatch.setenv(K.REVERSE_TILES_ENV, "rising")
    assert rising_of_a_reverse_launch() is True
    launch_meta.clear()
    K.linear_scan_fwd(*args, 0, False)  # time order: the one variant, whatever the knob
    assert launch_meta == [("scan_fwd", False, False)]
    monkeypatch.setenv(K.REVERSE_TILES_ENV, "falling")
    assert rising_of_a_reverse_launch() is False
    monkeypatch.setattr(K.KNOBS, "reverse_tiles", "rising")  # the knob wins over the environment
    assert rising_of_a_reverse_launch() is True
    monkeypatch.setattr(K.KNOBS, "reverse_tiles", None)
    monkeypatch.setenv(K.REVERSE_TILES_ENV, "upward")
    with pytest.raises(ValueError, match="TFUN_LINEAR_SCAN_REVERSE_TILES must be one of .*'upward'"):
        K.linear_scan_fwd(*args, 0, True)
    monkeypatch.setattr(K.KNOBS, "reverse_tiles", "Rising")
    with pytest.raises(ValueError, match=r"Knobs.reverse_tiles must be one of .*'Rising'"):
        K.linear_scan_fwd(*args, 0, True)


@interpreter_only
@pytest.mark.parametrize("variant", REVERSE_TILES)
def test_rising_tiles_run_a_reverse_scan_in_the_kernel(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The RISING constexpr changes the code the kernel runs: with "rising", the reverse-order
    kernels (here the backward of an ordinary scan, and its summary kernel) call Triton's
    reverse scan; with "falling", and in time order, no kernel does."""
    from triton.runtime import interpreter

    scans: list[bool] = []
    original = interpreter.ScanOps.__init__

    def recording(self, axis, combine_fn, reverse):  # type: ignore[no-untyped-def]
        scans.append(bool(reverse))
        original(self, axis, combine_fn, reverse)

    monkeypatch.setattr(interpreter.ScanOps, "__init__", recording)
    monkeypatch.setattr(K.KNOBS, "reverse_tiles", variant)
    monkeypatch.setattr(K.KNOBS, "force_segment", 128)
    a, b, h0 = torch.rand(300, 2), torch.randn(300, 2), torch.zeros(2)
    h = K.linear_scan_fwd(a, b, h0, 0, False)
    assert scans and not any(scans), "a time-order kernel ran a reverse scan"
    scans.clear()
    K.linear_scan_bwd(a, h0, h, torch.randn(300, 2), 0, False)
    # per tile: the summary kernel's scans (2 segments x 1 tile), the carry scan (time order),
    # the main kernel's (3 segments x 1 tile)
    assert scans == [variant == "rising"] * 2 + [False] + [variant == "rising"] * 3


def test_hessian_vector_product_under_jit() -> None:
    """Hunt 25 (F9): a jitted Hessian-vector product through the kernel (the gradient with
    respect to `b` of a gradient with respect to `a`) failed with Dynamo's "failed to run FX
    node with fake tensors" on torch.func's grad-tracking tensors, wrapped in generic advice.
    There the traced derivative is differentiated again and the pure-torch reference runs, as
    tfun's loops unroll; the result equals the reference's own."""
    a, b, h0 = (t.double() for t in _inputs(6))
    w = torch.cos(torch.arange(b.numel(), dtype=torch.float64, device=b.device)).reshape(b.shape)

    def hvp(impl):
        f = lambda a, b: (linear_scan(a, b, h0, impl=impl) * w).sum()
        return lambda a, b: tfun.grad(lambda b: (tfun.grad(f)(a, b) * w).sum())(b)

    want = hvp("torch")(a, b)
    torch.testing.assert_close(hvp("triton")(a, b), want)
    torch._dynamo.reset()
    torch.testing.assert_close(tfun.jit(hvp("triton"), backend="aot_eager")(a, b), want)


@pytest.mark.parametrize("transform", ["tfun.jvp", "jacfwd", "jacrev", "hessian", "vmap(grad)"])
def test_torch_func_derivatives_under_jit(transform: str) -> None:
    """Hunt 27: under `tfun.jit`, forward mode through the kernel (`tfun.jvp`, `jacfwd`) gave
    zero tangents without an error (the op has no forward-mode rule; the eager Function's `jvp`
    is not traced), and reverse mode (`jacrev`, `hessian`, per-example gradients) failed on
    torch.func's grad-tracking tensors. Traced under such a transform the pure-torch reference
    runs; each result equals the eager float64 reference's own."""
    _quiet_jvp_decompositions()
    a, b, h0 = (t.double() for t in _inputs(7))
    w = torch.cos(torch.arange(b.numel(), dtype=torch.float64, device=b.device)).reshape(b.shape)

    def program(impl: str):
        f = lambda b: linear_scan(torch.sigmoid(b), torch.cos(b) * w, h0, impl=impl)
        loss = lambda b: (f(b) ** 2 * w).sum()
        if transform == "tfun.jvp":
            return lambda b: tfun.jvp(f, (b,), (w,))
        if transform == "jacfwd":
            return torch.func.jacfwd(f)
        if transform == "jacrev":
            return torch.func.jacrev(f)
        if transform == "hessian":
            return torch.func.hessian(loss)
        return torch.func.vmap(torch.func.grad(lambda r: (linear_scan(torch.sigmoid(r), torch.cos(r), h0[0], impl=impl) ** 2).sum()))

    want = program("torch")(b)
    torch._dynamo.reset()
    got = tfun.jit(program("triton"), backend="aot_eager")(b)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("transform", ["jacrev(jacfwd)", "grad(jvp)"])
def test_reverse_over_forward_mode(transform: str) -> None:
    """Hunt 27: eagerly, a reverse mode differentiating the kernel's forward-mode tangent
    (`jacrev(jacfwd(f))`, `grad` of a `jvp`) raised torch.func's "must override the
    setup_context staticmethod" (the Function's `jvp` called the op, whose own autograd
    torch.func refuses). Against the pure-torch algorithm in float64."""
    _quiet_jvp_decompositions()
    a, b, h0 = (t.double() for t in _inputs(8))
    v = torch.cos(torch.arange(b.numel(), dtype=torch.float64, device=b.device)).reshape(b.shape)

    def run(impl: str):
        f = lambda y: (linear_scan(torch.sigmoid(y), torch.cos(y), y[0] * 0.5, impl=impl) ** 2).sum()
        if transform == "jacrev(jacfwd)":
            return torch.func.jacrev(torch.func.jacfwd(f))(b)
        return torch.func.grad(lambda y: torch.func.jvp(f, (y,), (v,))[1])(b)

    torch.testing.assert_close(run("triton"), run("torch"))
