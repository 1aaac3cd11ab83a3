"""tfun._small_matmul: small CPU matrix products under tfun.jit (Inductor) become fused loops.

Every compiled value and gradient is compared with the float64 eager result, and the code
Inductor generates is read to check which products were rewritten (and which were not).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._inductor.utils import run_and_get_code

import tfun
from tfun import _compat, _small_matmul

pytestmark = pytest.mark.skipif(_compat.CustomGraphPass is object, reason="no custom graph passes")

TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _close(got, want, dtype):
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=TOL[dtype], atol=TOL[dtype] * max(1.0, want.abs().max().item()))


def _extern_products(code: str) -> int:
    """How many extern GEMM calls the generated code makes (`extern_kernels.mm(...)` and the like)."""
    return sum(code.count(f"extern_kernels.{name}(") for name in ("mm", "addmm", "bmm", "baddbmm"))


# --- which products are rewritten ------------------------------------------------------------


def _rnn(W, xs, h0):
    return tfun.lax.scan(lambda h, x: (torch.tanh(h @ W + x),) * 2, h0, xs)[1]


def _rnn_args(B, H, T=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(B * 1000 + H)
    W = torch.randn(H, H, generator=g, dtype=torch.float64) / math.sqrt(H)
    xs = torch.randn(T, B, H, generator=g, dtype=torch.float64)
    return W, xs, torch.zeros(B, H, dtype=torch.float64)


def test_a_small_loop_body_product_is_fused_forward_and_backward():
    W, xs, h0 = _rnn_args(4, 16)
    loss = lambda W, xs, h0: (_rnn(W, xs, h0) ** 2).sum()  # noqa: E731
    want = tfun.grad(loss, argnums=(0, 1, 2))(W, xs, h0)
    args = [t.float() for t in (W, xs, h0)]
    got, codes = run_and_get_code(tfun.jit(tfun.grad(loss, argnums=(0, 1, 2))), *args)
    for g, w in zip(got, want):
        _close(g, w, torch.float32)
    code = "\n".join(codes)
    assert "while_loop_body_graph" in code  # the loop was compiled as a loop
    assert _extern_products(code) == 0


def test_a_product_over_the_limit_stays_an_extern_gemm():
    # 64 x 128 x 128 multiply-adds = 2^20 > MAX_MULTIPLY_ADDS
    W, xs, h0 = _rnn_args(64, 128, T=3)
    args = [t.float() for t in (W, xs, h0)]
    got, codes = run_and_get_code(tfun.jit(_rnn), *args)
    _close(got, _rnn(W, xs, h0), torch.float32)
    assert _extern_products("\n".join(codes)) >= 1


def test_symbolic_sizes_stay_an_extern_gemm():
    W, xs, h0 = _rnn_args(4, 16)
    args = [t.float() for t in (W, xs, h0)]
    got, codes = run_and_get_code(tfun.jit(_rnn, dynamic=True), *args)
    _close(got, _rnn(W, xs, h0), torch.float32)
    assert _extern_products("\n".join(codes)) >= 1


def test_the_callers_own_pass_slot_turns_it_off():
    W, xs, h0 = _rnn_args(4, 16)
    args = [t.float() for t in (W, xs, h0)]
    got, codes = run_and_get_code(tfun.jit(_rnn, options={"post_grad_custom_pre_pass": None}), *args)
    _close(got, _rnn(W, xs, h0), torch.float32)
    assert _extern_products("\n".join(codes)) >= 1


def test_other_devices_and_integer_products_are_not_rewritten():
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    out = graph.call_function(torch.ops.aten.mm.default, (a, b))
    graph.output(out)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        for device, dtype in (("meta", torch.float32), ("cpu", torch.int64), ("cpu", torch.complex64)):
            a.meta["val"] = torch.empty(4, 16, device=device, dtype=dtype)
            b.meta["val"] = torch.empty(16, 4, device=device, dtype=dtype)
            assert _small_matmul.rewrite(graph) == 0, (device, dtype)
        a.meta["val"] = torch.empty(4, 16)
        b.meta["val"] = torch.empty(16, 4)
    del mode
    assert _small_matmul.rewrite(graph) == 1
    assert [n.target for n in graph.nodes if n.op == "call_function"][-1] == torch.ops.aten.sum.dim_IntList


# --- values: every op, dtype and shape against float64 -------------------------------------------


def _addmm_cases():
    # (beta, alpha): beta == 0 ignores the input, nan included (ATen's rule)
    return [(1, 1), (0.5, 2.0), (0, 1), (0, -1.5)]


@pytest.mark.parametrize(
    ("beta", "alpha", "dtype"),
    [
        # CI's second torch phase runs every (beta, alpha) in float32 and two in the other dtypes
        pytest.param(b, a, d, id=f"{str(d).removeprefix('torch.')}-{b}-{a}", marks=[pytest.mark.heavy] if (d != torch.float32 and (b, a) in ((0.5, 2.0), (0, -1.5))) else [])
        for d in [torch.float32, torch.bfloat16, torch.float64]
        for b, a in _addmm_cases()
    ],
)
def test_addmm_values_and_gradients(beta, alpha, dtype):
    g = torch.Generator().manual_seed(7)
    bias, a, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((5,), (3, 12), (12, 5)))
    if beta == 0:
        bias = torch.full_like(bias, float("nan"))

    def f(bias, a, b):
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha)

    want = f(bias, a, b)
    loss = lambda *t: (f(*t) * torch.arange(15.0, dtype=t[1].dtype).reshape(3, 5)).sum()  # noqa: E731
    want_g = tfun.grad(loss, argnums=(1, 2))(bias, a, b)
    args = [t.to(dtype) for t in (bias, a, b)]
    # the value and the gradients from one compiled program: no product in it (forward or
    # backward) is left to an extern GEMM
    (got, got_g), codes = run_and_get_code(tfun.jit(lambda *t: (f(*t), tfun.grad(loss, argnums=(1, 2))(*t))), *args)
    _close(got, want, dtype)
    assert _extern_products("\n".join(codes)) == 0
    for gg, wg in zip(got_g, want_g):
        _close(gg, wg, dtype)


@pytest.mark.heavy
@settings(max_examples=8, deadline=None)
@given(
    m=st.integers(1, 7),
    k=st.integers(9, 12),  # <= 8 is left to ATen (see the module)
    n=st.integers(1, 7),
    batch=st.sampled_from([None, 1, 3]),
    transpose=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_matmul_shapes_against_float64(m, k, n, batch, transpose, dtype):
    # mm and bmm (batch), operands contiguous or transposed views, outputs and both gradients
    g = torch.Generator().manual_seed(m * 100 + k * 10 + n)
    lead = () if batch is None else (batch,)
    a = torch.randn(*lead, m, k, generator=g, dtype=torch.float64)
    b = torch.randn(*lead, n, k, generator=g, dtype=torch.float64) if transpose else torch.randn(*lead, k, n, generator=g, dtype=torch.float64)

    def f(a, b):
        return torch.sin(a @ (b.transpose(-1, -2) if transpose else b))

    def loss(a, b):
        return (f(a, b) * torch.cos(f(a, b))).sum()

    # the oracle: float64 on the operands as the compiled run gets them (rounded to `dtype`),
    # so the tolerance measures the computation's rounding, not the inputs' (bfloat16 inputs
    # rounded once already differ by up to ~0.07 after `sin(a @ b)` with k = 11)
    a, b = a.to(dtype).double(), b.to(dtype).double()
    torch._dynamo.reset()
    # the output and both gradients from one compiled program
    got, got_g = tfun.jit(lambda a, b: (f(a, b), tfun.grad(loss, argnums=(0, 1))(a, b)))(a.to(dtype), b.to(dtype))
    _close(got, f(a, b), dtype)
    for gg, wg in zip(got_g, tfun.grad(loss, argnums=(0, 1))(a, b)):
        _close(gg, wg, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nn_linear_in_a_fori_loop_body(dtype):
    # nn.Linear lowers to addmm with a broadcast bias; the weight's and bias's gradients
    torch.manual_seed(0)
    lin = torch.nn.Linear(12, 12).double()
    x0 = torch.randn(3, 12, dtype=torch.float64)

    def loss(params, x0):
        def body(i, x):
            return torch.tanh(torch.func.functional_call(lin, params, (x,)))

        return tfun.lax.fori_loop(0, 4, body, x0).pow(2).sum()

    params = dict(lin.named_parameters())
    want_v, want_g = tfun.value_and_grad(loss)({k: v.detach() for k, v in params.items()}, x0)
    p = {k: v.detach().to(dtype) for k, v in params.items()}
    (got_v, got_g), codes = run_and_get_code(tfun.jit(tfun.value_and_grad(loss)), p, x0.to(dtype))
    _close(got_v, want_v, dtype)
    for k in want_g:
        _close(got_g[k], want_g[k], dtype)
    assert _extern_products("\n".join(codes)) == 0


# --- regression: products of few terms through flipped, strided views ---------------------------


def _flipped_products(x):
    y = x.flip(0)
    p = y[1::2] @ y[0:4:2]
    return p[1] @ p[0]


def _reversed_matrix_scan(x):
    return tfun.lax.associative_scan(lambda l, r: r @ l, x, reverse=True, axis=0)


@pytest.mark.parametrize("k", [2, 9])
@pytest.mark.parametrize("fun", [_flipped_products, _reversed_matrix_scan], ids=["flipped", "assoc_scan"])
def test_products_read_through_flipped_strided_views_have_eagers_gradients(fun, k, monkeypatch):
    """Found by a correctness hunt (session 19): 2x2 products rewritten were inlined by Inductor
    into a flipped, strided scatter whose index arithmetic torch 2.11-2.13 printed with C's `%`,
    and the backward read garbage (relative error 1 to 1e250, NaN). A product of k <= 8 terms
    stays ATen's; k = 9 is rewritten and right. The FX graph cache is off: a cached graph from
    another test would hide what this pass does."""
    n = 5 if fun is _flipped_products else 7
    g = torch.Generator().manual_seed(k)
    x = torch.eye(k, dtype=torch.float64) + 0.3 / k * torch.rand(n, 3, k, k, dtype=torch.float64, generator=g)
    w = torch.randn(fun(x).shape, dtype=torch.float64, generator=g)
    loss = lambda x: (fun(x) * w).sum()  # noqa: E731
    want = tfun.grad(loss)(x)
    torch._dynamo.reset()
    rewritten = []
    real = _small_matmul.rewrite
    monkeypatch.setattr(_small_matmul, "rewrite", lambda graph: rewritten.append(real(graph)) or rewritten[-1])
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch.testing.assert_close(tfun.jit(tfun.grad(loss))(x), want, rtol=1e-10, atol=1e-10)
    assert (sum(rewritten) > 0) == (k > 8)


@pytest.mark.parametrize("k", [8, 9])
@pytest.mark.parametrize("user", ["tanh", "t", "flip", "view", "output"])
def test_a_product_of_few_terms_is_rewritten_only_with_pointwise_users_up_to_the_output(k, user):
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    out = graph.call_function(torch.ops.aten.mm.default, (a, b))
    if user != "output":
        op, args = {"tanh": (torch.ops.aten.tanh.default, ()), "flip": (torch.ops.aten.flip.default, ([0],)),
                    "view": (torch.ops.aten.view.default, ([16],)), "t": (torch.ops.aten.t.default, ())}[user]
        out = graph.call_function(op, (out, *args))
    graph.output(out)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        a.meta["val"], b.meta["val"] = torch.empty(4, k), torch.empty(k, 4)
        for node in graph.nodes:
            if node.op == "call_function":
                node.meta["val"] = node.target(*[x.meta["val"] if isinstance(x, torch.fx.Node) else x for x in node.args])
    assert _small_matmul.rewrite(graph) == (1 if k > 8 or user in ("tanh", "t", "output") else 0)
