"""`tfun.checkpoint` on a `tfun.lax.scan` body: saved state grows with T·|carry| only.

Counts the unique bytes autograd saves for backward (by storage, via
`saved_tensors_hooks`), not time: deterministic. See benchmarks/scan_memory.py for the
measured table at realistic sizes.
"""

from __future__ import annotations

import torch

import tfun

B, W = 4, 32  # carry (4, 32); intermediates (4, 128)


def _saved_bytes(fn) -> int:
    seen: dict[int, int] = {}

    def pack(x):
        s = x.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(seen.values())


def _rnn():
    g = torch.Generator().manual_seed(0)
    w_in = (torch.randn(W, 4 * W, generator=g) / W**0.5).requires_grad_(True)
    w_mid = (torch.randn(4 * W, 4 * W, generator=g) / (4 * W) ** 0.5).requires_grad_(True)
    w_out = (torch.randn(4 * W, W, generator=g) / (4 * W) ** 0.5).requires_grad_(True)

    def step(h, x):
        u = h @ w_in
        a = torch.tanh(u) * torch.sigmoid(u + 1.0)
        c = torch.tanh(a @ w_mid) * a
        h = torch.tanh(c @ w_out + x + h)
        return h, None

    return step, (w_in, w_mid, w_out)


def _saved(step, T: int) -> int:
    h0 = torch.randn(B, W, generator=torch.Generator().manual_seed(1))
    xs = torch.randn(T, B, W, generator=torch.Generator().manual_seed(2))
    return _saved_bytes(lambda: tfun.lax.scan(step, h0, xs)[0].sum())


def test_checkpointed_scan_saves_only_carries():
    step, params = _rnn()
    ck = tfun.checkpoint(step)
    plain16, plain64 = _saved(step, 16), _saved(step, 64)
    ck16, ck64 = _saved(ck, 16), _saved(ck, 64)
    # T·|carry| growth only: 4x the steps, at most ~4.5x the saved bytes (weights included)
    assert ck64 <= 4.5 * ck16, (ck16, ck64)
    # and far less than the plain body, which keeps the 4x-wide intermediates of every step
    assert ck64 < 0.5 * plain64, (ck64, plain64)
    # the per-step growth of the checkpointed scan is a few carries, not the intermediates
    carry = B * W * 4
    per_step_ck = (ck64 - ck16) / 48
    per_step_plain = (plain64 - plain16) / 48
    assert per_step_ck <= 3 * carry, per_step_ck / carry
    assert per_step_plain >= 10 * carry, per_step_plain / carry


def test_checkpointed_scan_gradients_match():
    step, params = _rnn()
    h0 = torch.randn(B, W, generator=torch.Generator().manual_seed(1))
    xs = torch.randn(8, B, W, generator=torch.Generator().manual_seed(2))
    grads = []
    for f in (step, tfun.checkpoint(step)):
        loss = tfun.lax.scan(f, h0, xs)[0].sum()
        grads.append(torch.autograd.grad(loss, params))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
