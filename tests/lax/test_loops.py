"""tfun.lax.while_loop and fori_loop: property tests against Python loops, gradients, and
JAX as an oracle."""

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
from tfun.errors import ArgumentValueError, JitError
from tfun.tree import tree_map


def update(tree: Any, i: torch.Tensor) -> Any:
    """An order-sensitive update of every leaf by the step `i`."""

    def up(v: torch.Tensor) -> torch.Tensor:
        if v.is_floating_point():
            return v * 0.5 + i.to(v.dtype)
        return v * 2 - i.to(v.dtype)

    return tree_map(up, tree)


# ----------------------------------------------------------------------------------------
# while_loop
# ----------------------------------------------------------------------------------------


def ref_while(cond_fun: Any, body_fun: Any, init: Any) -> Any:
    val = tree_map(as_tensor, init)
    while cond_fun(val):
        val = body_fun(val)
    return val


def w_cond(val: Any) -> Any:
    i, n, _ = val
    return i < n


def w_body(val: Any) -> Any:
    i, n, tree = val
    return i + 1, n, update(tree, i)


@given(
    tree_t=structures(st.sampled_from(["t", "t", "i", "f"])),
    n=st.integers(0, 5),
    python_counter=st.booleans(),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_while_loop_matches_python_loop(tree_t, n, python_counter, dtype, seed):
    tree = materialize(tree_t, dtype, seed)
    init = (0, n, tree) if python_counter else (torch.tensor(0), torch.tensor(n), tree)
    out = lax.while_loop(w_cond, w_body, init)
    want = ref_while(w_cond, w_body, init)
    assert_tree_allclose(out, want, rtol=0, atol=0)
    assert out[0].dtype == torch.int64 and out[0].item() == n


def test_while_loop_data_dependent_trip_count():
    def cond_fun(v):
        return v["x"].abs().sum() < 100.0

    def body_fun(v):
        return {"x": v["x"] * 1.7 + 0.1, "k": v["k"] + 1}

    init = {"x": torch.tensor([0.5, -0.25], dtype=torch.float64), "k": 0}
    out = lax.while_loop(cond_fun, body_fun, init)
    want = ref_while(cond_fun, body_fun, init)
    assert_tree_allclose(out, want, rtol=0, atol=0)
    assert out["k"].item() > 3
    # Python bool predicates and a zero-trip loop return init (as tensors)
    out = lax.while_loop(lambda v: False, lambda v: v + 1, 2.5)
    assert out.dtype == torch.float32 and out.item() == 2.5


def test_while_loop_python_int_carry_becomes_int64():
    out = lax.while_loop(lambda v: v[0] < 10, lambda v: (v[0] * 2 + 1, v[1] + 0.5), (1, 0.0))
    assert out[0].dtype == torch.int64 and out[0].shape == () and out[0].item() == 15
    assert out[1].dtype == torch.float32 and out[1].item() == 1.5


# ----------------------------------------------------------------------------------------
# fori_loop
# ----------------------------------------------------------------------------------------


def ref_fori(lower: int, upper: int, body_fun: Any, init: Any, i_dtype: torch.dtype) -> Any:
    val = tree_map(as_tensor, init)
    for i in range(lower, upper):
        val = body_fun(torch.tensor(i, dtype=i_dtype), val)
    return val


def f_body(i: torch.Tensor, val: Any) -> Any:
    # The carry keeps the last index seen: its dtype is pinned by init, so an index of
    # another dtype would fail the carry check.
    _, tree = val
    return i, update(tree, i)


BOUND_KINDS = ["int", "int64", "int32"]


@given(
    tree_t=structures(st.sampled_from(["t", "t", "i", "f"])),
    lower=st.integers(-3, 4),
    span=st.integers(-2, 5),
    kinds=st.tuples(st.sampled_from(BOUND_KINDS), st.sampled_from(BOUND_KINDS)),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_fori_loop_matches_python_loop(tree_t, lower, span, kinds, dtype, seed):
    upper = lower + span
    bounds = [v if k == "int" else torch.tensor(v, dtype=getattr(torch, k)) for v, k in zip((lower, upper), kinds)]
    tensors = [b for b in bounds if isinstance(b, torch.Tensor)]
    if not tensors:
        i_dtype = torch.int64
    elif len(tensors) == 1:
        i_dtype = tensors[0].dtype
    else:
        i_dtype = torch.promote_types(tensors[0].dtype, tensors[1].dtype)
    tree = materialize(tree_t, dtype, seed)
    init = (torch.tensor(-100, dtype=i_dtype), tree)
    out = lax.fori_loop(bounds[0], bounds[1], f_body, init)
    want = ref_fori(lower, upper, f_body, init, i_dtype)
    assert_tree_allclose(out, want, rtol=0, atol=0)
    assert out[0].item() == (upper - 1 if upper > lower else -100)


def test_fori_loop_empty_range_returns_init():
    x = torch.randn(3)
    assert torch.equal(lax.fori_loop(5, 5, lambda i, v: v + 1, x), x)
    assert torch.equal(lax.fori_loop(torch.tensor(7), torch.tensor(2), lambda i, v: v + 1, x), x)
    out = lax.fori_loop(3, 0, lambda i, v: (v[0] + i, v[1]), (0, 1.0))
    assert out[0].dtype == torch.int64 and out[0].item() == 0
    assert out[1].dtype == torch.float32 and out[1].item() == 1.0


def test_fori_loop_unroll_needs_a_static_trip_count():
    """As in JAX: an int `unroll` other than 1 with a traced or per-example bound is an
    ArgumentValueError (a ValueError); None, False, 1 and (JAX's test is `unroll != 1`) True
    pass. Eager tensor bounds and Python-int bounds accept any unroll."""
    import tfun

    body = lambda i, c: c + 1
    x = torch.zeros(())
    assert lax.fori_loop(torch.tensor(0), torch.tensor(5), body, x, unroll=3).item() == 5
    j = tfun.jit(lambda n, c, u: lax.fori_loop(0, n, body, c, unroll=u), backend="aot_eager", static_argnums=2)
    for u in (None, False, 1, True):
        assert j(torch.tensor(4), x, u).item() == 4
    for u in (2, 0):
        with pytest.raises(ArgumentValueError, match="static trip count"):
            j(torch.tensor(4), x, u)
    assert tfun.jit(lambda c: lax.fori_loop(0, 4, body, c, unroll=2), backend="aot_eager")(x).item() == 4
    with pytest.raises(ValueError, match="differs per example"):
        tfun.vmap(lambda n: lax.fori_loop(0, n, body, x, unroll=2))(torch.tensor([1, 2]))
    assert tfun.vmap(lambda n: lax.fori_loop(0, n, body, x, unroll=1))(torch.tensor([1, 2])).tolist() == [1, 2]


def test_traced_fori_loop_bounds_are_named_in_fori_loops_messages():
    """Hunt 31, finding 5: numpy bounds are traced under tfun.jit (Dynamo makes numpy values
    arrays), so the loop has no static trip count. The messages are fori_loop's (not those of
    the while_loop it would lower to), say that a numpy bound is why, and what to pass."""
    import tfun

    body = lambda i, c: c * 0.5 + 1
    x = torch.zeros(2, 3)
    want = tfun.vmap(lambda c: lax.fori_loop(np.int64(0), np.int64(3), body, c))(x)  # eagerly: ints
    torch.testing.assert_close(want, tfun.vmap(lambda c: lax.fori_loop(0, 3, body, c))(x))
    for lo, hi, why in [(np.int64(0), np.int64(3), "a numpy value"), (torch.tensor(0), torch.tensor(3), "a traced tensor")]:
        torch._dynamo.reset()
        with pytest.raises(JitError, match=r"^tfun\.lax\.fori_loop: under tfun\.jit inside a torch\.func transform") as info:
            tfun.jit(tfun.vmap(lambda c: lax.fori_loop(lo, hi, body, c)), backend="aot_eager")(x)
        msg = str(info.value)
        assert why in msg and "static_argnums" in msg and "test_loops.py" in msg and "while_loop:" not in msg
        torch._dynamo.reset()
        with pytest.raises(ArgumentValueError, match="static trip count") as info:
            tfun.jit(lambda c: lax.fori_loop(lo, hi, body, c, unroll=2), backend="aot_eager")(x[0])
        assert why in str(info.value) and "static_argnums" in str(info.value)
    torch._dynamo.reset()
    # the fix the messages give: a numpy bound passed in a static argument reaches f as an int
    j = tfun.jit(lambda c, n: tfun.vmap(lambda c: lax.fori_loop(0, n, body, c))(c), backend="aot_eager", static_argnums=1)
    torch.testing.assert_close(j(x, np.int64(3)), want)


def test_fori_loop_python_int_carry_sums_indices():
    out = lax.fori_loop(2, 7, lambda i, v: v + i, 0)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int64 and out.item() == sum(range(2, 7))


# ----------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------


def test_fori_and_while_grads_match_python_loop():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)

    def body(i, c):
        h, acc = c
        h = torch.tanh(h @ W + xs[i])
        return h, acc + (h * h).sum() * (i + 1)

    def loss(c):
        return c[0].sum() + c[1]

    init = (h0, torch.zeros((), dtype=torch.float64))
    want = torch.autograd.grad(loss(ref_fori(1, 5, body, init, torch.int64)), (W, h0, xs))

    got = torch.autograd.grad(loss(lax.fori_loop(1, 5, body, init)), (W, h0, xs))
    assert_grads_close(got, want, rtol=1e-12, atol=1e-12)

    got = torch.autograd.grad(loss(lax.fori_loop(torch.tensor(1), torch.tensor(5), body, init)), (W, h0, xs))
    assert_grads_close(got, want, rtol=1e-12, atol=1e-12)

    def w_cond_(c):
        return c[0] < 5

    def w_body_(c):
        i, h, acc = c
        h, acc = body(i, (h, acc))
        return i + 1, h, acc

    out = lax.while_loop(w_cond_, w_body_, (1, h0, torch.zeros((), dtype=torch.float64)))
    got = torch.autograd.grad(out[1].sum() + out[2], (W, h0, xs))
    assert_grads_close(got, want, rtol=1e-12, atol=1e-12)


def test_fori_and_while_gradcheck():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)

    def fn(W, h0):
        a = lax.fori_loop(0, 3, lambda i, h: torch.sin(h @ W) * (i + 1), h0)
        b = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, torch.cos(c[1]) @ W), (0, h0))[1]
        return a, b

    assert torch.autograd.gradcheck(fn, (W, h0))


# ----------------------------------------------------------------------------------------
# JAX as a differential oracle
# ----------------------------------------------------------------------------------------


def test_while_loop_matches_jax(jax):
    jnp = jax.numpy

    def make(lib):
        def cond_fun(c):
            return (c["x"] * c["x"]).sum() < 50.0

        def body_fun(c):
            return {"x": c["x"] * 1.3 + lib.sin(c["x"]), "n": Point(c["n"].x + 1, c["n"].y * 2 - c["n"].x)}

        return cond_fun, body_fun

    x = np.array([0.3, -0.2, 0.1])
    ours = lax.while_loop(*make(torch), {"x": torch.from_numpy(x), "n": Point(torch.tensor(0), torch.tensor(1))})
    theirs = jax.lax.while_loop(
        *make(jnp), {"x": jnp.asarray(x), "n": Point(jnp.asarray(0, jnp.int64), jnp.asarray(1, jnp.int64))}
    )
    assert_matches_jax(ours, theirs)
    assert ours["n"].x.item() > 2


@pytest.mark.parametrize("bounds", [(0, 6), (2, 5), (4, 4), (5, 1), (-3, 2)])
@pytest.mark.parametrize("tensor_bounds", [False, True])
def test_fori_loop_matches_jax(jax, bounds, tensor_bounds):
    jnp = jax.numpy

    def make(lib):
        def body(i, c):
            h, k = c
            return h * 0.7 + lib.cos(h) * i, k * 3 - i

        return body

    h = np.linspace(-1, 1, 3)
    lo, hi = bounds
    if tensor_bounds:
        ours = lax.fori_loop(torch.tensor(lo), torch.tensor(hi), make(torch), (torch.from_numpy(h), torch.tensor(1)))
        theirs = jax.lax.fori_loop(
            jnp.asarray(lo, jnp.int64), jnp.asarray(hi, jnp.int64), make(jnp), (jnp.asarray(h), jnp.asarray(1, jnp.int64))
        )
    else:
        ours = lax.fori_loop(lo, hi, make(torch), (torch.from_numpy(h), torch.tensor(1)))
        theirs = jax.lax.fori_loop(lo, hi, make(jnp), (jnp.asarray(h), jnp.asarray(1, jnp.int64)))
    assert_matches_jax(ours, theirs)


# JAX traces a loop's body whatever its trip count, and under vmap too: a body that breaks
# the carry rules raises there, and must here, never work until the loop first runs.
def _rule_breakers(jax: Any) -> dict[str, Any]:
    """The same programs for tfun (`jax=None`) and for JAX."""
    if jax is None:
        lib, lx, vmap = torch, lax, torch.func.vmap
        f64, cat = (lambda v: v.double()), torch.cat
    else:
        lib, lx, vmap = jax.numpy, jax.lax, jax.vmap
        f64, cat = (lambda v: v.astype(lib.float64)), lib.concatenate
    return {
        "fori_empty_dtype": lambda x: lx.fori_loop(5, 2, lambda i, c: f64(c), x),
        "fori_empty_structure": lambda x: lx.fori_loop(3, 3, lambda i, c: (c,), x),
        "while_false_shape": lambda x: lx.while_loop(lambda c: c.sum() < -1, lambda c: cat([c, c]), x),
        "scan_empty_dtype": lambda x: lx.scan(lambda c, y: (f64(c), y), x, x[:0]),
        "vmap_while_dtype": lambda x: vmap(
            lambda r: lx.while_loop(lambda c: c.sum() < r.sum(), lambda c: f64(c + 1), r * 0)
        )(lib.stack([x, x * 2])),
        "vmap_fori_batched_bounds_shape": lambda x: vmap(
            lambda r: lx.fori_loop(0, (r.sum() > 0) * 2, lambda i, c: cat([c, c]), r)
        )(lib.stack([x, -x])),
    }


@pytest.mark.parametrize(
    "case",
    ["fori_empty_dtype", "fori_empty_structure", "while_false_shape", "scan_empty_dtype", "vmap_while_dtype", "vmap_fori_batched_bounds_shape"],
)
def test_body_breaking_the_carry_rules_raises_like_jax(jax, case):
    x = np.linspace(0.5, 1.5, 3).astype(np.float32)
    with pytest.raises(TypeError, match="carry input and carry output must have"):
        _rule_breakers(jax)[case](jax.numpy.asarray(x))
    with pytest.raises(TypeError, match=r"tfun\.lax\.\w+: body(_fun)? (carry )?input and output must have the same"):
        _rule_breakers(None)[case](torch.from_numpy(x))


def test_fori_loop_body_closing_over_its_tensor_bound_under_jit():
    """A tensor bound the body also reads (a while_loop under tfun.jit): torch's while_loop
    refuses a carry input that is also a closed-over input, so the lowering carries copies."""
    import tfun

    def f(n, x):
        return lax.fori_loop(0, n, lambda i, c: c * 0.5 + (n + i).to(c.dtype) * x, x)

    j = tfun.jit(f, backend="aot_eager")
    x = torch.tensor([0.25, -1.5], dtype=torch.float32)
    for n in (0, 2, 3, 5):
        ref = f(torch.tensor(n), x.double())
        torch.testing.assert_close(j(torch.tensor(n), x), ref.float())


_ZERO_TRIP_LOOPS = {
    # (loop, steps it runs): W is closed over, x the initial carry
    "while_false_at_start": (lambda W, x: lax.while_loop(lambda h: h.sum() > 100.0, lambda h: torch.tanh(h @ W), x), 0),
    "while_counter_0": (lambda W, x: lax.while_loop(lambda c: c[0] < 0, lambda c: (c[0] + 1, torch.tanh(c[1] @ W)), (0, x))[1], 0),
    "fori_tensor_bounds_5_2": (lambda W, x: lax.fori_loop(torch.tensor(5), torch.tensor(2), lambda i, h: torch.tanh(h @ W), x), 0),
    "fori_numpy_bounds_3_3": (lambda W, x: lax.fori_loop(np.int64(3), np.int64(3), lambda i, h: torch.tanh(h @ W) + i, x), 0),
    "while_counter_1": (lambda W, x: lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, torch.tanh(c[1] @ W)), (0, x))[1], 1),
    "while_counter_2": (lambda W, x: lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, torch.tanh(c[1] @ W)), (0, x))[1], 2),
}


@pytest.mark.parametrize("mode", ["tfun.grad", "backward"])
@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)]
)
@pytest.mark.parametrize("name", list(_ZERO_TRIP_LOOPS))
def test_gradient_of_a_loop_that_runs_zero_times_under_jit(name, backend, mode):
    """Hunt 31 (F1), silent wrong gradients: torch's while_loop backward runs one step of the
    body's derivative for a loop that ran zero times (its forward stacks the initial carry
    once), so under `tfun.jit` the initial carry's gradient was the body's vector-Jacobian
    product and the closed-over `W` got a nonzero gradient, where the loop is the identity
    (torch 2.11, 2.13, 2.14.1; eager was right). Against eager float64, with one- and
    two-step loops beside them; tensor and numpy `fori_loop` bounds are traced under jit."""
    loop, steps = _ZERO_TRIP_LOOPS[name]
    g = torch.Generator().manual_seed(1)
    W, x = torch.randn(3, 3, generator=g) * 0.5, torch.randn(3, generator=g)
    f = lambda W, x: (loop(W, x) * torch.arange(1.0, 4.0, dtype=x.dtype)).sum()
    want_v, want_g = tfun.value_and_grad(f, argnums=(0, 1))(W.double(), x.double())
    if steps == 0:  # the loop is the identity
        torch.testing.assert_close(want_g[0], torch.zeros_like(want_g[0]))
    torch._dynamo.reset()
    if mode == "tfun.grad":
        got_v, got_g = tfun.jit(tfun.value_and_grad(f, argnums=(0, 1)), backend=backend)(W, x)
    else:
        Wr, xr = W.clone().requires_grad_(), x.clone().requires_grad_()
        got_v = tfun.jit(f, backend=backend)(Wr, xr)
        got_v.backward()
        got_g = (Wr.grad, xr.grad)
    torch.testing.assert_close(got_v.double(), want_v, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_g, want_g):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _fori_reading_xs(W, xs, h):
    body = lambda i, h: torch.tanh(h @ W + tfun.at(xs)[i].get())
    return lax.fori_loop(torch.tensor(0), torch.tensor(xs.shape[0]), body, h)


def _while_reading_xs(W, xs, h):
    T = xs.shape[0]
    body = lambda c: (c[0] + 1, torch.tanh(c[1] @ W + tfun.at(xs)[c[0]].get()))
    return lax.while_loop(lambda c: c[0] < T, body, (torch.tensor(0), h))[1]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
@pytest.mark.parametrize("loop", [_fori_reading_xs, _while_reading_xs], ids=["fori_tensor_bounds", "while"])
def test_a_loop_of_zero_steps_reading_an_empty_sequence_under_jit_with_gradients(loop, backend):
    """Hunt 31 (F1's second symptom): under `tfun.jit` with gradients, torch's while_loop
    backward runs the body once on the initial carry even when the loop ran zero times
    (tfun discards what it computes), so a body reading `tfun.at(xs)[i].get()` from an empty
    `xs` (an empty sequence, T = 0) raised torch's raw IndexError at run time. In a traced
    body that read now gives the fill value; the gradients are the identity loop's, as
    eagerly, with `tfun.grad` inside jit and `.backward()` outside."""
    g = torch.Generator().manual_seed(5)
    W, xs, h = torch.randn(3, 3, generator=g) * 0.5, torch.zeros(0, 3), torch.randn(3, generator=g)
    f = lambda W, xs, h: (loop(W, xs, h) * torch.arange(1.0, 4.0)).sum()
    want_v, want_g = tfun.value_and_grad(f, argnums=(0, 2))(W.double(), xs.double(), h.double())
    torch.testing.assert_close(want_g[0], torch.zeros_like(want_g[0]))  # eagerly: the identity
    torch._dynamo.reset()
    got_v, got_g = tfun.jit(tfun.value_and_grad(f, argnums=(0, 2)), backend=backend)(W, xs, h)
    Wr, hr = W.clone().requires_grad_(), h.clone().requires_grad_()
    got_v2 = tfun.jit(f, backend=backend)(Wr, xs, hr)
    got_v2.backward()
    for v, grads in ((got_v, got_g), (got_v2, (Wr.grad, hr.grad))):
        torch.testing.assert_close(v.double(), want_v, rtol=1e-5, atol=1e-5)
        for got, want in zip(grads, want_g):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_read_of_an_empty_sequence_that_runs_is_refused_eagerly_and_under_jit():
    """The fill value is only for reads no step makes: eagerly, and under `tfun.jit` outside
    a loop body, reading an element of an empty axis is tfun's error (JAX raises IndexError)."""
    xs = torch.zeros(0, 3)
    read = lambda xs, i: tfun.at(xs)[i].get()
    message = r"tfun.at: index is out of bounds for axis 0 with size 0\.\n  \* x.shape: \(0, 3\), index: "
    with pytest.raises(ArgumentValueError, match=message + r"2 \(a torch.int64 tensor\)"):
        read(xs, torch.tensor(2))
    with pytest.raises(ArgumentValueError, match=message + r"2\n"):
        lax.fori_loop(0, 1, lambda i, h: h + read(xs, 2), torch.zeros(3))
    torch._dynamo.reset()
    with pytest.raises(ArgumentValueError, match=message + r"a torch.int64 tensor of shape \(\)"):
        tfun.jit(read, backend="aot_eager")(xs, torch.tensor(2))
    # a loop of zero steps checks its body on fake tensors: no error, the loop is the identity
    h = torch.ones(3)
    assert torch.equal(lax.fori_loop(0, 0, lambda i, h: h + read(xs, i), h), h)


_NON_CONTIGUOUS = {"transposed": ((3, 4), lambda b: b.t()), "expanded": ((1, 3), lambda b: b.expand(4, 3))}


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
@pytest.mark.parametrize("layout", list(_NON_CONTIGUOUS))
def test_a_while_loop_body_reading_a_non_contiguous_tensor_under_jit_with_gradients(layout, backend):
    """Hunt 33 (F6): torch's while_loop backward keeps a gradient accumulator with the strides
    of each tensor the body reads, and refused a transposed or expanded one against the
    body's dense gradient (a JitError whose advice did not apply). The value and the
    gradients of the initial carry and of the non-contiguous tensor, with `.backward()`
    outside `tfun.jit`, against eager float64."""
    shape, view = _NON_CONTIGUOUS[layout]
    g = torch.Generator().manual_seed(2)
    base0, init0 = torch.randn(*shape, generator=g), torch.randn(3, generator=g)

    def f(init, xs):
        body = lambda s: (s[0] + 1, torch.tanh(s[1] * xs[0] + xs[1]))
        return lax.while_loop(lambda s: s[0] < 3, body, (torch.tensor(0), init))[1]

    results = []
    for dtype, run in ((torch.float64, f), (torch.float32, tfun.jit(f, backend=backend))):
        torch._dynamo.reset()
        init, xs = init0.to(dtype).requires_grad_(), view(base0.to(dtype)).detach().requires_grad_()
        assert not xs.is_contiguous()
        out = run(init, xs)
        (out * torch.arange(1.0, 4.0, dtype=dtype)).sum().backward()
        results.append((out.detach(), init.grad, xs.grad))
    for want, got in zip(*results):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


_PLAIN_COMPILE_LOOPS = {
    "fori_tensor_bounds": lambda W, x: lax.fori_loop(torch.tensor(0), torch.tensor(3), lambda i, h: torch.tanh(h @ W), x),
    "fori_tensor_bounds_zero_trip": lambda W, x: lax.fori_loop(torch.tensor(3), torch.tensor(3), lambda i, h: torch.tanh(h @ W), x),
    "while_float_cond": lambda W, x: lax.while_loop(lambda h: h.abs().sum() < 10.0, lambda h: h * 1.5 + torch.tanh(h @ W) + 0.1, x),
    # Inductor decomposes a scan or map into a while_loop whose body reads its counter with
    # `.item()`: every one failed, forward alone included (hunt 33, F5)
    "scan": lambda W, x: lax.scan(lambda h, xt: (torch.tanh(h @ W + xt), h.sum()), x, torch.stack([x, -x, 2 * x]))[0],
    "fori_static_bounds": lambda W, x: lax.fori_loop(0, 3, lambda i, h: torch.tanh(h @ W) + i, x),
    "map": lambda W, x: lax.map(lambda r: torch.tanh(r @ W), torch.stack([x, x * 2]))[1],
}


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
@pytest.mark.parametrize("name", list(_PLAIN_COMPILE_LOOPS))
def test_plain_torch_compile_with_graph_breaks_then_backward(name, backend):
    """Hunt 31 (F6): a plain `torch.compile` (graph breaks allowed, not `tfun.jit`) of a loop
    that lowers to torch's while_loop, then `.backward()`: torch's while_loop backward reads
    its step index with `.item()`, which such a trace refused, and Dynamo's fallback ran part
    of the loop eagerly and part traced (a StructureMismatchError blaming tfun's own `w_body`).
    With Inductor, plain `torch.compile`'s default, the backward graph's fake-tensor pass then
    refused the same `.item()` (torch's InductorError), and so did Inductor's decomposition of
    a scan or map into a while_loop, the forward alone too (`torch.no_grad()` below).
    Against eager float64."""
    loop = _PLAIN_COMPILE_LOOPS[name]
    g = torch.Generator().manual_seed(3)
    W, x = torch.randn(3, 3, generator=g) * 0.5, torch.randn(3, generator=g)
    f = lambda W, x: (loop(W, x) * torch.arange(1.0, 4.0, dtype=x.dtype)).sum()
    want_v, want_g = tfun.value_and_grad(f, argnums=(0, 1))(W.double(), x.double())
    torch._dynamo.reset()
    Wr, xr = W.clone().requires_grad_(), x.clone().requires_grad_()
    got_v = torch.compile(f, backend=backend)(Wr, xr)
    got_v.backward()
    torch.testing.assert_close(got_v.double(), want_v, rtol=1e-5, atol=1e-5)
    for got, want in zip((Wr.grad, xr.grad), want_g):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(f, backend=backend)(W, x).double(), want_v, rtol=1e-5, atol=1e-5)


_STEPS = {
    "jacrev": lambda c: c + tfun.jacrev(lambda z: (z**3).sum())(c) * 0.1,
    "vmap_of_grad": lambda c: c + tfun.vmap(tfun.grad(lambda z: z**3))(c) * 0.1,
}


@pytest.mark.parametrize("step", sorted(_STEPS))
def test_reverse_mode_inside_a_differentiated_jitted_while_loop_is_refused(step):
    """torch's while_loop backward takes the derivative of a body that runs a reverse-mode
    torch.func transform at the first step's values for every step (torch 2.13-2.15: the
    jitted gradient was 2.197 = 1.3**3 for a true 2.4558): refused, never returned. The
    forward alone, the same body in a scan, and the eager gradient are right."""
    body = _STEPS[step]
    x = torch.tensor([0.5, -0.3], dtype=torch.float64)
    loop = lambda x: lax.while_loop(lambda s: s[1] < 3, lambda s: (body(s[0]), s[1] + 1), (x, 0))[0].pow(2).sum()
    scan = lambda x: lax.scan(lambda c, _: (body(c), None), x, None, length=3)[0].pow(2).sum()
    want = tfun.grad(loop)(x)
    eps = 1e-6
    fd = torch.stack([(loop(x + eps * e) - loop(x - eps * e)) / (2 * eps) for e in torch.eye(2, dtype=x.dtype)])
    torch.testing.assert_close(want, fd, rtol=1e-6, atol=1e-6)  # eager is right
    with pytest.raises(JitError, match=r"tfun\.lax\.while_loop: .* loop is itself differentiated") as e:
        tfun.jit(tfun.grad(loop), backend="aot_eager")(x)
    assert "test_loops.py:" in str(e.value) and "lax.scan" in str(e.value)
    xr = x.clone().requires_grad_()
    with pytest.raises(JitError, match="loop is itself differentiated"):
        tfun.jit(loop, backend="aot_eager")(xr)  # differentiable: .backward() could follow
    torch.testing.assert_close(tfun.jit(loop, backend="aot_eager")(x), loop(x))
    torch.testing.assert_close(tfun.jit(tfun.grad(scan), backend="aot_eager")(x), tfun.grad(scan)(x))


@pytest.mark.parametrize("name", ["jacfwd", "hessian"])
def test_derivatives_inside_a_jitted_scan_body_match_eager(name):
    """A scan body that takes a Jacobian or Hessian per step: the jitted gradient of the
    loop is eager's (and a while_loop body with them is a JitError, not a number)."""
    per_step = {
        "jacfwd": lambda c: c + tfun.jacfwd(lambda z: (z**3).sum())(c) * 0.1,
        "hessian": lambda c: c + (tfun.hessian(lambda z: (z**3).sum())(c) @ c) * 0.1,
    }[name]
    x = torch.tensor([0.5, -0.3], dtype=torch.float64)
    scan = lambda x: lax.scan(lambda c, _: (per_step(c), None), x, None, length=3)[0].pow(2).sum()
    torch.testing.assert_close(tfun.jit(tfun.grad(scan), backend="aot_eager")(x), tfun.grad(scan)(x))
    loop = lambda x: lax.while_loop(lambda s: s[1] < 3, lambda s: (per_step(s[0]), s[1] + 1), (x, 0))[0].pow(2).sum()
    with pytest.raises(JitError):
        tfun.jit(tfun.grad(loop), backend="aot_eager")(x)


@pytest.mark.filterwarnings("ignore:torch.compile is ignored when called inside torch.export region:UserWarning")
def test_fori_loop_bounded_by_a_dynamic_size_under_export():
    """`fori_loop(0, xs.shape[0], ...)` under non-strict `torch.export` with a `Dim` on that
    size (hunt 24: refused, "upper is a SymInt", though the size is an int in the user's
    code): the bound stays a symbol, and the exported module gives float64 eager's values and
    gradients at other lengths."""
    from torch.export import Dim

    def f(W, xs, h0):
        return tfun.lax.fori_loop(0, xs.shape[0], lambda i, h: torch.tanh(h @ W) + 0.1 * i, h0)

    class M(torch.nn.Module):
        def forward(self, W, xs, h0):
            return f(W, xs, h0)

    g = torch.Generator().manual_seed(3)
    args = (torch.randn(4, 4) * 0.4, torch.randn(8, 2), torch.randn(4))
    ep = torch.export.export(M(), args, dynamic_shapes=({}, {0: Dim("T", min=1, max=64)}, {}), strict=False)
    for T in (8, 5, 1):
        want_in = [torch.randn(4, 4, dtype=torch.float64, generator=g, requires_grad=True), torch.randn(T, 2, dtype=torch.float64), torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)]
        got_in = [want_in[0].detach().float().requires_grad_(), want_in[1].float(), want_in[2].detach().float().requires_grad_()]
        got, want = ep.module()(*got_in), f(*want_in)
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad(got.sum(), (got_in[0], got_in[2]))
        for gr, w in zip(grads, torch.autograd.grad(want.sum(), (want_in[0], want_in[2]))):
            torch.testing.assert_close(gr.double(), w, rtol=1e-4, atol=1e-4)


def test_fori_loop_index_is_a_strong_int64_tensor_documented_weak_index():
    from tfun.errors import TensorMismatchError

    # docs/porting.md, row `weak-index`: JAX's `i` is weakly typed; tfun's is a 0-d int64 tensor,
    # so a 0-d int32 carry widens (refused, naming the carry) and the documented idiom keeps it.
    c0 = torch.tensor(0, dtype=torch.int32)
    with pytest.raises(TensorMismatchError, match=r"carry: input is int32\[\] on cpu, output is int64\[\]"):
        lax.fori_loop(0, 3, lambda i, c: c + i, c0)
    out = lax.fori_loop(0, 3, lambda i, c: c + i.to(c.dtype), c0)
    assert out.dtype == torch.int32 and int(out) == 3
    # a carry with dimensions keeps its dtype (a 0-d tensor does not promote it)
    assert lax.fori_loop(0, 3, lambda i, c: c + i, torch.zeros(2, dtype=torch.int32)).dtype == torch.int32


@pytest.mark.parametrize(
    ("producer", "consumer", "backend"),
    [(p, c, "aot_eager") for p in ("while_loop", "fori_loop_tensor_bound") for c in ("map", "scan", "cond", "while_loop")]
    + [pytest.param("while_loop", "map", "inductor", marks=pytest.mark.heavy)],
)
def test_a_differentiated_while_loops_result_read_by_a_later_body_under_jit(producer, consumer, backend):
    """Hunt 34 (F7): differentiated, torch's while_loop returns its carries as views into the
    stack of every iteration's, at an offset of the unknown trip count. A later loop body or
    cond branch closing over one made Dynamo lift that symbol with no source: a bare
    `AssertionError` ("Source of '4*u0 - 4' is None") at the forward call, aot_eager and
    Inductor, torch 2.11-2.14. The while_loop's outputs are copies now: eager float64's values
    and gradients."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(4, 4, dtype=torch.float64, generator=g) * 0.4
    x0 = torch.randn(6, 4, dtype=torch.float64, generator=g)
    make = {
        "while_loop": lambda x: lax.while_loop(
            lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ W + x[0]), (torch.tensor(0), x[1])
        )[1],
        "fori_loop_tensor_bound": lambda x: lax.fori_loop(0, torch.tensor(2), lambda i, c: c @ W + x[0], x[1]),
    }[producer]
    use = {
        "map": lambda x, c: lax.map(lambda r: r * c, x),
        "scan": lambda x, c: lax.scan(lambda h, r: (h + r * c, h), torch.zeros(4, dtype=x.dtype), x)[1],
        "cond": lambda x, c: lax.cond(x.sum() > 0, lambda a: a * c, lambda a: a - c, x),
        "while_loop": lambda x, c: lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1] * c), (torch.tensor(0), x[0]))[1],
    }[consumer]

    def f(x):
        return use(x, make(x))

    def run(fn):
        x = x0.clone().requires_grad_()
        out = fn(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        return out, x.grad

    torch._dynamo.reset()
    (got, got_g), (want, want_g) = run(tfun.jit(f, backend=backend)), run(f)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_g, want_g)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("bound", ["int_argument", "dynamic_size"])
def test_a_fori_loop_bounded_by_an_int_argument_that_changes_between_jitted_calls(bound, backend):
    """Hunt 34 (F6): a Python int bound passed to the jitted function, or a size of an input
    whose shape changes, becomes a symbol once tfun.jit has seen it change, and tfun's traced
    fori_loop scanned `Max(0, n)` steps, which Inductor could not compile ("KeyError: s66" in
    `sympy_interp`, every later call, torch 2.11-2.14.1, with and without gradients). Every
    call, zero and negative trip counts included, gives eager float64's values and
    gradients. (A length that is an expression of the symbol, `fori_loop(n // 2, n)`, is
    still torch's failure, with its own message: tests/test_jit.py.)"""
    g = torch.Generator().manual_seed(1)
    W = torch.randn(3, 3, dtype=torch.float64, generator=g) * 0.5

    if bound == "int_argument":
        def f(x, n):
            return lax.fori_loop(0, n, lambda i, h: torch.tanh(h @ W) + i, x)

        arg = lambda n: n  # noqa: E731
    else:
        def f(x, steps):
            return lax.fori_loop(0, steps.shape[0], lambda i, h: torch.tanh(h @ W) + tfun.at(steps)[i].get() * i, x)

        arg = lambda n: torch.linspace(0.5, 1.5, max(n, 0), dtype=torch.float64)  # noqa: E731

    def run(fn, n):
        x = torch.linspace(-1, 1, 3, dtype=torch.float64).requires_grad_()
        out = fn(x, arg(n))
        (out * torch.tensor([1.0, -2.0, 0.5], dtype=out.dtype)).sum().backward()
        return out, x.grad

    torch._dynamo.reset()
    jf = tfun.jit(f, backend=backend)
    for n in ([3, 5, 0, -2, 4] if bound == "int_argument" else [3, 5, 0, 4]):
        (got, got_g), (want, want_g) = run(jf, n), run(f, n)
        torch.testing.assert_close(got, want, msg=f"n={n}")
        torch.testing.assert_close(got_g, want_g, msg=f"n={n}")
    with torch.no_grad():
        x = torch.linspace(-1, 1, 3, dtype=torch.float64)
        for n in [6, 1]:
            torch.testing.assert_close(jf(x, arg(n)), f(x, arg(n)), msg=f"no_grad n={n}")
