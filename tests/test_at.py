"""tfun.at against JAX's x.at[...] (the oracle), gradients against float64 gradcheck, vmap and jit."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import tfun
from tfun.errors import ArgumentTypeError, ArgumentValueError

HAVE_JAX = importlib.util.find_spec("jax") is not None
if HAVE_JAX:
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_platforms", "cpu")



@pytest.fixture(autouse=True)
def _jax_default_32_bit_mode():
    """Other test modules turn on `jax_enable_x64` globally; compare with JAX's default mode."""
    if not HAVE_JAX:
        yield
        return
    with jax.enable_x64(False):
        yield


X = np.arange(20, dtype=np.float32).reshape(4, 5) - 7.0
INDICES = [
    ("int", lambda m: 2),
    ("neg_int", lambda m: -1),
    ("oob_int", lambda m: 9),
    ("slice", lambda m: (slice(1, 3),)),
    ("pair", lambda m: (1, 3)),
    ("ints", lambda m: m.asarray([0, 2, 2, -1])),
    ("oob_ints", lambda m: m.asarray([0, 7, -9, 3])),
    ("ints_slice", lambda m: (m.asarray([3, 0, 3]), slice(None, 2))),
    ("two_arrays", lambda m: (m.asarray([0, 1, 5]), m.asarray([4, 4, -1]))),
    ("ellipsis", lambda m: (Ellipsis, m.asarray([1, 1, 9]))),
    ("none", lambda m: (None, 1)),
    ("bool", lambda m: m.asarray([True, False, True, False])),
]


class _T:
    @staticmethod
    def asarray(v):
        return torch.tensor(v)


@pytest.mark.skipif(not HAVE_JAX, reason="jax is the oracle")
@pytest.mark.parametrize("op", ["get", "set", "add", "multiply", "min", "max"])
@pytest.mark.parametrize("mode", [None, "clip", "drop", "fill"])
@pytest.mark.parametrize("name,index", INDICES, ids=[n for n, _ in INDICES])
def test_matches_jax(op: str, mode: str | None, name: str, index) -> None:
    jx, tx = jnp.asarray(X), torch.from_numpy(X.copy())
    jref, tref = jx.at[index(jnp)], tfun.at(tx)[index(_T)]
    if op == "get":
        expected = jref.get(mode=mode)
        got = tref.get(mode=mode)
    else:
        shape = np.shape(jx[index(jnp)]) if mode == "clip" or name not in ("oob_int", "oob_ints", "two_arrays", "ellipsis") else np.shape(jref.get(mode="clip"))
        v = (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) % 5) - 2.0
        expected = getattr(jref, op)(v, mode=mode)
        got = getattr(tref, op)(torch.as_tensor(np.asarray(v)), mode=mode)
    np.testing.assert_array_equal(got.numpy(), np.asarray(expected))
    assert torch.equal(tx, torch.from_numpy(X))  # never in place


@pytest.mark.skipif(not HAVE_JAX, reason="jax is the oracle")
def test_fill_value_and_int_dtypes_match_jax() -> None:
    jx, tx = jnp.arange(5), torch.arange(5, dtype=torch.int32)
    idx = [1, 9, -2]
    got = tfun.at(tx)[torch.tensor(idx)].get(mode="fill")
    np.testing.assert_array_equal(got.numpy(), np.asarray(jx.at[jnp.asarray(idx)].get(mode="fill")))
    got = tfun.at(tx)[torch.tensor(idx)].get(mode="fill", fill_value=-1)
    np.testing.assert_array_equal(got.numpy(), np.asarray(jx.at[jnp.asarray(idx)].get(mode="fill", fill_value=-1)))
    got = tfun.at(tx)[torch.tensor(idx)].add(2.7)  # values are cast to x's dtype, as in JAX
    np.testing.assert_array_equal(got.numpy(), np.asarray(jx.at[jnp.asarray(idx)].add(2)))


@pytest.mark.parametrize("op", ["get", "set", "add", "multiply", "min", "max"])
def test_gradients_float64(op: str) -> None:
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    idx = (torch.tensor([0, 2, 3]), slice(1, 3))  # distinct rows: no ties for min/max
    if op == "get":
        assert torch.autograd.gradcheck(lambda x: tfun.at(x)[idx].get(), (x,))
    else:
        assert torch.autograd.gradcheck(lambda x, v: getattr(tfun.at(x)[idx], op)(v), (x, v))


def test_add_accumulates_repeated_indices_in_the_gradient() -> None:
    g = tfun.grad(lambda v: tfun.at(torch.zeros(3))[torch.tensor([1, 1, 2])].add(v).pow(2).sum())(
        torch.tensor([1.0, 2.0, 3.0])
    )
    # out[1] = v0 + v1 = 3, out[2] = v2 = 3: d/dv = 2 * out[idx]
    assert torch.equal(g, torch.tensor([6.0, 6.0, 6.0]))


def test_vmap_and_jit() -> None:
    rows = torch.zeros(3, 4)
    idx = torch.tensor([1, 7, 3])  # 7 is out of bounds: dropped
    out = tfun.vmap(lambda r, i: tfun.at(r)[i].add(1.0))(rows, idx)
    assert torch.equal(out, torch.tensor([[0, 1.0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1.0]]))
    out = tfun.vmap(lambda r, i: tfun.at(r)[i].get(mode="fill", fill_value=-1.0))(rows, idx)
    assert torch.equal(out, torch.tensor([0.0, -1.0, 0.0]))
    f = tfun.jit(lambda x, i, v: tfun.at(x)[i].max(v), backend="aot_eager")
    x, i, v = torch.arange(5.0), torch.tensor([0, 0, 9, -1]), torch.tensor([3.0, 5.0, 100.0, 1.0])
    assert torch.equal(f(x, i, v), tfun.at(x)[i].max(v))
    assert torch.equal(f(x, i, v), torch.tensor([5.0, 1, 2, 3, 4]))


def test_errors() -> None:
    with pytest.raises(ArgumentTypeError, match="tfun.at: x must be a torch.Tensor"):
        tfun.at([1, 2])
    with pytest.raises(ArgumentTypeError, match="a torch.float32 tensor"):
        tfun.at(torch.zeros(3))[torch.tensor([0.5])].get()
    with pytest.raises(ArgumentValueError, match="mode must be one of"):
        tfun.at(torch.zeros(3))[0].set(1.0, mode="wrap")
    with pytest.raises(ArgumentValueError, match=r"values.shape: \(4,\), x\[idx\].shape: \(2,\)"):
        tfun.at(torch.zeros(3))[torch.tensor([0, 1])].set(torch.zeros(4))
    with pytest.raises(ArgumentValueError, match="too many indices"):
        tfun.at(torch.zeros(3))[0, 1].get()


@pytest.mark.parametrize("index", ["ij", "i_slice", "slice_i", "i_none_j"])
def test_traced_scalar_tensor_indices_under_jit(index):
    """0-d tensor indices under tfun.jit (JAX's `x.at[i, j].set(v)` with traced i, j): no
    data-dependent read of the index; values and gradients equal eager float64."""
    import tfun

    def f(x, i, j, v):
        idx = {"ij": (i, j), "i_slice": (i, slice(1, 3)), "slice_i": (slice(None), j), "i_none_j": (i, None, j)}[index]
        ref = tfun.at(x)[idx]
        return (ref.set(v * ref.get()) + tfun.at(x)[idx].get().sum()).sum() * x

    x = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4)
    i, j, v = torch.tensor(2), torch.tensor(-1), torch.tensor(1.5, dtype=torch.float64)
    xe = x.clone().requires_grad_()
    ref = f(xe, i, j, v)
    (g_ref,) = torch.autograd.grad(ref.sum(), xe)
    xj = x.clone().requires_grad_()
    out = tfun.jit(f, backend="aot_eager")(xj, i, j, v)
    (g,) = torch.autograd.grad(out.sum(), xj)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g, g_ref)


class _LoopIndexed(torch.nn.Module):
    """A fori_loop reading `xs[i]` and writing `out[i]` through tfun.at, as JAX code does."""

    def forward(self, xs):
        def body(i, c):
            h, out = c
            h = torch.tanh(h * 0.5 + tfun.at(xs)[i].get())
            return h, tfun.at(out)[i].set(h.sum())

        return tfun.lax.fori_loop(0, xs.shape[0], body, (torch.zeros_like(xs[0]), xs.new_zeros(xs.shape[0])))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
def test_loop_index_reads_and_writes_under_export(strict, dynamic):
    """`torch.export` of a fori_loop indexing with its loop counter through tfun.at, run at the
    traced length and (with a `Dim`) at others: values and gradients equal eager float64.
    Non-strict export read `xs[0]` at every step (values off by 3, no error): the clip bound
    `max(n - 1, 0)`, Python's `max` of a symbolic size inside the loop body, came out 0 in the
    exported graph (torch 2.13 and 2.14.1; `n - 1 if n > 0 else 0` is right)."""
    from torch.export import Dim, export

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, generator=g)
    shapes = ({0: Dim("T", min=2, max=64)},) if dynamic else None
    module = export(_LoopIndexed(), (x,), dynamic_shapes=shapes, strict=strict).module()
    for length in (7, 2, 11) if dynamic else (7,):
        xs = torch.randn(length, 3, generator=g)
        x64 = xs.double().requires_grad_()
        want = _LoopIndexed()(x64)
        xe = xs.clone().requires_grad_()
        got = module(xe)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-6)
        (sum((t.double() ** 2).sum() for t in got)).backward()
        (sum((t**2).sum() for t in want)).backward()
        torch.testing.assert_close(xe.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)
