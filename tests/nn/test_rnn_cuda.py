"""tfun.nn's RNN layers on CUDA: eagerly they call torch's fused functions (cuDNN, as
`torch.nn.LSTM` does); traced with a gradient, cuDNN's kernels through the `tfun::rnn_cudnn`
op and its backward op (`tfun.nn._rnn_fused`). Each path against the float64 eager scan on the
CPU, outputs and every input's gradient. Skipped without CUDA (run on the device machine:
`benchmarks/gpu_session.sh`)."""

from __future__ import annotations

import pytest
import torch

import tfun
from tfun.nn import _rnn_fused

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DT = torch.float64
IN, HID, B = 3, 8, 2
LAYERS = {"LSTM": tfun.nn.LSTM, "GRU": tfun.nn.GRU, "RNN_TANH": tfun.nn.RNN}


@pytest.fixture(autouse=True)
def _no_tf32():
    # cuDNN runs float32 RNNs in TF32 on Ampere and later unless this is off (torch's default
    # for cuDNN, for torch.nn.LSTM alike); off, float32 is compared at float32's tolerance
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        yield


def _layers(mode, dtype=torch.float32, **kw):
    """(the layer under test on CUDA, a float64 scan oracle on the CPU with the same weights)."""
    torch.manual_seed(0)
    oracle = LAYERS[mode](IN, HID, dtype=DT, fused=False, **kw)
    layer = LAYERS[mode](IN, HID, dtype=dtype, **kw).cuda()
    layer.load_state_dict(oracle.state_dict())
    return layer, oracle


def _inputs(mode, steps, num_layers=1, bidirectional=False, batch_first=False, give_hx=True):
    g = torch.Generator().manual_seed(1)
    x = torch.randn((B, steps, IN) if batch_first else (steps, B, IN), dtype=DT, generator=g)
    if not give_hx:
        return x, None
    lead = (num_layers * (2 if bidirectional else 1), B)
    h = torch.randn(*lead, HID, dtype=DT, generator=g)
    return x, ((h, torch.randn(*lead, HID, dtype=DT, generator=g)) if mode == "LSTM" else h)


def _flat(out):
    out, hx = out
    return [out, *hx] if isinstance(hx, tuple) else [out, hx]


def _outputs_and_grads(fn, m, x, hx, dtype, device):
    """Outputs, and the gradients of a random projection of them w.r.t. the input, the
    parameters and the initial state."""
    def put(t):
        return t.detach().to(device=device, dtype=dtype).requires_grad_()

    xi = put(x)
    hi = None if hx is None else (tuple(put(h) for h in hx) if isinstance(hx, tuple) else put(hx))
    outs = _flat(fn(xi, hi))
    gen = torch.Generator().manual_seed(2)
    loss = sum((t * torch.randn(t.shape, dtype=DT, generator=gen).to(t)).sum() for t in outs)
    states = [] if hi is None else (list(hi) if isinstance(hi, tuple) else [hi])
    grads = torch.autograd.grad(loss, [xi, *m.parameters(), *states])
    return [t.detach().cpu() for t in outs], [g.cpu() for g in grads]


def _close(got, want, rtol, atol):
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (k, a.shape, b.shape)
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=atol * scale, msg=lambda m, k=k: f"leaf {k}: {m}")


def _check(mode, path, steps, kw, give_hx=True, dtype=torch.float32, tol=(1e-4, 2e-5)):
    layer, oracle = _layers(mode, dtype, **kw)
    x, hx = _inputs(mode, steps, kw.get("num_layers", 1), kw.get("bidirectional", False),
                    kw.get("batch_first", False), give_hx)
    want = _outputs_and_grads(oracle, oracle, x, hx, DT, "cpu")
    got = _outputs_and_grads(path(layer), layer, x, hx, dtype, "cuda")
    _close(got[0], want[0], *tol)
    _close(got[1], want[1], *tol)


# (steps, num_layers, bidirectional, batch_first, bias, give_hx)
CASES = [
    (1, 1, False, False, True, True),
    (7, 2, True, True, True, False),
    (63, 1, True, False, False, True),
    (5, 2, False, False, False, True),
]


def _kw(case):
    steps, num_layers, bidirectional, batch_first, bias, give_hx = case
    return steps, dict(num_layers=num_layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias), give_hx


def _id(c):
    return "T{}_L{}_bi{}_bf{}_bias{}_hx{}".format(*c)


@pytest.mark.parametrize("mode", list(LAYERS))
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_eager_layers_call_torchs_fused_function(mode, case, fused_calls):
    steps, kw, give_hx = _kw(case)
    _check(mode, lambda m: m, steps, kw, give_hx)
    assert fused_calls == [mode]


@pytest.mark.parametrize("mode", list(LAYERS))
@pytest.mark.parametrize(
    ("case", "backend"),
    [pytest.param(c, "aot_eager", id=f"{_id(c)}-aot_eager") for c in CASES]
    + [pytest.param(c, "inductor", id=f"{_id(c)}-inductor") for c in CASES[:2]],
)
def test_jitted_layers_take_the_cudnn_op(mode, case, backend, fused_calls):
    steps, kw, give_hx = _kw(case)
    _check(mode, lambda m: tfun.jit(m, backend=backend), steps, kw, give_hx)
    assert fused_calls == ["cudnn", "cudnn_backward"]


def test_jitted_with_symbolic_sizes(fused_calls):
    # symbolic sizes: cuDNN's reserve space and flat weights are sizes known once the op has run
    layer, oracle = _layers("LSTM", num_layers=2, bidirectional=True)
    jitted = tfun.jit(layer, backend="aot_eager", dynamic=True)
    for steps in (5, 9):
        x, hx = _inputs("LSTM", steps, 2, True)
        want = _outputs_and_grads(oracle, oracle, x, hx, DT, "cpu")
        got = _outputs_and_grads(jitted, layer, x, hx, torch.float32, "cuda")
        _close(got[0], want[0], 1e-4, 2e-5)
        _close(got[1], want[1], 1e-4, 2e-5)
    assert fused_calls == ["cudnn", "cudnn_backward"] * 2


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_jitted_bfloat16(mode, fused_calls):
    _check(mode, lambda m: tfun.jit(m, backend="inductor"), 7, {}, dtype=torch.bfloat16, tol=(5e-2, 5e-2))
    assert fused_calls == ["cudnn", "cudnn_backward"]


def test_jitted_part_of_the_outputs_and_a_forward_alone(fused_calls):
    # only h_n is used: the backward op gets no cotangent for the output sequence nor c_n
    layer, oracle = _layers("LSTM", num_layers=2)
    x, _ = _inputs("LSTM", 9, 2)
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def loss(params, x):
        return torch.func.functional_call(layer, params, (x,))[1][0].pow(2).sum()

    got = tfun.jit(tfun.grad(loss), backend="aot_eager")(params, x.float().cuda())
    assert fused_calls == ["cudnn", "cudnn_backward"]
    want = tfun.grad(lambda p: torch.func.functional_call(oracle, p, (x,))[1][0].pow(2).sum())(
        {k: v.detach() for k, v in oracle.named_parameters()}
    )
    _close([got[k].cpu() for k in want], list(want.values()), 1e-4, 2e-5)
    with torch.no_grad():
        out = tfun.jit(layer, backend="aot_eager")(x.float().cuda())[0]
    assert fused_calls == ["cudnn", "cudnn_backward", "LSTM"]  # no gradient: the forward op
    _close([out.cpu()], [oracle(x)[0].detach()], 1e-4, 2e-5)


def test_second_order_and_float64_keep_the_scan(fused_calls):
    layer, oracle = _layers("GRU")
    x, _ = _inputs("GRU", 4)
    xc = x.float().cuda()

    def f(s):
        return layer(xc * s)[0].pow(2).sum()

    got = tfun.jit(tfun.grad(tfun.grad(f)), backend="aot_eager")(torch.tensor(0.7, device="cuda"))
    s = torch.tensor(0.7, dtype=DT, requires_grad=True)
    (g,) = torch.autograd.grad(oracle(x * s)[0].pow(2).sum(), s, create_graph=True)
    (want,) = torch.autograd.grad(g, s)
    _close([got.cpu()], [want], 1e-4, 2e-5)
    layer64, _ = _layers("GRU", DT)
    tfun.jit(layer64, backend="aot_eager")(x.cuda())
    assert "cudnn" not in fused_calls


@pytest.mark.parametrize(("mode", "num_layers", "bidirectional", "bias"),
                         [("LSTM", 1, False, True), ("GRU", 2, True, False)])
def test_opcheck_cudnn_op(mode, num_layers, bidirectional, bias):
    # schema, autograd registration and the fake kernel's sizes (cuDNN's reserve space and flat
    # weights included). Not opcheck's AOTAutograd test: it compares every output of two runs,
    # and cuDNN's reserve space is scratch memory
    m = LAYERS[mode](IN, HID, num_layers=num_layers, bidirectional=bidirectional, bias=bias).cuda()
    weights = [getattr(m, n).detach().requires_grad_() for n in m._flat_weights_names]
    nd = num_layers * (2 if bidirectional else 1)
    x = torch.randn(5, B, IN, device="cuda", requires_grad=True)
    h0 = torch.randn(nd, B, HID, device="cuda", requires_grad=True)
    c0 = torch.randn(nd, B, HID, device="cuda", requires_grad=True) if mode == "LSTM" else None
    torch.library.opcheck(
        torch.ops.tfun.rnn_cudnn.default,
        (mode, x, h0, c0, weights, bias, num_layers, bidirectional),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def test_training_op_equals_torch_autograd_of_the_eager_call():
    # against torch's own autograd of `torch._VF.gru` on CUDA, strided operands included
    m = tfun.nn.GRU(IN, HID, num_layers=2, bidirectional=True).cuda()
    weights = [getattr(m, n).detach().requires_grad_() for n in m._flat_weights_names]
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(B, 6, IN, device="cuda", generator=g).transpose(0, 1).requires_grad_()
    h0 = torch.randn(B, 4, HID, device="cuda", generator=g).transpose(0, 1).requires_grad_()
    inputs = [x, h0, *weights]
    out, h, _, _, _ = torch.ops.tfun.rnn_cudnn("GRU", x, h0, None, weights, True, 2, True)
    cts = [torch.randn(t.shape, device="cuda", generator=g) for t in (out, h)]
    got = torch.autograd.grad((out, h), inputs, cts)
    want_out = _rnn_fused.call("GRU", x, h0, None, weights, True, 2, True, False, True)[:2]
    want = torch.autograd.grad(want_out, inputs, cts)
    for a, b in zip((out, h), want_out):
        torch.testing.assert_close(a, b)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
