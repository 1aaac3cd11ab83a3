"""tfun.nn.RNN/LSTM/GRU and cells against torch.nn in float64: outputs, states, gradients."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import tfun
from tfun.errors import ArgumentTypeError, ArgumentValueError, TensorMismatchError

DT = torch.float64
IN, HID, PROJ, T, B = 3, 4, 2, 5, 2

MODES = {
    "rnn_tanh": (torch.nn.RNN, tfun.nn.RNN, {"nonlinearity": "tanh"}),
    "rnn_relu": (torch.nn.RNN, tfun.nn.RNN, {"nonlinearity": "relu"}),
    "gru": (torch.nn.GRU, tfun.nn.GRU, {}),
    "lstm": (torch.nn.LSTM, tfun.nn.LSTM, {}),
    "lstm_proj": (torch.nn.LSTM, tfun.nn.LSTM, {"proj_size": PROJ}),
}


def _pair(mode: str, seed: int = 0, **kw):
    tcls, fcls, extra = MODES[mode]
    kw = {**extra, **kw}
    torch.manual_seed(seed)
    ref = tcls(IN, HID, dtype=DT, **kw)
    torch.manual_seed(seed)
    ours = fcls(IN, HID, dtype=DT, **kw)
    return ref, ours


def _flat(out):
    return [t for t in (out[0], *(out[1] if isinstance(out[1], tuple) else (out[1],)))]


GRID = list(itertools.product(MODES, [1, 2], [True, False], [True, False], [True, False], [True, False], [True, False]))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "scan"])
@pytest.mark.parametrize("mode,num_layers,bias,batch_first,bidirectional,unbatched,give_hx", GRID)
def test_matches_torch(mode, num_layers, bias, batch_first, bidirectional, unbatched, give_hx, fused):
    kw = dict(num_layers=num_layers, bias=bias, batch_first=batch_first, bidirectional=bidirectional)
    ref, ours = _pair(mode, **kw)
    ours.fused = fused
    # same seed, same registration order and init -> identical parameters; and strict state_dict loading
    assert list(dict(ref.named_parameters())) == list(dict(ours.named_parameters()))
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert p.shape == q.shape and torch.equal(p, q), n
    ours.load_state_dict(ref.state_dict(), strict=True)

    g = torch.Generator().manual_seed(1)
    shape = (T, IN) if unbatched else ((B, T, IN) if batch_first else (T, B, IN))
    x = torch.randn(shape, dtype=DT, generator=g)
    nd = 2 if bidirectional else 1
    hsize = PROJ if mode == "lstm_proj" else HID
    lead = (num_layers * nd,) if unbatched else (num_layers * nd, B)
    hx = None
    if give_hx:
        h0 = torch.randn(*lead, hsize, dtype=DT, generator=g)
        hx = (h0, torch.randn(*lead, HID, dtype=DT, generator=g)) if mode.startswith("lstm") else h0

    def run(m):
        xi = x.clone().requires_grad_()
        hi = None
        if hx is not None:
            hi = tuple(h.clone().requires_grad_() for h in hx) if isinstance(hx, tuple) else hx.clone().requires_grad_()
        out = m(xi, hi)
        leaves = _flat(out)
        gen = torch.Generator().manual_seed(2)
        loss = sum((t * torch.randn(t.shape, dtype=DT, generator=gen)).sum() for t in leaves)
        inputs = [xi, *m.parameters()] + ([*hi] if isinstance(hi, tuple) else ([hi] if hi is not None else []))
        grads = torch.autograd.grad(loss, inputs)
        return leaves, grads

    ref_out, ref_grads = run(ref)
    our_out, our_grads = run(ours)
    assert len(ref_out) == len(our_out)
    for a, b in zip(ref_out, our_out):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    for a, b in zip(ref_grads, our_grads):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", list(MODES))
def test_dropout_train_eval(mode):
    ref, ours = _pair(mode, num_layers=2, dropout=0.5)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(T, B, IN, dtype=DT)
    ours.train()
    a, b = ours(x)[0], ours(x)[0]
    assert not torch.equal(a, b)  # dropout between layers is active in training
    ours.eval()
    ref.eval()
    torch.testing.assert_close(ours(x)[0], ref(x)[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours(x)[0], ours(x)[0], rtol=0, atol=0)


def test_dropout_single_layer_warns_like_torch():
    with pytest.warns(UserWarning, match="dropout option adds dropout after all but last recurrent layer"):
        tfun.nn.LSTM(IN, HID, dropout=0.3)


def test_constructor_errors():
    with pytest.raises(ArgumentValueError, match="dropout"):
        tfun.nn.GRU(IN, HID, dropout=1.5)
    with pytest.raises(ArgumentValueError, match="proj_size must be smaller than hidden_size"):
        tfun.nn.LSTM(IN, HID, proj_size=HID)
    with pytest.raises(ArgumentValueError, match="nonlinearity"):
        tfun.nn.RNN(IN, HID, nonlinearity="sigmoid")
    with pytest.raises(ArgumentValueError, match="hidden_size must be a positive int"):
        tfun.nn.RNN(IN, 0)


CELLS = {
    "rnn_tanh": (torch.nn.RNNCell, tfun.nn.RNNCell, {"nonlinearity": "tanh"}),
    "rnn_relu": (torch.nn.RNNCell, tfun.nn.RNNCell, {"nonlinearity": "relu"}),
    "gru": (torch.nn.GRUCell, tfun.nn.GRUCell, {}),
    "lstm": (torch.nn.LSTMCell, tfun.nn.LSTMCell, {}),
}


@pytest.mark.parametrize("mode,bias,unbatched,give_hx", list(itertools.product(CELLS, [True, False], [True, False], [True, False])))
def test_cells_match_torch(mode, bias, unbatched, give_hx):
    tcls, fcls, extra = CELLS[mode]
    torch.manual_seed(0)
    ref = tcls(IN, HID, bias=bias, dtype=DT, **extra)
    torch.manual_seed(0)
    ours = fcls(IN, HID, bias=bias, dtype=DT, **extra)
    assert list(ref.state_dict()) == list(ours.state_dict())
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p, q)
    lead = () if unbatched else (B,)
    x = torch.randn(*lead, IN, dtype=DT)
    hx = None
    if give_hx:
        hx = torch.randn(*lead, HID, dtype=DT)
        if mode == "lstm":
            hx = (hx, torch.randn(*lead, HID, dtype=DT))

    def run(m):
        xi = x.clone().requires_grad_()
        out = m(xi, hx)
        outs = list(out) if isinstance(out, tuple) else [out]
        loss = sum((o * (k + 1.5)).sin().sum() for k, o in enumerate(outs))
        return outs, torch.autograd.grad(loss, [xi, *m.parameters()])

    (ro, rg), (oo, og) = run(ref), run(ours)
    for a, b in zip(ro + list(rg), oo + list(og)):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_state_dict_from_torch_lstm_roundtrip_float32():
    ref = torch.nn.LSTM(IN, HID, num_layers=2, bidirectional=True, batch_first=True)
    ours = tfun.nn.LSTM(IN, HID, num_layers=2, bidirectional=True, batch_first=True)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(B, T, IN)
    (a, (ha, ca)), (b, (hb, cb)) = ref(x), ours(x)
    torch.testing.assert_close(b, a)
    torch.testing.assert_close(hb, ha)
    torch.testing.assert_close(cb, ca)
    # and back
    ref2 = torch.nn.LSTM(IN, HID, num_layers=2, bidirectional=True, batch_first=True)
    ref2.load_state_dict(ours.state_dict(), strict=True)


def test_state_dict_missing_and_extra_keys_reported_like_torch():
    ref = torch.nn.LSTM(IN, HID)
    ours = tfun.nn.LSTM(IN, HID)
    sd = ref.state_dict()
    del sd["bias_hh_l0"]
    sd["weight_hr_l0"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as theirs:
        torch.nn.LSTM(IN, HID).load_state_dict(sd)
    with pytest.raises(RuntimeError) as mine:
        ours.load_state_dict(sd)
    assert 'Missing key(s) in state_dict: "bias_hh_l0"' in str(mine.value)
    assert 'Unexpected key(s) in state_dict: "weight_hr_l0"' in str(mine.value)
    assert str(mine.value).replace("tfun.nn._rnn.LSTM", "X").split(":", 1)[1] == str(theirs.value).split(":", 1)[1]


@pytest.mark.parametrize("fused", [True, False])
def test_bad_inputs(fused):
    # `_prepare` validates in front of both paths: the same tfun errors either way
    m = tfun.nn.LSTM(IN, HID, num_layers=2, fused=fused)
    with pytest.raises(ArgumentValueError, match=r"tfun.nn.LSTM: input must be 2-D or 3-D") as e:
        m(torch.randn(2, 3, 4, IN))
    assert "got shape (2, 3, 4, 3)" in str(e.value)
    with pytest.raises(ArgumentValueError, match=r"tfun.nn.LSTM: the last axis of input must have the layer's feature size 3") as e:
        m(torch.randn(T, B, IN + 1))
    assert "got shape (5, 2, 4)" in str(e.value)
    with pytest.raises(TensorMismatchError, match=r"expected torch.float32, got torch.float64"):
        m(torch.randn(T, B, IN, dtype=DT))
    with pytest.raises(ArgumentValueError, match=r"h_0: expected shape \(2, 2, 4\), got \(1, 2, 4\)"):
        m(torch.randn(T, B, IN), (torch.zeros(1, B, HID), torch.zeros(2, B, HID)))
    with pytest.raises(ArgumentValueError, match=r"c_0: expected shape \(2, 4\), got \(2, 2, 4\)"):
        m(torch.randn(T, IN), (torch.zeros(2, HID), torch.zeros(2, B, HID)))
    with pytest.raises(ArgumentValueError, match=r"tfun.nn.GRU: hx has the wrong shape"):
        tfun.nn.GRU(IN, HID, fused=fused)(torch.randn(T, B, IN), torch.zeros(1, B + 1, HID))
    packed = pack_padded_sequence(torch.randn(T, B, IN), torch.tensor([T, T - 1]))
    with pytest.raises(ArgumentTypeError, match="PackedSequence input is not supported"):
        m(packed)
    with pytest.raises(ArgumentValueError, match=r"tfun.nn.GRUCell: input must be 1-D or 2-D"):
        tfun.nn.GRUCell(IN, HID)(torch.randn(1, 2, IN))
    with pytest.raises(ArgumentValueError, match=r"tfun.nn.LSTMCell: h has the wrong shape"):
        tfun.nn.LSTMCell(IN, HID)(torch.randn(B, IN), (torch.zeros(B, HID + 1), torch.zeros(B, HID)))


@pytest.mark.parametrize("cls", ["RNN", "LSTM", "GRU"])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("batched", [True, False])
def test_step_mode_matches_forward(cls, batch_first, batched):
    kw = {"proj_size": 3} if cls == "LSTM" else {}
    layer = getattr(tfun.nn, cls)(5, 6, num_layers=2, batch_first=batch_first, **kw).double()
    T, B = 7, 3
    x = torch.randn((B, T, 5) if batch_first else (T, B, 5), dtype=torch.float64)
    if not batched:
        x = x[0] if batch_first else x[:, 0]
    out, final = layer(x)
    state = layer.init_state(B if batched else None)
    ys = []
    for t in range(T):
        x_t = (x[:, t] if batch_first else x[t]) if batched else x[t]
        y_t, state = layer.step(x_t, state)
        ys.append(y_t)
    stacked = torch.stack(ys, dim=1 if (batch_first and batched) else 0)
    torch.testing.assert_close(stacked, out)
    for a, b in zip(tfun.tree.tree_leaves(state), tfun.tree.tree_leaves(final)):
        torch.testing.assert_close(a, b)


def test_step_mode_refuses_bidirectional():
    layer = tfun.nn.GRU(4, 4, bidirectional=True)
    with pytest.raises(tfun.errors.ArgumentValueError, match=r"tfun\.nn\.GRU\.step: a bidirectional layer has no step mode"):
        layer.step(torch.zeros(2, 4), layer.init_state(2))


# ----------------------------------------------------------------------------------------
# The fused eager path (torch._VF.*) against the scan (fused=False)
# ----------------------------------------------------------------------------------------


# batch_first, unbatched, bias, give_hx: four combinations covering every value of each
VARIANTS = [(False, False, True, True), (True, False, False, False), (False, True, True, False), (True, True, False, True)]
FUSED_GRID = list(itertools.product(MODES, [1, 2], [False, True], [1, 7, 63], VARIANTS))


def _loss_and_grads(m, x, hx, dtype):
    xi = x.to(dtype).requires_grad_()
    hi = None
    if hx is not None:
        hi = tuple(h.to(dtype).requires_grad_() for h in hx) if isinstance(hx, tuple) else hx.to(dtype).requires_grad_()
    out = m(xi, hi)
    leaves = _flat(out)
    gen = torch.Generator().manual_seed(2)
    loss = sum((t * torch.randn(t.shape, dtype=DT, generator=gen).to(dtype)).sum() for t in leaves)
    inputs = [xi, *m.parameters()] + ([*hi] if isinstance(hi, tuple) else ([hi] if hi is not None else []))
    return [t.detach() for t in leaves], list(torch.autograd.grad(loss, inputs))


@pytest.mark.parametrize("mode,num_layers,bidirectional,steps,variant", FUSED_GRID)
def test_fused_and_scan_match_a_float64_oracle(mode, num_layers, bidirectional, steps, variant, fused_calls):
    batch_first, unbatched, bias, give_hx = variant
    _, fcls, extra = MODES[mode]
    kw = dict(num_layers=num_layers, bias=bias, batch_first=batch_first, bidirectional=bidirectional, **extra)
    torch.manual_seed(0)
    oracle = fcls(IN, HID, dtype=DT, fused=False, **kw)
    fused = fcls(IN, HID, **kw)
    scan = fcls(IN, HID, fused=False, **kw)
    fused.load_state_dict(oracle.state_dict())
    scan.load_state_dict(oracle.state_dict())
    g = torch.Generator().manual_seed(1)
    shape = (steps, IN) if unbatched else ((B, steps, IN) if batch_first else (steps, B, IN))
    x = torch.randn(shape, dtype=DT, generator=g)
    nd = 2 if bidirectional else 1
    lead = (num_layers * nd,) if unbatched else (num_layers * nd, B)
    hx = None
    if give_hx:
        h0 = torch.randn(*lead, PROJ if mode == "lstm_proj" else HID, dtype=DT, generator=g)
        hx = (h0, torch.randn(*lead, HID, dtype=DT, generator=g)) if mode.startswith("lstm") else h0

    want_out, want_grads = _loss_and_grads(oracle, x, hx, DT)
    assert fused_calls == []
    got = {"fused": _loss_and_grads(fused, x, hx, torch.float32)}
    assert fused_calls == [oracle.mode]  # the fused layer took the fused path
    got["scan"] = _loss_and_grads(scan, x, hx, torch.float32)
    assert fused_calls == [oracle.mode]  # and fused=False did not
    for name, (out, grads) in got.items():
        for what, ours, ref in (("output", out, want_out), ("gradient", grads, want_grads)):
            assert len(ours) == len(ref)
            for k, (a, b) in enumerate(zip(ours, ref)):
                assert a.dtype == torch.float32 and a.shape == b.shape
                scale = max(1.0, b.abs().max().item())
                torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=2e-5 * scale,
                                           msg=lambda m, at=f"{name} {what} {k}": f"{at}: {m}")


def _small(mode="lstm", **kw):
    _, fcls, extra = MODES[mode]
    torch.manual_seed(0)
    return fcls(IN, HID, dtype=DT, **{**extra, **kw})


@pytest.mark.parametrize("mode", list(MODES))
def test_fused_path_taken_eagerly_and_not_with_fused_false(mode, fused_calls):
    m = _small(mode, num_layers=2, bidirectional=True)
    x = torch.randn(T, B, IN, dtype=DT)
    m(x)
    assert fused_calls == [m.mode]
    with torch.no_grad():
        m(x)
    m.eval()
    m(x)
    assert len(fused_calls) == 3
    m.fused = False
    m(x)
    assert len(fused_calls) == 3


def test_fused_path_not_taken_with_dropout_in_training(fused_calls):
    m = _small("lstm", num_layers=2, dropout=0.5)
    x = torch.randn(T, B, IN, dtype=DT)
    torch.manual_seed(3)
    a = m(x)[0]
    assert fused_calls == []
    torch.manual_seed(3)
    b = m(x)[0]
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # the scan's masks, from the same RNG stream
    m.eval()
    m(x)
    assert fused_calls == ["LSTM"]  # eval: no dropout, fused


@pytest.mark.parametrize("mode", list(MODES))
def test_fused_path_not_taken_under_tfun_jit_in_float64(mode, fused_calls):
    # traced, the fused op runs only oneDNN's LSTM (float32, bfloat16): tests/nn/test_rnn_fused.py
    m = _small(mode, num_layers=2)
    x = torch.randn(B, T, IN, dtype=DT)
    f = tfun.jit(lambda x: _flat(m(x)), backend="aot_eager")
    got = f(x)
    assert fused_calls == []
    m.fused = False
    want = _flat(m(x))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_fused_path_not_taken_under_torch_func_transforms(fused_calls):
    from torch.func import functional_call

    m = _small("lstm_proj", num_layers=2, bidirectional=True)
    params = {k: v.detach() for k, v in m.named_parameters()}
    xs = torch.randn(3, T, B, IN, dtype=DT)

    def loss(params, x):
        return functional_call(m, params, (x,))[0].pow(2).sum()

    per_example = tfun.vmap(tfun.grad(loss), in_axes=(None, 0))(params, xs)
    tangent = {n: torch.randn_like(p) for n, p in params.items()}
    _, directional = tfun.jvp(lambda p: loss(p, xs[0]), (params,), (tangent,))
    out_vmapped = torch.func.vmap(lambda x: m(x)[0])(xs)
    assert fused_calls == []
    # against the fused path eagerly
    for k in range(xs.shape[0]):
        m.zero_grad()
        loss(dict(m.named_parameters()), xs[k]).backward()
        for n, p in m.named_parameters():
            torch.testing.assert_close(per_example[n][k], p.grad, rtol=1e-9, atol=1e-12)
    m.zero_grad()
    loss(dict(m.named_parameters()), xs[0]).backward()
    want = sum((p.grad * tangent[n]).sum() for n, p in m.named_parameters())
    torch.testing.assert_close(directional, want, rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        for k in range(xs.shape[0]):
            torch.testing.assert_close(out_vmapped[k], m(xs[k])[0], rtol=1e-10, atol=1e-12)
    assert len(fused_calls) == 4 + 3


def test_fused_path_not_taken_under_forward_ad(fused_calls):
    import torch.autograd.forward_ad as fwAD

    m = _small("gru", num_layers=2)
    x = torch.randn(T, B, IN, dtype=DT)
    t = torch.randn(T, B, IN, dtype=DT)
    with fwAD.dual_level():
        y = m(fwAD.make_dual(x, t))[0]
        tangent = fwAD.unpack_dual(y).tangent
    assert fused_calls == []
    _, want = torch.func.jvp(lambda x: m(x)[0], (x,), (t,))
    torch.testing.assert_close(tangent, want, rtol=1e-10, atol=1e-12)
    m(x)
    assert fused_calls == ["GRU"]  # the level is closed: fused again


@pytest.mark.parametrize("fused", [False, True])
def test_double_backward(fused, fused_calls):
    # fused=False: the scan is differentiable twice. fused=True on CPU: torch's kernels are too
    # (oneDNN's layer has a differentiable backward under create_graph; float64 runs ATen's
    # cells). CUDA takes the scan for now (cuDNN has no double backward).
    x = torch.randn(T, B, IN, dtype=DT)
    results = {}
    for dtype in (torch.float32, DT):
        m = _small("lstm", num_layers=2, fused=fused).to(dtype)
        xi = x.to(dtype).requires_grad_()
        (g,) = torch.autograd.grad(m(xi)[0].pow(2).sum(), xi, create_graph=True)
        results[dtype] = torch.autograd.grad(g.pow(2).sum(), [xi, *m.parameters()])
    assert len(fused_calls) == (2 if fused else 0)
    oracle = _small("lstm", num_layers=2, fused=False)
    xi = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(oracle(xi)[0].pow(2).sum(), xi, create_graph=True)
    want = torch.autograd.grad(g.pow(2).sum(), [xi, *oracle.parameters()])
    for a, b in zip(results[DT], want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    for a, b in zip(results[torch.float32], want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5 * max(1.0, b.abs().max().item()))


def test_nested_tfun_grad_with_fused_layer(fused_calls):
    m = _small("lstm", num_layers=2, bidirectional=True)
    x = torch.randn(T, B, IN, dtype=DT)

    def f(s):
        return m(x * s)[0].pow(2).sum()

    got = tfun.grad(tfun.grad(f))(torch.tensor(0.7, dtype=DT))
    assert fused_calls == []
    m.fused = False
    s = torch.tensor(0.7, dtype=DT, requires_grad=True)
    (g,) = torch.autograd.grad(f(s), s, create_graph=True)
    (want,) = torch.autograd.grad(g, s)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_fused_flag_repr_and_pickle():
    import pickle

    assert "fused" not in repr(tfun.nn.LSTM(IN, HID))
    assert repr(tfun.nn.GRU(IN, HID, fused=False)) == "GRU(3, 4, fused=False)"
    assert tfun.nn.RNN(IN, HID).fused is True
    with pytest.raises(TypeError):
        tfun.nn.LSTM(IN, HID, 1, True, False, 0.0, False, 0, None, None, False)  # keyword-only
    m = tfun.nn.LSTM(IN, HID, fused=False)
    assert pickle.loads(pickle.dumps(m)).fused is False
    del m.__dict__["fused"]  # a layer pickled before the flag existed
    assert pickle.loads(pickle.dumps(m)).fused is True


@pytest.mark.heavy
@pytest.mark.parametrize(("layer", "dtype"), [("RNN", torch.bfloat16), ("RNN", torch.float16), ("LSTM", torch.float16),
                                              ("LSTM", torch.bfloat16), ("GRU", torch.bfloat16)])
def test_half_precision_training_under_inductor(layer, dtype):
    """A half-precision layer's training step under tfun.jit (Inductor): forward, then
    `.backward()`, against the float64 layer on the same rounded parameters. Regression (hunt,
    session 21): RNN (bfloat16, float16) and LSTM (float16) failed to compile with Inductor's
    C++ error "conflicting declaration ... tmp_acc0_vec" (the two biases' identical gradient
    reductions); the scan path now adds them once."""
    torch.manual_seed(0)
    m = getattr(tfun.nn, layer)(4, 5, batch_first=True).to(dtype)
    m64 = __import__("copy").deepcopy(m).double()
    x = torch.randn(2, 9, 4).to(dtype)
    (m64(x.double())[0] ** 2).sum().backward()
    torch._dynamo.reset()
    out = tfun.jit(lambda v: (m(v)[0].float() ** 2).sum())(x)
    out.backward()
    for (n, p), q in zip(m.named_parameters(), m64.parameters()):
        err = ((p.grad.double() - q.grad).abs().max() / q.grad.abs().max()).item()
        assert err < 5e-2, f"{layer} {dtype}: gradient of {n}, relative error {err:.2e}"


_AUTOCAST_LAYERS = {
    "RNN": lambda mod, **kw: mod.RNN(3, 5, **kw),
    "LSTM": lambda mod, **kw: mod.LSTM(3, 5, num_layers=2, **kw),
    "LSTM_proj": lambda mod, **kw: mod.LSTM(3, 5, proj_size=3, **kw),
    "GRU": lambda mod, **kw: mod.GRU(3, 5, **kw),
}


# torch.nn.LSTM's own warning, for the reference under autocast
@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize(
    ("x_dtype", "path"),
    [
        ("float32", "fused"), ("float32", "scan"), ("float32", "jit_aot_eager"),
        pytest.param("float32", "jit_inductor", marks=pytest.mark.heavy),
        ("bfloat16", "fused"), ("bfloat16", "scan"), pytest.param("bfloat16", "jit_aot_eager", marks=pytest.mark.heavy),
    ],
)
@pytest.mark.parametrize("layer", sorted(_AUTOCAST_LAYERS))
def test_under_autocast_a_layer_computes_as_torch_nn_does(layer, x_dtype, path):
    """Under `torch.autocast`, each layer computes in the dtype `torch.nn`'s does, on every
    path, with its values and gradients. Against `torch.nn` under the same autocast: the
    dtypes of the output and final states, values within bfloat16's rounding, and the
    gradients of the input and of every parameter after `.backward()` outside the block.

    - Hunt 33, F1: the recurrent product makes a float32 state bfloat16 from the first step;
      the scan path started it in float32 and refused the carry (RNN, projected LSTM).
    - F2: an LSTM on oneDNN computes in bfloat16 in `torch.nn` (autocast casts oneDNN's layer
      kernel); compiled (`tfun::lstm_onednn`, no autocast rule) or as a scan it computed in
      float32 without a word.
    - F7: an input in autocast's dtype beside float32 parameters, which `torch.nn` takes, was
      refused."""
    torch.manual_seed(0)
    ref = _AUTOCAST_LAYERS[layer](torch.nn)
    m = _AUTOCAST_LAYERS[layer](tfun.nn, fused=path != "scan")
    m.load_state_dict(ref.state_dict())
    x0 = torch.randn(7, 2, 3).to(getattr(torch, x_dtype))

    def run(module, fn):
        module.zero_grad()
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, state = fn(x)
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        states = state if isinstance(state, tuple) else (state,)
        return [y, *states], [x.grad, *(p.grad for p in module.parameters())]

    want_outs, want_grads = run(ref, ref)
    torch._dynamo.reset()
    fn = m if path in ("fused", "scan") else tfun.jit(m, backend="aot_eager" if path == "jit_aot_eager" else "inductor")
    got_outs, got_grads = run(m, fn)
    assert [t.dtype for t in got_outs] == [t.dtype for t in want_outs]
    for g, w in zip(got_outs, want_outs):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
    for g, w in zip(got_grads, want_grads):
        assert g is not None and g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=3e-2, atol=3e-2)
