"""tfun.nn.selective_scan against a float64 sequential reference (values and gradients)."""

from __future__ import annotations

import itertools
import math

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


# ---------------------------------------------------------------- complex A (mamba_ssm's selective_scan_ref)

CT = torch.complex128


def complex_reference(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False):
    """The complex-state selective scan as a plain complex128 loop: a real (batch, state, 2L) B or
    C holds (real, imag) pairs along time; the output is 2 Re(C·h)."""
    if delta_bias is not None:
        delta = delta + delta_bias[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
    b, d, length = u.shape

    def at(M, t):
        if M.dim() == 2:
            return M
        if not M.is_complex() and M.shape[-1] == 2 * length:
            return torch.complex(M[:, None, :, 2 * t], M[:, None, :, 2 * t + 1])
        return M[:, None, :, t]

    h = torch.zeros(b, d, A.shape[1], dtype=CT)
    ys = []
    for t in range(length):
        h = torch.exp(delta[:, :, t, None] * A) * h + delta[:, :, t, None] * at(B, t) * u[:, :, t, None]
        ys.append(2 * (h * at(C, t)).sum(-1).real)
    y = torch.stack(ys, -1)
    if D is not None:
        y = y + D[:, None] * u
    if z is not None:
        y = y * F.silu(z)
    return (y, h) if return_last_state else y


KINDS = ["const-complex", "const-real", "var-complex", "var-interleaved", "var-real"]


def _coeff(kind, g):
    def r(*s, dtype=DT):
        return torch.randn(*s, dtype=dtype, generator=g).requires_grad_()

    return {
        "const-complex": lambda: r(Dc, N, dtype=CT),
        "const-real": lambda: r(Dc, N),
        "var-complex": lambda: r(Bt, N, L, dtype=CT),
        "var-interleaved": lambda: r(Bt, N, 2 * L),
        "var-real": lambda: r(Bt, N, L),
    }[kind]()


@pytest.mark.parametrize("kind_B", KINDS)
@pytest.mark.parametrize("kind_C", KINDS)
@pytest.mark.parametrize("extras", [False, True])
def test_complex_A_matches_complex128_loop(kind_B, kind_C, extras):
    # It used to cast A (and B, C) to real with a warning: a wrong result (rel. error ~1).
    g = torch.Generator().manual_seed(KINDS.index(kind_B) * 10 + KINDS.index(kind_C) + 100 * extras)
    u = torch.randn(Bt, Dc, L, dtype=DT, generator=g).requires_grad_()
    delta = (torch.rand(Bt, Dc, L, dtype=DT, generator=g) * 0.5).requires_grad_()
    # S4D-Lin-like: decaying, oscillating
    A = torch.complex(-torch.rand(Dc, N, dtype=DT, generator=g) - 0.1,
                      math.pi * torch.arange(N, dtype=DT).expand(Dc, N) + torch.randn(Dc, N, dtype=DT, generator=g))
    A = A.detach().requires_grad_()
    B, C = _coeff(kind_B, g), _coeff(kind_C, g)
    kw = {}
    if extras:
        kw = dict(D=torch.randn(Dc, dtype=DT, generator=g).requires_grad_(),
                  z=torch.randn(Bt, Dc, L, dtype=DT, generator=g).requires_grad_(),
                  delta_bias=torch.randn(Dc, dtype=DT, generator=g).requires_grad_(),
                  delta_softplus=True)
    ours, last = tfun.nn.selective_scan(u, delta, A, B, C, return_last_state=True, **kw)
    ref, ref_last = complex_reference(u, delta, A, B, C, return_last_state=True, **kw)
    assert ours.dtype == DT and ours.shape == (Bt, Dc, L)
    assert last.dtype == CT and last.shape == (Bt, Dc, N)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(last, ref_last, rtol=1e-10, atol=1e-12)
    assert ref.abs().max() > 0.1  # not trivially zero
    inputs = [t for t in (u, delta, A, B, C, *kw.values()) if isinstance(t, torch.Tensor)]
    w = torch.randn(Bt, Dc, L, dtype=DT, generator=g)
    wl = torch.randn(Bt, Dc, N, dtype=CT, generator=g)
    loss = lambda o, h: (o * w).sum() + (h * wl).real.sum()  # noqa: E731
    ga = torch.autograd.grad(loss(ours, last), inputs)
    gb = torch.autograd.grad(loss(ref, ref_last), inputs)
    for a, b in zip(ga, gb):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_complex_A_float32_runs_in_complex64():
    g = torch.Generator().manual_seed(3)
    u = torch.randn(Bt, Dc, L, generator=g)
    delta = torch.rand(Bt, Dc, L, generator=g) * 0.5
    A = torch.complex(-torch.rand(Dc, N, generator=g) - 0.1, torch.randn(Dc, N, generator=g))
    B = torch.randn(Bt, N, 2 * L, generator=g)
    C = torch.randn(Bt, N, L, dtype=torch.complex64, generator=g)
    out, last = tfun.nn.selective_scan(u, delta, A, B, C, return_last_state=True)
    assert out.dtype == torch.float32 and last.dtype == torch.complex64
    ref = complex_reference(u.double(), delta.double(), A.to(CT), B.double(), C.to(CT))
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_complex_where_not_supported_is_refused():
    u = torch.randn(Bt, Dc, L, dtype=DT)
    A = -torch.rand(Dc, N, dtype=DT)
    Bc = torch.randn(Dc, N, dtype=CT)
    with pytest.raises(tfun.errors.ArgumentTypeError) as e:
        tfun.nn.selective_scan(u, u.abs(), A, Bc, torch.randn(Dc, N, dtype=DT))
    lines = str(e.value).splitlines()
    assert lines[0] == ("tfun.nn.selective_scan: only A, B and C may be complex, and B and C only with a complex A "
                        "(as in mamba_ssm's selective_scan_ref).")
    assert lines[1] == "  * B: a torch.complex128 tensor of shape (3, 4)"
    assert lines[-1] == "Make A complex for a complex state, or pass real tensors there."
    with pytest.raises(tfun.errors.ArgumentTypeError, match=r"\* u: a torch.complex128 tensor"):
        tfun.nn.selective_scan(u.to(CT), u.abs(), A.to(CT), Bc, Bc)
    with pytest.raises(ArgumentValueError) as e:
        tfun.nn.selective_scan(u, u.abs(), A.to(CT), torch.randn(Bt, N, 2 * L + 1, dtype=DT), Bc)
    assert "B: expected (3, 4), (2, 4, 7) or (2, 4, 14), got (2, 4, 15)" in str(e.value)
    with pytest.raises(ArgumentValueError):  # interleaved only with a complex A
        tfun.nn.selective_scan(u, u.abs(), A, torch.randn(Bt, N, 2 * L, dtype=DT), A)


def test_complex_A_under_tfun_grad_is_jax_convention():
    # tfun.grad gives JAX's gradient for complex parameters: the conjugate of torch's .grad
    g = torch.Generator().manual_seed(5)
    u = torch.randn(Bt, Dc, L, dtype=DT, generator=g)
    delta = torch.rand(Bt, Dc, L, dtype=DT, generator=g) * 0.5
    A = torch.complex(-torch.rand(Dc, N, dtype=DT, generator=g) - 0.1, torch.randn(Dc, N, dtype=DT, generator=g))
    B, C = torch.randn(Bt, N, 2 * L, dtype=DT, generator=g), torch.randn(Dc, N, dtype=CT, generator=g)
    ours = tfun.grad(lambda a: (tfun.nn.selective_scan(u, delta, a, B, C) ** 2).sum())(A)
    Ar = A.clone().requires_grad_()
    (complex_reference(u, delta, Ar, B, C) ** 2).sum().backward()
    torch.testing.assert_close(ours, Ar.grad.conj(), rtol=1e-10, atol=1e-12)
