"""tfun.custom_vjp / tfun.custom_jvp under autograd, torch.func and tfun transforms."""

from __future__ import annotations

import functools
import re

import numpy as np
import optree
import pytest
import torch

import tfun
from tfun.errors import ArgumentTypeError, ArgumentValueError, StructureMismatchError, TensorMismatchError

D = torch.float64


def t(*shape, seed=0, grad=False):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)
    return x.requires_grad_(grad)


# ---------------------------------------------------------------- custom_vjp fixtures


@tfun.custom_vjp
def scaled_sin(p, y):
    return torch.sin(p["x"]) * y


def scaled_sin_fwd(p, y):
    return scaled_sin(p, y), (p["x"], y)  # inputs as residuals: bwd stays differentiable


def scaled_sin_bwd(res, g):
    x, y = res
    return ({"x": torch.cos(x) * g * y}, torch.sin(x) * g)


scaled_sin.defvjp(scaled_sin_fwd, scaled_sin_bwd)


@functools.partial(tfun.custom_vjp, nondiff_argnums=(0,))
def clip_grad_apply(fn, x, bound):
    return fn(x) * bound


def clip_fwd(fn, x, bound):
    return clip_grad_apply(fn, x, bound), (x, bound)


def clip_bwd(fn, res, g):
    x, bound = res
    _, pull = torch.func.vjp(lambda u: fn(u) * bound, x)
    (gx,) = pull(g)
    return (gx.clamp(-1, 1), None)  # None: zero cotangent for `bound`


clip_grad_apply.defvjp(clip_fwd, clip_bwd)


def test_custom_vjp_backward_and_autograd_grad():
    x, y = t(3, grad=True), t(3, seed=1, grad=True)
    scaled_sin({"x": x}, y).sum().backward()
    assert torch.allclose(x.grad, torch.cos(x) * y) and torch.allclose(y.grad, torch.sin(x))
    assert torch.autograd.gradcheck(lambda a, b: scaled_sin({"x": a}, b), (x, y))
    assert torch.autograd.gradgradcheck(lambda a, b: scaled_sin({"x": a}, b), (x, y))


def test_custom_vjp_rule_is_used_and_primal_when_not_differentiated():
    calls = []

    @tfun.custom_vjp
    def f(x):
        calls.append("f")
        return x * 2

    f.defvjp(lambda x: (calls.append("fwd") or x * 2, None), lambda r, g: (g * 100,))
    assert torch.allclose(tfun.grad(lambda x: f(x).sum())(t(2)), torch.full((2,), 100.0, dtype=D))
    assert "fwd" in calls
    calls.clear()
    f(t(2))
    assert calls == ["f"]


def test_custom_vjp_under_transforms():
    x, y = t(4, 3), t(4, 3, seed=1)
    g = tfun.vmap(tfun.grad(lambda a, b: scaled_sin({"x": a}, b).sum()))(x, y)
    assert torch.allclose(g, torch.cos(x) * y)
    J = tfun.jacrev(lambda a: scaled_sin({"x": a}, y[0]))(x[0])
    assert torch.allclose(J, torch.diag(torch.cos(x[0]) * y[0]))
    gg = tfun.grad(tfun.grad(lambda a: scaled_sin({"x": a}, torch.tensor(2.0, dtype=D))))(torch.tensor(0.3, dtype=D))
    assert torch.allclose(gg, -2 * torch.sin(torch.tensor(0.3, dtype=D)))
    tg = torch.func.grad(lambda a: scaled_sin({"x": a}, y[0]).sum())(x[0])
    assert torch.allclose(tg, torch.cos(x[0]) * y[0])


def test_custom_vjp_nondiff_argnums():
    x = t(5) * 10
    g = tfun.grad(lambda u: clip_grad_apply(torch.sinh, u, torch.tensor(2.0, dtype=D)).sum())(x)
    assert torch.allclose(g, (2 * torch.cosh(x)).clamp(-1, 1))


def test_custom_vjp_bwd_errors():
    def bad_bwd(res, g):
        return g * 2

    @tfun.custom_vjp
    def f(x):
        return x * 2

    f.defvjp(lambda x: (x * 2, None), bad_bwd)
    with pytest.raises(StructureMismatchError) as e:
        tfun.grad(lambda x: f(x).sum())(t(2))
    msg = str(e.value)
    assert msg.startswith(
        "tfun.custom_vjp: the bwd rule must return a tuple with one entry per differentiable argument (1), "
        "got a tensor of shape (2,) and dtype torch.float64."
    )
    assert re.search(r"The function is `\S*bad_bwd at \S*test_custom_derivatives\.py:\d+`", msg)
    assert "e.g. `(g_x,)` for one argument" in msg

    @tfun.custom_vjp
    def h(d):
        return d["a"] * d["b"].sum()

    h.defvjp(lambda d: (h(d), d), lambda d, g: ({"a": g, "b": g[:1]},))
    with pytest.raises(TensorMismatchError) as e:
        tfun.grad(lambda d: h(d).sum())({"a": t(2), "b": t(2)})
    assert "  * bwd output[0]['b']: expected a tensor of shape (2,) and dtype torch.float64, got a tensor of shape (1,)" in str(e.value)
    # a TensorMismatchError (a TypeError, as every tfun shape mismatch) that is also the
    # ValueError JAX raises for a bwd cotangent of the wrong shape
    assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)
    assert re.search(r"The function is `<lambda> at \S*test_custom_derivatives\.py:\d+`", str(e.value))
    h.defvjp(lambda d: (h(d), d), lambda d, g: ({"a": g},))
    with pytest.raises(StructureMismatchError) as e:
        tfun.grad(lambda d: h(d).sum())({"a": t(2), "b": t(2)})
    assert "  * bwd output[0]: expected a dict with keys ['a', 'b'], got a dict with keys ['a']" in str(e.value)
    with pytest.raises(ArgumentValueError, match="no VJP rule is defined"):
        tfun.custom_vjp(lambda x: x)(t(1))


@pytest.mark.parametrize("path", ["eager", "vmap", "jit"])
@pytest.mark.parametrize(
    "x_dtype,ct_dtype",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.float64), (torch.float64, torch.int64),
     (torch.float64, torch.complex128)],
)
def test_custom_vjp_bwd_cotangent_of_another_dtype_is_converted(path, x_dtype, ct_dtype):
    """As in JAX, a bwd cotangent of the argument's shape may have another dtype when the
    argument is floating (JAX's custom_vjp accepts a float32 cotangent for a bfloat16 input):
    tfun converts it to the argument's dtype (the real part of a complex one), on every path."""

    @tfun.custom_vjp
    def f(x, w):
        return x.to(torch.float64) * w

    def bwd(res, g):
        x, w = res
        g_x = g * w  # float64 whatever x's dtype
        if ct_dtype.is_complex:
            g_x = g_x + 5j  # the imaginary part is dropped
        return g_x.to(ct_dtype), g * x.to(torch.float64)

    f.defvjp(lambda x, w: (f(x, w), (x, w)), bwd)
    x = torch.arange(6.0).reshape(2, 3).to(x_dtype)
    w = torch.full((2, 3), 2.0, dtype=torch.float64)
    grad = tfun.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))
    if path == "vmap":
        g_x, g_w = tfun.vmap(grad)(x, w)
    elif path == "jit":
        g_x, g_w = tfun.jit(grad, backend="aot_eager")(x, w)
    else:
        g_x, g_w = grad(x, w)
    assert g_x.dtype == x_dtype and g_w.dtype == torch.float64
    assert torch.equal(g_x, torch.full((2, 3), 2.0, dtype=x_dtype))
    assert torch.equal(g_w, x.to(torch.float64))


def test_custom_vjp_bwd_cotangent_of_another_shape_is_still_refused():
    """Only the dtype is converted: a cotangent of another shape is a mismatch, whatever its
    dtype (an integer argument's cotangent is ignored, as JAX's float0 is)."""

    @tfun.custom_vjp
    def f(x):
        return x * 2

    for bad in (lambda g: g[:1], lambda g: g[:1].to(torch.float32)):
        f.defvjp(lambda x: (f(x), None), lambda _, g, bad=bad: (bad(g),))
        with pytest.raises(TensorMismatchError, match=r"bwd output\[0\]: expected a tensor of shape \(2,\) and dtype torch.float64, got a tensor of shape \(1,\)"):
            tfun.grad(lambda x: f(x).sum())(t(2))


# ---------------------------------------------------------------- custom_jvp


@tfun.custom_jvp
def softplus(x):
    return torch.log1p(torch.exp(x))


@softplus.defjvp
def softplus_jvp(primals, tangents):
    (x,), (tx,) = primals, tangents
    return softplus(x), torch.sigmoid(x) * tx


def test_custom_jvp_forward_and_reverse():
    x = t(4)
    out, tan = tfun.jvp(softplus, (x,), (torch.ones_like(x),))
    assert torch.allclose(tan, torch.sigmoid(x))
    assert torch.allclose(tfun.grad(lambda u: softplus(u).sum())(x), torch.sigmoid(x))
    assert torch.allclose(tfun.jacfwd(softplus)(x), tfun.jacrev(softplus)(x))
    assert torch.allclose(tfun.vmap(softplus)(x), softplus(x))
    xg = t(4, grad=True)
    assert torch.autograd.gradcheck(softplus, (xg,)) and torch.autograd.gradgradcheck(softplus, (xg,))
    s = torch.sigmoid(torch.tensor(0.4, dtype=D))
    assert torch.allclose(tfun.grad(tfun.grad(softplus))(torch.tensor(0.4, dtype=D)), s * (1 - s))


def test_custom_jvp_rule_is_used_and_pytree_nondiff():
    @functools.partial(tfun.custom_jvp, nondiff_argnums=(1,))
    def f(d, k):
        return {"o": d["a"] * k}

    @f.defjvp
    def f_jvp(k, primals, tangents):
        (d,), (td,) = primals, tangents
        return f(d, k), {"o": td["a"] * 7.0}

    x = t(3)
    _, tan = tfun.jvp(lambda a: f({"a": a}, 2.0), (x,), (torch.ones_like(x),))
    assert torch.allclose(tan["o"], torch.full((3,), 7.0, dtype=D))
    assert torch.allclose(tfun.grad(lambda a: f({"a": a}, 2.0)["o"].sum())(x), torch.full((3,), 7.0, dtype=D))


def test_custom_jvp_rule_error():
    @tfun.custom_jvp
    def f(x):
        return x * 2

    @f.defjvp
    def wrong(primals, tangents):
        return primals[0] * 2, (tangents[0],)

    with pytest.raises(StructureMismatchError) as e:
        tfun.jvp(f, (t(2),), (t(2),))
    assert str(e.value).startswith("tfun.custom_jvp: the tangent_out must have the structure of the primal output")
    assert "wrong at " in str(e.value)


# ---------------------------------------------------------------- JAX


@pytest.fixture(scope="module")
def jax():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    return jax


def test_jax_custom_vjp_nondiff(jax):
    jnp = jax.numpy

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def japply(fn, x, bound):
        return fn(x) * bound

    def jfwd(fn, x, bound):
        return japply(fn, x, bound), (x, bound)

    def jbwd(fn, res, g):
        x, bound = res
        _, pull = jax.vjp(lambda u: fn(u) * bound, x)
        return (jnp.clip(pull(g)[0], -1, 1), None)

    japply.defvjp(jfwd, jbwd)
    x = t(6) * 3
    mine = tfun.grad(lambda u: clip_grad_apply(torch.sinh, u, torch.tensor(2.0, dtype=D)).sum())(x)
    ref = jax.grad(lambda u: japply(jnp.sinh, u, 2.0).sum())(x.numpy())
    np.testing.assert_allclose(mine.numpy(), np.asarray(ref), rtol=1e-12)


def test_jax_custom_jvp(jax):
    jnp = jax.numpy

    @jax.custom_jvp
    def jsp(x):
        return jnp.log1p(jnp.exp(x))

    @jsp.defjvp
    def _(primals, tangents):
        (x,), (tx,) = primals, tangents
        return jsp(x), jax.nn.sigmoid(x) * tx

    x = t(5)
    for mine, ref in (
        (tfun.jvp(softplus, (x,), (x * 2,))[1], jax.jvp(jsp, (x.numpy(),), (x.numpy() * 2,))[1]),
        (tfun.grad(lambda u: softplus(u).sum())(x), jax.grad(lambda u: jsp(u).sum())(x.numpy())),
        (tfun.hessian(lambda u: softplus(u).sum())(x), jax.hessian(lambda u: jsp(u).sum())(x.numpy())),
    ):
        np.testing.assert_allclose(mine.numpy(), np.asarray(ref), rtol=1e-10)


@tfun.custom_vjp
def _sin_with_residual(x):
    return torch.sin(x)


def _sin_fwd(x):
    return torch.sin(x), torch.cos(x)  # a residual computed in fwd, not an input


def _sin_bwd(c, g):
    return (g * c,)


_sin_with_residual.defvjp(_sin_fwd, _sin_bwd)


def test_custom_vjp_second_order_through_computed_residuals():
    # As in JAX, residuals are differentiable functions of the inputs: d2/dx2 sin = -sin.
    x = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    second = torch.func.vmap(torch.func.grad(torch.func.grad(_sin_with_residual)))(x)
    torch.testing.assert_close(second, -torch.sin(x))
    torch.testing.assert_close(tfun.grad(tfun.grad(_sin_with_residual))(x[0]), -torch.sin(x[0]))
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(_sin_with_residual(xr).sum(), xr, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), xr)
    torch.testing.assert_close(g, torch.cos(x))
    torch.testing.assert_close(gg, -torch.sin(x))
    assert torch.autograd.gradgradcheck(_sin_with_residual, (xr,))


def test_custom_vjp_refuses_forward_mode_with_a_tfun_error():
    x = torch.tensor(0.5, dtype=torch.float64)
    with pytest.raises(tfun.errors.ArgumentTypeError) as e:
        tfun.jvp(_sin_with_residual, (x,), (torch.ones_like(x),))
    lines = str(e.value).splitlines()
    assert lines[0] == (
        "tfun.custom_vjp: forward-mode differentiation (jvp, jacfwd, hessian) of a custom_vjp function is not "
        "supported, as in JAX."
    )
    assert lines[1].startswith("The function is `_sin_fwd at ")


# ---------------------------------------------------------------- a rule that calls its own function


@tfun.custom_jvp
def _neg(x):
    return -x


@_neg.defjvp
def _neg_jvp(primals, tangents):
    # JAX custom_api_test `test_linear_in_scan`: the tangent map is the function itself.
    return _neg(primals[0]), _neg(tangents[0])


@pytest.mark.parametrize("length", [1, 2, 3, 4])
def test_rule_calling_its_own_function_in_scan_terminates_with_exact_grad(length):
    # It used to recurse without end: transposing the rule re-entered the rule.
    def through_scan(x):
        c, ys = tfun.lax.scan(lambda c, _: (_neg(c), _neg(c)), x, None, length=length)
        return c, ys

    x = torch.tensor(3.0, dtype=torch.float64)
    assert tfun.grad(lambda u: through_scan(u)[0])(x).item() == (-1.0) ** length
    # ys[k] = (-1)^(k+1) x, so d(sum ys)/dx = sum_k (-1)^(k+1)
    assert tfun.grad(lambda u: through_scan(u)[1].sum())(x).item() == sum((-1.0) ** (k + 1) for k in range(length))
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(through_scan(xr)[0], xr)
    assert g.item() == (-1.0) ** length
    assert tfun.jvp(lambda u: through_scan(u)[0], (x,), (torch.ones_like(x),))[1].item() == (-1.0) ** length


def test_rule_calling_its_own_function_outside_scan():
    x = torch.tensor([1.0, -2.0], dtype=torch.float64)
    assert torch.equal(tfun.grad(lambda u: _neg(u).sum())(x), -torch.ones_like(x))
    assert torch.equal(tfun.jacrev(_neg)(x), -torch.eye(2, dtype=torch.float64))
    assert torch.equal(tfun.grad(tfun.grad(lambda u: _neg(u) ** 2))(x[0]), torch.tensor(2.0, dtype=torch.float64))


@tfun.custom_jvp
def _sin_doubled_rule(x):
    return torch.sin(x)


@_sin_doubled_rule.defjvp
def _sin_doubled_rule_jvp(primals, tangents):
    # deliberately not sin's derivative, so the test sees which derivative is used
    return _sin_doubled_rule(primals[0]), 2 * torch.cos(primals[0]) * tangents[0]


@tfun.custom_jvp
def _square_via_custom(x):
    return x**2


@_square_via_custom.defjvp
def _square_via_custom_jvp(primals, tangents):
    return _square_via_custom(primals[0]), _sin_doubled_rule(primals[0]) * tangents[0]


def test_custom_function_of_primals_inside_a_rule_keeps_its_rule_under_second_order(jax):
    # Only calls on the tangent path fall back to the primal function; a custom function of the
    # primals inside a rule is still differentiated by its own rule (as in JAX).
    jnp = jax.numpy

    @jax.custom_jvp
    def jsin(x):
        return jnp.sin(x)

    jsin.defjvp(lambda p, t: (jsin(p[0]), 2 * jnp.cos(p[0]) * t[0]))

    @jax.custom_jvp
    def jsq(x):
        return x**2

    jsq.defjvp(lambda p, t: (jsq(p[0]), jsin(p[0]) * t[0]))
    x = torch.tensor(0.7, dtype=torch.float64)
    ours = tfun.grad(tfun.grad(_square_via_custom))(x)
    theirs = jax.grad(jax.grad(jsq))(0.7)
    np.testing.assert_allclose(ours.item(), float(theirs), rtol=1e-12)
    np.testing.assert_allclose(ours.item(), 2 * np.cos(0.7), rtol=1e-12)
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(_square_via_custom(xr), xr, create_graph=True)
    (gg,) = torch.autograd.grad(g, xr)
    np.testing.assert_allclose(gg.item(), 2 * np.cos(0.7), rtol=1e-12)


# ---------------------------------------------------------------- complex values: JAX's convention


@tfun.custom_vjp
def _csin_scale(z, w):
    return torch.sin(z) * w


_csin_scale.defvjp(
    lambda z, w: (_csin_scale(z, w), (z, w)),
    # JAX's convention: the transpose of the tangent map, no conjugates
    lambda res, g: (torch.cos(res[0]) * res[1] * g, torch.sin(res[0]) * g),
)


@tfun.custom_jvp
def _cexp(z):
    return torch.exp(z)


@_cexp.defjvp
def _cexp_jvp(primals, tangents):
    return _cexp(primals[0]), torch.exp(primals[0]) * tangents[0]


def test_jax_complex_custom_vjp_and_custom_jvp(jax):
    jnp = jax.numpy

    @jax.custom_vjp
    def jsin_scale(z, w):
        return jnp.sin(z) * w

    jsin_scale.defvjp(
        lambda z, w: (jsin_scale(z, w), (z, w)), lambda res, g: (jnp.cos(res[0]) * res[1] * g, jnp.sin(res[0]) * g)
    )

    @jax.custom_jvp
    def jexp(z):
        return jnp.exp(z)

    jexp.defjvp(lambda p, t: (jexp(p[0]), jnp.exp(p[0]) * t[0]))

    g = torch.Generator().manual_seed(0)
    z, w, ct = (torch.randn(3, generator=g, dtype=torch.complex128) for _ in range(3))
    jz, jw, jct = z.numpy(), w.numpy(), ct.numpy()
    loss = lambda z, w: (torch.abs(_csin_scale(z, w)) ** 2 + (_cexp(z) * w).real).sum()  # noqa: E731
    jloss = lambda z, w: (jnp.abs(jsin_scale(z, w)) ** 2 + (jexp(z) * w).real).sum()  # noqa: E731
    for ours, theirs in zip(tfun.grad(loss, argnums=(0, 1))(z, w), jax.grad(jloss, argnums=(0, 1))(jz, jw)):
        np.testing.assert_allclose(ours.numpy(), np.asarray(theirs), rtol=1e-12)
    for ours, theirs in zip(tfun.vjp(_csin_scale, z, w)[1](ct), jax.vjp(jsin_scale, jz, jw)[1](jct)):
        np.testing.assert_allclose(ours.numpy(), np.asarray(theirs), rtol=1e-12)
    np.testing.assert_allclose(tfun.vjp(_cexp, z)[1](ct)[0].numpy(), np.asarray(jax.vjp(jexp, jz)[1](jct)[0]), rtol=1e-12)
    # the custom rules give what plain autodiff of the same functions gives, under .backward() too
    zr, wr = z.clone().requires_grad_(), w.clone().requires_grad_()
    loss(zr, wr).backward()
    plain = lambda z, w: (torch.abs(torch.sin(z) * w) ** 2 + (torch.exp(z) * w).real).sum()  # noqa: E731
    zp, wp = z.clone().requires_grad_(), w.clone().requires_grad_()
    plain(zp, wp).backward()
    torch.testing.assert_close(zr.grad, zp.grad)
    torch.testing.assert_close(wr.grad, wp.grad)


def test_nondiff_argnames_as_jax():
    @functools.partial(tfun.custom_vjp, nondiff_argnums=(0,), nondiff_argnames=("g",))
    def app(f, g, x):
        return f(x) + g(x)

    app.defvjp(lambda f, g, x: (app(f, g, x), torch.cos(x)), lambda f, g, cos_x, v: (cos_x * v,))
    f = g = lambda x: 2 * x
    x = torch.tensor(1.0)
    assert app(f, g, x).item() == 4.0
    assert torch.allclose(tfun.grad(lambda x: app(f, g, x))(x), torch.cos(x))

    @functools.partial(tfun.custom_jvp, nondiff_argnames=("f",))
    def app2(f, x):
        return f(x)

    app2.defjvp(lambda f, primals, tangents: (app2(f, primals[0]), 3 * tangents[0]))
    assert tfun.jvp(lambda x: app2(lambda y: 2 * y, x), (x,), (x,))[1].item() == 3.0
    with pytest.raises(ArgumentValueError, match="nondiff_argnames contains 'h'"):
        tfun.custom_jvp(lambda f, x: x, nondiff_argnames=("h",))


def test_rule_flags_as_jax():
    @tfun.custom_vjp
    def f(x):
        return torch.sin(x)

    f.defvjp(lambda x: (torch.sin(x), (x,)), lambda res, g: (torch.cos(res[0]) * g,), optimize_remat=True)
    x = torch.tensor(3.2)
    assert torch.allclose(tfun.grad(f)(x), torch.cos(x))
    with pytest.raises(ArgumentValueError, match="symbolic_zeros=True is not supported"):
        f.defvjp(lambda x: (x, None), lambda r, g: (g,), symbolic_zeros=True)
    h = tfun.custom_jvp(torch.sin)
    with pytest.raises(ArgumentValueError, match="symbolic_zeros=True is not supported"):
        h.defjvp(lambda p, t: (p[0], t[0]), symbolic_zeros=True)
    with pytest.raises(ArgumentTypeError, match="optimize_remat must be a bool"):
        f.defvjp(lambda x: (x, None), lambda r, g: (g,), optimize_remat="yes")


def test_functorch_internal_asserts_become_tfun_errors():
    # torch.func's "flat_bdims must not be None" (forward mode through vmap of a custom_vjp)
    # must reach the user as a tfun error that says what to change, never as torch's assertion
    @tfun.custom_vjp
    def f(x):
        return torch.sin(x)

    f.defvjp(lambda x: (torch.sin(x), x), lambda x, g: (torch.cos(x) * g,))
    with pytest.raises(TypeError, match="forward-mode") as info:
        tfun.jvp(tfun.vmap(f), (torch.arange(3.0, dtype=D),), (torch.ones(3, dtype=D),))
    assert "test_custom_derivatives.py" in str(info.value)
    # transforms still work afterwards
    assert torch.allclose(tfun.vmap(tfun.grad(torch.sin))(torch.arange(3.0)), torch.cos(torch.arange(3.0)))


# ------------------------------------- rules closing over tensors of enclosing transforms
# tfun lifts such tensors into inputs of its autograd.Function (see _Captures): the rule is
# used, and the closed-over tensors are constants of the custom function.

XS = torch.tensor([0.5, -1.0, 2.0], dtype=D)


def test_custom_jvp_nondiff_arg_batched_by_vmap():
    @functools.partial(tfun.custom_jvp, nondiff_argnums=(0,))
    def f(x, y):
        return x * torch.sin(y)

    # the rule's tangent is 3 x cos(y) t: deliberately not the true derivative, so the
    # oracle (float64, analytic) tells the rule was used
    f.defjvp(lambda x, p, t: (f(x, p[0]), 3 * x * torch.cos(p[0]) * t[0]))
    y = torch.tensor([0.3, 0.7, 1.1], dtype=D)
    ty = torch.tensor([1.0, -2.0, 0.5], dtype=D)
    out, tan = tfun.jvp(lambda y: tfun.vmap(f)(XS, y), (y,), (ty,))
    torch.testing.assert_close(out, XS * torch.sin(y))
    torch.testing.assert_close(tan, 3 * XS * torch.cos(y) * ty)
    # reverse mode: the transposed rule, per example
    g = tfun.grad(lambda y: tfun.vmap(f)(XS, y).sum())(y)
    torch.testing.assert_close(g, 3 * XS * torch.cos(y))


def test_custom_jvp_closing_over_vmap_batched_value():
    def h(z):
        def per_x(x):
            @tfun.custom_jvp
            def g(y):
                return x * y**2

            @g.defjvp
            def g_jvp(primals, tangents):
                (y,), (ty,) = primals, tangents
                return x * y**2, 5 * x * y * ty  # the rule (true derivative: 2 x y)

            return g(z)

        return tfun.vmap(per_x)(XS)

    z = torch.tensor(1.5, dtype=D)
    out, tan = tfun.jvp(h, (z,), (torch.tensor(2.0, dtype=D),))
    torch.testing.assert_close(out, XS * 1.5**2)
    torch.testing.assert_close(tan, 5 * XS * 1.5 * 2.0)
    torch.testing.assert_close(tfun.grad(lambda z: h(z).sum())(z), (5 * XS * 1.5).sum())


def test_custom_vjp_closing_over_vmap_batched_value():
    def h(z):
        def per_x(x):
            @tfun.custom_vjp
            def g(y):
                return x * torch.sin(y)

            g.defvjp(lambda y: (x * torch.sin(y), (x, y)), lambda res, w: (4 * res[0] * torch.cos(res[1]) * w,))
            return g(z)

        return tfun.vmap(per_x)(XS).sum()

    z = torch.tensor(0.8, dtype=D)
    torch.testing.assert_close(h(z), (XS * np.sin(0.8)).sum())
    torch.testing.assert_close(tfun.grad(h)(z), (4 * XS * np.cos(0.8)).sum())


def test_custom_vjp_fwd_residual_closed_over_from_outer_transform():
    # fwd keeps a tensor of an outer vmap/grad as its residual; an outer grad then
    # differentiates bwd's use of it (second order through the rule)
    def f(y):
        @tfun.custom_vjp
        def g(x):
            return 2.0 * torch.sin(x)

        g.defvjp(lambda x: (g(x), y), lambda y, w: (2.0 * torch.cos(y) * w,))
        return tfun.grad(g)(torch.tensor(1.0, dtype=D))

    torch.testing.assert_close(tfun.vmap(f)(XS), 2.0 * torch.cos(XS))
    torch.testing.assert_close(tfun.grad(f)(torch.tensor(4.0, dtype=D)), torch.tensor(-2.0 * np.sin(4.0), dtype=D))
    torch.testing.assert_close(tfun.vmap(tfun.grad(f))(XS), -2.0 * torch.sin(XS))


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_derivative_through_a_closure_is_refused(kind):
    # the rule says nothing about the closed-over x: differentiating through it (which tfun
    # used to answer with a silent zero) is an error naming the rule, as in JAX
    def make(x):
        if kind == "custom_jvp":
            g = tfun.custom_jvp(lambda y: x * y)
            g.defjvp(lambda p, t: (x * p[0], x * t[0]))
        else:
            g = tfun.custom_vjp(lambda y: x * y)
            g.defvjp(lambda y: (x * y, None), lambda _, w: (x * w,))
        return g

    y = torch.tensor(3.0, dtype=D)
    with pytest.raises(ArgumentValueError, match=f"tfun.{kind}: the function is differentiated with respect to a "
                       "tensor that it or its rules close over") as info:
        tfun.grad(lambda x: make(x)(y))(torch.tensor(2.0, dtype=D))
    assert re.search(r"test_custom_derivatives\.py:\d+", str(info.value))
    with pytest.raises(ArgumentValueError, match="close over"):
        tfun.vmap(tfun.grad(lambda x: make(x)(y)))(XS)
    if kind == "custom_jvp":
        with pytest.raises(ArgumentValueError, match="forward-mode derivative"):
            tfun.jvp(lambda x: tfun.vmap(lambda v: make(x)(v))(XS), (y,), (torch.tensor(1.0, dtype=D),))
    # a closed-over tensor that is not differentiated is fine, and the rule is used
    torch.testing.assert_close(
        tfun.grad(lambda v: make(torch.tensor(2.0, dtype=D))(v))(y), torch.tensor(2.0, dtype=D)
    )


def test_custom_jvp_rule_primal_out_checked_as_jax():
    # JAX checks the rule's primal output against the function's output (structure, shape, dtype)
    @tfun.custom_jvp
    def f(x):
        return x

    f.defjvp(lambda p, t: ((p[0], p[0]), (t[0], t[0])))
    x = torch.tensor(1.0)
    with pytest.raises(StructureMismatchError, match="primal_out"):
        tfun.jvp(f, (x,), (x,))
    f.defjvp(lambda p, t: (torch.zeros(3), t[0]))
    with pytest.raises(TensorMismatchError, match="primal_out"):
        tfun.jvp(f, (x,), (x,))


def test_custom_jvp_integer_outputs_have_no_tangent():
    # JAX's float0: a rule's tangent for an integer output is dropped (torch would refuse it)
    @tfun.custom_jvp
    def f(x, y):
        return x, y

    f.defjvp(lambda p, t: ((p[0], p[1]), (2 * t[0], torch.zeros((), dtype=torch.int64))))
    (px, py), (tx, ty) = tfun.jvp(f, (torch.tensor(2.0), torch.tensor(3)), (torch.tensor(1.0), torch.tensor(0)))
    assert (px.item(), py.item(), tx.item()) == (2.0, 3, 2.0)
    assert ty.dtype == torch.int64 and ty.item() == 0


@tfun.custom_jvp
def _halved_sin(x):
    return torch.sin(x)


@_halved_sin.defjvp
def _halved_sin_jvp(primals, tangents):
    (x,), (t_,) = primals, tangents
    return torch.sin(x), 0.5 * torch.cos(x) * t_  # not the derivative: the rule must be used


@pytest.mark.parametrize("how", ["backward", "jit(grad)"])
def test_custom_jvp_of_an_intermediate_under_jit(how):
    """Regression: under tfun.jit, a custom_jvp function applied to the output of another op
    (`f(x @ w)`, not to an input) failed to compile: its traced backward differentiated the
    rule with the saved primal's autograd history attached, which Dynamo refuses
    ("autograd.grad consumed returned tensor's grad_fn"). Gradients equal eager float64."""
    x, w = t(4, 3), t(3, 3, seed=1)

    def loss(x, w):
        return (_halved_sin(x @ w) * torch.arange(3.0, dtype=x.dtype)).sum() + _halved_sin(x).sum()

    want = tfun.grad(loss, argnums=(0, 1))(x, w)
    torch.testing.assert_close(want[1], x.T @ (0.5 * torch.cos(x @ w) * torch.arange(3.0, dtype=x.dtype)))
    if how == "backward":
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        tfun.jit(loss, backend="aot_eager")(xx, ww).backward()
        got = (xx.grad, ww.grad)
    else:
        got = tfun.jit(tfun.grad(loss, argnums=(0, 1)), backend="aot_eager")(x, w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_jit_grad_of_custom_jvp_whose_rule_calls_the_function():
    # the usual `return f(x), ...` in a rule: traced, the transposed rule runs the function's
    # primal there (Dynamo used to trace the backward again and again: a RecursionError)
    @tfun.custom_jvp
    def f(x):
        return torch.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), 3 * torch.cos(p[0]) * t[0]))  # not the true derivative: the oracle sees the rule
    x = torch.tensor([0.5, -1.25, 2.0], dtype=D)
    jf = tfun.jit(f, backend="aot_eager")
    torch.testing.assert_close(jf(x), torch.sin(x))
    xg = x.clone().requires_grad_(True)
    jf(xg).sum().backward()
    torch.testing.assert_close(xg.grad, 3 * torch.cos(x))

    # and inside a scan, as JAX's test_initial_style (one compile of both gradients)
    @tfun.custom_jvp
    def g(x):
        return 3 * x

    g.defjvp(lambda p, t: (g(p[0]), 2 * t[0]))
    foo = lambda x: tfun.lax.scan(lambda c, _: (g(c), None), x, None, length=2)[0]
    both = tfun.jit(lambda x, y: (tfun.grad(lambda x: f(x).sum())(x), tfun.grad(foo)(y)), backend="aot_eager")
    gf, gfoo = both(x, torch.tensor(3.0, dtype=D))
    torch.testing.assert_close(gf, 3 * torch.cos(x))
    torch.testing.assert_close(gfoo, torch.tensor(4.0, dtype=D))


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_nondiff_function_closing_over_a_transformed_tensor(kind):
    # a nondiff argument that is a function is searched for closed-over tensors as the
    # rules are (JAX's test_nondiff_arg_hiding_jvp_tracer): a derivative through one is
    # refused; a vmap-batched one is lifted and the rule is used
    def make():
        if kind == "custom_jvp":
            g = tfun.custom_jvp(lambda h, x: h(x), nondiff_argnums=(0,))
            g.defjvp(lambda h, p, t: (g(h, p[0]), 2.0 * t[0]))
        else:
            g = tfun.custom_vjp(lambda h, x: h(x), nondiff_argnums=(0,))
            g.defvjp(lambda h, x: (g(h, x), None), lambda h, _, w: (2.0 * w,))
        return g

    def f(x):
        return make()(lambda y: x + y, x)

    one = torch.tensor(1.0, dtype=D)
    with pytest.raises(ArgumentValueError, match="close over"):
        if kind == "custom_jvp":
            tfun.jvp(f, (torch.tensor(2.0, dtype=D),), (one,))
        else:
            tfun.grad(f)(torch.tensor(2.0, dtype=D))
    # batched by vmap, not differentiated: the value, and the rule's derivative in y
    g = make()
    out = tfun.vmap(lambda c: tfun.grad(lambda y: g(lambda v: c * v, y))(one))(XS)
    torch.testing.assert_close(out, torch.full_like(XS, 2.0))


# ------------------------------------------------- custom_jvp under tfun.jit in forward mode


@tfun.custom_jvp
def _twice_sin(x):
    return torch.sin(x)


# 2x the true derivative, and the rule calls the function: the tangent must be the rule's
_twice_sin.defjvp(lambda p, t_: (_twice_sin(p[0]), 2 * torch.cos(p[0]) * t_[0]))


@tfun.custom_jvp
def _neg4(x):
    return -x


# applies the function to the tangent (a custom function on the linear path), 4x its derivative
_neg4.defjvp(lambda p, t_: (_neg4(p[0]), 4 * _neg4(t_[0])))


@functools.partial(tfun.custom_jvp, nondiff_argnums=(0,))
def _pow_pair(n, d):
    return {"v": d["x"] * d["y"] ** n, "pos": (d["x"] > 0).to(torch.int64)}


@_pow_pair.defjvp
def _pow_pair_jvp(n, p, t_):
    (d,), (td,) = p, t_
    return _pow_pair(n, d), {"v": 3 * td["x"] * d["y"] ** n + 5 * d["x"] * td["y"], "pos": None}


@tfun.custom_jvp
def _const(x):
    return torch.full((3,), 7.0, dtype=x.dtype)


_const.defjvp(lambda p, t_: (_const(p[0]), None))


@tfun.custom_jvp
def _affine(x):
    return x + 1


_affine.defjvp(lambda p, t_: (_affine(p[0]), t_[0] + 91))  # JAX's test_symbolic_zero_custom_jvp: not linear

_X = torch.tensor([0.5, -1.25, 2.0], dtype=D)
_T = torch.tensor([0.3, 1.5, -0.7], dtype=D)
_Y = torch.tensor([1.5, 2.0, -0.3], dtype=D)
_TY = torch.tensor([-0.2, 0.4, 1.1], dtype=D)

_JIT_JVP_CASES = {
    "one call": (lambda x, t_: tfun.jvp(_twice_sin, (x,), (t_,)), (_X, _T)),
    "several calls": (lambda x, t_: tfun.jvp(lambda z: _twice_sin(_twice_sin(z)) * _neg4(z), (x,), (t_,)), (_X, _T)),
    "pytree, nondiff, int output": (
        lambda x, y, tx, ty: tfun.jvp(lambda d: _pow_pair(2, d), ({"x": x, "y": y},), ({"x": tx, "y": ty},)),
        (_X, _Y, _T, _TY),
    ),
    "has_aux": (
        lambda x, t_: tfun.jvp(lambda z: (_twice_sin(z).sum(), {"a": z * 2, "k": 3}), (x,), (t_,), has_aux=True),
        (_X, _T),
    ),
    "output independent of the input": (lambda x, t_: tfun.jvp(_const, (x,), (t_,)), (_X, _T)),
    "rule not linear in the tangent": (lambda x, t_: tfun.jvp(_affine, (x,), (t_,)), (_X, _T)),
    "integer primal": (
        lambda x, t_: tfun.jvp(lambda z, k: _twice_sin(z) * k, (x, torch.tensor(3)), (t_, torch.tensor(0))),
        (_X, _T),
    ),
    "complex": (
        lambda x, t_: tfun.jvp(_twice_sin, (x,), (t_,)),
        (_X.to(torch.complex128) * (1 + 0.5j), _T.to(torch.complex128) * (0.25 - 1j)),
    ),
    "jacfwd": (lambda x: tfun.jacfwd(lambda z: _twice_sin(z) * _neg4(z).sum())(x), (_X,)),
    "vmap of jvp": (lambda x, t_: tfun.vmap(lambda a, b: tfun.jvp(_twice_sin, (a,), (b,)))(x, t_), (_X, _T)),
    "jvp of vmap": (
        lambda x, y, t_, ty: tfun.jvp(
            tfun.vmap(lambda a, b: _pow_pair(1, {"x": a, "y": b})["v"] * _neg4(a), in_axes=(0, None)),
            (x[:, None] * _Y, y),
            (t_[:, None] * _Y, ty),
        ),
        (_X, _Y, _T, _TY),
    ),
    "two jvps, a plain call first": (
        lambda x, t_: (_twice_sin(x), tfun.jvp(_twice_sin, (x,), (t_,)), tfun.jvp(_neg4, (x,), (t_,))),
        (_X, _T),
    ),
}


def _assert_same(got, want):
    gl, gs = tfun.tree.tree_flatten(got)
    wl, ws = tfun.tree.tree_flatten(want)
    assert gs == ws
    for a, b in zip(gl, wl):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        else:
            assert a == b


@pytest.mark.parametrize("case", list(_JIT_JVP_CASES))
def test_jit_of_jvp_of_custom_jvp_uses_the_rule(case):
    """tfun.jit of tfun.jvp (jacfwd, with vmaps) through custom_jvp functions: outputs and
    tangents equal eager float64, whose tangents are the rules'."""
    fn, args = _JIT_JVP_CASES[case]
    _assert_same(tfun.jit(fn, backend="aot_eager")(*args), fn(*args))


def test_jit_of_jvp_of_custom_jvp_tangent_is_the_rules():
    # the oracle, independently of eager tfun.jvp: 2x the true derivative
    out, tan = tfun.jit(lambda x, t_: tfun.jvp(_twice_sin, (x,), (t_,)), backend="aot_eager")(_X, _T)
    torch.testing.assert_close(out, torch.sin(_X))
    torch.testing.assert_close(tan, 2 * torch.cos(_X) * _T)
    out, tan = tfun.jit(lambda x, t_: tfun.jvp(_affine, (x,), (t_,)), backend="aot_eager")(_X, _T)
    torch.testing.assert_close(tan, _T + 91)


@pytest.mark.parametrize("case", ["several calls", "jvp of vmap"])
def test_jit_of_jvp_of_custom_jvp_inductor(case):
    fn, args = _JIT_JVP_CASES[case]
    _assert_same(tfun.jit(fn)(*args), fn(*args))


def test_jit_of_vmap_of_custom_jvp_without_gradient():
    xs = torch.stack([_X, _Y])
    torch.testing.assert_close(tfun.jit(tfun.vmap(_twice_sin), backend="aot_eager")(xs), torch.sin(xs))


def _closes_over_the_dual(x, t_):
    def inner(z):
        @tfun.custom_jvp
        def h(y):
            return y * z

        h.defjvp(lambda p, tt: (h(p[0]), tt[0] * z))
        return h(torch.ones_like(z))

    return tfun.jvp(inner, (x,), (t_,))


@tfun.custom_vjp
def _vjp_sin(x):
    return torch.sin(x)


_vjp_sin.defvjp(lambda x: (_vjp_sin(x), x), lambda r, g: (g,))

_W = torch.tensor(2.0, dtype=D, requires_grad=True)


@tfun.custom_jvp
def _closes_over_a_parameter(x):
    return torch.sin(x) * _W


_closes_over_a_parameter.defjvp(lambda p, t_: (_closes_over_a_parameter(p[0]), _W * t_[0]))


@tfun.custom_jvp
def _with_a_loop(x):
    return tfun.lax.fori_loop(0, 2, lambda i, c: c * 2, x)


_with_a_loop.defjvp(lambda p, t_: (_with_a_loop(p[0]), t_[0]))


@pytest.mark.parametrize(
    "case,error,match",
    [
        (
            "argument requires grad",
            tfun.errors.JitError,
            r"cannot be differentiated again by reverse mode(.|\n)*_twice_sin at .*test_custom_derivatives.py:\d+",
        ),
        ("closure requires grad", tfun.errors.JitError, "cannot be differentiated again by reverse mode"),
        ("closure has a tangent", ArgumentValueError, "close over"),
        ("custom_vjp", tfun.errors.JitError, "a custom_vjp function cannot be called inside a torch.func transform"),
        ("control flow", tfun.errors.JitError, "control-flow op"),
        ("jvp of jvp", tfun.errors.JitError, "enclosing torch.func transforms are jvp of jvp"),
    ],
)
def test_jit_of_jvp_of_custom_jvp_refusals(case, error, match):
    x, tx = _X, _T
    fn = {
        "argument requires grad": lambda x, t_: tfun.jvp(_twice_sin, (x,), (t_,)),
        "closure requires grad": lambda x, t_: tfun.jvp(_closes_over_a_parameter, (x,), (t_,)),
        "closure has a tangent": _closes_over_the_dual,
        "custom_vjp": lambda x, t_: tfun.jvp(_vjp_sin, (x,), (t_,)),
        "control flow": lambda x, t_: tfun.jvp(_with_a_loop, (x,), (t_,)),
        "jvp of jvp": lambda x, t_: tfun.jvp(lambda a: tfun.jvp(_twice_sin, (a,), (t_,))[1], (x,), (t_,)),
    }[case]
    if case == "argument requires grad":
        x = x.clone().requires_grad_()
    with pytest.raises(error, match=match):
        tfun.jit(fn, backend="aot_eager")(x, tx)
    if case in ("argument requires grad", "closure requires grad"):
        # without a gradient to take, it runs (and uses the rule)
        with torch.no_grad():
            got = tfun.jit(fn, backend="aot_eager")(x, tx)
            _assert_same(got, fn(x, tx))


def test_forward_over_forward_through_custom_jvp_differentiates_the_rule():
    """`jvp` of `jvp` (and `jacfwd` of `jacfwd`) through a custom_jvp function differentiates
    the rule's tangent map, as JAX does. Through torch's `autograd.Function` alone the
    second-order tangent came out zero without an error (it runs its `jvp` outside the outer
    forward-mode transform); tfun handles the innermost level by hand. Reverse mode over or
    under forward mode differentiates the rule too."""

    @tfun.custom_jvp
    def f(x):
        return torch.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), 2 * torch.cos(p[0]) * t[0]))  # twice the true derivative
    x = torch.tensor([3.0, 1.0], dtype=D)
    first = lambda x: tfun.jvp(f, (x,), (x,))[1]  # 2 cos(x) x
    want_first = 2 * torch.cos(x) * x
    primal, second = tfun.jvp(first, (x,), (x,))
    torch.testing.assert_close(primal, want_first)
    torch.testing.assert_close(second, (2 * torch.cos(x) - 2 * x * torch.sin(x)) * x)
    third = tfun.jvp(lambda a: tfun.jvp(lambda b: tfun.jvp(f, (b,), (x,))[1], (a,), (x,))[1], (x,), (x,))[1]
    torch.testing.assert_close(third, -2 * torch.cos(x) * x**3)
    want = torch.diag(-2 * torch.sin(x))
    fwd_fwd = tfun.jacfwd(tfun.jacfwd(f))(x)
    torch.testing.assert_close(torch.diagonal(fwd_fwd, dim1=1, dim2=2).diagonal(), torch.diagonal(want))
    torch.testing.assert_close(fwd_fwd.abs().sum(), want.abs().sum())  # zero off the diagonal
    # d/dx of the rule's tangent map, in the mixed orders
    torch.testing.assert_close(tfun.grad(lambda x: first(x).sum())(x), 2 * torch.cos(x) - 2 * x * torch.sin(x))
    torch.testing.assert_close(tfun.hessian(lambda x: f(x).sum())(x), want)
    for jac in (tfun.jacrev(tfun.jacfwd(f))(x), tfun.jacfwd(tfun.jacrev(f))(x)):
        torch.testing.assert_close(torch.diagonal(jac, dim1=1, dim2=2).diagonal(), torch.diagonal(want))
    # JAX's test_invariance: nested jvps that keep only the primal output
    f2 = lambda x: tfun.jvp(f, (x,), (x,))[0]
    f3 = lambda x: tfun.jvp(f2, (x,), (x,))[0]
    for g in (f2, f3):
        torch.testing.assert_close(tfun.jvp(g, (x,), (x,)), (torch.sin(x), want_first))


_T1, _T2, _T3 = [0.5, 2.0, -1.0], [1.5, -0.5, 0.25], [-1.0, 0.75, 2.0]


def _stack_programs(L, fn, arr):
    """Programs that nest forward mode (and vmap, grad) around `fn`, in tfun or in JAX."""
    s = lambda z: z.sum()
    t1, t2, t3 = arr(_T1), arr(_T2), arr(_T3)
    jvp, grad, vmap, jacfwd, jacrev = L.jvp, L.grad, L.vmap, L.jacfwd, L.jacrev
    return {
        "jvp_jvp": lambda x: jvp(lambda a: jvp(fn, (a,), (t1,))[1], (x,), (t2,)),
        "jvp_jvp_same_tangent": lambda x: jvp(lambda a: jvp(fn, (a,), (a,))[1], (x,), (t2,)),
        "jvp_jvp_jvp": lambda x: jvp(lambda b: jvp(lambda a: jvp(fn, (a,), (t1,))[1], (b,), (t2,))[1], (x,), (t3,)),
        "jacfwd_jacfwd": lambda x: jacfwd(jacfwd(fn))(x),
        "jacfwd_jacfwd_jacfwd": lambda x: jacfwd(jacfwd(jacfwd(fn)))(x),
        "jvp_vmap_jvp": lambda x: jvp(lambda a: vmap(lambda r: jvp(fn, (r,), (r * 2,))[1])(a.reshape(3, 1)), (x,), (t2,)),
        "jvp_jvp_vmap": lambda x: jvp(lambda a: jvp(vmap(fn), (a,), (t1,))[1], (x,), (t2,)),
        "vmap_jvp_jvp": lambda x: vmap(lambda a: jvp(lambda b: jvp(fn, (b,), (b,))[1], (a,), (a,))[1])(x),
        "outer_only": lambda x: jvp(lambda a: jvp(lambda b: fn(a) * b, (t1,), (t2,))[1], (x,), (t3,)),
        "jvp_grad_jvp": lambda x: jvp(grad(lambda a: s(jvp(fn, (a,), (t1,))[1])), (x,), (t2,)),
        "grad_jvp_jvp": lambda x: grad(lambda a: s(jvp(lambda b: jvp(fn, (b,), (t1,))[1], (a,), (t2,))[1]))(x),
        "jvp_jvp_grad": lambda x: jvp(lambda a: jvp(grad(lambda c: s(fn(c))), (a,), (t1,))[1], (x,), (t2,)),
        "jvp_jvp_vjp": lambda x: jvp(lambda a: jvp(lambda b: L.vjp(fn, b)[1](t3)[0], (a,), (t1,))[1], (x,), (t2,)),
        "jacrev_jacfwd_jacfwd": lambda x: jacrev(jacfwd(jacfwd(fn)))(x),
        "jacfwd_jacfwd_jacrev": lambda x: jacfwd(jacfwd(jacrev(fn)))(x),
        "jvp_jvp_grad_perturbed": lambda x: jvp(
            lambda a: jvp(lambda b: grad(lambda c: s(fn(c * b)))(b), (a,), (t1,))[1], (x,), (t2,)
        ),
    }


_STACKS = list(_stack_programs(tfun, None, lambda v: v))


def _assert_tree_close_to_jax(jax, got, want):
    got_l, want_l = optree.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got_l) == len(want_l)
    for g, w in zip(got_l, want_l):
        np.testing.assert_allclose(g.numpy(), np.asarray(w), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("stack", _STACKS)
def test_forward_over_forward_stacks_match_jax(jax, stack):
    """Every nesting of forward mode with vmap and reverse mode around a custom_jvp function
    whose rule is not the function's derivative (and calls the function): JAX's values."""
    jnp = jax.numpy

    @tfun.custom_jvp
    def f(x):
        return torch.sin(x) * x

    f.defjvp(lambda p, t: (f(p[0]), 2 * torch.cos(p[0]) * t[0] + p[0] * t[0]))

    @jax.custom_jvp
    def jf(x):
        return jnp.sin(x) * x

    jf.defjvp(lambda p, t: (jf(p[0]), 2 * jnp.cos(p[0]) * t[0] + p[0] * t[0]))
    x = [0.3, 1.2, -0.7]
    got = _stack_programs(tfun, f, lambda v: torch.tensor(v, dtype=D))[stack](torch.tensor(x, dtype=D))
    want = _stack_programs(jax, jf, jnp.asarray)[stack](jnp.asarray(x))
    _assert_tree_close_to_jax(jax, got, want)


@pytest.mark.parametrize("program", ["jvp_jvp", "jacfwd_jacfwd", "jacfwd_jacfwd_jacfwd", "jvp_jvp_vmap"])
def test_forward_over_forward_pytrees_nondiff_and_loops_match_jax(jax, program):
    """Forward over forward mode through a custom_jvp with pytree arguments and outputs,
    nondiff arguments (an int and a function) and a rule that runs a `fori_loop` and calls
    the function: JAX's values."""
    jnp = jax.numpy

    def build(custom, np_, lax, arr):
        @functools.partial(custom, nondiff_argnums=(0, 1))
        def f(k, act, d):
            return (act(d["a"]) * d["b"] ** k, np_.sin(d["a"] + d["b"]))

        def f_jvp(k, act, p, t):
            (d,), (td,) = p, t
            a, b, ta, tb = d["a"], d["b"], td["a"], td["b"]
            g = lax.fori_loop(0, 2, lambda i, c: c * np_.cos(a), ta)
            return f(k, act, d), (g * b**k + 3 * act(a) * b ** (k - 1) * tb, np_.cos(a + b) * (ta + 2 * tb))

        f.defjvp(f_jvp)
        first = lambda z: f(2, np_.tanh, {"a": z, "b": z * 0.5 + 1})[0]
        summed = lambda z: sum(o.sum() for o in f(2, np_.tanh, {"a": z, "b": z * z + 1}))
        return first, summed, arr(_T1), arr(_T2)

    def programs(L, first, summed, t1, t2):
        return {
            "jvp_jvp": lambda z: L.jvp(lambda a: L.jvp(first, (a,), (t1,))[1], (z,), (t2,)),
            "jacfwd_jacfwd": lambda z: L.jacfwd(L.jacfwd(first))(z),
            "jacfwd_jacfwd_jacfwd": lambda z: L.jacfwd(L.jacfwd(L.jacfwd(summed)))(z),
            "jvp_jvp_vmap": lambda z: L.jvp(
                lambda a: L.jvp(L.vmap(first), (a.reshape(3, 1),), (t1.reshape(3, 1),))[1], (z,), (t2,)
            ),
        }

    x = [0.3, 1.2, -0.7]
    t_args = build(tfun.custom_jvp, torch, tfun.lax, lambda v: torch.tensor(v, dtype=D))
    got = programs(tfun, *t_args)[program](torch.tensor(x, dtype=D))
    want = programs(jax, *build(jax.custom_jvp, jnp, jax.lax, jnp.asarray))[program](jnp.asarray(x))
    _assert_tree_close_to_jax(jax, got, want)


def test_forward_over_forward_closure_derivative_is_refused():
    """Forward over forward mode through a custom_jvp that closes over a tensor perturbed by
    the outer jvp: the rule says nothing about that tensor, so it is refused (as at first
    order), naming the rule."""
    x = torch.tensor([0.3, 1.2], dtype=D)

    def outer(w):
        @tfun.custom_jvp
        def h(y):
            return y * w

        h.defjvp(lambda p, t: (h(p[0]), t[0] * w))
        return tfun.jvp(lambda a: tfun.jvp(h, (a,), (x,))[1], (x,), (x,))[1]

    with pytest.raises(ArgumentValueError, match="close over") as e:
        tfun.jvp(outer, (x,), (x,))
    assert "test_custom_derivatives.py" in str(e.value)
    # not perturbed by any transform: a constant of the function, as at first order
    torch.testing.assert_close(outer(x), torch.zeros_like(x))


def test_forward_over_forward_under_functionalize_is_refused():
    """The one nesting tfun does not handle level by level: `functionalize` innermost. An
    error naming the transform and the function, not a zero second-order tangent."""

    @tfun.custom_jvp
    def f(x):
        return torch.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), 2 * torch.cos(p[0]) * t[0]))
    x = torch.tensor([0.3, 1.2], dtype=D)
    with pytest.raises(ArgumentValueError, match="innermost torch.func transform is functionalize") as e:
        tfun.jvp(lambda a: tfun.jvp(torch.func.functionalize(f), (a,), (x,))[1], (x,), (x,))
    assert re.search(r"The function is `f at \S*test_custom_derivatives\.py:\d+`", str(e.value))
    assert "tfun.hessian" in str(e.value)


# ------------------------------------------- custom_vjp inside tfun.vmap inside tfun.jit
# (porting-guide row jit-vmap-custom-function, narrowed): traced, the call applies the rule
# outside the vmaps, vectorised over their batch dimensions, so that an outer reverse mode
# (tfun.vjp / tfun.grad inside tfun.jit, .backward() outside) uses the rule. Each rule below
# differs from the true derivative, so a gradient that ignored it would not match.


@tfun.custom_vjp
def _vv_f(x, y):
    return torch.sin(x) * y


_vv_f.defvjp(
    lambda x, y: (_vv_f(x, y), (torch.cos(x), torch.sin(x), y, 2.0)),  # a static residual too
    lambda res, g: (3 * res[0] * g * res[2] + res[3], 5 * res[1] * g),
)


def _vv_rule(x, y, g):
    """The rule's cotangents, elementwise (before any sum over an unbatched argument)."""
    return 3 * torch.cos(x) * g * y + 2.0, 5 * torch.sin(x) * g


@tfun.custom_vjp
def _vv_tree(pair, z):
    return [pair[0] * pair[1], (torch.exp(z),)]


_vv_tree.defvjp(
    lambda pair, z: (_vv_tree(pair, z), (pair, z, "tag")),
    lambda res, g: ((7 * g[0] * res[0][1], None), g[1][0] * 11),  # None: a zero cotangent
)


@functools.partial(tfun.custom_vjp, nondiff_argnums=(0, 1))
def _vv_nondiff(n, fn, x):
    return fn(x) * n


_vv_nondiff.defvjp(lambda n, fn, x: (_vv_nondiff(n, fn, x), x), lambda n, fn, r, g: (g * n * 100 * fn(r),))


@tfun.custom_vjp
def _vv_int(x):
    return x * 2, torch.argmax(x, dim=-1)


_vv_int.defvjp(lambda x: (_vv_int(x), None), lambda r, g: (g[0] * 9,))


def _vv_vjp(f):
    def run(*a):
        ct, args = a[-1], a[:-1]
        out, pull = tfun.vjp(f, *args)
        return out, pull(ct)

    return run


def _vv_cases():
    x, y, ct = t(4, 3, seed=1), t(4, 3, seed=2), t(4, 3, seed=3)
    y1, ct_t = t(4, seed=4), t(3, 4, seed=5)
    xb, yb, ctb = t(5, 3, seed=6), t(3, seed=7), t(3, 5, seed=8)
    xc, yc = t(5, seed=9), t(3, seed=10)
    a, b, z, cp, cq = t(4, 2, seed=11), t(4, 2, seed=12), t(4, seed=13), t(4, 2, seed=14), t(4, seed=15)
    gx_t, gy_t = _vv_rule(x.T, y1, ct_t)
    gx_b, gy_b = _vv_rule(xb.T, yb[:, None], ctb)
    gx_c, gy_c = _vv_rule(xc[None], yc[:, None], ctb)
    return {
        "one vmap": (
            _vv_vjp(tfun.vmap(_vv_f)),
            (x, y, ct),
            (torch.sin(x) * y, _vv_rule(x, y, ct)),
        ),
        "nested": (
            _vv_vjp(tfun.vmap(tfun.vmap(_vv_f))),
            (x, y, ct),
            (torch.sin(x) * y, _vv_rule(x, y, ct)),
        ),
        "in_axes 1, unbatched y": (
            _vv_vjp(tfun.vmap(_vv_f, in_axes=(1, None))),
            (x, y1, ct_t),
            (torch.sin(x.T) * y1, (gx_t.T, gy_t.sum(0))),
        ),
        "nested, y unbatched by the inner": (
            _vv_vjp(tfun.vmap(tfun.vmap(_vv_f, in_axes=(0, None)), in_axes=(1, 0))),
            (xb, yb, ctb),
            (torch.sin(xb.T) * yb[:, None], (gx_b.T, gy_b.sum(1))),
        ),
        "nested, x unbatched by the outer": (
            _vv_vjp(tfun.vmap(tfun.vmap(_vv_f, in_axes=(0, None)), in_axes=(None, 0))),
            (xc, yc, ctb),
            (torch.sin(xc[None]) * yc[:, None], (gx_c.sum(0), gy_c.sum(1))),
        ),
        "pytrees": (
            _vv_vjp(lambda a, b, z: tfun.vmap(_vv_tree)((a, b), z)),
            (a, b, z, [cp, (cq,)]),
            ([a * b, (torch.exp(z),)], (7 * cp * b, torch.zeros_like(b), cq * 11)),
        ),
        "nondiff": (
            _vv_vjp(tfun.vmap(lambda x: _vv_nondiff(3.0, torch.cos, x))),
            (x, ct),
            (torch.cos(x) * 3, (ct * 300 * torch.cos(x),)),
        ),
        "integer output": (
            lambda x, ct: (*_vv_vjp(lambda x: tfun.vmap(_vv_int)(x)[0])(x, ct), tfun.vmap(_vv_int)(x)[1]),
            (x, ct),
            (x * 2, (ct * 9,), torch.argmax(x, -1)),
        ),
        "grad": (
            tfun.grad(lambda x, y: tfun.vmap(_vv_f)(x, y).sum(), argnums=(0, 1)),
            (x, y),
            _vv_rule(x, y, torch.ones_like(x)),
        ),
    }


# CI's second torch phase leaves the nested cases out (`heavy`: see pyproject.toml)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.heavy) if c.startswith("nested") else c for c in _vv_cases()])
def test_jit_of_vmap_of_custom_vjp_uses_the_rule(case):
    fn, args, want = _vv_cases()[case]
    _assert_same(fn(*args), want)  # eagerly
    _assert_same(tfun.jit(fn, backend="aot_eager")(*args), want)
    assert torch._C._functorch.peek_interpreter_stack() is None


@pytest.mark.parametrize("case", ["nested, y unbatched by the inner", "pytrees"])
def test_jit_of_vmap_of_custom_vjp_inductor(case):
    fn, args, want = _vv_cases()[case]
    _assert_same(tfun.jit(fn)(*args), want)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_jit_of_vmap_of_custom_vjp_backward_outside(backend):
    x, y, ct = t(4, 3, seed=1, grad=True), t(4, 3, seed=2, grad=True), t(4, 3, seed=3)
    options = {} if backend == "inductor" else {"backend": backend}
    jitted = tfun.jit(lambda x, y: tfun.vmap(tfun.vmap(_vv_f))(x, y), **options)
    out = jitted(x, y)
    out.backward(ct)
    xd, yd = x.detach(), y.detach()
    _assert_same((out.detach(), (x.grad, y.grad)), (torch.sin(xd) * yd, _vv_rule(xd, yd, ct)))
    with torch.no_grad():  # nothing to differentiate: the function runs
        _assert_same(jitted(x, y), torch.sin(x.detach()) * y.detach())


@pytest.mark.heavy
def test_jit_of_vmap_of_custom_vjp_batch_sizes_change():
    # a second size makes tfun.jit compile with symbolic sizes. A call whose arguments the
    # vmap does not batch is not batched: its rule runs once, on the cotangent summed over the
    # batch (the rule's `+ 2.0` counts once, as eagerly)
    jitted = tfun.jit(_vv_vjp(tfun.vmap(_vv_f)), backend="aot_eager")
    unbatched = tfun.jit(_vv_vjp(lambda x, y: tfun.vmap(lambda xi: _vv_f(y, y) * xi)(x)), backend="aot_eager")
    for n in (4, 6, 7):
        x, y, ct = t(n, 3, seed=n), t(n, 3, seed=n + 1), t(n, 3, seed=n + 2)
        _assert_same(jitted(x, y, ct), (torch.sin(x) * y, _vv_rule(x, y, ct)))
        gx, gy = unbatched(x, y[0], ct)[1]
        torch.testing.assert_close(gx, torch.sin(y[0]) * y[0] * ct)
        rx, ry = _vv_rule(y[0], y[0], (ct * x).sum(0))
        torch.testing.assert_close(gy, rx + ry)


def test_jit_of_vmap_of_custom_vjp_refusals():
    x, y, ct = t(4, 3, seed=1), t(4, 3, seed=2), t(4, 3, seed=3)

    @functools.partial(tfun.custom_vjp, nondiff_argnums=(0,))
    def scaled(s, a):
        return a * s

    scaled.defvjp(lambda s, a: (scaled(s, a), None), lambda s, r, g: (g * s * 10,))
    # a nondiff tensor that the vmap batches
    fn = _vv_vjp(lambda x: tfun.vmap(scaled)(y, x))
    with pytest.raises(tfun.errors.JitError, match="a nondiff argument is a tensor batched by the vmap") as e:
        tfun.jit(fn, backend="aot_eager")(x, ct)
    assert re.search(r"The function is `scaled at \S*test_custom_derivatives\.py:\d+`", str(e.value))
    # one it does not batch is a constant, as eagerly
    fn = _vv_vjp(lambda x: tfun.vmap(scaled, in_axes=(None, 0))(y[0], x))
    _assert_same(tfun.jit(fn, backend="aot_eager")(x, ct), fn(x, ct))

    # a tensor batched by the vmap that the function's rules close over
    def closes_over(x, y, ct):
        def per(xi, yi):
            @tfun.custom_vjp
            def f(a):
                return torch.sin(a) * yi

            f.defvjp(lambda a: (f(a), a), lambda r, g: (3 * torch.cos(r) * g * yi,))
            return f(xi)

        out, pull = tfun.vjp(lambda x: tfun.vmap(per)(x, y), x)
        return out, pull(ct)

    torch.testing.assert_close(closes_over(x, y, ct)[1][0], 3 * torch.cos(x) * ct * y)  # eagerly
    with pytest.raises(tfun.errors.JitError, match="closes over a tensor batched by that vmap"):
        tfun.jit(closes_over, backend="aot_eager")(x, y, ct)
    # forward mode: refused (as eagerly, where it is a TypeError)
    with pytest.raises(tfun.errors.JitError, match="other than tfun.vmap \\(here jvp of vmap"):
        tfun.jit(lambda x: tfun.jvp(tfun.vmap(lambda a: _vv_f(a, a)), (x,), (x,)), backend="aot_eager")(x)
    assert torch._C._functorch.peek_interpreter_stack() is None


def test_jit_of_vmap_of_custom_vjp_rule_errors_name_the_rule():
    @tfun.custom_vjp
    def f(x, y):
        return torch.sin(x) * y

    def short_bwd(res, g):
        return (g,)

    f.defvjp(lambda x, y: (f(x, y), (x, y)), short_bwd)
    x = t(4, 3)
    fn = _vv_vjp(tfun.vmap(tfun.vmap(f)))
    for run in (fn, tfun.jit(fn, backend="aot_eager")):
        with pytest.raises(StructureMismatchError, match="one entry per differentiable argument") as e:
            run(x, x, x)
        assert re.search(r"The function is `short_bwd at \S*test_custom_derivatives\.py:\d+`", str(e.value))
    assert torch._C._functorch.peek_interpreter_stack() is None


@pytest.mark.heavy
def test_jit_of_vmap_of_custom_jvp_reverse_mode_uses_the_rule():
    """A custom_jvp call inside tfun.vmap under tfun.jit, differentiated by reverse mode (it was
    a JitError): the transposed rule, applied outside the vmaps as for custom_vjp."""

    @tfun.custom_jvp
    def f(x, y):
        return torch.sin(x) * y

    @f.defjvp
    def f_jvp(p, t_):
        (x, y), (tx, ty) = p, t_
        return f(x, y), 3 * torch.cos(x) * y * tx + 5 * torch.sin(x) * ty  # not the true derivative

    def rule(x, y, g):
        return 3 * torch.cos(x) * y * g, 5 * torch.sin(x) * g

    @tfun.custom_jvp
    def with_int(x):
        return x * 2, torch.argmax(x, dim=-1)

    with_int.defjvp(lambda p, t_: (with_int(p[0]), (t_[0] * 9, None)))
    x, y, ct = t(4, 3, seed=1), t(4, 3, seed=2), t(4, 3, seed=3)
    y1, ct_t = t(4, seed=4), t(3, 4, seed=5)
    gx_t, gy_t = rule(x.T, y1, ct_t)
    cases = [
        (_vv_vjp(tfun.vmap(tfun.vmap(f))), (x, y, ct), (torch.sin(x) * y, rule(x, y, ct))),
        (_vv_vjp(tfun.vmap(f, in_axes=(1, None))), (x, y1, ct_t), (torch.sin(x.T) * y1, (gx_t.T, gy_t.sum(0)))),
        (_vv_vjp(lambda x: tfun.vmap(with_int)(x)[0]), (x, ct), (x * 2, (ct * 9,))),
        (tfun.grad(lambda x, y: tfun.vmap(f)(x, y).sum(), argnums=(0, 1)), (x, y), rule(x, y, torch.ones_like(x))),
    ]
    for fn, args, want in cases:
        _assert_same(fn(*args), want)
    # (one compile of the four cases, each result checked as eagerly)
    jitted = tfun.jit(lambda all_args: [fn(*args) for (fn, _, _), args in zip(cases, all_args)], backend="aot_eager")
    for got, (_, _, want) in zip(jitted([args for _, args, _ in cases]), cases):
        _assert_same(got, want)
    _assert_same(tfun.jit(cases[0][0])(*cases[0][1]), cases[0][2])  # Inductor
    # .backward() outside tfun.jit (the JitError case "vmap, requires grad" before)
    xg = _X.clone().requires_grad_()
    out = tfun.jit(lambda x, t_: tfun.vmap(_twice_sin)(x) * t_, backend="aot_eager")(xg, _T)
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(xg.grad, 2 * torch.cos(_X) * _T)
    assert torch._C._functorch.peek_interpreter_stack() is None


# ---------------------------------------------------------------- a vjp function as a residual


def _vjp_function_residual_rule():
    """JAX's nestable-vjp idiom: fwd returns `tfun.vjp`'s function (with `has_aux`, inside a
    pytree with other residuals) and bwd pulls back with it. bwd scales by 2 where the
    derivative scales by 3, so a path that ignores the rule is caught."""

    def f(w, x):
        return torch.sin(w * x), {"s": w.sum()}

    @tfun.custom_vjp
    def g(w, x):
        return torch.sin(w * x) * 3

    def fwd(w, x):
        y, pull, aux = tfun.vjp(f, w, x, has_aux=True)
        return y * 3, {"pull": pull, "k": torch.tensor(2.0, dtype=D), "s": aux["s"]}

    g.defvjp(fwd, lambda r, yb: r["pull"](yb * r["k"]))
    return g


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_jit_grad_of_custom_vjp_with_vjp_function_residual(backend):
    """The residual's vjp function crosses the rule's traced forward/backward as its leaves
    (the primals) and recomputes in the backward: the rule's gradient, as eagerly."""
    g = _vjp_function_residual_rule()
    w, x = t(3, seed=1), t(3, seed=2)

    def loss(w, x):
        return (g(w, x) ** 2).sum()

    yb = 2 * torch.sin(w * x) * 3
    rule = (yb * 2 * torch.cos(w * x) * x, yb * 2 * torch.cos(w * x) * w)
    eager = tfun.grad(loss, argnums=(0, 1))(w, x)
    got = tfun.jit(tfun.grad(loss, argnums=(0, 1)), backend=backend)(w, x)
    for a, b, c in zip(got, eager, rule):
        torch.testing.assert_close(b, c)
        torch.testing.assert_close(a, c)


def test_jit_custom_vjp_with_vjp_function_residual_backward_outside():
    """Compiled forward, `.backward()` after: the compiled backward uses the rule."""
    g = _vjp_function_residual_rule()
    w, x = t(3, seed=3, grad=True), t(3, seed=4)
    loss = tfun.jit(lambda w, x: (g(w, x) ** 2).sum(), backend="aot_eager")(w, x)
    loss.backward()
    w0 = w.detach()
    torch.testing.assert_close(w.grad, 2 * torch.sin(w0 * x) * 3 * 2 * torch.cos(w0 * x) * x)


# --------------------------------------------------------------------------------------
# control flow inside a custom function under tfun.jit
# --------------------------------------------------------------------------------------


def _fixed_point(f, a, x_guess):
    """JAX's custom_vjp tutorial: `x* = f(a, x*)` by iteration, differentiated implicitly
    (a while_loop in the function, its fwd and its bwd)."""

    def cond(c):
        x_prev, x, k = c
        return ((x_prev - x).abs().max() > 1e-12) & (k < 200)

    def body(c):
        _, x, k = c
        return x, f(a, x), k + 1

    return tfun.lax.while_loop(cond, body, (x_guess, f(a, x_guess), torch.tensor(0)))[1]


@functools.partial(tfun.custom_vjp, nondiff_argnums=(0,))
def fixed_point(f, a, x_guess):
    return _fixed_point(f, a, x_guess)


def _fixed_point_fwd(f, a, x_guess):
    x_star = _fixed_point(f, a, x_guess)
    return x_star, (a, x_star)


def _fixed_point_bwd(f, res, x_star_bar):
    a, x_star = res
    _, vjp_a = tfun.vjp(lambda a: f(a, x_star), a)
    _, vjp_x = tfun.vjp(lambda x: f(a, x), x_star)
    w = _fixed_point(lambda v, w: v + vjp_x(w)[0], x_star_bar, x_star_bar)
    return vjp_a(w)[0], torch.zeros_like(x_star)


fixed_point.defvjp(_fixed_point_fwd, _fixed_point_bwd)


def _newton_sqrt(a):
    return fixed_point(lambda a, x: 0.5 * (x + a / x), a, a)


@tfun.custom_vjp
def _sqrt_by_newton(a):
    return _fixed_point(lambda a, x: 0.5 * (x + a / x), a, a)


def _sqrt_fwd(a):
    x = _fixed_point(lambda a, x: 0.5 * (x + a / x), a, a)
    return x, x


_sqrt_by_newton.defvjp(_sqrt_fwd, lambda x, g: (g * 0.5 / x,))


@tfun.custom_vjp
def _scan_rnn(x):
    return _rnn_scan(x)


_W_RNN = torch.randn(3, 3, generator=torch.Generator().manual_seed(21), dtype=D) * 0.5


def _rnn_scan(x):
    return tfun.lax.scan(lambda c, _: (torch.tanh(c @ _W_RNN), None), x, None, length=4)[0]


_scan_rnn.defvjp(lambda x: tfun.vjp(_rnn_scan, x), lambda f_vjp, g: f_vjp(g * 1.5))  # not the derivative


@tfun.custom_jvp
def _cond_fn(x):
    return tfun.lax.cond(x.sum() > 0, torch.sin, torch.cos, x)


_cond_fn.defjvp(lambda p, t: (_cond_fn(p[0]), t[0] * 2.0))  # not the derivative


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
def test_control_flow_inside_the_rule_under_jit(backend):
    """A tfun.lax op in a custom function, its fwd or its rule (JAX's fixed-point example: a
    while_loop in all three), under tfun.jit(tfun.grad(...)): the rule's gradient, as eagerly.
    On torch 2.13/2.14 this was a Dynamo error ("'_VjpSpec' object has no attribute
    'res_src'"): see `_Results`."""
    a = torch.tensor([2.0, 3.0, 0.5], dtype=D)
    x = torch.randn(3, generator=torch.Generator().manual_seed(22), dtype=D)
    sqrt_grad = tfun.grad(lambda a: _sqrt_by_newton(a).sum())
    rnn_grad = tfun.grad(lambda z: (_scan_rnn(z) ** 2).sum())
    cond_grad = tfun.grad(lambda z: (_cond_fn(z) ** 2).sum())
    # (one compile of the three gradients, one of the two forwards: each value checked as before)
    got = tfun.jit(lambda a, x: (sqrt_grad(a), rnn_grad(x), cond_grad(x)), backend=backend)(a, x)
    torch.testing.assert_close(got[0], 0.5 / a.sqrt())
    torch.testing.assert_close(got[1], rnn_grad(x))
    torch.testing.assert_close(got[2], cond_grad(x))
    # JAX's fixed point, whose bwd iterates a pullback in a while_loop: eagerly exact; under
    # tfun.jit a pullback inside a loop body (torch.autograd.grad in a HOP) is a JitError
    newton_grad = tfun.grad(lambda a: _newton_sqrt(a).sum())
    torch.testing.assert_close(newton_grad(a), 0.5 / a.sqrt())
    by_newton, newton = tfun.jit(lambda a: (_sqrt_by_newton(a), _newton_sqrt(a)), backend=backend)(a)
    torch.testing.assert_close(by_newton, a.sqrt())
    torch.testing.assert_close(newton, a.sqrt())
    with pytest.raises(tfun.errors.JitError):
        tfun.jit(newton_grad, backend=backend)(a)
    # the rules differ from the derivatives: the rule's gradient is what came out
    plain = tfun.grad(lambda z: (_rnn_scan(z) ** 2).sum())(x)
    assert not torch.allclose(tfun.grad(lambda z: (_scan_rnn(z) ** 2).sum())(x), plain)


@pytest.mark.parametrize("loop", ["scan", "while_loop"])
@pytest.mark.parametrize("kind", ["custom_vjp", "custom_jvp"])
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
def test_a_rule_inside_a_scan_body_whose_init_needs_no_grad_is_used_under_jit(loop, kind, backend):
    """A custom function in a scan body whose carry starts as `torch.zeros`: traced, the carry
    does not require grad, so the rule was left out and torch's scan autograd differentiated
    the primal (the true derivative, silently; hunt 22). The scan now lowers again with its
    carry requiring grad: the rule (here half the true derivative) is used, as eagerly."""
    if kind == "custom_vjp":

        @tfun.custom_vjp
        def half(x):
            return torch.sin(x)

        half.defvjp(lambda x: (torch.sin(x), x), lambda x, g: (g * torch.cos(x) * 0.5,))
    else:

        @tfun.custom_jvp
        def half(x):
            return torch.sin(x)

        half.defjvp(lambda primals, tangents: (torch.sin(primals[0]), torch.cos(primals[0]) * 0.5 * tangents[0]))

    def loss(x):
        if loop == "while_loop":  # a fori_loop with a tensor bound is a while_loop
            c = tfun.lax.fori_loop(0, torch.tensor(4), lambda i, c: half(c) + x[1], torch.zeros(3, dtype=x.dtype))
            return (c**2).sum()
        c, ys = tfun.lax.scan(lambda c, xt: (half(c) + xt, c), torch.zeros(3, dtype=x.dtype), x)
        return (c**2).sum() + (ys**2).sum()

    x = torch.randn(6, 3, dtype=D, generator=torch.Generator().manual_seed(0))
    want = tfun.grad(loss)(x)
    torch._dynamo.reset()
    torch.testing.assert_close(tfun.jit(tfun.grad(loss), backend=backend)(x), want)
    torch._dynamo.reset()
    xg = x.clone().requires_grad_()
    tfun.jit(loss, backend=backend)(xg).backward()
    torch.testing.assert_close(xg.grad, want)
    # and the same without the rule would differ: the test can tell the two apart
    def plain(x):
        if loop == "while_loop":
            c = tfun.lax.fori_loop(0, torch.tensor(4), lambda i, c: torch.sin(c) + x[1], torch.zeros(3, dtype=x.dtype))
            return (c**2).sum()
        c, ys = tfun.lax.scan(lambda c, xt: (torch.sin(c) + xt, c), torch.zeros(3, dtype=x.dtype), x)
        return (c**2).sum() + (ys**2).sum()

    assert not torch.allclose(tfun.grad(plain)(x), want, rtol=1e-3, atol=1e-3)


# --- a custom rule inside a loop body under a traced vmap (hunt 25, finding 3) ---------------


def _loop_rule_pair(kind):
    """A custom function whose rule is not tanh's derivative (so that using the primal's
    derivative instead is seen), and a straight-through oracle with the rule's derivative."""
    if kind == "custom_vjp":

        @tfun.custom_vjp
        def cf(h, W):
            return torch.tanh(h @ W)

        def fwd(h, W):
            y = torch.tanh(h @ W)
            return y, (h, W, y)

        def bwd(res, g):
            h, W, y = res
            gz = g * (1 - y * y)
            return 0.5 * (gz @ W.T), 2.0 * (h[:, None] * gz[None, :])

        cf.defvjp(fwd, bwd)
    else:

        @tfun.custom_jvp
        def cf(h, W):
            return torch.tanh(h @ W)

        @cf.defjvp
        def _rule(primals, tangents):
            (h, W), (dh, dW) = primals, tangents
            y = torch.tanh(h @ W)
            return y, (1 - y * y) * (0.5 * (dh @ W) + 2.0 * (h @ dW))

    def oracle(h, W):
        s = 0.5 * torch.tanh(h @ W.detach()) + 2.0 * torch.tanh(h.detach() @ W)
        return torch.tanh(h @ W).detach() + s - s.detach()

    return cf, oracle


_LOOPS = {
    "map": lambda c: (lambda x, W: (tfun.lax.map(lambda r: c(r, W), x) ** 2).sum()),
    "scan": lambda c: (lambda x, W: (tfun.lax.scan(lambda h, xt: (c(h + xt, W), h), x[0], x)[1] ** 2).sum()),
}


# torch's vmap falls back to a loop for aten::select_copy (map's slices) and says so
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
@pytest.mark.parametrize("loop", sorted(_LOOPS))
@pytest.mark.parametrize("kind", ["custom_vjp", "custom_jvp"])
def test_a_rule_in_a_loop_body_under_jit_of_vmap_is_refused_not_wrong(kind, loop):
    """Under `tfun.jit(tfun.vmap(...))`, a custom function called in a loop body gave wrong
    per-example gradients with no error (relative error up to 1.4) where the batch size equals
    a dimension of a tensor the vmap does not batch, else a fake-tensor shape error: torch
    batches the body's graph again after tfun's batching of the rule. Now a JitError that
    names the call; eagerly the same program is right."""
    cf, oracle = _loop_rule_pair(kind)
    g = torch.Generator().manual_seed(2)
    W = torch.randn(3, 3, dtype=torch.float64, generator=g) * 0.6
    x = torch.randn(7, 3, dtype=torch.float64, generator=g)
    xs = torch.stack([x * (k + 1) * (-1) ** k for k in range(3)])  # batch 3 == W.shape[0]
    want = [torch.stack(t) for t in zip(*[torch.func.grad(_LOOPS[loop](oracle), argnums=(0, 1))(xi, W) for xi in xs])]
    per_example = tfun.vmap(tfun.grad(_LOOPS[loop](cf), argnums=(0, 1)), in_axes=(0, None))
    for got, w in zip(per_example(xs, W), want):
        torch.testing.assert_close(got, w)
    torch._dynamo.reset()
    with pytest.raises(tfun.errors.JitError, match=rf"(?s)^tfun\.{kind}: under tfun\.jit, .* inside the body of a tfun\.lax\s+loop") as info:
        tfun.jit(per_example, backend="aot_eager")(xs, W)
    assert "test_custom_derivatives.py" in str(info.value)
    torch._dynamo.reset()
    xg = xs.clone().requires_grad_()
    with pytest.raises(tfun.errors.JitError, match=r"inside the body of a tfun.lax\s+loop"):  # .backward() outside
        tfun.jit(tfun.vmap(_LOOPS[loop](cf), in_axes=(0, None)), backend="aot_eager")(xg, W).sum().backward()


def _check_jitted_gradients(loss_of, cf, oracle, x, W, how):
    """The gradients of `loss_of(cf)` in x and W, compiled (`tfun.jit(tfun.grad(...))`, or
    `.backward()` outside `tfun.jit`), against `torch.func.grad` of `loss_of(oracle)`."""
    want = torch.func.grad(loss_of(oracle), argnums=(0, 1))(x, W)
    torch._dynamo.reset()
    if how == "jit(grad)":
        got = tfun.jit(tfun.grad(loss_of(cf), argnums=(0, 1)), backend="aot_eager")(x, W)
    else:
        xr, Wr = x.clone().requires_grad_(), W.clone().requires_grad_()
        got = torch.autograd.grad(tfun.jit(loss_of(cf), backend="aot_eager")(xr, Wr), (xr, Wr))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


_VMAPPED_IN_BODY = {
    "map": lambda c: (lambda x, W: (tfun.lax.map(lambda r: tfun.vmap(c, in_axes=(0, None))(r, W), x) ** 2).sum()),
    "scan": lambda c: (
        lambda x, W: (tfun.lax.scan(lambda h, xt: (tfun.vmap(c, in_axes=(0, None))(h + xt, W), h), x[0], x)[1] ** 2).sum()
    ),
}


@pytest.mark.parametrize("how", ["jit(grad)", "backward outside"])
@pytest.mark.parametrize("loop", sorted(_VMAPPED_IN_BODY))
@pytest.mark.parametrize("kind", ["custom_vjp", "custom_jvp"])
def test_a_rule_vmapped_inside_a_loop_body_under_jit_compiles(kind, loop, how):
    """Hunt 26, finding 3: the refusal above reached a vmap entered *inside* the loop body
    (`scan(lambda h, x: (tfun.vmap(cf)(h + x, W), h), ...)` under `tfun.jit(tfun.grad(f))`),
    which torch does not batch again: that vmap is traced into the body's graph. Refused
    only where a vmap encloses the loop (`_hop.body_transform_level`); this compiles and
    equals the straight-through float64 oracle."""
    cf, oracle = _loop_rule_pair(kind)
    g = torch.Generator().manual_seed(6)
    W = torch.randn(3, 3, dtype=torch.float64, generator=g) * 0.6
    x = torch.randn(5, 4, 3, dtype=torch.float64, generator=g)
    _check_jitted_gradients(_VMAPPED_IN_BODY[loop], cf, oracle, x, W, how)


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
@pytest.mark.parametrize("how", ["jit(grad)", "backward outside"])
@pytest.mark.parametrize("loop", sorted(_LOOPS))
def test_a_rule_in_a_loop_body_whose_fwd_returns_an_input_as_a_residual_compiles(loop, how):
    """Hunt 25, finding 4: `fwd` returning the closed-over `W` itself in its residuals (JAX's
    usual `return y, (h, W, y)`) inside a map or scan body was refused under tfun.jit with
    gradients, by a message about views the program does not have ("Higher order ops do not
    support aliasing": the body returned one of its inputs as a saved tensor)."""
    cf, oracle = _loop_rule_pair("custom_vjp")  # its fwd returns `W` itself in the residuals
    g = torch.Generator().manual_seed(4)
    W = torch.randn(3, 3, dtype=torch.float64, generator=g) * 0.6
    x = torch.randn(7, 3, dtype=torch.float64, generator=g)
    _check_jitted_gradients(_LOOPS[loop], cf, oracle, x, W, how)


def _rule_100_vjp():
    @tfun.custom_vjp
    def g(x):
        return torch.sin(x)

    def g_fwd(x):
        if x.sum() > 0:  # Python control flow on a tensor: refused by tfun.jit
            return torch.sin(x), x
        return torch.sin(x), x

    g.defvjp(g_fwd, lambda r, ct: (100.0 * ct,))
    return g


def _rule_100_jvp(branch_on_value):
    @tfun.custom_jvp
    def f(x):
        return torch.sin(x)

    def f_jvp(primals, tangents):
        if branch_on_value and primals[0].sum() > 0:
            return f(primals[0]), 100.0 * tangents[0]
        return f(primals[0]), 100.0 * tangents[0]

    f.defjvp(f_jvp)
    return f


_FAILING_TRACES = {
    "custom_vjp fwd branches on a value, jit(grad)": lambda x: tfun.jit(
        tfun.grad(lambda y: _rule_100_vjp()(y).sum()), backend="aot_eager"
    )(x),
    "custom_jvp rule branches on a value, jit(grad)": lambda x: tfun.jit(
        tfun.grad(lambda y: _rule_100_jvp(True)(y).sum()), backend="aot_eager"
    )(x),
    "the same in a scan body": lambda x: tfun.jit(
        tfun.grad(lambda y: tfun.lax.scan(lambda c, a: (_rule_100_jvp(True)(c) + a, None), y, y[None])[0].sum()),
        backend="aot_eager",
    )(x),
}


@pytest.mark.parametrize("failure", list(_FAILING_TRACES))
def test_a_failed_trace_inside_a_custom_function_leaves_every_rule_in_use(failure):
    """A trace that fails inside a custom function's forward (a JitError the user catches)
    never runs the exits of the scopes it entered. Their state is the trace's own: afterwards,
    eagerly and under tfun.jit, custom rules are still used (hunt 29 F0: every rule in the
    process was ignored, the primal differentiated instead, without an error)."""
    torch.manual_seed(0)
    x = torch.tensor([0.3, -1.2], dtype=torch.float64)
    want = torch.full((2,), 100.0, dtype=torch.float64)
    with pytest.raises(tfun.errors.JitError):
        _FAILING_TRACES[failure](x)
    g, f = _rule_100_vjp(), _rule_100_jvp(False)
    torch.testing.assert_close(tfun.grad(lambda y: g(y).sum())(x), want)
    torch.testing.assert_close(tfun.grad(lambda y: f(y).sum())(x), want)
    torch.testing.assert_close(tfun.jvp(f, (x,), (torch.ones(2, dtype=torch.float64),))[1], want)
    xb = x.clone().requires_grad_()
    f(xb).sum().backward()
    torch.testing.assert_close(xb.grad, want)
    torch.testing.assert_close(tfun.jit(tfun.grad(lambda y: f(y).sum()), backend="aot_eager")(x), want)


def _dict_in_vjp():
    @tfun.custom_vjp
    def v(d):
        return d["a"] * d["b"] + d["c"]["e"]

    def bwd(r, ct):
        return ({"a": ct * r["b"] * 100.0, "b": ct * r["a"], "c": {"e": 3.0 * ct}},)

    v.defvjp(lambda d: (v(d), d), bwd)
    return lambda y: v({"a": y, "b": y * 2, "c": {"e": y.sin()}}).sum()


def _dict_out_jvp():
    @tfun.custom_jvp
    def j(a):
        return {"z": torch.sin(a), "w": {"u": a * a}}

    j.defjvp(lambda pr, tg: (j(pr[0]), {"z": tg[0] * 100.0, "w": {"u": 7.0 * tg[0]}}))
    return lambda y: (j(y)["z"] + j(y)["w"]["u"]).sum()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
@pytest.mark.parametrize("how", ["jit(grad)", "jit+backward"])
@pytest.mark.parametrize("case", ["custom_vjp taking dicts", "custom_jvp returning dicts"])
def test_rules_with_dict_arguments_and_outputs_under_jit(case, how, backend):
    """Dict arguments of a custom_vjp and dict outputs of a custom_jvp, differentiated under
    tfun.jit, use the rule as eagerly (hunt 29 F2: Dynamo's optree support failed to rebuild
    a dict of constants, "unhashable type: 'list'" / "length mismatch")."""
    loss = _dict_in_vjp() if case.startswith("custom_vjp") else _dict_out_jvp()
    x = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    want = tfun.grad(loss)(x)
    if how == "jit(grad)":
        got = tfun.jit(tfun.grad(loss), backend=backend)(x)
    else:
        xb = x.clone().requires_grad_()
        tfun.jit(loss, backend=backend)(xb).backward()
        got = xb.grad
    torch.testing.assert_close(got, want)
    assert want.abs().max() > 50  # the rule's gradient, not the primal's


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
@pytest.mark.parametrize(
    "where", ["backward_after_the_block", "backward_inside_the_block", "jit", pytest.param("jit_inductor", marks=pytest.mark.heavy)]
)
def test_rules_run_under_the_forwards_autocast_state(kind, where):
    """Hunt 33 (F4): a custom function called under `torch.autocast` and differentiated after
    the block (the usual mixed-precision step). The custom_jvp rule, run again in the
    backward, saw float32 where the forward saw bfloat16 (a TensorMismatchError blaming the
    user's correct rule); a custom_vjp `bwd` mixed bfloat16 residuals with float32 inputs
    (torch's "expected m1 and m2 to have the same dtype"). Both now run under the forward's
    state, as under `tfun.jit`. Against the plain function's gradients under autocast."""
    g = torch.Generator().manual_seed(0)
    x0, W0 = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g)
    plain = lambda x, W: torch.sin(x @ W)  # noqa: E731
    if kind == "custom_jvp":
        f = tfun.custom_jvp(plain)

        @f.defjvp
        def f_jvp(primals, tangents):
            (x, W), (tx, tW) = primals, tangents
            u = x @ W
            return torch.sin(u), torch.cos(u) * (tx @ W + x @ tW)

    else:
        f = tfun.custom_vjp(plain)

        def f_fwd(x, W):
            u = x @ W
            return torch.sin(u), (x, W, u)

        def f_bwd(res, g):
            x, W, u = res
            gu = g * torch.cos(u)
            return gu @ W.T, x.T @ gu

        f.defvjp(f_fwd, f_bwd)

    def step(fn):
        x, W = x0.clone().requires_grad_(), W0.clone().requires_grad_()
        if where.startswith("jit"):
            torch._dynamo.reset()
            fn = tfun.jit(fn, backend="inductor" if where == "jit_inductor" else "aot_eager")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x, W)
            if where == "backward_inside_the_block":
                (out.float() ** 2).sum().backward()
        if where != "backward_inside_the_block":
            (out.float() ** 2).sum().backward()
        return out, x.grad, W.grad

    want, got = step(plain), step(f)
    assert got[0].dtype == want[0].dtype == torch.bfloat16
    for w, o in zip(want, got):
        assert o.dtype == w.dtype
        torch.testing.assert_close(o.float(), w.float(), rtol=2e-2, atol=2e-2 * float(w.detach().abs().max()))
