"""The complex diagonal recurrence under S4D/S5/LRU (tfun/nn/_diagonal_scan.py): both of its
algorithms, values and the gradients of all four inputs, against the float64 recurrence run
one step at a time; the traced path under tfun.jit (aot_eager and Inductor)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tfun
from tfun.nn import _diagonal_scan as ds

ALGORITHMS = {"log_depth": ds._log_depth, "chunked": ds._chunked}


def reference(zr, zi, ur, ui):
    """`h_t = exp(z) h_{t-1} + u_t`, one step at a time, in complex128."""
    lam = torch.exp(torch.complex(zr, zi).to(torch.complex128))
    u = torch.complex(ur, ui).to(torch.complex128)
    h = torch.zeros(u.shape[0], u.shape[2], dtype=u.dtype)
    hs = []
    for t in range(u.shape[1]):
        h = lam * h + u[:, t]
        hs.append(h)
    out = torch.stack(hs, 1) if hs else u
    return out.real, out.imag


def inputs(batch, length, n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    zr = -torch.rand(n, generator=g, dtype=dtype) * 0.5 - 1e-3  # |λ| in (0.6, 1)
    zi = (torch.rand(n, generator=g, dtype=dtype) - 0.5) * 6.0
    ur = torch.randn(batch, length, n, generator=g, dtype=dtype)
    ui = torch.randn(batch, length, n, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (zr, zi, ur, ui)]


def values_and_grads(f, args):
    hr, hi = f(*args)
    g = torch.Generator().manual_seed(1)
    # the same weights whatever the dtype (drawn in float64)
    wr, wi = (torch.randn(hr.shape, generator=g, dtype=torch.float64).to(hr.dtype) for _ in range(2))
    loss = (hr * wr + hi * wi).sum()
    grads = torch.autograd.grad(loss, args, allow_unused=True)
    return (hr, hi), [torch.zeros_like(a) if gr is None else gr for a, gr in zip(args, grads)]


def check(f, args, rtol, atol):
    (hr, hi), grads = values_and_grads(f, args)
    ref64 = [a.detach().double().requires_grad_() for a in args]
    (rr, ri), rgrads = values_and_grads(reference, ref64)
    torch.testing.assert_close(hr.double(), rr, rtol=rtol, atol=atol)
    torch.testing.assert_close(hi.double(), ri, rtol=rtol, atol=atol)
    for name, got, want in zip(("zr", "zi", "ur", "ui"), grads, rgrads):
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol, msg=lambda m, name=name: f"d/d{name}: {m}")


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), length=st.sampled_from([0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 100]),
       n=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_algorithm_matches_the_recurrence_values_and_gradients(algorithm, batch, length, n, seed):
    check(ALGORITHMS[algorithm], inputs(batch, length, n, seed), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("length", [513, 1000])
def test_long_float32_against_float64(algorithm, length):
    args = inputs(2, length, 3, seed=length, dtype=torch.float32)
    check(ALGORITHMS[algorithm], args, rtol=2e-4, atol=2e-4)


# CI's second torch phase keeps aot_eager (the Inductor cell, 43 s there, is `heavy`; the
# module's `test_a_jitted_scan_at_a_second_length_under_inductor` stays)
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
def test_traced_runs_the_chunked_real_algorithm_with_the_recurrences_values_and_gradients(backend, monkeypatch):
    called = []
    chunked = ds._chunked
    monkeypatch.setattr(ds, "_log_depth", lambda *a: pytest.fail("traced call ran the complex log-depth scan"))
    monkeypatch.setattr(ds, "_chunked", lambda *a: called.append(1) or chunked(*a))
    f = tfun.jit(ds.diagonal_scan, backend=backend)
    # 3 chunks; 1 (no padding); 9 chunks (a second level, over 2 chunks, over 1). Under Inductor
    # (each length its own graph) 19 is left out: 67's graph holds every piece of 19's
    # (padded chunks, a second level, one chunk), and aot_eager traces all three lengths
    for length in (19, 8, 67) if backend == "aot_eager" else (8, 67):
        check(f, inputs(2, length, 3, seed=length), rtol=1e-9, atol=1e-9)
    assert called


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_precision_scans_in_float32_eagerly_and_traced(dtype):
    """Half-precision states come from a float32 scan on both paths (found by a correctness
    hunt, session 20: eagerly, bfloat16 raised torch's "Expected both inputs to be Half, Float
    or Double tensors" and float16 "exp_vml_cpu not implemented for 'ComplexHalf'", while the
    traced real path ran): the float32 scan of the same inputs, rounded once."""
    args = [a.detach().to(dtype).requires_grad_() for a in inputs(2, 40, 3, seed=11, dtype=torch.float32)]
    want32 = ds.diagonal_scan(*[a.detach().float() for a in args])
    eager = ds.diagonal_scan(*args)
    torch._dynamo.reset()
    traced = tfun.jit(ds.diagonal_scan, backend="aot_eager")(*args)
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    for got, rtol in ((eager, 0.0), (traced, ulp)):  # traced: the chunked algorithm's float32 rounding, then one
        assert got[0].dtype == dtype and got[1].dtype == dtype
        for g, w in zip(got, want32):
            torch.testing.assert_close(g.float(), w.to(dtype).float(), rtol=rtol, atol=rtol * 1e-2)
    (eager[0].float().sum() + eager[1].float().sum()).backward()
    assert all(a.grad is not None and a.grad.dtype == dtype and a.grad.isfinite().all() for a in args)


# torch's export of a scan whose parameters require grad reads a non-leaf's `.grad` (torch's
# own warning, about its own code)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
@pytest.mark.filterwarnings("ignore:torch.compile is ignored when called inside torch.export region:UserWarning")
@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
@pytest.mark.parametrize("layer", ["S5", "LRU", "S4D-scan", "S4D-conv"])
def test_export_with_a_dynamic_length(layer, strict):
    """`torch.export` with the length a `Dim` runs the scan as one loop (`_loop`), whose graph
    does not depend on the length (found by a correctness hunt, session 20: the chunked
    algorithm made export fail inside torch's constraint solver, "Cannot create Dim with
    inconsistent min=0, max=-8"). Hunt 28: under strict export too (its Dynamo shows a
    symbolic length as an int: "Constraints violated ... specialized it to be a constant"),
    and S4D in its default conv mode (the kernel's block count specialized the length: "T <=
    64", or torch's AssertionError at an example length of 100), which exports the recurrence.
    The exported program against eager at four lengths, values and the input's gradient."""
    torch.manual_seed(0)
    m = {"S5": lambda: tfun.nn.S5(3, 4), "LRU": lambda: tfun.nn.LRU(3, 4),
         "S4D-scan": lambda: tfun.nn.S4D(3, 4, mode="scan"), "S4D-conv": lambda: tfun.nn.S4D(3, 4)}[layer]()
    length = torch.export.Dim("length", min=2, max=4096)
    ep = torch.export.export(m, (torch.randn(2, 100, 3),), dynamic_shapes=({1: length},), strict=strict)
    for t in (2, 19, 65, 100):
        x = torch.randn(2, t, 3, requires_grad=True)
        x64 = x.detach().double().requires_grad_()
        got, want = ep.module()(x), m.double()(x64)
        m.float()
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-4, atol=1e-5)
        (gx,) = torch.autograd.grad((got**2).sum(), x)
        (wx,) = torch.autograd.grad((want**2).sum(), x64)
        torch.testing.assert_close(gx.double(), wx, rtol=1e-3, atol=1e-4)


def test_a_jitted_scan_at_a_second_length_under_inductor():
    """Hunt 27: `tfun.jit` (Inductor) of S5 / LRU at 257 then 1000 steps raised torch's bare
    "Guard failed on the same frame it was created" (the second length made dynamic, and the
    chunked algorithm's nested padded reshapes, one per factor of 8, got a wrong guard). Traced,
    the length is now static (each length its own graph); values at both lengths against the
    complex128 recurrence."""
    f = tfun.jit(ds.diagonal_scan)
    torch._dynamo.reset()
    with torch.no_grad():
        for length in (257, 1000):
            args = [a.detach().float() for a in inputs(2, length, 3, seed=length)]
            got = f(*args)
            want = reference(*[a.double() for a in args])
            for g, w in zip(got, want):
                torch.testing.assert_close(g.double(), w, rtol=2e-4, atol=2e-4)
