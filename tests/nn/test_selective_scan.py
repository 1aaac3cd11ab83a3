"""tfun.nn.selective_scan against a float64 sequential reference (values and gradients)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import tfun
from tfun.errors import ArgumentValueError

DT = torch.float64
Bt, Dc, N, L = 2, 3, 4, 7


def reference(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False):
    """The selective scan as a plain loop over time (Gu & Dao 2023, Algorithm 2)."""
    if delta_bias is not None:
        delta = delta + delta_bias[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    b, d, length = u.shape
    h = u.new_zeros(b, d, A.shape[1])
    ys = []
    for t in range(length):
        Bt_ = B if B.dim() == 2 else B[:, None, :, t]
        Ct_ = C if C.dim() == 2 else C[:, None, :, t]
        h = torch.exp(delta[:, :, t, None] * A) * h + delta[:, :, t, None] * Bt_ * u[:, :, t, None]
        ys.append((h * Ct_).sum(-1))
    y = torch.stack(ys, -1)
    if D is not None:
        y = y + D[:, None] * u
    if z is not None:
        y = y * F.silu(z)
    return (y, h) if return_last_state else y


FLAGS = list(itertools.product([False, True], repeat=7))


@pytest.mark.parametrize("var_B,var_C,use_D,use_z,use_bias,softplus,last", FLAGS)
def test_matches_sequential_reference(var_B, var_C, use_D, use_z, use_bias, softplus, last):
    g = torch.Generator().manual_seed(hash((var_B, var_C, use_D, use_z, use_bias, softplus, last)) % 2**31)
    r = lambda *s: torch.randn(*s, dtype=DT, generator=g).requires_grad_()  # noqa: E731
    u = r(Bt, Dc, L)
    delta = (torch.rand(Bt, Dc, L, dtype=DT, generator=g) * 0.5).requires_grad_()
    A = (-torch.rand(Dc, N, dtype=DT, generator=g) - 0.1).requires_grad_()
    B = r(Bt, N, L) if var_B else r(Dc, N)
    C = r(Bt, N, L) if var_C else r(Dc, N)
    kw = dict(
        D=r(Dc) if use_D else None,
        z=r(Bt, Dc, L) if use_z else None,
        delta_bias=r(Dc) if use_bias else None,
        delta_softplus=softplus,
        return_last_state=last,
    )
    args = (u, delta, A, B, C)
    ours = tfun.nn.selective_scan(*args, **kw)
    ref = reference(*args, **kw)
    ours_l = list(ours) if last else [ours]
    ref_l = list(ref) if last else [ref]
    for a, b in zip(ours_l, ref_l):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    if last:
        assert ours_l[1].shape == (Bt, Dc, N)
    inputs = [t for t in (*args, *kw.values()) if isinstance(t, torch.Tensor)]
    w = [torch.randn(t.shape, dtype=DT, generator=g) for t in ours_l]
    ga = torch.autograd.grad(sum((t * wi).sum() for t, wi in zip(ours_l, w)), inputs)
    gb = torch.autograd.grad(sum((t * wi).sum() for t, wi in zip(ref_l, w)), inputs)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_float32_output_keeps_input_dtype():
    u = torch.randn(1, 2, 5)
    out = tfun.nn.selective_scan(u, torch.rand(1, 2, 5), -torch.rand(2, 3), torch.randn(2, 3), torch.randn(2, 3))
    assert out.dtype == torch.float32 and out.shape == (1, 2, 5)


def test_bad_shapes():
    u = torch.randn(Bt, Dc, L)
    with pytest.raises(ArgumentValueError, match=r"B must be \(channels, state\) or \(batch, state, length\)") as e:
        tfun.nn.selective_scan(u, u, -torch.rand(Dc, N), torch.randn(Bt, N, L + 1), torch.randn(Dc, N))
    assert "B: expected (3, 4) or (2, 4, 7), got (2, 4, 8)" in str(e.value)
    with pytest.raises(ArgumentValueError, match=r"A must be \(channels, state\)"):
        tfun.nn.selective_scan(u, u, -torch.rand(Dc + 1, N), torch.randn(Dc, N), torch.randn(Dc, N))
    with pytest.raises(ArgumentValueError, match=r"delta must have u's shape"):
        tfun.nn.selective_scan(u, u[:, :, :-1], -torch.rand(Dc, N), torch.randn(Dc, N), torch.randn(Dc, N))
