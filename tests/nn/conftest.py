"""Fixtures shared by the tfun.nn tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def fused_calls(monkeypatch):
    """The modes of the calls of torch's fused RNN functions (`tfun.nn._rnn_fused.call`: what
    the eager fused path calls, and the `tfun::rnn_fused` op's forward and backward when they
    run), in order."""
    from tfun.nn import _rnn_fused

    calls = []
    real = _rnn_fused.call

    def spy(mode, *args, **kwargs):
        calls.append(mode)
        return real(mode, *args, **kwargs)

    monkeypatch.setattr(_rnn_fused, "call", spy)
    return calls
