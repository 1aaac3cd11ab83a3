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


@pytest.mark.parametrize("mode,num_layers,bias,batch_first,bidirectional,unbatched,give_hx", GRID)
def test_matches_torch(mode, num_layers, bias, batch_first, bidirectional, unbatched, give_hx):
    kw = dict(num_layers=num_layers, bias=bias, batch_first=batch_first, bidirectional=bidirectional)
    ref, ours = _pair(mode, **kw)
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


def test_bad_inputs():
    m = tfun.nn.LSTM(IN, HID, num_layers=2)
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
        tfun.nn.GRU(IN, HID)(torch.randn(T, B, IN), torch.zeros(1, B + 1, HID))
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
