"""Translation helpers for the port of JAX's own test suites (issue 16).

JAX's `jtu.JaxTestCase` gives its tests `assertAllClose`, `check_grads` and `rng()`; these
are their tfun counterparts, in float64 (JAX's suites run with `jax_enable_x64` on CI):

- `assert_all_close(x, y, rtol=, atol=, check_dtypes=False)`: pytrees of tensors, numpy
  arrays and Python numbers; leaves compared as float64 (or exactly, for integers/bools).
- `check_grads(f, args, order, modes=("fwd", "rev"))`: JAX's `jtu.check_grads`: forward
  mode (`tfun.jvp`) against central finite differences, reverse mode (`tfun.vjp`) against
  forward mode by the dot-product identity `<ct, J t> == <J^T ct, t>`, recursively up to
  `order` (derivatives of derivatives), as JAX does.
- `rng()`: `numpy.random.RandomState(0)`, as `self.rng()`.
- `T(x)`: a float64 tensor from a Python number or numpy array (JAX's "weakly typed"
  Python scalars become 0-d float64 tensors where a test differentiates them).

The `float64` fixture is autouse: torch's default dtype is float64 inside every test of
this package and restored afterwards (so other test files in the same xdist worker keep
float32).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import pytest
import torch

import tfun
from tfun.tree import tree_flatten, tree_leaves, tree_map, tree_structure, tree_unflatten


@pytest.fixture(autouse=True)
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def rng() -> np.random.RandomState:
    return np.random.RandomState(0)


def T(x: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor from a Python number / numpy array; floats become float64."""
    if isinstance(x, torch.Tensor):
        return x if dtype is None else x.to(dtype)
    t = torch.as_tensor(np.asarray(x))
    if dtype is not None:
        return t.to(dtype)
    if t.is_floating_point():
        return t.to(torch.float64)
    return t


def _as_array(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().resolve_conj().numpy()
    return np.asarray(x)


def _is_leaf_none(x: Any) -> bool:
    return x is None


def assert_all_close(
    x: Any, y: Any, *, rtol: float = 1e-7, atol: float = 1e-9, check_dtypes: bool = False
) -> None:
    """JAX's `assertAllClose` over pytrees (tuples and lists are interchangeable, as in JAX)."""
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        assert len(x) == len(y), f"lengths differ: {len(x)} vs {len(y)}"
        for a, b in zip(x, y):
            assert_all_close(a, b, rtol=rtol, atol=atol, check_dtypes=check_dtypes)
        return
    if isinstance(x, dict) and isinstance(y, dict):
        assert set(x) == set(y), f"keys differ: {sorted(x)} vs {sorted(y)}"
        for k in x:
            assert_all_close(x[k], y[k], rtol=rtol, atol=atol, check_dtypes=check_dtypes)
        return
    if x is None or y is None:
        assert x is None and y is None, f"{x!r} vs {y!r}"
        return
    if hasattr(x, "_fields") and hasattr(y, "_fields"):  # namedtuples
        assert type(x) is type(y)
        assert_all_close(tuple(x), tuple(y), rtol=rtol, atol=atol, check_dtypes=check_dtypes)
        return
    a, b = _as_array(x), _as_array(y)
    if check_dtypes and isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        assert x.dtype == y.dtype, f"dtypes differ: {x.dtype} vs {y.dtype}"
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    if a.dtype.kind in "biu" and b.dtype.kind in "biu":
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a.astype(np.complex128 if "c" in (a.dtype.kind + b.dtype.kind) else np.float64),
                                   b.astype(np.complex128 if "c" in (a.dtype.kind + b.dtype.kind) else np.float64),
                                   rtol=rtol, atol=atol)


# --- check_grads ---------------------------------------------------------------------


def _float_leaf(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def _rand_like(tree: Any, gen: torch.Generator) -> Any:
    def one(x: Any) -> Any:
        if _float_leaf(x):
            return torch.randn(x.shape, dtype=x.dtype, generator=gen)
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        return x

    return tree_map(one, tree)


def _vdot(a: Any, b: Any) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for x, y in zip(tree_leaves(a), tree_leaves(b)):
        if _float_leaf(x) and _float_leaf(y):
            total = total + (x.to(torch.float64) * y.to(torch.float64)).sum()
    return total


def _axpy(alpha: float, t: Any, x: Any) -> Any:
    return tree_map(lambda ti, xi: xi + alpha * ti if _float_leaf(xi) else xi, t, x)


def _numerical_jvp(f: Callable[..., Any], args: tuple, tangents: tuple, eps: float) -> Any:
    plus = f(*_axpy(eps, tangents, args))
    minus = f(*_axpy(-eps, tangents, args))
    return tree_map(
        lambda p, m: (p - m) / (2 * eps) if _float_leaf(p) else torch.zeros_like(torch.as_tensor(p), dtype=torch.float64),
        plus,
        minus,
    )


def _check_close(x: Any, y: Any, atol: float, rtol: float, what: str) -> None:
    xs = [t for t in tree_leaves(x) if _float_leaf(t)]
    ys = [t for t in tree_leaves(y) if _float_leaf(t)]
    assert len(xs) == len(ys), f"{what}: {len(xs)} vs {len(ys)} float leaves"
    for a, b in zip(xs, ys):
        torch.testing.assert_close(a.detach().to(torch.float64), b.detach().to(torch.float64), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{what}: {m}")


def check_jvp(f: Callable[..., Any], args: tuple, *, atol: float, rtol: float, eps: float, gen: torch.Generator) -> None:
    tangents = _rand_like(args, gen)
    out, t_out = tfun.jvp(f, args, tangents)
    out_ref = f(*args)
    _check_close(out, out_ref, atol, rtol, "jvp primal output")
    _check_close(t_out, _numerical_jvp(f, args, tangents, eps), atol, rtol, "jvp tangent vs finite differences")


def check_vjp(f: Callable[..., Any], args: tuple, *, atol: float, rtol: float, eps: float, gen: torch.Generator) -> None:
    out, vjp_fn = tfun.vjp(f, *args)
    tangents = _rand_like(args, gen)
    ct = _rand_like(out, gen)
    cts_in = vjp_fn(ct)
    t_out = _numerical_jvp(f, args, tangents, eps)
    lhs = _vdot(cts_in, tangents)
    rhs = _vdot(ct, t_out)
    torch.testing.assert_close(lhs, rhs, atol=atol, rtol=rtol, msg=lambda m: f"vjp vs finite differences: {m}")


def check_grads(
    f: Callable[..., Any],
    args: Sequence[Any],
    order: int,
    modes: Sequence[str] = ("fwd", "rev"),
    atol: float = 1e-5,
    rtol: float = 1e-5,
    eps: float = 1e-5,
) -> None:
    """JAX's `jtu.check_grads`, over tfun.jvp / tfun.vjp, in float64."""
    args = tuple(T(a) if isinstance(a, (float, np.ndarray, np.floating)) else a for a in args)
    gen = torch.Generator().manual_seed(0)

    def _check(f: Callable[..., Any], args: tuple, order: int) -> None:
        if "fwd" in modes:
            check_jvp(f, args, atol=atol, rtol=rtol, eps=eps, gen=gen)
            if order > 1:
                tangents = _rand_like(args, gen)
                _check(lambda *a: tfun.jvp(f, a, tangents)[1], args, order - 1)
        if "rev" in modes:
            check_vjp(f, args, atol=atol, rtol=rtol, eps=eps, gen=gen)
            if order > 1:
                ct = _rand_like(f(*args), gen)
                _check(lambda *a: tfun.vjp(f, *a)[1](ct), args, order - 1)

    _check(f, args, order)


def jit(f: Callable[..., Any] | None = None, **kw: Any) -> Any:
    """`jax.jit` in this port: `tfun.jit` with the aot_eager backend (fast to compile)."""
    kw.setdefault("backend", "aot_eager")
    if f is None:
        return lambda g: tfun.jit(g, **kw)
    return tfun.jit(f, **kw)


def linearize(f: Callable[..., Any], *primals: Any) -> tuple[Any, Callable[..., Any]]:
    """`jax.linearize` in this port: `tfun.linearize` (whose `f_lin(*t)` is a `tfun.jvp` at
    `primals`)."""
    return tfun.linearize(f, *primals)
