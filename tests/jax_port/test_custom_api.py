"""Port of JAX's `tests/custom_api_test.py`, classes `CustomJVPTest` and `CustomVJPTest`.

Test methods keep JAX's names (`TestCustomJVP.test_basic` is `CustomJVPTest.test_basic`).
Translated in our own words; the translation rules are those of
test_lax_control_flow.py: `jnp` -> `torch`, `jax`/`api` -> `tfun`, float64 throughout,
Python floats that are differentiated -> 0-d float64 tensors (`T`), `jax.jit` ->
`tfun.jit(backend="aot_eager")`, `jax.linearize` -> `tfun.linearize`, `jax.random` ->
`tfun.random`, error tests check JAX's exception class (tfun's errors subclass it), not
JAX's message text. JAX's `float0` tangents of integer inputs become tfun's conventions
(integer primals are constants; their cotangents are zeros of their dtype).

Skips point to a row of "Differences from JAX" in docs/porting.md. Not ported (jaxprs,
JAX internals, `custom_batching`, `custom_transpose`, `closure_convert`, pretty-printing,
`symbolic_zeros`, `custom_gradient`): tests/jax_port/README.md.
"""

from __future__ import annotations

import functools
from functools import partial

import numpy as np
import pytest
import torch

import tfun
import tfun.random as random
from tfun import lax

from .conftest import T, assert_all_close, check_grads, jit, linearize, rng

D = "docs/porting.md, Differences from JAX: "


def skip(row: str):
    return pytest.mark.skip(reason=D + row)


def _sin_jvp_f():
    @tfun.custom_jvp
    def f(x):
        return torch.sin(x)

    def f_jvp(primals, tangents):
        (x,), (g,) = primals, tangents
        return f(x), 2 * torch.cos(x) * g

    f.defjvp(f_jvp)
    return f


def _sin_vjp_f():
    @tfun.custom_vjp
    def f(x):
        return torch.sin(x)

    def f_fwd(x):
        return f(x), torch.cos(x)

    def f_rev(cos_x, g):
        return (2 * cos_x * g,)

    f.defvjp(f_fwd, f_rev)
    return f


class TestCustomJVP:
    def test_basic(self):
        f = _sin_jvp_f()
        x = T(3.0)
        assert_all_close(f(x), torch.sin(x))
        assert_all_close(tfun.jvp(f, (x,), (T(1.0),)), (torch.sin(x), 2 * torch.cos(x)))
        assert_all_close(tfun.grad(f)(x), 2 * torch.cos(x))

    def test_invariance(self):
        @tfun.custom_jvp
        def f(x):
            return torch.cos(2 * x) / 2.0

        f.defjvp(lambda primals, tangents: (f(primals[0]), 3 * tangents[0]))

        def f2(x):
            y, _ = tfun.jvp(f, (x,), (x,))
            return y

        def f3(x):
            y, _ = tfun.jvp(f2, (x,), (x,))
            return y

        x = T(1.0)
        assert_all_close(tfun.jvp(f, (x,), (x,)), tfun.jvp(f2, (x,), (x,)))
        assert_all_close(tfun.jvp(f, (x,), (x,)), tfun.jvp(f3, (x,), (x,)))

    def test_python_control_flow(self):
        @tfun.custom_jvp
        def f(x):
            return torch.sin(x) if x > 0 else torch.cos(x)

        def f_jvp(primals, tangents):
            (x,), (g,) = primals, tangents
            return (f(x), 2 * g) if x > 0 else (f(x), 3 * g)

        f.defjvp(f_jvp)
        x = T(2.0)
        assert_all_close(f(x), torch.sin(x))
        assert_all_close(f(-x), torch.cos(-x))
        assert_all_close(tfun.jvp(f, (x,), (T(1.0),)), (torch.sin(x), 2.0))
        assert_all_close(tfun.jvp(f, (-x,), (T(1.0),)), (torch.cos(-x), 3.0))
        assert_all_close(tfun.grad(f)(x), 2.0)
        assert_all_close(tfun.grad(f)(-x), 3.0)

    def test_vmap(self):
        @tfun.custom_jvp
        def f(x):
            assert x.ndim == 0
            return torch.sin(x)

        def f_jvp(primals, tangents):
            (x,), (g,) = primals, tangents
            assert x.ndim == g.ndim == 0
            return f(x), 2 * torch.cos(x) * g

        f.defjvp(f_jvp)
        x = torch.arange(3.0)
        xx = torch.arange(6.0).reshape(2, 3)
        assert_all_close(tfun.vmap(f)(x), torch.sin(x))
        assert_all_close(tfun.vmap(tfun.vmap(f))(xx), torch.sin(xx))
        assert_all_close(tfun.vmap(lambda x: tfun.jvp(f, (x,), (x,)))(x), (torch.sin(x), 2 * torch.cos(x) * x))
        assert_all_close(tfun.vmap(tfun.vmap(lambda x: tfun.jvp(f, (x,), (x,))))(xx), (torch.sin(xx), 2 * torch.cos(xx) * xx))
        assert_all_close(tfun.jvp(tfun.vmap(f), (x,), (x,)), (torch.sin(x), 2 * torch.cos(x) * x))
        assert_all_close(tfun.jvp(tfun.vmap(tfun.vmap(f)), (xx,), (xx,)), (torch.sin(xx), 2 * torch.cos(xx) * xx))
        assert_all_close(tfun.vmap(lambda x: tfun.jvp(tfun.vmap(f), (x,), (x,)))(xx), (torch.sin(xx), 2 * torch.cos(xx) * xx))

    def test_jit(self):
        f = _sin_jvp_f()
        x = T(3.0)
        assert_all_close(jit(f)(x), torch.sin(x))
        assert_all_close(jit(jit(f))(x), torch.sin(x))
        assert_all_close(tfun.jvp(jit(f), (x,), (x,)), (torch.sin(x), 2 * torch.cos(x) * x))

    def test_jit_of_jvp(self):
        """The "jit of jvp" line of JAX's test_jit."""
        f = _sin_jvp_f()
        x = T(3.0)
        assert_all_close(jit(lambda x: tfun.jvp(f, (x,), (x,)))(x), (torch.sin(x), 2 * torch.cos(x) * x))

    def test_pytrees(self):
        @tfun.custom_jvp
        def f(x):
            return {"b": torch.sin(x["a"])}

        f.defjvp(lambda p, t: (f(p[0]), {"b": 2 * torch.cos(p[0]["a"]) * t[0]["a"]}))
        x = {"a": T(3.0)}
        assert_all_close(f(x)["b"], torch.sin(x["a"]))
        assert_all_close(tfun.jvp(f, (x,), (x,)), ({"b": torch.sin(x["a"])}, {"b": 2 * torch.cos(x["a"]) * x["a"]}))

    def test_kwargs(self):
        @tfun.custom_jvp
        def my_fun(x, y, c=1.0):
            return c * (x + y)

        def my_jvp(primals, tangents):
            x, y, c = primals
            t_x, t_y, t_c = tangents
            return my_fun(x, y, c), t_c

        my_fun.defjvp(my_jvp)
        f = lambda x, y: torch.square(my_fun(x, y, c=T(2.0))).sum()
        f(T(10.0), T(5.0))
        tfun.jvp(f, (T(10.0), T(5.0)), (T(1.0), T(1.0)))

    def test_initial_style(self):
        @tfun.custom_jvp
        def f(x):
            return 3 * x

        f.defjvp(lambda p, t: (f(p[0]), 2 * t[0]))

        def foo(x):
            out, _ = lax.scan(lambda c, _: (f(c), None), x, None, length=1)
            return out

        x = T(3.0)
        assert_all_close(tfun.grad(foo)(x), 2.0)
        assert_all_close(tfun.grad(tfun.grad(foo))(x), 0.0)
        assert_all_close(tfun.grad(jit(foo))(x), 2.0)

    @staticmethod
    def _initial_style_foo():
        @tfun.custom_jvp
        def f(x):
            return 3 * x

        f.defjvp(lambda p, t: (f(p[0]), 2 * t[0]))
        return lambda x: lax.scan(lambda c, _: (f(c), None), x, None, length=1)[0]

    def test_initial_style_jit(self):
        """The jit lines of test_initial_style but the last (`jit(grad(grad(foo)))`, below)."""
        foo = self._initial_style_foo()
        x = T(3.0)
        assert_all_close(jit(tfun.grad(foo))(x), 2.0)
        assert_all_close(tfun.grad(tfun.grad(jit(foo)))(x), 0.0)
        assert_all_close(tfun.grad(jit(tfun.grad(foo)))(x), 0.0)

    @skip("jit-grad")
    def test_initial_style_jit_of_grad_of_grad(self):
        """The last line of test_initial_style: `jit(grad(grad(foo)))`."""
        foo = self._initial_style_foo()
        assert_all_close(jit(tfun.grad(tfun.grad(foo)))(T(3.0)), 0.0)

    def test_initial_style_vmap(self):
        @tfun.custom_jvp
        def f(x):
            assert x.ndim == 0
            return 3 * x

        f.defjvp(lambda p, t: (f(p[0]), 2 * t[0]))

        def foo(x):
            out, _ = lax.scan(lambda c, _: (f(c), None), x, None, length=1)
            return out

        assert_all_close(tfun.vmap(foo)(torch.ones(3)), 3.0 * torch.ones(3))
        assert_all_close(tfun.grad(lambda x: tfun.vmap(foo)(x).sum())(torch.ones(3)), 2.0 * torch.ones(3))

    def test_nondiff_argnums(self):
        @partial(tfun.custom_jvp, nondiff_argnums=(0,))
        def app(f, x):
            return f(x)

        def app_jvp(f, primals, tangents):
            (x,), (t,) = primals, tangents
            return app(f, x), 3 * t

        app.defjvp(app_jvp)
        assert_all_close(app(lambda x: 2 * x, T(1)), 2)
        assert_all_close(tfun.jvp(lambda x: app(lambda y: 2 * y, x), (T(1.0),), (T(1.0),)), (2.0, 3.0))

    def test_nondiff_argnames(self):
        @partial(tfun.custom_jvp, nondiff_argnames=("f",))
        def app(f, x):
            return f(x)

        def app_jvp(f, primals, tangents):
            (x,), (t,) = primals, tangents
            return app(f, x), 3 * t

        app.defjvp(app_jvp)
        assert_all_close(app(lambda x: 2 * x, T(1)), 2)

    def test_nondiff_arg_vmap_tracer(self):
        @partial(tfun.custom_jvp, nondiff_argnums=(0,))
        def f(x, y):
            return x * y

        def f_jvp(x, primals, tangents):
            (y,), (t_y,) = primals, tangents
            return f(x, y), 5 * t_y

        f.defjvp(f_jvp)
        g = tfun.vmap(f)
        ans = tfun.jvp(lambda y: g(torch.tensor([2.0]), y), (torch.tensor([3.0]),), (torch.tensor([1.0]),))
        assert_all_close(ans, (np.array([6.0]), np.array([5.0])))

    def test_missing_jvp_rule_error_message(self):
        @tfun.custom_jvp
        def foo(x):
            return x**2

        # JAX: AttributeError "No JVP defined ..."; tfun: an ArgumentValueError (a
        # ValueError) "no JVP rule is defined", raised on every call
        for call in (lambda: foo(T(2.0)), lambda: tfun.jvp(foo, (T(2.0),), (T(1.0),)), lambda: tfun.grad(foo)(T(2.0))):
            with pytest.raises(tfun.errors.ArgumentValueError, match="no JVP rule is defined"):
                call()

    def test_jvp_rule_inconsistent_pytree_structures_error_message(self):
        @tfun.custom_jvp
        def f(x):
            return (x**2,)

        @f.defjvp
        def foo_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            return f(x), [2 * x * t, x]

        f(T(2.0))
        with pytest.raises(TypeError):
            tfun.jvp(f, (T(2.0),), (T(1.0),))

    def test_primal_tangent_aval_disagreement_error_message(self):
        @tfun.custom_jvp
        def f(x):
            return x**2

        @f.defjvp
        def foo_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            return f(x), torch.reshape(t, (1,))

        f(T(2.0))
        with pytest.raises(TypeError):
            tfun.jvp(f, (T(2.0),), (T(1.0),))

    def test_jvp_rule_doesnt_return_pair_error_message(self):
        @tfun.custom_jvp
        def f(x):
            return x**2

        @f.defjvp
        def foo_jvp(primals, tangents):
            return tangents[0]

        f(T(2.0))
        with pytest.raises(TypeError):
            tfun.jvp(f, (T(2.0),), (T(1.0),))

    def test_jvp_rule_primal_out_type_doesnt_match_primal_error_message(self):
        def scan_apply(f, x):
            y, _ = lax.scan(lambda x, _: (f(x), None), x, None, length=1)
            return y

        @tfun.custom_jvp
        def f(x):
            return x

        @f.defjvp
        def f_jvp(primals, tangents):
            (x,), (xdot,) = primals, tangents
            return (x, x), (xdot, xdot)

        x = T(1.0)
        with pytest.raises(TypeError):
            tfun.jvp(lambda x: scan_apply(f, x), (x,), (x,))

        @f.defjvp
        def f_jvp2(primals, tangents):
            (x,), (xdot,) = primals, tangents
            return torch.zeros((3, *x.shape), dtype=x.dtype), xdot

        with pytest.raises(TypeError):
            tfun.jvp(lambda x: scan_apply(f, x), (x,), (x,))

    def test_multiple_rule_invocations(self):
        @tfun.custom_jvp
        def expit(x):
            return 1 / (1 + torch.exp(-x))

        @expit.defjvp
        def _expit_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            ans = expit(x)
            return ans, t * ans * (1 - ans)

        def scanned_fun(c, _):
            return [expit(c[0])] + [c[i - 1] + c[i] for i in range(1, len(c))], None

        def foo(x):
            zero = torch.zeros_like(x)
            c, _ = lax.scan(scanned_fun, [x, zero, zero, zero, zero], None, length=10)
            return c[-1]

        foo(T(3.0))
        tfun.grad(foo)(T(3.0))
        tfun.grad(lambda x: tfun.vmap(foo)(x).sum())(torch.arange(3.0))

    def test_hard_stuff(self):
        arr = torch.ones((5, 2, 2))
        assert_all_close(tfun.vmap(torch.linalg.det)(arr), np.zeros(5))

    def test_hard_stuff2(self):
        @tfun.custom_jvp
        def f(x):
            return torch.zeros(x.shape, dtype=x.dtype)

        f.defjvp(lambda p, t: (f(p[0]), t[0]))
        tfun.vmap(f)(torch.arange(3.0))
        tfun.vmap(tfun.grad(f))(torch.arange(3.0))
        tfun.grad(lambda x: tfun.vmap(f)(x).sum())(torch.arange(3.0))
        tfun.jvp(tfun.vmap(f), (torch.arange(3.0),), (torch.ones(3),))

    def test_hard_stuff3(self):
        @tfun.custom_jvp
        def relu(x):
            return torch.maximum(x, torch.zeros_like(x))

        @relu.defjvp
        def _relu_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            return relu(x), lax.select(x > 0, t, torch.zeros_like(t))

        def scanned_fun(c, _):
            return [relu(c[0])] + [c[i - 1] + c[i] for i in range(1, len(c))], None

        def f(x):
            zero = torch.zeros_like(x)
            c, _ = lax.scan(scanned_fun, [x, zero, zero, zero, zero], None, length=10)
            return c[-1]

        tfun.vmap(f)(torch.arange(3.0))
        tfun.vmap(tfun.grad(f))(torch.arange(3.0))
        tfun.grad(lambda x: tfun.vmap(f)(x).sum())(torch.arange(3.0))
        tfun.jvp(tfun.vmap(f), (torch.arange(3.0),), (torch.ones(3),))

    def test_jaxpr_zeros(self):
        @tfun.custom_jvp
        def f(A, b):
            return A @ b

        def f_jvp(primals, tangents):
            (A, b), (dA, db) = primals, tangents
            return f(A, b), A @ db + dA @ b

        f.defjvp(f_jvp)

        def experiment(theta):
            def step(q, _):
                z = f(torch.eye(3), torch.ones(3) * theta)
                return q + z[0], q + z[0]

            q, _ = lax.scan(step, torch.zeros(()), None, 4)
            return q

        assert_all_close(tfun.grad(experiment)(T(1.0)), 4.0)

    def test_linear_in_scan(self):
        @tfun.custom_jvp
        def f(x):
            return -x

        f.defjvp(lambda p, t: (f(p[0]), f(t[0])))

        def foo(x):
            out, _ = lax.scan(lambda c, _: (f(c), None), x, None, length=1)
            return out

        assert_all_close(tfun.grad(foo)(T(3.0)), -1.0)

    def test_custom_jvps_first_rule_is_none(self):
        @tfun.custom_jvp
        def f(x, y):
            return x**2 * y

        f.defjvps(None, lambda x_dot, primal_out, x, y: 2 * x * y * x_dot)
        assert_all_close(tfun.grad(f, 1)(T(2.0), T(3.0)), 12.0)

    def test_nondiff_argnums_vmap_tracer(self):
        @partial(tfun.custom_jvp, nondiff_argnums=(0, 2))
        def sample(shape, param, seed):
            return random.uniform(key=seed, shape=shape, minval=param)

        @sample.defjvp
        def sample_jvp(shape, seed, primals, tangents):
            (param,), (dparam,) = primals, tangents
            dparam = torch.broadcast_to(dparam, shape)
            samples = sample(shape, param, seed)
            return samples, samples * dparam

        tfun.vmap(lambda seed: sample((2, 3), T(1.0), seed))(random.split(random.PRNGKey(1), 10))
        tfun.jvp(lambda x: sample((2, 3), x, random.PRNGKey(1)), (T(1.0),), (T(1.0),))

    def test_fun_with_nested_calls_2(self):
        def call(f, *args):
            f = tfun.custom_jvp(f)
            f.defjvp(lambda primals, tangents: (f(*primals), sum(tangents)))
            return f(*args)

        def fun_with_nested_calls_2(x):
            def bar(y):
                def baz(w):
                    q = call(lambda x: y, x)
                    q = q + call(lambda: y)
                    q = q + call(lambda y: w + y, y)
                    q = call(lambda w: call(torch.sin, x) * y, T(1.0)) + q
                    return q

                return baz(x)  # JAX jits baz

            return call(bar, x)

        fun_with_nested_calls_2(T(3.0))
        tfun.vmap(fun_with_nested_calls_2)(torch.arange(3.0))

    def test_closure_with_vmap2(self):
        def h(z):
            def f(x):
                @tfun.custom_jvp
                def g(y):
                    return x * y

                @g.defjvp
                def g_jvp(primals, tangents):
                    (y,), (ydot,) = primals, tangents
                    return x * y, x * ydot

                return g(z)

            return tfun.vmap(f)(torch.arange(3.0, dtype=torch.float32))

        primals, tangents = tfun.jvp(h, (torch.tensor(1.0, dtype=torch.float32),), (torch.tensor(2.0, dtype=torch.float32),))
        assert_all_close(primals, np.arange(3.0))
        assert_all_close(tangents, 2 * np.arange(3.0))

    def test_remat(self):
        f = _sin_jvp_f()

        @tfun.remat
        def g(x):
            return f(f(x))

        x = T(2.0)
        assert_all_close(g(x), np.sin(np.sin(2.0)))
        assert_all_close(tfun.grad(g)(x), 4.0 * tfun.grad(lambda x: torch.sin(torch.sin(x)))(x))

    def test_remat_higher_order(self):
        f = _sin_jvp_f()

        def g(x):
            return f(f(x))

        x = T(2.0)
        assert_all_close(tfun.grad(tfun.grad(tfun.checkpoint(g)))(x), tfun.grad(tfun.grad(g))(x))
        assert_all_close(tfun.grad(tfun.checkpoint(tfun.grad(g)))(x), tfun.grad(tfun.grad(g))(x))
        assert_all_close(tfun.grad(tfun.grad(tfun.grad(tfun.checkpoint(g))))(x), tfun.grad(tfun.grad(tfun.grad(g)))(x))

    def test_initial_style_vmap_2(self):
        y = torch.arange(1.0, 4.0)

        @tfun.custom_jvp
        def f(x):
            assert x.ndim == 0
            return 3 * x * torch.sum(y)

        f.defjvp(lambda p, t: (f(p[0]), 2 * t[0]))

        def foo(x):
            out, _ = lax.scan(lambda c, _: (f(c), None), x, None, length=1)
            return out

        assert_all_close(tfun.grad(lambda x: tfun.vmap(foo)(x).sum())(torch.ones(3)), 2.0 * torch.ones(3))

    def test_custom_jvp_vmap_broadcasting_interaction(self):
        def f2(y, z):
            v1 = z
            v2 = torch.sum(y) + z
            return torch.logaddexp(v1, v2)

        def f1(y, z):
            return torch.sum(tfun.vmap(lambda _y: f2(_y, z))(y))

        y = torch.ones((3, 2))
        val, g = tfun.value_and_grad(lambda z: f1(y, z))(T(0.1))
        assert val.shape == () and g.shape == ()

    def test_custom_jvp_vmap_broadcasting_interaction_2(self):
        @tfun.custom_jvp
        def transform(box, R):
            if box.numel() == 1:
                return R * box
            return torch.einsum("ij,j->i", box, R)

        @transform.defjvp
        def transform_jvp(primals, tangents):
            (box, R), (dbox, dR) = primals, tangents
            return transform(box, R), dR + transform(dbox, R)

        def displacement(Ra, Rb, box):
            return transform(box, Ra - Rb)

        R = random.uniform(random.PRNGKey(0), (25, 2), dtype=torch.float64)

        def energy_fn(box):
            d = partial(displacement, box=box)
            d = tfun.vmap(tfun.vmap(d, (None, 0)), (0, None))
            return torch.sum(d(R, R) ** 2)

        assert tfun.grad(energy_fn)(T(1.0)).shape == ()

    def test_custom_jvp_unbroadcasting(self):
        a = torch.tensor([1.0, 1.0])

        @tfun.custom_jvp
        def f(x):
            return a * x

        f.defjvp(lambda p, t: (a * p[0], a * t[0]))
        assert tfun.grad(lambda x: torch.sum(f(x)))(T(1.0)).shape == ()

    def test_sinc_constant_function_batching(self):
        batch_data = torch.arange(15.0).reshape(5, 3)

        @tfun.vmap
        def f(x):
            return lax.map(torch.sinc, x)

        @tfun.vmap
        def f_ref(x):
            return torch.stack([torch.sinc(x_) for x_ in x])

        g = lambda param: f(param * batch_data).sum()
        g_ref = lambda param: f_ref(param * batch_data).sum()
        assert_all_close(tfun.grad(g)(T(0.1)), tfun.grad(g_ref)(T(0.1)))

    def test_custom_jvp_functools_partial(self):
        def fun(x, y, a):
            return x + y * a

        fun_wrapped = functools.partial(fun, a=0.1)
        fn = tfun.custom_jvp(fun_wrapped)
        fn.defjvp(lambda primals, tangents: tfun.jvp(fun_wrapped, primals, tangents))
        assert_all_close(tfun.grad(lambda args: fn(*args))((T(1.0), T(2.0))), (1.0, 0.1))

    def test_resolve_kwargs_error_message(self):
        @tfun.custom_jvp
        def f(x, y, *, z=None):
            return torch.sin(x), x + torch.cos(y)

        f.defjvp(lambda p, t: pytest.fail("should not be executed"))
        with pytest.raises(TypeError):
            f(T(0.5))
        with pytest.raises(TypeError):
            f(T(0.5), T(0.1), z=T(1.0))

    def test_custom_jvp_transpose_vjp3(self):
        @tfun.custom_jvp
        def div(x, y):
            return x / y

        @div.defjvp
        def sin_jvp(primals, tangents):
            (x, y), (x_dot, y_dot) = primals, tangents
            return div(x, y), div(x_dot, y)

        _, f_vjp = tfun.vjp(lambda x: div(x, T(2.0)), T(1.0))
        (ans,) = f_vjp(T(1.0))
        assert_all_close(ans, 0.5)

    def test_float0(self):
        # JAX's float0 tangents of integer values are integer zeros in tfun
        @tfun.custom_jvp
        def f(x, y):
            return x, y

        f.defjvp(lambda p, t: ((p[0], p[1]), (T(2.0), torch.zeros((), dtype=torch.int64))))
        out = tfun.jvp(f, (T(2.0), T(3)), (T(1.0), torch.zeros((), dtype=torch.int64)))
        assert_all_close(out, ((2.0, 3), (2.0, 0)))

    def test_closed_over_tracers_error_message(self):
        # JAX raises UnexpectedTracerError: the function closes over `x`, which the outer
        # jvp/grad differentiates. tfun refuses that derivative too, with an
        # ArgumentValueError naming the rule.
        def f(x):
            @tfun.custom_jvp
            def g(y):
                return x + y

            g.defjvp(lambda primals, tangents: (g(x), 2 * primals[0]))
            return g(T(1.0))

        with pytest.raises(tfun.errors.ArgumentValueError, match="close over"):
            tfun.jvp(f, (T(3.0),), (T(1.0),))
        with pytest.raises(tfun.errors.ArgumentValueError, match="close over"):
            tfun.grad(f)(T(3.0))

    def test_concurrent_initial_style(self):
        import concurrent.futures

        def unroll(param, sequence):
            def scan_f(prev_state, inputs):
                return prev_state, torch.sigmoid(param * inputs)

            return torch.sum(lax.scan(scan_f, None, sequence)[1])

        def run():
            return tfun.grad(unroll)(T(1.0), torch.tensor([1.0]))

        expected = run()
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as e:
            results = [f.result() for f in [e.submit(run) for _ in range(2)]]
        for ans in results:
            assert_all_close(ans, expected)

    def test_float0_initial_style(self):
        @tfun.custom_jvp
        def f(x, y):
            return x, y

        f.defjvp(lambda p, t: ((p[0], p[1]), (T(2.0), torch.zeros((), dtype=torch.int64))))

        def foo(x, y):
            out, _ = lax.scan(lambda c, _: (f(*c), None), (x, y), None, length=1)
            return out

        out = tfun.jvp(foo, (T(2.0), T(3)), (T(1.0), torch.zeros((), dtype=torch.int64)))
        assert_all_close(out, ((2.0, 3), (2.0, 0)))

    def test_vmap_inside_defjvp(self):
        key = random.PRNGKey(47)
        mat = random.normal(key, (2, 3), dtype=torch.float64)

        @tfun.custom_jvp
        def f(mat, aux):
            num_rows, num_cols = mat.shape
            return torch.ones((num_rows, 1)) / num_cols

        @f.defjvp
        def f_jvp(primals, tangents):
            mat, aux = primals
            vec, _ = tangents
            output = f(*primals)
            num_rows, num_cols = mat.shape
            size = num_rows * num_cols
            bd_mat = mat.reshape(1, 1, num_rows, num_cols).tile((num_rows, num_cols, 1, 1)).reshape(size, num_rows, num_cols)
            rowsum = torch.sum(mat, dim=1, keepdim=True)
            colsum = torch.sum(mat, dim=0, keepdim=True)
            bd_rowsum = rowsum.tile((1, num_rows))
            bd_colsum = colsum.tile((num_cols, 1))
            bd_vec = vec.reshape(size, 1)

            def operate(mx, val):
                buf = 0
                for i in range(2):
                    buf = buf + (mx @ bd_colsum) / aux**i
                buf = bd_rowsum @ buf
                return buf * val[None, :]

            bd_buf = tfun.vmap(operate, in_axes=(0, 0), out_axes=0)(bd_mat, bd_vec) / aux
            jvp = torch.sum(bd_buf, dim=0)
            return output, torch.mean(jvp, dim=1, keepdim=True)

        tfun.grad(lambda mat, aux: torch.sum(f(mat, aux)))(mat, T(0.5))  # doesn't crash

    def test_run_rules_more_than_once(self):
        @tfun.custom_jvp
        def f(x, y):
            return x

        f.defjvp(lambda p, t: (p[0], t[0]))

        def body(x_y, _):
            x, y = x_y
            return (f(x, y), x), None

        @tfun.grad
        def g(x):
            (out, _), _ = lax.scan(body, (x, torch.ones(())), xs=None, length=2)
            return out

        g(T(1.0))

    def test_nondiff_arg_hiding_jvp_tracer(self):
        # JAX: UnexpectedTracerError, the nondiff function `h` closes over `x`, which the
        # outer jvp differentiates. tfun refuses that derivative too (the error of
        # test_closed_over_tracers_error_message).
        def f(x):
            @partial(tfun.custom_jvp, nondiff_argnums=(0,))
            def g(h, x):
                return h(x)

            @g.defjvp
            def g_jvp(h, primals, tangents):
                (x,), (t,) = primals, tangents
                return g(h, x), 2.0 * t

            h = lambda y: x + y  # captures x
            return g(h, x)

        with pytest.raises(tfun.errors.ArgumentValueError, match="close over"):
            tfun.jvp(f, (T(2.0),), (T(1.0),))

    @pytest.mark.parametrize("maybe_jit,maybe_vmap", [
        pytest.param(True, True, id="jit_vmap"),
        pytest.param(True, False, id="jit"),
        pytest.param(False, True, id="vmap"),
        pytest.param(False, False, id=""),
    ])
    def test_symbolic_zero_custom_jvp(self, maybe_jit, maybe_vmap):
        """Without symbolic zeros (tfun has no `symbolic_zeros=True`): the rule gets zero
        tangents for the constant arguments, so JAX's checks that they are `SymbolicZero`s
        (and of the output's Python types) are dropped; the values are JAX's."""

        def f(static_scalar, static_array, dyn_scalar, dyn_array):
            return static_scalar + dyn_scalar, static_array + dyn_array

        def _vmap(fun):
            def _fun(*args):
                args = [torch.as_tensor(a)[None] for a in args]
                out = tfun.vmap(fun)(*args)
                return tuple(o[0] for o in out)

            return _fun

        f = tfun.custom_jvp(f)

        @f.defjvp
        def f_jvp(primals, tangents):
            static_scalar, *_ = primals
            *_, t_dyn_array = tangents
            return f(*primals), (static_scalar + 90, t_dyn_array + 91)

        def g(dyn_scalar, dyn_array):
            f_ = _vmap(f) if maybe_vmap else f
            return f_(T(1.0), torch.tensor([2.0, 3.0]), dyn_scalar, dyn_array)

        def run(primal_ins, tangent_ins):
            return tfun.jvp(g, primal_ins, tangent_ins)

        if maybe_jit:
            run = jit(run)

        primal_ins = (T(4.0), torch.tensor([5.0, 6.0]))
        tangent_ins = (T(7.0), torch.tensor([8.0, 9.0]))
        (primal_out1, primal_out2), (tangent_out1, tangent_out2) = run(primal_ins, tangent_ins)
        assert_all_close(primal_out1, 5.0)
        assert_all_close(tangent_out1, 91.0)
        assert_all_close(primal_out2, np.array([7.0, 9.0]))
        assert_all_close(tangent_out2, np.array([99.0, 100.0]))

    def test_symbolic_zero_under_vmap_of_jit(self):
        # JAX's rule returns `zero_from_primal(x, symbolic_zeros=True)`: a zero tangent,
        # here `torch.zeros_like(x)` (tfun has no symbolic zeros)
        @tfun.custom_jvp
        def f(x):
            return x + 1

        @f.defjvp
        def f_jvp(x, t):
            (x,), (t,) = x, t
            return f(x), torch.zeros_like(x)

        x = torch.arange(3.0)
        out = tfun.jvp(tfun.vmap(jit(f)), (x,), (x,))  # doesn't crash
        assert_all_close(out, (x + 1, np.zeros(3)))


class TestCustomVJP:
    def test_basic(self):
        f = _sin_vjp_f()
        x = T(3.0)
        assert_all_close(f(x), torch.sin(x))
        assert_all_close(tfun.grad(f)(x), 2 * torch.cos(x))
        assert_all_close(tfun.value_and_grad(f)(x), (torch.sin(x), 2 * torch.cos(x)))

    def test_invariance(self):
        @tfun.custom_vjp
        def f(x):
            return torch.cos(2 * x) / 2.0

        f.defvjp(lambda x: (f(x), x), lambda x, g: (g * 3,))

        def f2(x):
            return tfun.value_and_grad(f)(x)[0]

        def f3(x):
            return tfun.value_and_grad(f2)(x)[0]

        x = T(1.0)
        assert_all_close(f(x), f2(x))
        assert_all_close(f(x), f3(x))
        assert_all_close(tfun.grad(f)(x), tfun.grad(f2)(x))
        assert_all_close(tfun.grad(f)(x), tfun.grad(f3)(x))

    def test_python_control_flow(self):
        @tfun.custom_vjp
        def f(x):
            return torch.sin(x) if x > 0 else torch.cos(x)

        f.defvjp(lambda x: (f(x), x), lambda x, g: (2 * g,) if x > 0 else (3 * g,))
        x = T(2.0)
        assert_all_close(f(x), torch.sin(x))
        assert_all_close(f(-x), torch.cos(-x))
        assert_all_close(tfun.value_and_grad(f)(x), (torch.sin(x), 2.0))
        assert_all_close(tfun.value_and_grad(f)(-x), (torch.cos(-x), 3.0))

    def test_python_control_flow_bwd(self):
        @tfun.custom_vjp
        def f(x):
            return lax.cond(x > 0, torch.sin, torch.cos, x)

        f.defvjp(lambda x: ((torch.sin(x) if x > 0 else torch.cos(x)), x), lambda x, g: (2 * g,) if x > 0 else (3 * g,))
        x = T(2.0)
        assert_all_close(f(x), torch.sin(x))
        assert_all_close(f(-x), torch.cos(-x))
        assert_all_close(tfun.value_and_grad(f)(x), (torch.sin(x), 2.0))
        assert_all_close(tfun.value_and_grad(f)(-x), (torch.cos(-x), 3.0))

    def test_vmap(self):
        @tfun.custom_vjp
        def f(x):
            assert x.ndim == 0
            return torch.sin(x)

        def f_fwd(x):
            assert x.ndim == 0
            return f(x), torch.cos(x)

        f.defvjp(f_fwd, lambda cos_x, g: (2 * cos_x * g,))
        x = torch.arange(3.0)
        xx = torch.arange(6.0).reshape(2, 3)
        assert_all_close(tfun.vmap(f)(x), torch.sin(x))
        assert_all_close(tfun.vmap(tfun.vmap(f))(xx), torch.sin(xx))
        assert_all_close(tfun.vmap(tfun.grad(f))(x), 2 * torch.cos(x))
        assert_all_close(tfun.vmap(tfun.value_and_grad(f))(x), (torch.sin(x), 2 * torch.cos(x)))
        assert_all_close(tfun.vmap(tfun.vmap(tfun.grad(f)))(xx), 2 * torch.cos(xx))
        assert_all_close(tfun.vmap(tfun.vmap(tfun.value_and_grad(f)))(xx), (torch.sin(xx), 2 * torch.cos(xx)))
        assert_all_close(tfun.grad(lambda x: tfun.vmap(f)(x).sum())(x), 2 * torch.cos(x))
        assert_all_close(tfun.grad(lambda x: tfun.vmap(tfun.vmap(f))(x).sum())(xx), 2 * torch.cos(xx))
        assert_all_close(tfun.vmap(tfun.grad(lambda x: tfun.vmap(f)(x).sum()))(xx), 2 * torch.cos(xx))

    def test_jit(self):
        f = _sin_vjp_f()
        x = T(3.0)
        assert_all_close(jit(f)(x), torch.sin(x))
        assert_all_close(jit(jit(f))(x), torch.sin(x))

    def test_jit_of_grad(self):
        """The "jit of grad" and "grad of jit" lines of JAX's test_jit."""
        f = _sin_vjp_f()
        x = T(3.0)
        assert_all_close(jit(tfun.grad(f))(x), 2 * torch.cos(x))
        assert_all_close(tfun.grad(jit(f))(x), 2 * torch.cos(x))

    def test_pytrees(self):
        @tfun.custom_vjp
        def f(x):
            return {"b": torch.sin(x["a"])}

        f.defvjp(lambda x: (f(x), {"r": torch.cos(x["a"])}), lambda res, g: ({"a": 2 * res["r"] * g["b"]},))
        x = {"a": T(3.0)}
        assert_all_close(f(x)["b"], torch.sin(x["a"]))
        assert_all_close(tfun.grad(lambda x: f(x)["b"])(x), {"a": 2 * torch.cos(x["a"])})

    def test_jvp_error(self):
        f = _sin_vjp_f()
        with pytest.raises(TypeError, match="forward-mode"):
            tfun.jvp(f, (T(3.0),), (T(1.0),))

    def test_jvp_error_vmap_jit(self):
        """The vmap and jit lines of JAX's test_jvp_error: the same TypeError under
        jvp(vmap(f)) and jvp(jit(f))."""
        f = _sin_vjp_f()
        with pytest.raises(TypeError):
            tfun.jvp(tfun.vmap(f), (torch.arange(3.0),), (torch.ones(3),))
        with pytest.raises(TypeError):
            tfun.jvp(jit(f), (T(3.0),), (T(1.0),))

    def test_kwargs(self):
        @tfun.custom_vjp
        def my_fun(x, y, c=1.0):
            return c * (x + y)

        my_fun.defvjp(lambda x, y, c=1.0: (my_fun(c, y, c), None), lambda _, g: (g, g, g))
        f = lambda x, y: torch.square(my_fun(x, y, c=T(2.0))).sum()
        f(T(10.0), T(5.0))
        tfun.grad(f)(T(10.0), T(5.0))

    def test_initial_style(self):
        f = _sin_vjp_f()

        def foo(x):
            out, _ = lax.scan(lambda c, _: (f(c), None), x, None, length=1)
            return out

        x = T(3.0)
        assert_all_close(tfun.grad(foo)(x), 2.0 * torch.cos(x))
        assert_all_close(tfun.grad(tfun.grad(foo))(x), -2.0 * torch.sin(x))

    def test_initial_style_vmap(self):
        @tfun.custom_vjp
        def f(x):
            assert x.ndim == 0
            return 3 * x

        f.defvjp(lambda x: (f(x), torch.cos(x)), lambda cos_x, g: (2 * cos_x * g,))

        def foo(x):
            out, _ = lax.scan(lambda c, _: (f(c), None), x, None, length=1)
            return out

        assert_all_close(tfun.vmap(foo)(torch.arange(3.0)), 3.0 * torch.arange(3.0))
        assert_all_close(tfun.grad(lambda x: tfun.vmap(foo)(x).sum())(torch.arange(3.0)), 2.0 * torch.cos(torch.arange(3.0)))

    @pytest.mark.parametrize("how", ["test_nondiff_argnums", "test_nondiff_argnames", "test_nondiff_argnums_argnames"])
    def test_nondiff_argnums(self, how):
        """JAX's test_nondiff_argnums, test_nondiff_argnames and test_nondiff_argnums_argnames."""
        if how == "test_nondiff_argnums_argnames":
            @partial(tfun.custom_vjp, nondiff_argnums=(0,), nondiff_argnames=("g",))
            def app(f, g, x):
                return f(x) + g(x)

            app.defvjp(lambda f, g, x: (app(f, g, x), torch.cos(x)), lambda f, g, cos_x, v: (cos_x * v,))
            f = g = lambda x: 2 * x
            assert_all_close(app(f, g, T(1)), 4)
            assert_all_close(tfun.value_and_grad(lambda x: app(f, g, x))(T(1.0)), (4.0, np.cos(1.0)))
            return
        kw = {"nondiff_argnums": (0,)} if how == "test_nondiff_argnums" else {"nondiff_argnames": ("f",)}

        @partial(tfun.custom_vjp, **kw)
        def app(f, x):
            return f(x)

        app.defvjp(lambda f, x: (app(f, x), torch.cos(x)), lambda f, cos_x, g: (cos_x * g,))
        assert_all_close(app(lambda x: 2 * x, T(1)), 2)
        assert_all_close(tfun.value_and_grad(lambda x: app(lambda y: 2 * y, x))(T(1.0)), (2.0, np.cos(1.0)))

    def test_closed_over_vmap_tracer(self):
        def outer(x):
            @tfun.custom_vjp
            def f(y):
                return x * y

            f.defvjp(lambda y: (f(y), torch.cos(y)), lambda cos_y, g: (cos_y * g,))
            return f

        g = tfun.vmap(lambda x: outer(x)(T(3.0)))
        assert_all_close(g(torch.arange(3.0)), np.arange(3.0) * 3)

    def test_closed_over_tracer3(self):
        def outer(x):
            @tfun.custom_vjp
            def f(y):
                return x * y

            f.defvjp(lambda y: (f(y), (x, torch.cos(y))), lambda res, g: (res[1] * g * res[0],))
            return tfun.grad(f)

        g = tfun.vmap(lambda x: outer(x)(T(3.0)))
        assert_all_close(g(torch.arange(3.0)), np.cos(3.0) * np.arange(3.0))

    def test_missing_vjp_rule_error(self):
        @tfun.custom_vjp
        def foo(x):
            return x**2

        with pytest.raises(tfun.errors.ArgumentValueError, match="no VJP rule is defined"):
            foo(T(2.0))
        with pytest.raises(tfun.errors.ArgumentValueError, match="no VJP rule is defined"):
            tfun.grad(foo)(T(2.0))

    def test_vjp_rule_inconsistent_pytree_structures_error(self):
        @tfun.custom_vjp
        def f(x):
            return x

        f.defvjp(lambda x: (x, None), lambda _, g: (g, g))
        f(T(2.0))
        with pytest.raises(Exception, match="bwd"):
            tfun.grad(f)(T(2.0))

    def test_vjp_bwd_returns_non_tuple_error(self):
        @tfun.custom_vjp
        def f(x):
            return x

        f.defvjp(lambda x: (x, None), lambda _, g: 2.0 * g)
        with pytest.raises(TypeError, match="tuple"):
            tfun.grad(f)(T(3.0))

    def test_fwd_rule_primal_out_type_doesnt_match_primal_error_message(self):
        def scan_apply(f, x):
            y, _ = lax.scan(lambda x, _: (f(x), None), x, None, length=1)
            return y

        @tfun.custom_vjp
        def f(x):
            return x

        f.defvjp(lambda x: ((x, x), None), lambda _, y_bar: (y_bar,))
        with pytest.raises(TypeError):
            tfun.grad(lambda x: scan_apply(f, x))(torch.tensor(1.0, dtype=torch.float32))
        f.defvjp(lambda x: (torch.zeros((3, *x.shape), dtype=x.dtype), None), lambda _, y_bar: (y_bar,))
        with pytest.raises(TypeError):
            tfun.grad(lambda x: scan_apply(f, x))(torch.tensor(1.0, dtype=torch.float32))

    def test_issue2511(self):
        arr = torch.ones((5, 2, 2))
        jit(lambda x: tfun.vmap(torch.linalg.det, (0,))(x))(arr)

    def test_clip_gradient(self):
        @tfun.custom_vjp
        def _clip_gradient(lo, hi, x):
            return x

        _clip_gradient.defvjp(lambda lo, hi, x: (x, (lo, hi)), lambda res, g: (None, None, torch.clip(g, res[0], res[1])))

        def clip_gradient(x):
            return _clip_gradient(T(-0.1), x + 0.1, x)

        assert_all_close(tfun.grad(clip_gradient)(T(0.1)), 0.2)

    def test_nestable_vjp(self):
        def f(x):
            return x**2

        @tfun.custom_vjp
        def g(x):
            return f(x)

        def g_fwd(x):
            y, f_vjp = tfun.vjp(f, x)
            return y, f_vjp

        g.defvjp(g_fwd, lambda f_vjp, y_bar: f_vjp(y_bar))
        _, g_vjp = tfun.vjp(g, T(1.0))
        (y,) = g_vjp(T(1.0))
        assert_all_close(y, 2.0)

    def test_nestable_vjp_residual_function(self):
        """The second half of test_nestable_vjp: the residual is the vjp function itself,
        returned from a jitted function."""
        f = lambda x: x**2

        @tfun.custom_vjp
        def g(x):
            return f(x)

        g.defvjp(lambda x: tfun.vjp(f, x), lambda f_vjp, y_bar: f_vjp(y_bar))
        z = jit(lambda x: tfun.vjp(g, x)[1])
        (y,) = z(T(1.0))(T(3.0))
        assert_all_close(y, 6.0)

    def test_initial_style_vmap_2(self):
        x = torch.ones((10, 3))

        @tfun.custom_vjp
        def custom_fun(x):
            return x.sum()

        custom_fun.defvjp(lambda x: (x.sum(), (torch.ones_like(x),)), lambda res, g: (g * res[0],))

        def train_fun(x):
            return tfun.grad(lambda x: tfun.vmap(custom_fun)(x).sum())(x)

        lax.scan(lambda carry, inputs: (carry, train_fun(carry)), x, torch.arange(4))

    def test_initial_style_vmap_3(self):
        y = torch.arange(1.0, 4.0)

        @tfun.custom_vjp
        def f(x):
            assert x.ndim == 0
            return 3 * x * torch.sum(y)

        f.defvjp(lambda x: (f(x), torch.cos(x)), lambda cos_x, g: (2 * cos_x * g,))

        def foo(x):
            out, _ = lax.scan(lambda c, _: (f(c), None), x, None, length=1)
            return out

        assert_all_close(tfun.vmap(foo)(torch.arange(3.0)), 3.0 * torch.arange(3.0) * 6)
        assert_all_close(tfun.grad(lambda x: tfun.vmap(foo)(x).sum())(torch.arange(3.0)), 2.0 * torch.cos(torch.arange(3.0)))

    def test_bwd_closes_over_tracer(self):
        def f(y):
            @tfun.custom_vjp
            def f(x):
                return 2.0 * torch.sin(x)

            f.defvjp(lambda x: (f(x), ()), lambda _, g: (2.0 * torch.cos(y) * g,))
            return tfun.grad(f)(T(1.0))

        assert_all_close(tfun.vmap(f)(torch.arange(3.0)), 2.0 * torch.cos(torch.arange(3.0)))
        assert_all_close(tfun.grad(f)(T(4.0)), -2.0 * np.sin(4.0))

    def test_fwd_closes_over_tracer(self):
        def f(y):
            @tfun.custom_vjp
            def f(x):
                return 2.0 * torch.sin(x)

            f.defvjp(lambda x: (f(x), y), lambda y, g: (2.0 * torch.cos(y) * g,))
            return tfun.grad(f)(T(1.0))

        assert_all_close(tfun.vmap(f)(torch.arange(3.0)), 2.0 * torch.cos(torch.arange(3.0)))
        assert_all_close(tfun.grad(f)(T(4.0)), -2.0 * np.sin(4.0))

    def test_closes_over_tracer_jit(self):
        """The jit halves of test_bwd_closes_over_tracer / test_fwd_closes_over_tracer:
        jit of a function that takes a grad inside."""

        def f(y):
            @tfun.custom_vjp
            def f(x):
                return 2.0 * torch.sin(x)

            f.defvjp(lambda x: (f(x), ()), lambda _, g: (2.0 * torch.cos(y) * g,))
            return tfun.grad(f)(T(1.0))

        assert_all_close(jit(f)(T(2.0)), 2.0 * np.cos(2.0))

    def test_remat(self):
        f = _sin_vjp_f()

        @tfun.remat
        def g(x):
            return f(f(x))

        x = T(2.0)
        assert_all_close(g(x), np.sin(np.sin(2.0)))
        assert_all_close(tfun.grad(g)(x), 4.0 * tfun.grad(lambda x: torch.sin(torch.sin(x)))(x))

    def test_remat_higher_order(self):
        f = _sin_vjp_f()

        def g(x):
            return f(f(x))

        x = T(2.0)
        assert_all_close(tfun.grad(tfun.grad(tfun.remat(g)))(x), tfun.grad(tfun.grad(g))(x))
        assert_all_close(tfun.grad(tfun.remat(tfun.grad(g)))(x), tfun.grad(tfun.grad(g))(x))
        assert_all_close(tfun.grad(tfun.grad(tfun.grad(tfun.remat(g))))(x), tfun.grad(tfun.grad(tfun.grad(g)))(x))

    def test_bwd_nones(self):
        @tfun.custom_vjp
        def f(x, y):
            return x * torch.sin(y)

        f.defvjp(lambda x, y: (f(x, y), torch.cos(y)), lambda cos, g: (None, 2 * cos * g))
        assert_all_close(tfun.grad(lambda x: f(x, x))(T(3.0)), 2 * np.cos(3.0))

    def test_bwd_nones_vmap(self):
        @tfun.custom_vjp
        def f(x, y):
            return x * torch.sin(y)

        f.defvjp(lambda x, y: (f(x, y), torch.cos(y)), lambda cos, g: (None, 2 * cos * g))
        assert_all_close(tfun.grad(lambda x: tfun.vmap(f)(x, x).sum())(torch.arange(3.0)), 2 * torch.cos(torch.arange(3.0)))

    def test_bwd_nones_pytree(self):
        @tfun.custom_vjp
        def f(xs, y):
            x1, x2 = xs
            return x1 * x2 * torch.sin(y)

        f.defvjp(lambda xs, y: (f(xs, y), torch.cos(y)), lambda cos, g: (None, 2 * cos * g))
        assert_all_close(tfun.grad(lambda x: f((x, x), x))(T(3.0)), 2 * np.cos(3.0))

    def test_float0_bwd_none(self):
        @tfun.custom_vjp
        def f(i, x):
            return torch.sin(x)

        f.defvjp(lambda i, x: (f(i, x), torch.cos(x)), lambda cos_x, g: (None, 2 * cos_x * g))
        assert_all_close(tfun.grad(f, 1)(torch.tensor([1, 2]), T(3.0)), 2 * np.cos(3.0))

    def test_custom_vjp_scan_batching_edge_case(self):
        @tfun.custom_vjp
        def mul(x, coeff):
            return x * coeff

        def mul_bwd(res, g):
            x, coeff = res
            return g * coeff, (x * g).sum()

        mul.defvjp(lambda x, coeff: (mul(x, coeff), (x, coeff)), mul_bwd)

        def scan_over_mul(x, coeff):
            y, _ = lax.scan(lambda x, t: (mul(x, coeff), None), x, torch.arange(3))
            return y

        key1, key2 = random.split(random.PRNGKey(0), 2)
        x_batch = random.normal(key1, (3, 2), dtype=torch.float64)
        covector_batch = random.normal(key2, (3, 2), dtype=torch.float64)
        coeff = torch.tensor(1.0)
        batched = tfun.vmap(scan_over_mul, in_axes=(0, None), out_axes=0)
        _, vjp_fun = tfun.vjp(batched, x_batch, coeff)
        vjp_fun(covector_batch)
        check_grads(batched, (x_batch, coeff), order=2, modes=["rev"])

    def test_closure_with_vmap2(self):
        def h(z):
            def f(x):
                @tfun.custom_vjp
                def g(y):
                    return x * y

                g.defvjp(lambda y: (x * y, (x, x * y, y)), lambda res, w_bar: (res[0] * w_bar,))
                return g(z)

            return tfun.vmap(f)(torch.arange(3.0)).sum()

        check_grads(h, (T(3.14),), order=1, modes=["rev"])

    def test_custom_vjp_closure_4521(self):
        @tfun.custom_vjp
        def g(x, y):
            return None

        def g_bwd(residuals, z_bar):
            assert False

        g.defvjp(lambda x, y: (None, y), g_bwd)

        def f(xs, y):
            tfun.vmap(g, in_axes=(0, None), out_axes=None)(xs, y)

        def scan_body(xs, _):
            y = torch.zeros(1)
            _, vjp_f = tfun.vjp(f, xs, y)
            vjp_f(None)
            return xs, None

        lax.scan(scan_body, torch.ones(5), None, 100)  # doesn't crash

    def test_pytrees_not_required_to_contain_nones(self):
        class A(list):
            pass

        def unflatten(_, children):
            assert children[0] is not None
            return A(children)

        tfun.tree.register_pytree_node(A, lambda x: (list(x), None), unflatten)

        @tfun.custom_vjp
        def f(x):
            return x[0]

        f.defvjp(lambda x: (x[0], None), lambda _, g: (A([g]),))
        tfun.grad(f)(A([T(1.0)]))  # doesn't crash

    def test_float0_cotangents_automatically_handled(self):
        @tfun.custom_vjp
        def f(x, y):
            return x

        f.defvjp(lambda x, y: (x, None), lambda _, zbar: (T(0.0), None))
        # JAX: jit(lambda x: vjp(f, 0., x)[1](1.))(1), with an int x and a bwd giving 1 for it
        _, vjp = tfun.vjp(f, T(0.0), T(1))
        ct_x, ct_y = vjp(T(1.0))
        assert ct_y.dtype == torch.int64 and ct_y.item() == 0

    def test_lowering_out_of_traces(self):
        import collections

        class F(collections.namedtuple("F", ["a"])):
            def __call__(self, x):
                return torch.relu(self.a) * x

        g = jit(lambda f, x: f(x), static_argnums=0)
        f = F(T(2.0))
        tfun.grad(lambda x: g(f, x))(T(0.0))  # doesn't crash

    def test_vmap_vjp_called_twice(self):
        @tfun.custom_vjp
        def f(x):
            return x

        f.defvjp(lambda x: (x, None), lambda _, y_bar: (y_bar,))
        _, f_vjp = tfun.vjp(tfun.vmap(f), torch.tensor([3.0]))
        f_vjp(torch.tensor([3.0]))
        f_vjp(torch.tensor([3.0]))

    def test_nones_representing_zeros_in_subtrees_returned_by_bwd(self):
        @tfun.custom_vjp
        def f(x):
            return x[0]

        f.defvjp(lambda x: (f(x), None), lambda _, z_bar: ((z_bar, (None, None)),))
        tfun.grad(f)((T(1.0), (T(2.0), T(3.0))))

    def test_pytree_nones_returned_by_bwd(self):
        @tfun.custom_vjp
        def f(x):
            return x[0]

        f.defvjp(lambda x: (f(x), None), lambda _, z_bar: ((z_bar, (None, None)),))
        tfun.grad(f)((T(1.0), (T(2.0), None)))

    def test_bwd_rule_shape_mismatch(self):
        @tfun.custom_vjp
        def foo(x, y):
            return x

        foo.defvjp(lambda x, y: (x, None), lambda _, g: (torch.zeros(3), torch.zeros(3)))
        with pytest.raises(ValueError, match=r"bwd output\[1\]: expected a tensor of shape \(4,\)"):
            tfun.grad(lambda x, y: foo(x, y * y).sum(), 1)(torch.ones(3), torch.ones(4))

    def test_bwd_rule_can_produce_list_or_tuple(self):
        @tfun.custom_vjp
        def f(x, y):
            return x * y

        f.defvjp(lambda x, y: (f(x, y), (x, y)), lambda xy, g: [g * xy[1], xy[0] * g])
        tfun.grad(f)(T(1.0), T(2.0))

    def test_optimize_remat_gh21303(self):
        @tfun.custom_vjp
        def f(x):
            return torch.tan(x)

        f.defvjp(lambda x: (torch.sin(x), (x,)), lambda res, g: (torch.cos(res[0]) * g,), optimize_remat=True)

        def temp(x):
            return tfun.remat(f)(x) ** 2

        v, g = tfun.value_and_grad(temp)(T(3.2))
        assert_all_close(v, np.tan(3.2) ** 2)

    def test_optimize_remat_multiple_args(self):
        def f_(x, y):
            return torch.sin(x) * y

        @tfun.custom_vjp
        def f(x, y):
            return f_(x, y)

        f.defvjp(lambda x, y: (f(x, y), (torch.cos(x), torch.sin(x), y)),
                 lambda res, g: (res[0] * g * res[2], res[1] * g), optimize_remat=True)
        x, y = T(3.2), T(1.0)
        assert_all_close(tfun.grad(f)(x, y), tfun.grad(f_)(x, y))

    def test_optimize_remat_kwargs(self):
        @tfun.custom_vjp
        def f(x, y):
            return torch.sin(x) * y

        def f_fwd(x, y, *, keyword=False):
            return f(x, y), (torch.cos(x), torch.sin(x), y)

        f.defvjp(f_fwd, lambda res, g: (res[0] * g * res[2], res[1] * g), optimize_remat=True)
        tfun.grad(f)(T(3.2), T(1.0))

    def test_resolve_kwargs_error_message(self):
        @tfun.custom_vjp
        def f(x, y, *, z=None):
            return torch.sin(x), x + torch.cos(y)

        f.defvjp(lambda x, y: pytest.fail("no"), lambda r, c: pytest.fail("no"))
        with pytest.raises(TypeError):
            f(T(0.5))
        with pytest.raises(TypeError):
            f(T(0.5), T(0.1), z=T(1.0))

    def test_float0(self):
        # JAX's float0 zeros: an integer zero of the argument's dtype in tfun
        @tfun.custom_vjp
        def f(x, _):
            return x

        f.defvjp(lambda x, _: (x, (2.0, 1)), lambda *_: (T(2.0), 1))
        out = tfun.grad(f, argnums=(0, 1), allow_int=True)(T(2.0), T(3))
        assert_all_close(out, (2.0, 0))
        assert out[1].dtype == torch.int64

    @pytest.mark.xfail(strict=True, raises=pytest.fail.Exception, reason=D + "nondiff-tensors")
    def test_nondiff_arg_tracer_error(self):
        @partial(tfun.custom_vjp, nondiff_argnums=(0,))
        def f(x, y):
            return x * y

        f.defvjp(lambda x, y: (f(x, y), torch.cos(y)), lambda x, cos_y, g: (cos_y * g,))

        @jit
        def g(x, y):
            return f(x, y)

        with pytest.raises(TypeError, match="custom_vjp"):
            g(T(2), T(3.0))
        with pytest.raises(TypeError, match="custom_vjp"):
            tfun.grad(g, argnums=1)(T(2.0), T(3.0))

    def test_float0_initial_style(self):
        # JAX's float0 cotangent of the integer leaf: an integer zero of its dtype
        @tfun.custom_vjp
        def f(x):
            return x

        f.defvjp(lambda x: (x, (2.0, x)), lambda *_: ((T(2.0), torch.zeros((), dtype=torch.int64)),))

        def foo(x, y):
            out, _ = lax.scan(lambda c, _: (f(c), None), (x, y), None, length=1)
            return out[0]

        out = tfun.grad(foo, argnums=(0, 1), allow_int=True)(T(2.0), T(3))
        assert_all_close(out, (2.0, 0))
        assert out[1].dtype == torch.int64

    @pytest.mark.parametrize("maybe_jit,maybe_vmap", [
        pytest.param(True, True, id="jit_vmap"),
        pytest.param(True, False, id="jit"),
        pytest.param(False, True, id="vmap"),
        pytest.param(False, False, id=""),
    ])
    def test_symbolic_zero_custom_vjp(self, maybe_jit, maybe_vmap):
        """Without symbolic zeros (tfun has no `symbolic_zeros=True`): fwd gets the plain
        arguments (no `.value`/`.perturbed`) and bwd a zero cotangent for the unused first
        output, so JAX's `SymbolicZero`/`perturbed`/Python-type checks are dropped; the
        values are JAX's."""

        def f(static_scalar, static_array, dyn_scalar, dyn_array):
            out1 = static_scalar + dyn_scalar
            out2 = static_array + dyn_array
            return static_scalar, static_array, out1, out2

        def _vmap(fun):
            def _fun(*args):
                args = [torch.as_tensor(a)[None] for a in args]
                out = tfun.vmap(fun)(*args)
                return tuple(o[0] for o in out)

            return _fun

        f = tfun.custom_vjp(f)

        def fwd(*xs):
            return f(*xs), xs

        def bwd(res, g):
            static_scalar, *_ = res
            t_static, t_static_arr, t_dyn_scalar, t_dyn_array = g
            if not torch.compiler.is_compiling():  # (a traced value cannot be compared here)
                assert_all_close(t_static, 0.0)  # a zero cotangent, not a symbolic one
            return (static_scalar + 90, t_static_arr + 91, t_dyn_scalar + 92, t_dyn_array + 93)

        f.defvjp(fwd, bwd)

        def g(dyn_scalar, dyn_array):
            f_ = _vmap(f) if maybe_vmap else f
            outs = f_(T(1.0), torch.tensor([2.0, 3.0]), dyn_scalar, dyn_array)
            return outs[1:]

        def run(primal_ins, cotangent_outs):
            primal_outs, vjp = tfun.vjp(g, *primal_ins)
            return primal_outs, vjp(cotangent_outs)

        if maybe_jit:
            run = jit(run)

        primal_ins = (T(4.0), torch.tensor([5.0, 6.0]))
        cotangent_outs = (torch.tensor([10.0, 11.0]), T(7.0), torch.tensor([8.0, 9.0]))
        primal_outs, cotangent_ins = run(primal_ins, cotangent_outs)
        assert_all_close(primal_outs, (np.array([2.0, 3.0]), 5.0, np.array([7.0, 9.0])))
        assert_all_close(cotangent_ins, (99.0, np.array([101.0, 102.0])))

    def test_run_rules_more_than_once(self):
        # without symbolic zeros: fwd cannot ask `y.perturbed`; it saves nothing
        @tfun.custom_vjp
        def f(x, y):
            return x + y

        f.defvjp(lambda x, y: (x + y, None), lambda res, ct: (ct, ct))

        def body(x_y, _):
            x, y = x_y
            return (f(x, y), x), None

        @tfun.grad
        def g(x):
            (out, _), _ = lax.scan(body, (x, T(1.0)), xs=None, length=2)
            return out

        assert_all_close(g(T(1.0)), 2.0)

    def test_symbolic_zeros_remat(self):
        # without symbolic zeros: fwd gets `x`, not a CustomVJPPrimal
        @tfun.custom_vjp
        def f(x):
            return x

        f.defvjp(lambda x: (f(x), None), lambda _, g: (g,))

        @tfun.remat
        def foo(x):
            return f(f(x))

        assert_all_close(tfun.grad(foo)(T(3.0)), 1.0)
