"""The traced fused path of tfun.nn.LSTM (`tfun.nn._rnn_fused`, the `tfun::rnn_fused` op):
taken where it pays and is allowed, never elsewhere, and the same outputs and gradients as the
float64 eager scan on every path that takes it."""

from __future__ import annotations

import pytest
import torch

import tfun
from tfun.nn import _rnn_fused

DT = torch.float64
IN, HID, B = 3, 4, 2

needs_onednn = pytest.mark.skipif(not _rnn_fused._onednn_lstm()[0], reason="torch's CPU LSTM does not run oneDNN here")


def _layers(dtype=torch.float32, **kw):
    """(the layer under test, a float64 scan oracle with the same weights)."""
    torch.manual_seed(0)
    oracle = tfun.nn.LSTM(IN, HID, dtype=DT, fused=False, **kw)
    layer = tfun.nn.LSTM(IN, HID, dtype=dtype, **kw)
    layer.load_state_dict(oracle.state_dict())
    return layer, oracle


def _inputs(steps, num_layers=1, bidirectional=False, batch_first=False, unbatched=False, give_hx=True):
    g = torch.Generator().manual_seed(1)
    shape = (steps, IN) if unbatched else ((B, steps, IN) if batch_first else (steps, B, IN))
    x = torch.randn(shape, dtype=DT, generator=g)
    lead = (num_layers * (2 if bidirectional else 1),) + (() if unbatched else (B,))
    hx = (torch.randn(*lead, HID, dtype=DT, generator=g), torch.randn(*lead, HID, dtype=DT, generator=g))
    return x, hx if give_hx else None


def _loss_and_grads(fn, m, x, hx, dtype):
    """Outputs, and the gradients of a random projection of them w.r.t. the input, the
    parameters and the initial state."""
    xi = x.detach().to(dtype).requires_grad_()
    hi = tuple(h.detach().to(dtype).requires_grad_() for h in hx) if hx is not None else None
    out, (h, c) = fn(xi, hi)
    gen = torch.Generator().manual_seed(2)
    loss = sum((t * torch.randn(t.shape, dtype=DT, generator=gen).to(dtype)).sum() for t in (out, h, c))
    inputs = [xi, *m.parameters(), *(hi or ())]
    return [t.detach() for t in (out, h, c)], list(torch.autograd.grad(loss, inputs))


def _close(got, want, rtol, atol):
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=atol * scale, msg=lambda m, k=k: f"leaf {k}: {m}")


# (steps, num_layers, bidirectional, batch_first, unbatched, give_hx, bias)
CASES = [
    (1, 1, False, False, False, True, True),
    (7, 2, True, True, False, False, True),
    (63, 1, True, False, True, True, False),
    (5, 2, False, False, False, True, False),
]


def _case_id(c):
    return "T{}_L{}_bi{}_bf{}_unb{}_hx{}_bias{}".format(*c)


@needs_onednn
@pytest.mark.parametrize(
    ("case", "backend"),
    # every case on aot_eager; two on Inductor (a compile each)
    [pytest.param(c, "aot_eager", id=f"{_case_id(c)}-aot_eager") for c in CASES]
    + [pytest.param(c, "inductor", id=f"{_case_id(c)}-inductor") for c in CASES[:2]],
)
def test_jitted_lstm_takes_the_op_and_matches_float64(case, backend, fused_calls):
    steps, num_layers, bidirectional, batch_first, unbatched, give_hx, bias = case
    kw = dict(num_layers=num_layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias)
    layer, oracle = _layers(**kw)
    x, hx = _inputs(steps, num_layers, bidirectional, batch_first, unbatched, give_hx)
    want = _loss_and_grads(oracle, oracle, x, hx, DT)
    got = _loss_and_grads(tfun.jit(layer, backend=backend), layer, x, hx, torch.float32)
    assert fused_calls == ["onednn", "onednn_backward"]  # the op, and its backward op
    _close(got[0], want[0], 1e-4, 2e-5)
    _close(got[1], want[1], 1e-4, 2e-5)


@needs_onednn
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_jitted_lstm_with_symbolic_sizes(backend, fused_calls):
    # symbolic sizes: the fake kernel cannot ask oneDNN for its workspace's size, which is
    # then a size known once the op has run; two lengths through one compiled graph
    layer, oracle = _layers(num_layers=2, bidirectional=True)
    jitted = tfun.jit(layer, backend=backend, dynamic=True)
    for steps in (5, 9):
        x, hx = _inputs(steps, 2, True)
        want = _loss_and_grads(oracle, oracle, x, hx, DT)
        got = _loss_and_grads(jitted, layer, x, hx, torch.float32)
        _close(got[0], want[0], 1e-4, 2e-5)
        _close(got[1], want[1], 1e-4, 2e-5)
    assert fused_calls == ["onednn", "onednn_backward"] * 2


@needs_onednn
def test_jitted_gradient_and_no_grad_forward(fused_calls):
    layer, oracle = _layers(num_layers=2)
    x, _ = _inputs(9, num_layers=2)
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def loss(params, x):
        return torch.func.functional_call(layer, params, (x,))[0].pow(2).sum()

    # traced tfun.grad differentiates with autograd here: the op, forward and backward
    got = tfun.jit(tfun.grad(loss), backend="aot_eager")(params, x.float())
    assert fused_calls == ["onednn", "onednn_backward"]
    want = tfun.grad(lambda p: torch.func.functional_call(oracle, p, (x,))[0].pow(2).sum())(
        {k: v.detach() for k, v in oracle.named_parameters()}
    )
    _close([got[k] for k in want], list(want.values()), 1e-4, 2e-5)
    with torch.no_grad():
        out = tfun.jit(layer, backend="aot_eager")(x.float())[0]
    assert fused_calls == ["onednn", "onednn_backward", "LSTM"]  # no gradient: the forward op
    _close([out], [oracle(x)[0].detach()], 1e-4, 2e-5)


@needs_onednn
def test_plain_torch_compile_takes_the_op_too(fused_calls):
    layer, oracle = _layers()
    x, hx = _inputs(6)
    got = _loss_and_grads(torch.compile(layer, backend="aot_eager", fullgraph=True), layer, x, hx, torch.float32)
    assert fused_calls == ["onednn", "onednn_backward"]
    want = _loss_and_grads(oracle, oracle, x, hx, DT)
    _close(got[0], want[0], 1e-4, 2e-5)
    _close(got[1], want[1], 1e-4, 2e-5)


@pytest.mark.skipif(not _rnn_fused._onednn_lstm()[1], reason="oneDNN has no bfloat16 LSTM on this CPU")
def test_jitted_bfloat16(fused_calls):
    layer, oracle = _layers(dtype=torch.bfloat16)
    x, hx = _inputs(7)
    got = _loss_and_grads(tfun.jit(layer, backend="aot_eager"), layer, x, hx, torch.bfloat16)
    assert fused_calls == ["onednn", "onednn_backward"]
    want = _loss_and_grads(oracle, oracle, x, hx, DT)
    _close(got[0], want[0], 5e-2, 5e-2)
    _close(got[1], want[1], 5e-2, 5e-2)


# ----------------------------------------------------------------------------------------
# Where the traced layer keeps the scan
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: tfun.nn.GRU(IN, HID),  # ATen's per-step cells: the op's extra forward costs more
        lambda: tfun.nn.RNN(IN, HID),
        lambda: tfun.nn.LSTM(IN, HID, proj_size=2),
        lambda: tfun.nn.LSTM(IN, HID, dtype=DT),
        lambda: tfun.nn.LSTM(IN, HID, fused=False),
        lambda: tfun.nn.LSTM(IN, HID, num_layers=2, dropout=0.5),  # training: the scan's masks
    ],
    ids=["gru", "rnn", "lstm_proj", "lstm_float64", "fused_false", "dropout"],
)
def test_jitted_layers_that_keep_the_scan(make, fused_calls):
    torch.manual_seed(0)
    m = make()
    x = torch.randn(5, B, IN, dtype=next(m.parameters()).dtype)
    out = tfun.jit(lambda x: m(x)[0], backend="aot_eager")(x)
    assert fused_calls == []
    assert out.shape[:2] == (5, B)


# torch.export's Dynamo reads `.grad` of a non-leaf tensor of its own while it wraps the
# module's state (a warning from torch's tracer, on main before the op as well)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_op_not_taken_in_transforms_loop_bodies_second_order_or_export(fused_calls):
    layer, oracle = _layers()
    xs, _ = _inputs(4)
    x = xs.float()

    # tfun.grad of a function closing over parameters that require grad: outermost in the
    # trace, the gradient is kept first-order (`tfun._first_order`), so the op is taken (it
    # ran torch.func.grad over the scan, unrolled, before session 38); the rest of this test
    # must not take it
    got = tfun.jit(tfun.grad(lambda x: layer(x)[0].pow(2).sum()), backend="aot_eager")(x)
    want = tfun.grad(lambda x: oracle(x)[0].pow(2).sum())(xs)
    _close([got.detach()], [want], 1e-4, 2e-5)
    assert fused_calls == ["onednn", "onednn_backward"]
    fused_calls.clear()

    # a scan body (frozen weights: a scan nested in a scan body that closes over a tensor
    # requiring grad does not compile on torch 2.13, with the scan or the op alike)
    frozen, _ = _layers()
    frozen.requires_grad_(False)

    def body(c, xt):
        return c + frozen(xt.unsqueeze(0))[0].sum(), None

    total, _ = tfun.jit(lambda x: tfun.lax.scan(body, torch.zeros(()), x), backend="aot_eager")(x)
    want = sum(oracle(xs[t : t + 1])[0].sum() for t in range(xs.shape[0])).detach()
    _close([total], [want], 1e-4, 2e-5)

    # a derivative differentiated again
    def f(s):
        return layer(x * s)[0].pow(2).sum()

    got = tfun.jit(tfun.grad(tfun.grad(f)), backend="aot_eager")(torch.tensor(0.7))
    s = torch.tensor(0.7, dtype=DT, requires_grad=True)
    (g,) = torch.autograd.grad(oracle(xs * s)[0].pow(2).sum(), s, create_graph=True)
    (want2,) = torch.autograd.grad(g, s)
    _close([got], [want2], 1e-4, 2e-5)

    # torch.export: a graph of aten ops
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = layer

        def forward(self, x):
            return self.lstm(x)[0]

    ep = torch.export.export(M(), (x,))
    assert not any("rnn_fused" in str(n.target) for n in ep.graph.nodes)
    assert fused_calls == []
    _close([ep.module()(x)], [oracle(xs)[0].detach()], 1e-4, 2e-5)


@pytest.mark.parametrize("how", ["argument", "closure", "vjp_closure"])
def test_a_jitted_gradient_through_the_fused_layer_is_first_order_and_a_backward_through_it_is_refused(how):
    """`tfun.jit(tfun.grad(f))` where `f` runs the layer and the gradient may be differentiated
    again (its argument requires grad, or the layer's parameters do): the fused op stays (its
    backward has no derivative), the gradient is eager float64's, and a backward that reaches it
    (a penalty) is a JitError naming `f`, not a raw torch error at compile time ("no autograd
    formula was registered" for `tfun.lstm_onednn_backward`, before session 38) nor a dropped
    term. The same for `tfun.vjp` of `f` (the parameters closed over)."""
    from tfun.errors import JitError

    layer, oracle = _layers()
    xs, _ = _inputs(6)
    x = xs.float()
    if how == "argument":
        layer.requires_grad_(False)
        arg = x.clone().requires_grad_()
    else:
        arg = x

    def f(x):
        return layer(x)[0].pow(2).sum()

    want = tfun.grad(lambda x: oracle(x)[0].pow(2).sum())(xs)
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes)
        return gm

    if how == "vjp_closure":
        op, step = "vjp", lambda x: tfun.vjp(f, x)[1](torch.tensor(1.0))[0]
    else:
        op, step = "grad", lambda x: tfun.grad(f)(x)
    got = tfun.jit(step, backend=backend)(arg)
    assert any("lstm_onednn" in t or "rnn_fused" in t for t in targets), targets
    _close([got.detach()], [want.detach()], 1e-4, 2e-5)
    assert got.requires_grad
    with pytest.raises(JitError, match=rf"^tfun\.{op}: under tfun\.jit, this gradient was computed first-order") as e:
        got.pow(2).sum().backward()
    assert "f at " in str(e.value) and "test_rnn_fused.py:" in str(e.value), str(e.value)


# ----------------------------------------------------------------------------------------
# The ops themselves
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_opcheck_forward_op(mode):
    # the forward-only op: nothing requires grad where the layers call it
    m = getattr(tfun.nn, mode)(IN, HID, num_layers=2, bidirectional=True)
    weights = [getattr(m, n).detach() for n in m._flat_weights_names]
    x, h0 = torch.randn(5, B, IN), torch.randn(4, B, HID)
    c0 = torch.randn(4, B, HID) if mode == "LSTM" else None
    torch.library.opcheck(
        torch.ops.tfun.rnn_fused.default,
        (mode, x, h0, c0, weights, True, 2, True, False),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


@needs_onednn
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.parametrize(("num_layers", "bidirectional", "bias"), [(1, False, True), (2, True, False)])
def test_opcheck_training_op(num_layers, bidirectional, bias):
    # schema, autograd registration and the fake kernel's sizes (oneDNN's workspace included).
    # Not opcheck's AOTAutograd test: it compares every output of two runs, and oneDNN leaves
    # part of its workspace uninitialized; the jit tests above compare what is meant to be equal
    m = tfun.nn.LSTM(IN, HID, num_layers=num_layers, bidirectional=bidirectional, bias=bias)
    weights = [getattr(m, n).detach().requires_grad_() for n in m._flat_weights_names]
    nd = num_layers * (2 if bidirectional else 1)
    x = torch.randn(5, B, IN, requires_grad=True)
    h0, c0 = (torch.randn(nd, B, HID, requires_grad=True) for _ in range(2))
    torch.library.opcheck(
        torch.ops.tfun.lstm_onednn.default,
        (x, h0, c0, weights, bias, num_layers, bidirectional),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


@needs_onednn
def test_training_op_equals_torch_autograd_and_takes_strided_operands():
    # oneDNN's layer kernels read strided tensors as contiguous (wrong numbers, no error): the
    # op hands them contiguous copies. Against torch's own autograd of the eager fused call.
    m = tfun.nn.LSTM(IN, HID, num_layers=2, bidirectional=True)
    weights = [getattr(m, n).detach().requires_grad_() for n in m._flat_weights_names]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, 6, IN, generator=g).transpose(0, 1).requires_grad_()  # (T, B, IN), strided
    h0 = torch.randn(B, 4, HID, generator=g).transpose(0, 1).requires_grad_()
    c0 = torch.randn(4, B, HID, generator=g).requires_grad_()
    inputs = [x, h0, c0, *weights]
    out, h, c, _, _ = torch.ops.tfun.lstm_onednn(x, h0, c0, weights, True, 2, True)
    cts = [torch.randn(t.shape, generator=g).transpose(0, 1).contiguous().transpose(0, 1) for t in (out, h, c)]
    got = torch.autograd.grad((out, h, c), inputs, cts)
    want_out = _rnn_fused.call("LSTM", x, h0, c0, weights, True, 2, True, False, True)
    want = torch.autograd.grad(want_out, inputs, cts)
    for a, b in zip((out, h, c), want_out):
        torch.testing.assert_close(a, b)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@needs_onednn
def test_jitted_checkpointed_lstm(fused_calls):
    # tfun.checkpoint around the layer: the op runs forward, again when the checkpoint
    # recomputes, then its backward op
    layer, oracle = _layers(num_layers=2, bidirectional=True)
    x, _ = _inputs(6, num_layers=2, bidirectional=True)
    f = tfun.jit(lambda x: tfun.checkpoint(lambda x: layer(x)[0])(x).pow(2).sum(), backend="aot_eager")
    xi = x.float().requires_grad_()
    got = torch.autograd.grad(f(xi), [xi, *layer.parameters()])
    assert fused_calls == ["onednn", "onednn", "onednn_backward"]
    xo = x.clone().requires_grad_()
    want = torch.autograd.grad(oracle(xo)[0].pow(2).sum(), [xo, *oracle.parameters()])
    _close(list(got), list(want), 1e-4, 2e-5)
