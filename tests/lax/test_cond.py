"""tfun.lax.cond, switch and select: property tests against Python `if`/indexing, gradients,
and JAX as an oracle."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import DTYPES, Point, as_tensor, assert_grads_close, assert_matches_jax, assert_tree_allclose, materialize, structures
import tfun
from tfun import lax
from tfun.tree import tree_map


# Branches with distinct code objects (tfun caches branch checks per code object).
def br_a(x: Any, y: Any) -> Any:
    return {"out": tree_map(lambda v: v * 2 + 1, x), "y": tree_map(lambda v: v - 1, y)}


def br_b(x: Any, y: Any) -> Any:
    return {"out": tree_map(lambda v: v * 3 - 2, x), "y": tree_map(lambda v: v + 5, y)}


def br_c(x: Any, y: Any) -> Any:
    return {"out": tree_map(lambda v: -v, x), "y": y}


def br_d(x: Any, y: Any) -> Any:
    return {"out": x, "y": tree_map(lambda v: v * v, y)}


BRANCHES = [br_a, br_b, br_c, br_d]


# ----------------------------------------------------------------------------------------
# cond
# ----------------------------------------------------------------------------------------


# Float predicates exactly representable in every floating dtype (so rounding cannot change
# the truth value), with both zeros, NaN and infinity.
FLOAT_PREDS = [0.0, -0.0, 0.5, -2.0, 2.0**-10, float("nan"), float("inf"), float("-inf")]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def preds() -> st.SearchStrategy[tuple[Any, bool]]:
    """(pred, its truth value): Python bools, ints and floats, bool, integer and floating 0-d
    tensors. A number's truth value is Python's `pred != 0` (NaN is true), as in JAX."""
    ints = st.integers(-3, 3)
    floats = st.sampled_from(FLOAT_PREDS)
    return st.one_of(
        floats.map(lambda v: (v, v != 0)),
        st.tuples(floats, st.sampled_from(FLOAT_DTYPES)).map(lambda t: (torch.tensor(t[0], dtype=t[1]), t[0] != 0)),
        st.booleans().map(lambda b: (b, b)),
        st.booleans().map(lambda b: (torch.tensor(b), b)),
        ints.map(lambda i: (i, i != 0)),
        st.tuples(ints, st.sampled_from([torch.int64, torch.int32, torch.int8])).map(
            lambda t: (torch.tensor(t[0], dtype=t[1]), t[0] != 0)
        ),
        st.integers(0, 3).map(lambda i: (torch.tensor(i, dtype=torch.uint8), i != 0)),
    )


@given(
    pred=preds(),
    x_t=structures(st.sampled_from(["t", "t", "i", "f"])),
    y_t=structures(),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
    swap=st.booleans(),
)
def test_cond_matches_python_if(pred, x_t, y_t, dtype, seed, swap):
    p, truth = pred
    x = materialize(x_t, dtype, seed)
    y = materialize(y_t, dtype, seed + 1)
    t_fun, f_fun = (br_b, br_a) if swap else (br_a, br_b)
    out = lax.cond(p, t_fun, f_fun, x, y)
    # Python scalars among the operands reach the branch as 0-d tensors
    xt, yt = tree_map(as_tensor, x), tree_map(as_tensor, y)
    want = t_fun(xt, yt) if truth else f_fun(xt, yt)
    assert_tree_allclose(out, want, rtol=0, atol=0)


def test_cond_five_argument_form():
    # JAX's older form cond(pred, true_operand, true_fun, false_operand, false_fun), still accepted by JAX
    x, y = torch.arange(3.0), torch.tensor(5)
    assert torch.equal(lax.cond(True, x, lambda a: a * 2, y, lambda b: torch.zeros(3) + b), x * 2)
    assert torch.equal(lax.cond(torch.tensor(False), x, lambda a: a * 2, y, lambda b: torch.zeros(3) + b), torch.full((3,), 5.0))
    with pytest.raises(TypeError):
        lax.cond(True, x, lambda a: a, y, 3)


def test_cond_operands_forms():
    x = torch.arange(3.0)
    assert lax.cond(True, lambda: torch.tensor(1), lambda: torch.tensor(2)).item() == 1
    assert torch.equal(lax.cond(False, lambda a: a + 1, lambda a: a - 1, operand=x), x - 1)
    out = lax.cond(torch.tensor(-7), lambda a, b, c: (a, b + c), lambda a, b, c: (a - 1, c - b), 1, 2.5, x)
    assert out[0].dtype == torch.int64 and out[0].item() == 1
    assert out[1].dtype == torch.float32 and torch.equal(out[1], x + 2.5)


def test_cond_closures_with_different_output_structures():
    def make(k):
        return lambda v: (v,) * k

    x = torch.ones(2)
    assert len(lax.cond(True, make(1), make(1), x)) == 1
    assert len(lax.cond(True, make(2), make(2), x)) == 2


# ----------------------------------------------------------------------------------------
# switch
# ----------------------------------------------------------------------------------------


@given(
    n_branches=st.integers(1, 4),
    index=st.integers(-4, 7),
    index_kind=st.sampled_from(["int", "int64", "int32", "uint8"]),
    x_t=structures(st.sampled_from(["t", "t", "i", "f"])),
    y_t=structures(),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_switch_matches_clamped_indexing(n_branches, index, index_kind, x_t, y_t, dtype, seed):
    if index_kind == "uint8":
        index = abs(index)
    idx = index if index_kind == "int" else torch.tensor(index, dtype=getattr(torch, index_kind))
    x = materialize(x_t, dtype, seed)
    y = materialize(y_t, dtype, seed + 1)
    branches = BRANCHES[:n_branches]
    out = lax.switch(idx, branches, x, y)
    k = min(max(index, 0), n_branches - 1)
    want = branches[k](tree_map(as_tensor, x), tree_map(as_tensor, y))
    assert_tree_allclose(out, want, rtol=0, atol=0)


def test_switch_clamps_exactly_at_the_edges():
    branches = [lambda: torch.tensor(0), lambda: torch.tensor(1), lambda: torch.tensor(2)]
    got = [lax.switch(i, branches).item() for i in [-(2**40), -1, 0, 1, 2, 3, 2**40]]
    assert got == [0, 0, 0, 1, 2, 2, 2]
    got = [lax.switch(torch.tensor(i), branches).item() for i in [-(2**40), -1, 0, 1, 2, 3, 2**40]]
    assert got == [0, 0, 0, 1, 2, 2, 2]
    assert lax.switch(5, (lambda a: a * 2,), operand=torch.tensor(3)).item() == 6


# ----------------------------------------------------------------------------------------
# select
# ----------------------------------------------------------------------------------------


def ref_select(pred: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise `a if p else b`, without torch.where."""
    p = pred.expand(a.shape) if pred.dim() == 0 else pred
    out = b.clone()
    out[p] = a[p]
    return out


@given(
    t_t=structures(),
    shape=st.sampled_from([(), (3,), (2, 3)]),
    pred_kind=st.sampled_from(["bool", "scalar", "full"]),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_select_matches_elementwise_choice(t_t, shape, pred_kind, dtype, seed):
    a = materialize(t_t, dtype, seed, shape=shape)
    b = materialize(t_t, dtype, seed + 1, shape=shape)
    g = torch.Generator().manual_seed(seed)
    if pred_kind == "full":
        pred = torch.rand(shape, generator=g) < 0.5
    else:
        pred = bool(torch.rand((), generator=g) < 0.5)
        if pred_kind == "scalar":
            pred = torch.tensor(pred)
    out = lax.select(pred, a, b)
    p = torch.as_tensor(pred)
    want = tree_map(lambda u, v: ref_select(p, u, v), a, b)
    assert_tree_allclose(out, want, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------


def _branches(W: torch.Tensor) -> list[Any]:
    return [
        lambda x, h: {"o": torch.tanh(x @ W) * h, "s": (h * h).sum()},
        lambda x, h: {"o": torch.sin(x) + h @ W, "s": (x * h).sum()},
        lambda x, h: {"o": x * h, "s": (W * W).sum() + x.sum()},
    ]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_switch_and_cond_grads_match_python(k):
    g = torch.Generator().manual_seed(k)
    W = torch.randn(3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    h = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    branches = _branches(W)

    def loss(out):
        return (out["o"] * torch.arange(1.0, 4.0, dtype=torch.float64)).sum() + out["s"] ** 2

    want = torch.autograd.grad(loss(branches[k](x, h)), (W, x, h), allow_unused=True)
    got = torch.autograd.grad(loss(lax.switch(torch.tensor(k), branches, x, h)), (W, x, h), allow_unused=True)
    assert_grads_close(got, want, rtol=1e-12, atol=1e-12)
    if k < 2:
        got = torch.autograd.grad(loss(lax.cond(k == 0, branches[0], branches[1], x, h)), (W, x, h), allow_unused=True)
        assert_grads_close(got, want, rtol=1e-12, atol=1e-12)


def test_cond_switch_select_gradcheck():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([True, False, True])

    def fn(x, y):
        a = lax.cond(torch.tensor(1), lambda u, v: u * v.exp(), lambda u, v: u - v, x, y)
        b = lax.switch(-1, [lambda u: u.sin() * y, lambda u: u], x)
        c = lax.select(mask, x * y, y.cos())
        return a, b, c

    assert torch.autograd.gradcheck(fn, (x, y))


# ----------------------------------------------------------------------------------------
# JAX as a differential oracle
# ----------------------------------------------------------------------------------------


def _jx_branches(lib: Any) -> list[Any]:
    return [
        lambda x, k: {"h": lib.tanh(x) * 2, "k": Point(k + 1, k * 2)},
        lambda x, k: {"h": x * x - 1, "k": Point(k - 1, k * 3)},
        lambda x, k: {"h": lib.sin(x), "k": Point(k, -k)},
    ]


@pytest.mark.parametrize("pred", [True, False, 0, 3, -2, 0.0, -0.0, 0.25, -3.5, float("nan"), float("inf")])
def test_cond_matches_jax(jax, pred):
    jnp = jax.numpy
    x = np.linspace(-1, 1, 4)
    k = np.int64(5)
    tb, fb = _jx_branches(torch)[:2]
    ours = lax.cond(torch.tensor(pred), tb, fb, torch.from_numpy(x), torch.tensor(k))
    tb, fb = _jx_branches(jnp)[:2]
    theirs = jax.lax.cond(jnp.asarray(pred), tb, fb, jnp.asarray(x), jnp.asarray(k))
    assert_matches_jax(ours, theirs)


@pytest.mark.parametrize("index", [-5, -1, 0, 1, 2, 3, 100])
def test_switch_matches_jax(jax, index):
    jnp = jax.numpy
    x = np.linspace(-1, 1, 4)
    k = np.int64(5)
    ours = lax.switch(torch.tensor(index), _jx_branches(torch), torch.from_numpy(x), torch.tensor(k))
    theirs = jax.lax.switch(jnp.asarray(index), _jx_branches(jnp), jnp.asarray(x), jnp.asarray(k))
    assert_matches_jax(ours, theirs)
    ours = lax.switch(index, _jx_branches(torch), torch.from_numpy(x), torch.tensor(k))
    assert_matches_jax(ours, theirs)


@pytest.mark.parametrize("scalar_pred", [False, True])
def test_select_matches_jax(jax, scalar_pred):
    jnp = jax.numpy
    rng = np.random.default_rng(int(scalar_pred))
    pred = np.bool_(True) if scalar_pred else rng.random((2, 3)) < 0.5
    a = {"f": rng.standard_normal((2, 3)), "i": rng.integers(-9, 9, (2, 3))}
    b = {"f": rng.standard_normal((2, 3)), "i": rng.integers(-9, 9, (2, 3))}
    ours = lax.select(torch.as_tensor(pred), tree_map(torch.from_numpy, a), tree_map(torch.from_numpy, b))
    theirs = {k: jax.lax.select(jnp.asarray(pred), jnp.asarray(a[k]), jnp.asarray(b[k])) for k in a}
    assert_matches_jax(ours, theirs, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------
# The branch check keeps nothing alive
# ----------------------------------------------------------------------------------------


def test_cond_check_keeps_no_output_or_graph_alive():
    import gc
    import weakref

    from tfun import _rules

    w = torch.randn(64, 64, requires_grad=True)

    def up(x):
        return torch.tanh(x @ w)

    def down(x):
        return torch.sigmoid(x @ w)

    refs = []
    for n in range(1, 21):  # 20 signatures: 20 first calls, each checked and cached
        out = lax.cond(n % 2 == 0, up, down, torch.randn(n, 64))
        refs.append(weakref.ref(out))
        del out
    gc.collect()
    assert [r() for r in refs] == [None] * 20

    def tensors_in(v):
        if isinstance(v, torch.Tensor):
            return 1
        if isinstance(v, (tuple, list)):
            return sum(tensors_in(u) for u in v)
        return 0

    assert sum(tensors_in(v) for v in _rules._SEEN.values()) == 0


@pytest.mark.parametrize("pred", [True, False])
def test_cond_python_scalar_outputs_check_as_the_tensors_they_become(jax, pred):
    # The branch not taken, evaluated on fake tensors, returns the Python scalar itself;
    # it must be compared as the 0-d tensor it becomes when taken (it was refused).
    out = lax.cond(pred, lambda: 0, lambda: 1)
    assert out.dtype == torch.int64 and out.item() == (0 if pred else 1)
    assert int(jax.lax.cond(pred, lambda: 0, lambda: 1)) == out.item()
    out = lax.cond(pred, lambda x: 1.5, lambda x: x.sum(), torch.ones(2))
    assert out.dtype == torch.float32 and out.item() == (1.5 if pred else 2.0)
    out = lax.switch(int(pred), [lambda: False, lambda: True])
    assert out.dtype == torch.bool and out.item() is pred


def test_switch_static_python_index_under_jit():
    # a Python index under tfun.jit (a static argument) lowers like a tensor index, clamped
    branches = [lambda x: -x, lambda x: x * 2]
    f = tfun.jit(lambda i, x: lax.switch(i, branches, x), static_argnums=0, backend="aot_eager")
    x = torch.tensor(3.0)
    assert [f(i, x).item() for i in (-1, 0, 1, 5)] == [-3.0, -3.0, 6.0, 6.0]
    g = tfun.jit(lambda i, x: lax.switch(i, [lambda x: -x], x), static_argnums=0, backend="aot_eager")
    assert g(1, x).item() == -3.0


@pytest.mark.parametrize(("op", "how"), [("cond", "backward"), ("switch", "tfun.grad")])
def test_gradient_broadcast_in_one_branch_only_under_jit(op, how):
    """Regression: one branch's gradient of `w` is a broadcast (stride 0, from `w.sum()`, `w`
    closed over or an operand) and the other's a zero or a dense tensor. torch 2.13's cond
    backward refused to merge the two ("expected b_val == 0 when a_val == 0"), so `tfun.jit`
    failed to compile; `_compat.cond_autograd_fixes` makes the branches' gradients dense."""
    w = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)

    def f(x, w):
        if op == "cond":
            y = lax.cond(x.sum() > 0, lambda x, v: torch.tanh(x), lambda x, v: x * v.sum(), x, w)
        else:
            index = (x.sum().abs() * 5).to(torch.int64) % 3
            y = lax.switch(index, [lambda x: torch.tanh(x), lambda x: x * w.sum(), lambda x: torch.exp(-x * x)], x)
        return (y * torch.tensor([1.0, 2.0, 3.0], dtype=y.dtype)).sum() + (w * w).sum()

    for x in (torch.tensor([0.1, 0.2, -0.1], dtype=torch.float64), torch.tensor([-0.3, 0.2, -0.1], dtype=torch.float64)):
        want = tfun.grad(f, argnums=(0, 1))(x, w)
        if how == "backward":
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            tfun.jit(f, backend="aot_eager")(xx, ww).backward()
            got = (xx.grad, ww.grad)
        else:
            got = tfun.jit(tfun.grad(f, argnums=(0, 1)), backend="aot_eager")(x, w)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------
# Float predicates: `pred != 0`, as in JAX, on every path
# ----------------------------------------------------------------------------------------


def _float_pred_branches():
    return (lambda x: torch.sin(x) * 2, lambda x: x * x - 1)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("value", FLOAT_PREDS)
def test_float_pred_is_pred_ne_zero_eager_and_under_jit(dtype, value):
    tb, fb = _float_pred_branches()
    x = torch.linspace(-1, 1, 5, dtype=torch.float64)
    want = tb(x) if value != 0 else fb(x)  # the oracle: Python's `if pred != 0` in float64
    p = torch.tensor(value, dtype=dtype)
    torch.testing.assert_close(lax.cond(p, tb, fb, x), want, rtol=0, atol=0)
    f = tfun.jit(lambda p, x: lax.cond(p, tb, fb, x), backend="aot_eager")
    torch.testing.assert_close(f(p, x), want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_float_pred_under_jit_backends(backend):
    tb, fb = _float_pred_branches()
    f = tfun.jit(lambda p, x: lax.cond(p, tb, fb, x), backend=backend)
    x = torch.linspace(-1, 1, 5, dtype=torch.float64)
    for value in (0.0, -0.0, 1.5, float("nan")):
        want = tb(x) if value != 0 else fb(x)
        torch.testing.assert_close(f(torch.tensor(value, dtype=torch.float32), x), want)


def test_float_pred_batched_under_vmap_matches_jax(jax):
    jnp = jax.numpy
    ps = np.array([0.0, -0.0, 0.5, float("nan"), -1.0, float("inf")])
    x = np.linspace(-1, 1, 6)
    tb, fb = _float_pred_branches()
    ours = tfun.vmap(lambda p, x: lax.cond(p, tb, fb, x))(torch.from_numpy(ps), torch.from_numpy(x))
    theirs = jax.vmap(lambda p, x: jax.lax.cond(p, jnp.sin(x) * 2, lambda v: v, x * x - 1, lambda v: v))(ps, x)
    assert_matches_jax(ours, theirs)
    want = torch.from_numpy(np.where(ps != 0, np.sin(x) * 2, x * x - 1))
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("how", ["eager", "vmap", "jit"])
def test_float_pred_gets_no_gradient_and_operands_do(how):
    """tfun.grad through the operands of a cond with a float pred; a pred that requires grad
    (or is differentiated) changes nothing and gets a zero gradient, as in JAX."""

    def loss(p, x):
        return lax.cond(p, lambda v: (v * v).sum(), lambda v: torch.sin(v).sum(), x)

    x = torch.tensor([0.3, -0.7], dtype=torch.float64)
    g = tfun.grad(loss, argnums=(0, 1))
    if how == "vmap":
        g = tfun.vmap(g)
        ps, xs = torch.tensor([0.0, 2.5], dtype=torch.float64), torch.stack([x, x])
        gp, gx = g(ps, xs)
        assert gp.tolist() == [0.0, 0.0]
        torch.testing.assert_close(gx, torch.stack([torch.cos(x), 2 * x]))
        return
    if how == "jit":
        g = tfun.jit(g, backend="aot_eager")
    for value, want in ((0.0, torch.cos(x)), (2.5, 2 * x), (float("nan"), 2 * x)):
        gp, gx = g(torch.tensor(value, dtype=torch.float64), x)
        assert gp.item() == 0.0
        torch.testing.assert_close(gx, want)
    # A pred that requires grad: the output's graph runs through the operands only.
    p = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    xr = x.clone().requires_grad_()
    out = (tfun.jit(loss, backend="aot_eager") if how == "jit" else loss)(p, xr)
    out.backward()
    assert p.grad is None
    torch.testing.assert_close(xr.grad, 2 * x)


@pytest.mark.parametrize("index", [torch.tensor(0.5), torch.tensor(1.0), 1.0, torch.tensor(True)])
def test_switch_index_must_be_an_integer_as_in_jax(jax, index):
    # JAX: "Index type must be an integer"; cond's float pred does not extend to switch.
    with pytest.raises(tfun.errors.ArgumentTypeError, match=r"tfun\.lax\.switch: index must be an integer scalar"):
        lax.switch(index, [lambda: 0, lambda: 1])
    jindex = jax.numpy.asarray(index.numpy()) if isinstance(index, torch.Tensor) else index
    with pytest.raises(TypeError, match="Index type must be an integer"):
        jax.lax.switch(jindex, [lambda: 0, lambda: 1])


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
@pytest.mark.parametrize("op", ["cond", "switch", "map"])
def test_integer_outputs_next_to_differentiated_ones_under_jit(op, backend):
    """An integer or bool output beside a differentiated float one, under tfun.jit with
    `tfun.grad` inside and with `.backward()` after: it failed to compile (torch's autograd of
    cond/map asks a tangent of every output: "outs_to_grad length (1) != tangents length (2)";
    hunt, session 21). Integer outputs now cross the HOP as int64 bits, as a scan's do."""

    def f(x):
        if op == "cond":
            r = lax.cond(x.sum() > 0, lambda u: (u.sin(), (u > 0).sum(), u > 0), lambda u: (u.cos(), (u < 0).sum(), u < 0), x)
        elif op == "switch":
            r = lax.switch((x.sum() > 0).long() + 1, [lambda u: (u, u.argmin(), u > 1)] * 2 + [lambda u: (u.tanh(), u.argmax(), u < 1)], x)
        else:
            r = lax.map(lambda u: (u.sin(), u.argmax(), (u > 0).any()), x.reshape(2, 2))
        return r[0].sum(), (r[1], r[2])

    x = torch.tensor([0.3, -0.2, 0.5, 0.1], dtype=torch.float64)
    (want_v, want_aux), want_g = tfun.value_and_grad(f, has_aux=True)(x)
    torch._dynamo.reset()
    (v, aux), g = tfun.jit(tfun.value_and_grad(f, has_aux=True), backend=backend)(x)
    torch.testing.assert_close(g, want_g)
    for a, b in zip(aux, want_aux):
        assert a.dtype == b.dtype and torch.equal(a, b)
    torch._dynamo.reset()
    xx = x.clone().requires_grad_()
    v, aux = tfun.jit(f, backend=backend)(xx)
    v.backward()
    torch.testing.assert_close(xx.grad, want_g)
    for a, b in zip(aux, want_aux):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_branch_closing_over_a_non_leaf_that_requires_grad_warns_nothing():
    """The branch not taken is checked on fake tensors; a closed-over slice of a differentiated
    input (a non-leaf that requires grad) is made fake on first use, and torch's conversion
    reads its `.grad`, which warned ("The .grad attribute of a Tensor that is not a leaf"), an
    error under this suite's warnings-as-errors (hunt 22). The values and gradient are eager's."""
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    xt = x[1]
    out = lax.cond(torch.tensor(True), lambda h: h + xt, lambda h: h * 0.5 - xt, torch.zeros(4, dtype=torch.float64))
    (g,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, xt.detach())
    torch.testing.assert_close(g, torch.zeros_like(x).index_fill(0, torch.tensor([1]), 1.0))


@pytest.mark.parametrize("op", ["cond", "switch"])
def test_operands_that_are_views_of_one_tensor_compile(op):
    """`cond(p, f, g, x[0], x[1])` under tfun.jit: torch's cond refuses operands that share
    memory ("Higher order ops do not support aliasing"); tfun passes a copy of the later one,
    as the loops do (hunt 22). A branch that closes over a view of an operand's tensor is
    still refused, by a JitError that says what to pass instead."""
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    if op == "cond":
        f = lambda x: lax.cond(x.sum() > 0, lambda a, b: a * b, lambda a, b: a - b, x[0], x[1])
    else:
        f = lambda x: lax.switch((x.sum() > 0).to(torch.int64), [lambda a, b: a - b, lambda a, b: a * b], x[0], x[1])
    torch._dynamo.reset()
    torch.testing.assert_close(tfun.jit(f, backend="aot_eager")(x), f(x))
    closes = lambda x: lax.cond(x.sum() > 0, lambda c: c * x[1], lambda c: c - x[1], x[0])
    torch._dynamo.reset()
    with pytest.raises(tfun.errors.JitError, match=r"share memory: views of one tensor") as info:
        tfun.jit(closes, backend="aot_eager")(x)
    assert "x[0].clone()" in str(info.value)


_RETURNS_WHAT_IT_READS = {
    # a branch returning a tensor it closes over, unchanged (picking a parameter)
    "cond(p, lambda: W1, lambda: W2)": lambda x, W1, W2: lax.cond(x.sum() > 0, lambda: W1, lambda: W2) @ x.T,
    "switch(i, [lambda: W1, lambda: W2])": lambda x, W1, W2: lax.switch((x.sum() > 0).long(), [lambda: W1, lambda: W2]) @ x.T,
    "cond(p, lambda a: W1, lambda a: a.T @ a, x)": lambda x, W1, W2: lax.cond(x.sum() > 0, lambda a: W1, lambda a: a.T @ a, x),
    # a branch reading an attribute view of its operand
    "cond(p, lambda a: a * 3, lambda a: a.T @ a, W1)": lambda x, W1, W2: lax.cond(x.sum() > 0, lambda a: a * 3, lambda a: a.T @ a, W1) @ x.T,
    "switch(i, [lambda a: a.mT @ a, lambda a: a * 3], W2)": lambda x, W1, W2: lax.switch((x.sum() > 0).long(), [lambda a: a.mT @ a, lambda a: a * 3], W2) @ x.T,
    # branch outputs in different memory layouts (JAX has none)
    "cond(p, lambda a: a * 3, lambda a: a.T * 1, W1)": lambda x, W1, W2: lax.cond(x.sum() > 0, lambda a: a * 3, lambda a: a.T * 1, W1) @ x.T,
    # a map body returning a tensor it closes over
    "map(lambda r: (r @ W1, W1), x)": lambda x, W1, W2: sum(y.sum(0) for y in lax.map(lambda r: (r @ W1, W1), x)),
    # a scan body's y, and a while_loop body's new carry, that is a tensor it closes over (hunt 27)
    "scan(lambda c, r: (c * 0.5 + r @ W1, W2), x[0], x)": lambda x, W1, W2: (
        lambda c, ys: c.sum() + ys.sum(0))(*lax.scan(lambda c, r: (c * 0.5 + r @ W1, W2), x[0], x)),
    "while_loop(c[0] < 3, lambda c: (c[0] + 1, c[1] @ W1, W2), ...)": lambda x, W1, W2: sum(
        t.sum() for t in lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, torch.tanh(c[1] @ W1), W2), (0, x, W1))[1:]),
}


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
@pytest.mark.parametrize("case", list(_RETURNS_WHAT_IT_READS))
def test_a_branch_or_body_returning_what_it_reads_compiles(case, backend):
    """Hunt 25 (F6, F7), hunt 27: under tfun.jit, torch's cond, map, scan and while_loop refused
    a branch or body output that is a tensor the function closes over (`cond(p, lambda: W1,
    lambda: W2)`; cond and scan under `torch.no_grad()` only, while_loop always), an
    attribute view of an operand read in a branch (`a.T`: Dynamo lifted it as a second
    operand sharing memory with the first), and branch outputs in different memory layouts,
    each with a message about views the program did not have. Values and every input's
    gradient against eager float64, each branch taken by one of two calls: the jitted `f`'s
    values in grad mode (inputs requiring grad, then its `.backward()`) and under no_grad,
    and `tfun.jit(tfun.grad(loss))`. (A jitted `loss` differentiated outside, next to `f` on
    inputs that required no grad, compiled the same two paths a third time.)"""
    f = _RETURNS_WHAT_IT_READS[case]
    loss = lambda x, W1, W2: (f(x, W1, W2) ** 2).sum()
    torch._dynamo.reset()
    jf = tfun.jit(f, backend=backend)
    jgrad = tfun.jit(tfun.grad(loss, argnums=(0, 1, 2)), backend=backend)
    g = torch.Generator().manual_seed(7)
    for sign in (1.0, -1.0):
        x = sign * (torch.rand(5, 3, dtype=torch.float64, generator=g) + 0.1)
        W1, W2 = torch.randn(3, 3, dtype=torch.float64, generator=g), torch.randn(3, 3, dtype=torch.float64, generator=g)
        with torch.no_grad():  # (inference: torch's lowering refused the aliasing here too, hunt 27)
            torch.testing.assert_close(jf(x, W1, W2), f(x, W1, W2), rtol=1e-12, atol=1e-12)
        want = tfun.grad(loss, argnums=(0, 1, 2))(x, W1, W2)
        for a, b in zip(jgrad(x, W1, W2), want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        args = [t.clone().requires_grad_() for t in (x, W1, W2)]
        out = jf(*args)
        torch.testing.assert_close(out.detach(), f(x, W1, W2), rtol=1e-12, atol=1e-12)
        (out**2).sum().backward()
        for a, b in zip(args, want):  # (no `.grad` for an input the function does not read)
            torch.testing.assert_close(torch.zeros_like(b) if a.grad is None else a.grad, b, rtol=1e-12, atol=1e-12)
