"""tfun transforms composed with tfun.lax control flow.

With the eager lax implementations, autograd and torch.func trace through the Python
loops; these tests pin that behaviour so the later autograd.Function rules keep it."""

from __future__ import annotations

import pytest
import torch

import tfun

lax = pytest.importorskip("tfun.lax")
D = torch.float64


def t(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def rnn(h0, xs, w):
    def step(h, x):
        h = torch.tanh(h * w + x)
        return h, h.sum()

    return lax.scan(step, h0, xs)


def rnn_ref(h0, xs, w):
    h, ys = h0, []
    for x in xs:
        h = torch.tanh(h * w + x)
        ys.append(h.sum())
    return h, torch.stack(ys)


def run(name, f):
    return f()


def test_grad_of_scan():
    h0, xs, w = t(3), t(5, 3, seed=1), t(3, seed=2)
    loss = lambda fn: lambda h, w: fn(h, xs, w)[1].sum()
    got = run("grad(scan)", lambda: tfun.grad(loss(rnn), argnums=(0, 1))(h0, w))
    ref = tfun.grad(loss(rnn_ref), argnums=(0, 1))(h0, w)
    assert all(torch.allclose(a, b) for a, b in zip(got, ref))


def test_vmap_of_scan():
    h0, xs, w = t(4, 3), t(4, 5, 3, seed=1), t(3, seed=2)
    got = run("vmap(scan)", lambda: tfun.vmap(rnn, in_axes=(0, 0, None))(h0, xs, w))
    ref = tfun.vmap(rnn_ref, in_axes=(0, 0, None))(h0, xs, w)
    assert all(torch.allclose(a, b) for a, b in zip(got, ref))


def test_checkpoint_scan_body_under_grad():
    h0, xs, w = t(3), t(5, 3, seed=1), t(3, seed=2)

    def ck(h0, xs, w):
        step = tfun.checkpoint(lambda h, x: (torch.tanh(h * w + x),) * 2)
        return lax.scan(lambda h, x: (step(h, x)[0], step(h, x)[0].sum()), h0, xs)

    got = run("grad(scan(checkpoint))", lambda: tfun.grad(lambda w: ck(h0, xs, w)[1].sum())(w))
    ref = tfun.grad(lambda w: rnn_ref(h0, xs, w)[1].sum())(w)
    assert torch.allclose(got, ref)


def test_grad_of_cond():
    x = t(3)
    f = lambda x: lax.cond(x.sum() > 0, lambda v: (v**2).sum(), lambda v: v.sin().sum(), x)
    got = run("grad(cond)", lambda: tfun.grad(f)(x))
    ref = 2 * x if x.sum() > 0 else x.cos()
    assert torch.allclose(got, ref)


def test_vmap_of_cond():
    xs = t(4, 3)
    f = lambda x: lax.cond(x.sum() > 0, lambda v: v * 2, lambda v: -v, x)
    got = run("vmap(cond)", lambda: tfun.vmap(f)(xs))
    ref = torch.stack([x * 2 if x.sum() > 0 else -x for x in xs])
    assert torch.allclose(got, ref)


def test_grad_of_while_loop():
    x = torch.tensor(1.5, dtype=D)
    f = lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * x), (0, torch.ones((), dtype=D)))[1]
    got = run("grad(while_loop)", lambda: tfun.grad(f)(x))
    assert torch.allclose(got, 3 * x**2)
