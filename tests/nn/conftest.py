"""Fixtures shared by the tfun.nn tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def fused_calls(monkeypatch):
    """The calls of torch's fused RNN kernels, in order: the mode of each call of
    `tfun.nn._rnn_fused.call` (what the eager fused path and the `tfun::rnn_fused` op run),
    `"onednn"` for each run of oneDNN's LSTM layers (`onednn_layers`: the `tfun::lstm_onednn`
    op) and `"onednn_backward"` for each run of their backward (`tfun::lstm_onednn_backward`);
    `"cudnn"` and `"cudnn_backward"` likewise for cuDNN's (`tfun::rnn_cudnn` and its backward
    op, CUDA)."""
    from tfun.nn import _rnn_fused

    calls = []

    def spy(name, real):
        def run(*args, **kwargs):
            calls.append(name if name else args[0])
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(_rnn_fused, "call", spy(None, _rnn_fused.call))
    monkeypatch.setattr(_rnn_fused, "onednn_layers", spy("onednn", _rnn_fused.onednn_layers))
    monkeypatch.setattr(_rnn_fused, "onednn_layers_backward", spy("onednn_backward", _rnn_fused.onednn_layers_backward))
    monkeypatch.setattr(_rnn_fused, "cudnn_layers", spy("cudnn", _rnn_fused.cudnn_layers))
    monkeypatch.setattr(_rnn_fused, "cudnn_layers_backward", spy("cudnn_backward", _rnn_fused.cudnn_layers_backward))
    return calls
