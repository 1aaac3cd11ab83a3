"""tfun.nn.chunked_cross_entropy against F.cross_entropy on the full logits, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tfun
from tfun.errors import ArgumentTypeError, ArgumentValueError, TensorMismatchError

DT = torch.float64


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 64])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("rows", [(29,), (3, 5)])
def test_values_and_grads_match_full_logits(chunk_size, use_bias, reduction, rows):
    g = torch.Generator().manual_seed(chunk_size * 7 + use_bias)
    V, Hd = 11, 6
    hidden = torch.randn(*rows, Hd, dtype=DT, generator=g, requires_grad=True)
    weight = torch.randn(V, Hd, dtype=DT, generator=g, requires_grad=True)
    bias = torch.randn(V, dtype=DT, generator=g, requires_grad=True) if use_bias else None
    target = torch.randint(0, V, rows, generator=g)
    target.view(-1)[::5] = -100  # some ignored rows
    ours = tfun.nn.chunked_cross_entropy(hidden, weight, target, bias, chunk_size=chunk_size, reduction=reduction)
    logits = hidden @ weight.T + (bias if bias is not None else 0)
    ref = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction=reduction)
    if reduction == "none":
        ref = ref.reshape(rows)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    # per-row weights of the incoming gradient matter for reduction="none"
    w_out = torch.rand(rows, dtype=DT, generator=g) if reduction == "none" else 1.7
    ga = torch.autograd.grad((ours * w_out).sum(), inputs)
    gb = torch.autograd.grad((ref * w_out).sum(), inputs)
    for a, b in zip(ga, gb):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_custom_ignore_index_and_partial_requires_grad():
    hidden = torch.randn(10, 4, dtype=DT, requires_grad=True)
    weight = torch.randn(7, 4, dtype=DT)
    target = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 3, 3])
    ours = tfun.nn.chunked_cross_entropy(hidden, weight, target, chunk_size=3, ignore_index=3)
    ref = F.cross_entropy(hidden @ weight.T, target, ignore_index=3)
    torch.testing.assert_close(ours, ref)
    (ga,) = torch.autograd.grad(ours, hidden)
    (gb,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(ga, gb)


def test_float32_inputs_float32_loss():
    hidden = torch.randn(20, 8, requires_grad=True)
    weight = torch.randn(13, 8, requires_grad=True)
    target = torch.randint(0, 13, (20,))
    ours = tfun.nn.chunked_cross_entropy(hidden, weight, target, chunk_size=6)
    assert ours.dtype == torch.float32
    ours.backward()
    assert hidden.grad.dtype == torch.float32 and weight.grad.shape == weight.shape
    torch.testing.assert_close(ours, F.cross_entropy(hidden @ weight.T, target))


def test_errors():
    h, w, t = torch.randn(4, 3), torch.randn(5, 3), torch.randint(0, 5, (4,))
    with pytest.raises(ArgumentValueError, match="reduction must be 'mean', 'sum' or 'none', but got 'max'"):
        tfun.nn.chunked_cross_entropy(h, w, t, reduction="max")
    with pytest.raises(ArgumentValueError, match="chunk_size must be a positive int"):
        tfun.nn.chunked_cross_entropy(h, w, t, chunk_size=0)
    with pytest.raises(ArgumentValueError, match=r"weight: shape \(5, 4\)"):
        tfun.nn.chunked_cross_entropy(h, torch.randn(5, 4), t)
    with pytest.raises(ArgumentValueError, match=r"target: expected shape \(4,\), got \(3,\)"):
        tfun.nn.chunked_cross_entropy(h, w, t[:3])
    with pytest.raises(ArgumentTypeError, match="integer class indices"):
        tfun.nn.chunked_cross_entropy(h, w, t.float())
    with pytest.raises(TensorMismatchError, match="share a floating dtype"):
        tfun.nn.chunked_cross_entropy(h.double(), w, t)
    with pytest.raises(ArgumentValueError, match=r"bias: expected shape \(5,\), got \(4,\)"):
        tfun.nn.chunked_cross_entropy(h, w, t, torch.randn(4))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("transform", ["tfun.grad", "per-example", "tfun.jvp", "hessian"])
def test_under_torch_func_transforms(transform, reduction):
    """Hunt 27: under `tfun.grad`, `tfun.vmap(tfun.grad(...))`, `tfun.jvp` and `torch.func`
    (eagerly) the loss raised torch.func's "must override the setup_context staticmethod" (its
    Functions are old-style). There it is computed from plain differentiable ops per chunk;
    against `F.cross_entropy` of the full logits, float64."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(7, 4, dtype=torch.float64, generator=g)
    W = torch.randn(6, 4, dtype=torch.float64, generator=g)
    b = torch.randn(6, dtype=torch.float64, generator=g)
    t = torch.tensor([0, 5, -100, 2, 3, 1, 4])
    ours = lambda h, W: tfun.nn.chunked_cross_entropy(h, W, t, bias=b, chunk_size=3, reduction=reduction).sum()
    full = lambda h, W: F.cross_entropy(h @ W.T + b, t, reduction=reduction).sum()
    if transform == "tfun.grad":
        run = lambda f: tfun.grad(f, argnums=(0, 1))(h, W)
    elif transform == "per-example":  # each row's loss, differentiated w.r.t. W
        keep = t != -100  # (a mean over no rows is nan in both)
        one = {
            ours: lambda W, hr, tr: tfun.nn.chunked_cross_entropy(hr[None], W, tr[None], bias=b, chunk_size=3, reduction=reduction).sum(),
            full: lambda W, hr, tr: F.cross_entropy(hr[None] @ W.T + b, tr[None], reduction=reduction).sum(),
        }
        run = lambda f: tfun.vmap(tfun.grad(one[f]), in_axes=(None, 0, 0))(W, h[keep], t[keep])
    elif transform == "tfun.jvp":
        run = lambda f: tfun.jvp(f, (h, W), (torch.ones_like(h), torch.cos(W)))
    else:
        run = lambda f: torch.func.hessian(f, argnums=1)(h, W)
    got, want = run(ours), run(full)
    for a, c in zip(tfun.tree.tree_leaves(got), tfun.tree.tree_leaves(want)):
        torch.testing.assert_close(a, c)
