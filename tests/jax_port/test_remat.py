"""Port of the remat tests of JAX's `tests/api_test.py` (class `RematTest`).

Test methods keep JAX's names. Translation rules as in test_lax_control_flow.py:
`api.remat`/`jax.checkpoint` -> `tfun.remat`/`tfun.checkpoint`, `jnp` -> `torch`,
`lax.sin` -> `torch.sin`, float64 throughout, `api.linearize` -> the `linearize` helper
(`tfun.jvp`), `api.jit` -> `tfun.jit(backend="aot_eager")`. JAX's counts of primitive
evaluations (it swaps `sin_p`'s impl) are not ported: torch has no hook that sees
backward's recomputation; those tests check values instead. `concrete=True` (Python control flow
in a remat function) is the default in tfun: the function runs on real tensors.

The first tests follow the `api.remat` era version of `RematTest`; the rest (from
test_remat_vmap_not_leading_dim on) JAX's current one (`api_test.py` of 2025-26, read from
the mattjj/jax fork, stored version 1541103). JAX parametrizes most tests over `jax.remat`,
`jax.remat` with a policy that saves nothing and `jax.checkpoint` with that policy: here
`REMATS` (the last two are one function in tfun). JAX's custom policies
`lambda prim, *_, **__: str(prim) == 'cos'` become `lambda func, *_, **__: func is
torch.cos` (tfun asks a policy about torch functions; only matrix products can be saved,
see `tfun.checkpoint_policies`). JAX's checks of jaxprs (which ops the linearized or
transposed function recomputes) are dropped; the values, and `check_grads` where JAX
calls it, are kept.

Not ported (tests/jax_port/README.md lists them with reasons): jaxpr/HLO text, JAX's
caches and tracing counts, custom `Primitive`s, `checkpoint_name` and the name-based and
offloading policies, `saved_residuals`, `jax.ref`, remat logging, `Remat3Test`.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

import tfun
import tfun.random as random
from tfun import lax

from .conftest import T, assert_all_close, check_grads, jit, linearize

D = "docs/porting.md, Differences from JAX: "


def skip(row: str):
    return pytest.mark.skip(reason=D + row)


# JAX's `remat` parameters: jax.remat, and with a policy that saves nothing (JAX's '_new'
# case, jax.checkpoint with that policy, is the same function in tfun)
REMATS = [
    pytest.param(tfun.remat, id=""),
    pytest.param(partial(tfun.remat, policy=lambda *_, **__: False), id="_policy"),
]


class TestRemat:
    @pytest.mark.parametrize("remat", REMATS)
    def test_remat_basic(self, remat):
        @remat
        def g(x):
            return torch.sin(torch.sin(x)), T(3.0)

        def f(x):
            x, _ = g(x)
            return x

        assert_all_close(f(T(2.0)), np.sin(np.sin(2.0)))
        ans, f_lin = linearize(f, T(2.0))
        assert_all_close(ans, np.sin(np.sin(2.0)))
        assert_all_close(f_lin(T(3.0)), np.cos(np.sin(2.0)) * np.cos(2.0) * 3.0)

    @pytest.mark.parametrize("remat", REMATS)
    def test_remat_freevars(self, remat):
        def f1(x):
            y = 2 * torch.sin(x)
            return torch.cos(x) * torch.sin(y)

        def f2(x):
            y = 2 * torch.sin(x)
            return remat(lambda x: torch.cos(x) * torch.sin(y))(x)

        ans, f_lin = linearize(f2, T(2.0))
        expected, f_lin_expected = linearize(f1, T(2.0))
        assert_all_close(ans, expected)
        assert_all_close(f_lin(T(3.0)), f_lin_expected(T(3.0)))
        assert_all_close(tfun.grad(f2)(T(2.0)), tfun.grad(f1)(T(2.0)))

    def test_remat_grad_python_control_flow(self):
        @tfun.remat  # JAX: partial(api.remat, concrete=True)
        def g(x):
            if x > 0:
                return torch.sin(x), T(3.0)
            return torch.cos(x), T(4.0)

        def f(x):
            x, _ = g(x)
            return x

        assert_all_close(f(T(2.0)), np.sin(2.0))
        assert_all_close(tfun.grad(f)(T(2.0)), np.cos(2.0))

    def test_remat_jit(self):
        @tfun.remat
        def g(x):
            return torch.sin(torch.sin(x))

        def f_(x):
            return g(x)

        # eager: JAX's semantics without jit
        assert_all_close(f_(T(2.0)), np.sin(np.sin(2.0)))
        assert_all_close(tfun.grad(f_)(T(2.0)), np.cos(np.sin(2.0)) * np.cos(2.0))

    def test_remat_jit_compiled(self):
        """The jitted lines of test_remat_jit: jit(f), grad(jit(f)), jit(grad(f))."""

        @tfun.remat
        def g(x):
            return torch.sin(torch.sin(x))

        f = jit(g)
        assert_all_close(f(T(2.0)), np.sin(np.sin(2.0)))
        assert_all_close(tfun.grad(f)(T(2.0)), np.cos(np.sin(2.0)) * np.cos(2.0))
        assert_all_close(jit(tfun.grad(g))(T(2.0)), np.cos(np.sin(2.0)) * np.cos(2.0))

    @pytest.mark.parametrize("remat", REMATS)
    def test_remat_vmap(self, remat):
        @remat
        def g(x):
            return torch.sin(torch.sin(x))

        x = torch.arange(3.0)
        assert_all_close(tfun.vmap(g)(x), np.sin(np.sin(x.numpy())))
        want = np.diag(np.cos(np.sin(x.numpy())) * np.cos(x.numpy()))
        assert_all_close(tfun.jacfwd(g)(x), want)
        assert_all_close(tfun.jacrev(g)(x), want)

    @pytest.mark.parametrize("remat", REMATS)
    def test_remat_higher_order_autodiff(self, remat):
        def f(x):
            return torch.cos(torch.sin(x))

        g = remat(f)
        assert_all_close(tfun.grad(tfun.grad(g))(T(3.0)), tfun.grad(tfun.grad(f))(T(3.0)))

    def test_remat_higher_order_autodiff_fwd(self):
        """tfun addition: forward-over-forward through remat (as JAX's check_grads(order=2,
        modes=["fwd"]) in LaxControlFlowTest.testScanJVP with checkpoint)."""

        def f(x):
            return torch.cos(torch.sin(x))

        g = tfun.remat(f)
        t = T(1.0)
        h = lambda h_f: (lambda x: tfun.jvp(h_f, (x,), (t,))[1])
        assert_all_close(tfun.jvp(h(g), (T(3.0),), (t,))[1], tfun.jvp(h(f), (T(3.0),), (t,))[1])

    def test_remat_scan(self):
        to_scan = lambda c, x: (torch.sin(c), None)

        def f_noremat(x):
            y, _ = lax.scan(to_scan, x, torch.arange(3.0))
            return y

        def f_yesremat(x):
            y, _ = lax.scan(tfun.remat(to_scan), x, torch.arange(3.0))
            return y

        assert_all_close(f_yesremat(T(4.0)), f_noremat(T(4.0)))
        assert_all_close(tfun.grad(f_yesremat)(T(4.0)), tfun.grad(f_noremat)(T(4.0)))
        # JAX inspects the linearized and vjp jaxprs (out of scope); the port checks both
        assert_all_close(linearize(f_yesremat, T(4.0))[1](T(1.0)), linearize(f_noremat, T(4.0))[1](T(1.0)))
        assert_all_close(tfun.vjp(f_yesremat, T(4.0))[1](T(1.0)), tfun.vjp(f_noremat, T(4.0))[1](T(1.0)))

    def test_remat_no_redundant_flops(self):
        @tfun.remat
        def f(x, y):
            return torch.sin(x) * y

        def g(x):  # JAX jits g
            return f(T(2.0), x)

        # JAX counts sin evaluations (at most one under jit) by swapping sin_p's impl;
        # torch has no such hook for backward. The port checks the gradient.
        assert_all_close(tfun.grad(g)(T(3.0)), np.sin(2.0))

    @pytest.mark.parametrize("remat", REMATS)
    def test_remat_binomial_checkpointing(self, remat):
        def binom_checkpoint(funs):
            if len(funs) == 1:
                return funs[0]
            f1 = binom_checkpoint(funs[: len(funs) // 2])
            f2 = binom_checkpoint(funs[len(funs) // 2 :])
            return remat(lambda x: f1(f2(x)))

        f1 = binom_checkpoint([torch.sin, torch.sin, torch.sin, torch.sin])
        f2 = lambda x: torch.sin(torch.sin(torch.sin(torch.sin(x))))
        x = T(4.0)
        assert_all_close(f1(x), f2(x))
        assert_all_close(tfun.grad(f1)(x), tfun.grad(f2)(x))

    def test_remat_symbolic_zeros(self):
        key, split = random.split(random.PRNGKey(0))
        n = 5

        def func(D0):
            def shift(R, dR):
                return R + dR

            def apply_fn(R):
                return D0 * R

            Rinit = random.uniform(split, (n, 3), minval=0.0, maxval=5.0, dtype=torch.float32).to(torch.float64)

            def move(R, i):
                F = apply_fn(R)
                return shift(R, 0.001 * F), torch.tensor([0.0])

            R, _ = lax.scan(tfun.remat(move), Rinit, torch.arange(2))
            return R[0, 0]

        tfun.grad(func)(T(5.0))  # doesn't crash

    def test_remat_jit2(self):
        def f(x):  # JAX jits f
            y = 2 * x

            @tfun.remat
            def g():
                return y

            return g()

        assert_all_close(f(T(3)), 6)

    def test_remat_jit2_compiled(self):
        @jit
        def f(x):
            y = 2 * x
            return tfun.remat(lambda: y)()

        assert_all_close(f(T(3)), 6)

    def test_remat_nontrivial_env(self):
        @tfun.remat
        def foo(state, dt=0.5, c=1):
            u, u_t = state
            u_tt = c**2 * u
            u_t = u_t + u_tt * dt
            return (u, u_t)

        def _multi_step(state, count, dt, c):  # JAX: jit with static count
            f = lambda s, _: (foo(s, dt, c), _)
            return lax.scan(f, state, None, count)

        def multi_step(state, count, dt=1 / np.sqrt(2), c=1):
            return _multi_step(state, count, dt, c)

        def loss(u0, target, steps, dt=1 / np.sqrt(2), c=1):
            init = (u0, torch.zeros_like(u0))
            (uf, _), _ = multi_step(init, steps, dt, c)
            return ((uf - target) ** 2).mean()

        target = torch.zeros((128, 128))
        u0 = torch.ones_like(target)
        loss(u0, target, 10)  # doesn't crash
        tfun.grad(loss)(u0, target, 3)

    @pytest.mark.parametrize("remat", REMATS)
    def test_remat_jit3(self, remat):
        def f(w, x):
            a = x @ w
            b = torch.einsum("btd,bTd->btT", a, a)
            c = torch.einsum("btT,btd->btd", b, a)
            return torch.sum(c)

        w = torch.ones([1, 1])
        x = torch.ones([1, 1, 1])
        tfun.grad(remat(f))(w, x)

        mul = jit(lambda a, b: a * b)

        def f2(w, x):
            a = mul(w, x)
            return mul(a, a)

        tfun.grad(remat(f2))(T(1.0), T(1.0))

    def test_remat_scan2(self):
        def scan_bug(x0):
            f = lambda x, _: (x + 1, None)

            def scanned_f(x, _):
                return lax.scan(f, x, xs=None, length=1)[0], None

            x, _ = tfun.remat(scanned_f)(x0, None)
            return x

        assert_all_close(tfun.grad(scan_bug)(T(1.0)), 1.0)

    def test_escaped_tracer_remat(self):
        # JAX: UnexpectedTracerError ("global state") when a remat function writes to a
        # list it closes over, under jit. tfun runs the function eagerly and lets it; the
        # port checks that the values stay right (the function runs again in backward).
        seq = [torch.zeros(())]

        def g():
            seq[0] = seq[0] + 1
            return seq[0]

        tfun.remat(g)()
        tfun.remat(g)()
        assert seq[0].item() == 2.0

    @pytest.mark.parametrize("policy", ["nothing_saveable", "everything_saveable", "dots_saveable",
                                        "dots_with_no_batch_dims_saveable"])
    def test_remat_policies(self, policy):
        """tfun addition (JAX's policy tests inspect jaxprs): every `checkpoint_policies`
        policy gives the value and gradient of the function without remat."""
        W = T(np.random.RandomState(0).randn(3, 3))

        def f(x):
            h = torch.sin(W @ x)
            return torch.sum(torch.cos(W @ h))

        g = tfun.checkpoint(f, policy=getattr(tfun.checkpoint_policies, policy))
        x = T(np.random.RandomState(1).randn(3))
        assert_all_close(g(x), f(x))
        assert_all_close(tfun.grad(g)(x), tfun.grad(f)(x))
        assert_all_close(tfun.grad(lambda x: tfun.grad(g)(x).sum())(x), tfun.grad(lambda x: tfun.grad(f)(x).sum())(x))

    # --- JAX's current RematTest (api_test.py of 2025/2026, read from mattjj/jax@1541103) ---

    @pytest.mark.parametrize("remat", REMATS)
    def test_remat_vmap_not_leading_dim(self, remat):
        g = remat(lambda x: torch.sin(torch.sin(x)))
        x = torch.arange(3 * 5.0).reshape(3, 5)
        assert_all_close(tfun.vmap(g, 1, 0)(x), np.sin(np.sin(x.numpy())).T)

    @pytest.mark.parametrize("f", [
        pytest.param(lambda x: torch.sin(torch.sin(x)), id="basic"),
        pytest.param(lambda x: lax.cond(x > 0, torch.sin, torch.cos, x), id="cond"),
    ])
    def test_remat_higher_order_ad_preserves_remat_primitive(self, f):
        # JAX also looks for the remat primitive in the jaxpr (out of scope)
        g = tfun.remat(f)
        x = T(0.3)
        assert_all_close(tfun.grad(tfun.grad(g))(x), tfun.grad(tfun.grad(f))(x))

    @pytest.mark.parametrize("policy", [
        pytest.param(tfun.checkpoint_policies.everything_saveable, id="_save_anything_new_remat"),
        pytest.param(None, id="_save_nothing_new_remat"),
    ])
    def test_remat_custom_policy(self, policy):
        """JAX's save_anything/save_nothing cases (save_sin needs `checkpoint_name`, which tfun
        has not); JAX's checks of the linearized jaxpr are out of scope."""
        for square in [lambda x: x * x, jit(lambda x: x * x)]:
            def g(x, square=square):
                return torch.sin(square(torch.sin(x)))

            f = tfun.checkpoint(g, policy=policy)
            y, f_lin = linearize(f, T(1.0))
            y_expected, ydot_expected = tfun.jvp(g, (T(1.0),), (T(2.0),))
            assert_all_close(y, y_expected)
            assert_all_close(f_lin(T(2.0)), ydot_expected)
            check_grads(f, (T(3.0),), order=2, modes=["fwd", "rev"])

    def test_remat_custom_policy_save_cos(self):
        save_cos = lambda func, *_, **__: func is torch.cos
        f = tfun.remat(lambda x: torch.sin(torch.sin(x)), policy=save_cos)
        check_grads(f, (T(3.0),), order=2, modes=["fwd", "rev"])

    def test_remat_checkpoint_dots(self):
        """JAX runs it with jax.remat and jax.checkpoint (one function in tfun); JAX's counts
        of sin/dot in the linearized jaxpr are out of scope."""

        @partial(tfun.remat, policy=tfun.checkpoint_policies.checkpoint_dots)
        def f(x):
            x = torch.sin(x @ x)
            x = torch.sin(x @ x)
            return torch.sin(x @ x)

        check_grads(f, (torch.ones((2, 2)),), order=2, modes=["fwd", "rev"])

    def test_remat_checkpoint_dots_with_no_batch_dims(self):
        @partial(tfun.remat, policy=tfun.checkpoint_policies.checkpoint_dots_with_no_batch_dims)
        def f(x):
            x = torch.sin(torch.einsum("ij,jk->ik", x, x))
            x = torch.sin(torch.einsum("ij,jk->ik", x, x))
            return torch.sin(torch.einsum("ij,jk->ik", x, x))

        check_grads(f, (torch.ones((2, 2)),), order=2, modes=["fwd", "rev"])

    def test_remat_checkpoint_dots_with_no_batch_dims2(self):
        @partial(tfun.remat, policy=tfun.checkpoint_policies.checkpoint_dots_with_no_batch_dims)
        def f(x):
            x = torch.sin(torch.einsum("nij,njk->nik", x, x))
            x = torch.sin(torch.einsum("nij,njk->nik", x, x))
            return torch.sin(torch.einsum("nij,njk->nik", x, x))

        check_grads(f, (torch.ones((3, 2, 2)),), order=2, modes=["fwd", "rev"])

    def test_remat_checkpoint_dots_jit(self):
        @jit
        @partial(tfun.remat, policy=tfun.checkpoint_policies.checkpoint_dots)
        def f(x):
            x = torch.sin((x @ x) * 1e-3)
            x = torch.sin((x @ x) * 1e-3)
            return torch.sin((x @ x) * 1e-3)

        check_grads(f, (torch.ones((2, 2)),), order=2, modes=["fwd", "rev"])

    def test_remat_checkpoint_dots_inside_scan(self):
        x = torch.ones((5,))

        def f(W):
            @partial(tfun.remat, policy=tfun.checkpoint_policies.checkpoint_dots)
            def f(x):
                x = torch.sin(x @ W)
                x = torch.sin(x @ W)
                return torch.sin(x @ W)

            return lax.scan(lambda x, _: (f(x), None), x, None, length=2)[0]

        # JAX counts sin/cos/dot in the vjp's jaxpr (out of scope) and checks jit(f)
        check_grads(jit(f), (torch.ones((5, 5)),), order=2, modes=["fwd", "rev"])

    def test_remat_custom_jvp_policy(self):
        @tfun.custom_jvp
        def sin(x):
            return torch.sin(x)

        sin.defjvp(lambda p, t: (sin(p[0]), torch.cos(p[0]) * t[0]))

        @partial(tfun.remat, policy=tfun.checkpoint_policies.checkpoint_dots)
        def f(x):
            x = sin((x @ x) * 1e-3)
            x = sin((x @ x) * 1e-3)
            return sin((x @ x) * 1e-3)

        # JAX's x is a scalar (`jnp.dot` of scalars); torch's `@` needs a matrix. The
        # forward-over-forward half of JAX's order-2 check is the test below.
        g = lambda x: lax.scan(lambda x, _: (f(x), None), x, None, length=2)[0]
        for fn in (f, g):
            check_grads(fn, (T(3.0).reshape(1, 1),), order=2, modes=["rev"])
            check_grads(fn, (T(3.0).reshape(1, 1),), order=1, modes=["fwd"])

    def test_remat_custom_vjp_policy(self):
        @tfun.custom_vjp
        def sin(x):
            return torch.sin(x)

        sin.defvjp(lambda x: (sin(x), x), lambda x, y_bar: (torch.cos(x) * y_bar,))

        @partial(tfun.remat, policy=tfun.checkpoint_policies.checkpoint_dots)
        def f(x):
            def dot2(y, z):  # JAX wraps it in `api.named_call` (only a name in the jaxpr)
                return x @ (y @ z)

            x = sin(dot2(x, x) * 1e-3)
            x = sin(dot2(x, x) * 1e-3)
            return sin(dot2(x, x) * 1e-3)

        check_grads(f, (T(3.0).reshape(1, 1),), order=2, modes=["rev"])
        g = lambda x: lax.scan(lambda x, _: (f(x), None), x, None, length=2)[0]
        check_grads(g, (T(3.0).reshape(1, 1),), order=2, modes=["rev"])

    def test_remat_dropvar_policy(self):
        def f(x):
            return x, x

        @partial(tfun.remat, policy=tfun.checkpoint_policies.checkpoint_dots)
        def g(x):
            return tfun.grad(lambda x: f(x)[0])(x)

        assert_all_close(tfun.grad(g)(T(3.0)), 0.0)

    def test_remat_custom_jvp_linear_policy(self):
        @tfun.custom_jvp
        def sum(x):
            return torch.sum(x, dim=0)

        sum.defjvp(lambda p, t: (sum(p[0]), sum(t[0])))

        @partial(tfun.remat, policy=tfun.checkpoint_policies.checkpoint_dots)
        def f(x):
            return sum(x)

        g = lambda x: lax.scan(lambda _, x: (None, f(x)), None, x)[1]
        for fn, x in ((f, torch.ones(3)), (g, torch.ones((2, 3)))):
            check_grads(fn, (x,), order=2, modes=["rev"])
            check_grads(fn, (x,), order=1, modes=["fwd"])  # order 2 fwd: the test below

    @pytest.mark.parametrize("which", [pytest.param("policy", id="test_remat_custom_jvp_policy"),
                                       pytest.param("linear", id="test_remat_custom_jvp_linear_policy")])
    def test_remat_custom_jvp_policy_fwd_order_2(self, which):
        """The forward-over-forward half of JAX's order-2 checks in the two tests above."""

        @tfun.custom_jvp
        def h(x):
            return torch.sin(x) if which == "policy" else torch.sum(x, dim=0)

        h.defjvp(lambda p, t: (h(p[0]), torch.cos(p[0]) * t[0] if which == "policy" else torch.sum(t[0], dim=0)))
        def three_dots(x):
            x = h((x @ x) * 1e-3)
            x = h((x @ x) * 1e-3)
            return h((x @ x) * 1e-3)

        f = partial(tfun.remat, policy=tfun.checkpoint_policies.checkpoint_dots)(three_dots if which == "policy" else h)
        x = T(3.0).reshape(1, 1) if which == "policy" else torch.ones(3)
        check_grads(f, (x,), order=2, modes=["fwd"])

    @pytest.mark.parametrize("remat", REMATS)
    def test_checkpoint_dropvars(self, remat):
        @remat
        def f(x):
            _, x = jit(lambda: (x, x))()
            return x

        assert_all_close(tfun.grad(f)(T(3.0)), 1.0)

    def test_dce_keeps_eqns_with_used_outputs_but_no_used_inputs(self):
        @tfun.checkpoint
        def f(x):
            c = jit(lambda: torch.tensor(3.0))()
            return c * x

        assert_all_close(tfun.grad(f)(T(3.0)), 3.0)

    def test_remat_of_scan(self):
        # JAX's check that the linearized jaxpr has sin and cos is out of scope
        to_scan = lambda c, _: (torch.sin(c), torch.sin(c))
        f = lambda x: lax.scan(to_scan, x, None, length=3)
        check_grads(tfun.remat(f), (T(3.0),), order=2, modes=["rev"])

    def test_remat_of_scan_unused_extensive_output_grad(self):
        def f(c, a):
            b = torch.sin(a).sum() + torch.sin(c).sum()
            return torch.sin(c * b), b

        g = tfun.remat(partial(lax.scan, f), policy=tfun.checkpoint_policies.nothing_saveable)
        c = torch.arange(4.0) / 4.0
        as_ = torch.arange(15.0).reshape(5, 3) / 15.0
        ans = tfun.grad(lambda c, as_: g(c, as_)[0].sum(), argnums=(0, 1))(c, as_)
        expected = tfun.grad(lambda c, as_: lax.scan(f, c, as_)[0].sum(), argnums=(0, 1))(c, as_)
        assert_all_close(ans[0], expected[0])  # JAX's grad is w.r.t. c only

    def test_const_in_jvp_scan(self):
        @tfun.custom_jvp
        def f(x):
            return x * torch.arange(3.0)

        f.defjvp(lambda p, t: (f(p[0]), t[0] * torch.arange(3.0)))

        @tfun.remat
        def g(x):
            y, _ = lax.scan(lambda c, _: (f(c), None), x, None, length=1)
            return y.sum()

        assert_all_close(tfun.grad(g)(torch.arange(3.0)), np.arange(3.0))

    @staticmethod
    def _dots_outside_scan():
        x = torch.ones((5,))

        @partial(tfun.checkpoint, policy=tfun.checkpoint_policies.checkpoint_dots)
        def f(W):
            def f(x):
                x = torch.sin(x @ W)
                x = torch.sin(x @ W)
                return torch.sin(x @ W)

            return lax.scan(lambda x, _: (f(x), None), x, None, length=2)[0]

        return f

    def test_remat_checkpoint_dots_outside_scan(self):
        """JAX checks jit(f); eagerly here, the jitted line is in the test below."""
        f = self._dots_outside_scan()
        check_grads(f, (torch.ones((5, 5)),), order=2, modes=["fwd", "rev"])

    def test_remat_checkpoint_dots_outside_scan_jit(self):
        f = self._dots_outside_scan()
        check_grads(jit(f), (torch.ones((5, 5)),), order=2, modes=["fwd", "rev"])

    def test_remat_of_scan_policy(self):
        save_cos = lambda func, *_, **__: func is torch.cos
        to_scan = lambda c, _: (torch.sin(c), torch.sin(c))
        f = tfun.checkpoint(lambda x: lax.scan(to_scan, x, None, length=3), policy=save_cos)
        check_grads(f, (T(3.0),), order=2, modes=["rev"])

    @pytest.mark.parametrize("how", ["test_remat_of_scan_funky_custom_jvp", "test_remat_of_scan_funky_custom_jvp2",
                                     "test_remat_of_cond_funky_custom_jvp", "test_remat_of_cond_funky_custom_jvp2"])
    def test_remat_funky_custom_jvp(self, how):
        """JAX's test_remat_of_{scan,cond}_funky_custom_jvp{,2}: a custom_jvp sin whose rule
        computes sin and cos in a jitted function (or in a scan/cond), under a scan (cond)
        checkpointed with each policy; JAX's jaxpr counts are out of scope."""
        if "scan" in how:
            def apply(f, x):
                return lax.scan(lambda x, _: (f(x), None), x, None, length=1)[0]
        else:
            def apply(f, x):
                if how.endswith("2"):
                    return lax.cond(True, f, lambda x: x, x)
                return lax.cond(x.sum() > -torch.inf, f, lambda x: x, x)

        @tfun.custom_jvp
        def sin(x):
            return torch.sin(x)

        def sin_jvp(primals, tangents):
            (x,), (xdot,) = primals, tangents
            if how.endswith("2"):
                y, c = apply(lambda xs: (torch.sin(xs[0]), torch.cos(xs[1])), (x, x))
            else:
                y, c = jit(lambda x: (torch.sin(x), torch.cos(x)))(x)
            return y, c * xdot

        sin.defjvp(sin_jvp)
        save_cos = lambda func, *_, **__: func is torch.cos
        save_sin = lambda func, *_, **__: func is torch.sin
        pols = tfun.checkpoint_policies
        for policy in [save_cos, save_sin, pols.everything_saveable, pols.nothing_saveable]:
            check_grads(tfun.checkpoint(partial(apply, sin), policy=policy), (T(3.0),), order=2, modes=["rev"])
        f = tfun.checkpoint(lambda x: apply(sin, apply(sin, x)), policy=pols.nothing_saveable)
        check_grads(f, (T(3.0),), order=2, modes=["rev"])

    def test_remat_of_cond(self):
        # JAX's checks of sin/cos in the linearized jaxpr are out of scope
        true_fn = lambda c: (torch.sin(c), torch.sin(c))
        false_fn = lambda c: (torch.sin(c), torch.sin(c))
        f = lambda x: lax.cond(x > 0.0, true_fn, false_fn, x)
        check_grads(tfun.remat(f), (T(3.0),), order=2, modes=["rev"])
        f = lambda x: lax.cond(x > 0.0, lambda c: torch.sin(torch.sin(c)), lambda c: c, x)
        check_grads(tfun.remat(f), (T(3.0),), order=2, modes=["rev"])

    def test_const_in_jvp_cond(self):
        @tfun.custom_jvp
        def f(x):
            return x * torch.arange(3.0)

        f.defjvp(lambda p, t: (f(p[0]), t[0] * torch.arange(3.0)))

        @tfun.remat
        def g(x):
            return lax.cond(x.sum() > 0, f, lambda x: x, x).sum()

        assert_all_close(tfun.grad(g)(torch.arange(3.0)), np.arange(3.0))

    @pytest.mark.parametrize("where", [pytest.param("inside", id="test_remat_checkpoint_dots_inside_cond"),
                                       pytest.param("outside", id="test_remat_checkpoint_dots_outside_cond")])
    def test_remat_checkpoint_dots_inside_cond(self, where):
        """JAX's test_remat_checkpoint_dots_inside_cond and _outside_cond (`jax.remat` or
        `jax.checkpoint` of a function whose cond applies three dots); JAX's counts in the
        vjp's jaxpr are out of scope. JAX checks jit(f): eagerly here, the jitted line is
        in the test below."""
        check_grads(self._dots_cond(where), (torch.ones((5, 5)),), order=2, modes=["fwd", "rev"])

    @pytest.mark.parametrize("where", [pytest.param("inside", id="test_remat_checkpoint_dots_inside_cond"),
                                       pytest.param("outside", id="test_remat_checkpoint_dots_outside_cond")])
    def test_remat_checkpoint_dots_inside_cond_jit(self, where):
        check_grads(jit(self._dots_cond(where)), (torch.ones((5, 5)),), order=2, modes=["fwd", "rev"])

    @staticmethod
    def _dots_cond(where):
        x = torch.ones((5,))

        def f(W):
            def g(x):
                x = torch.sin(x @ W)
                x = torch.sin(x @ W)
                return torch.sin(x @ W)

            return lax.cond(x.sum() > 0, g, lambda x: x, x)

        return partial(tfun.remat if where == "inside" else tfun.checkpoint,
                       policy=tfun.checkpoint_policies.checkpoint_dots)(f)

    def test_remat_of_cond_policy(self):
        save_cos = lambda func, *_, **__: func is torch.cos
        f = tfun.checkpoint(lambda x: lax.cond(x > 0, torch.sin, lambda x: x, x), policy=save_cos)
        check_grads(f, (T(3.0),), order=2, modes=["rev"])

    def test_remat_of_while_loop(self):
        def f(x):
            _, y = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, torch.sin(c[1])), (0, x))
            return y

        _, f_lin = linearize(tfun.remat(f), T(3.0))
        expected = tfun.grad(lambda x: torch.sin(torch.sin(torch.sin(x))))(T(3.0))
        assert_all_close(f_lin(T(1.0)), expected)

    def test_excess_precision_hell(self):
        eps = torch.finfo(torch.bfloat16).eps

        @tfun.custom_vjp
        def dot(x):
            return x @ x

        dot.defvjp(lambda x: (dot(x), None), lambda _, g: (g,))

        @tfun.custom_vjp
        def foo(x):
            return torch.tensor(1.0, dtype=torch.float32) * x.to(torch.float32)

        # JAX's bwd returns a float32 cotangent for the bfloat16 input (tfun converts it)
        foo.defvjp(lambda x: (foo(x), x), lambda x, _: (torch.tensor(1.0, dtype=torch.float32) * x.to(torch.float32),))

        @jit
        @partial(tfun.remat, policy=lambda *_, **__: True)
        def f(x):
            return foo(dot(x))

        x = (1 + eps) * torch.eye(2, dtype=torch.bfloat16)
        y, vjp = tfun.vjp(f, x)
        (y_,) = vjp(torch.ones_like(y))
        assert_all_close(y, y_.to(torch.float32), atol=0, rtol=0)  # exact (numpy has no bfloat16)

    def test_excess_precision_hell_bwd_dtype(self):
        """test_excess_precision_hell with JAX's bwd rule unchanged: a float32 cotangent
        for a bfloat16 argument (accepted, as in JAX; tfun converts it to bfloat16)."""

        @tfun.custom_vjp
        def foo(x):
            return x.to(torch.float32)

        foo.defvjp(lambda x: (foo(x), x), lambda x, _: (x.to(torch.float32),))
        x = torch.eye(2, dtype=torch.bfloat16)
        y, vjp = tfun.vjp(foo, x)
        (ct,) = vjp(torch.ones_like(y))
        assert ct.dtype == torch.bfloat16
        assert_all_close(ct.to(torch.float32), torch.eye(2, dtype=torch.float32), atol=0, rtol=0)

    @pytest.mark.xfail(strict=True, raises=AssertionError, reason=D + "remat-concrete")
    @pytest.mark.parametrize("static", [
        pytest.param(False, id="test_concreteness_error_includes_user_code"),
        pytest.param(True, id="test_concreteness_error_includes_user_code_with_static_argnums"),
    ])
    def test_concreteness_error_includes_user_code(self, static):
        def f(x, _=None):
            if x > 0:
                return x
            return torch.sin(x)

        f = tfun.remat(f, static_argnums=(1,)) if static else tfun.remat(f)
        try:
            f(T(3.0), 1.0) if static else f(T(3.0))
        except TypeError:  # JAX's TracerBoolConversionError, naming `x > 0`
            import traceback

            assert "x > 0" in traceback.format_exc()
        else:
            assert False, "no concreteness error"

    def test_remat_partial_cse_prevention_all_false(self):
        @partial(tfun.remat, prevent_cse=(False, False))
        def layer(W, x):
            return x @ W

        def loss(Ws, x):
            for W in Ws:
                x = layer(W, x)
            return torch.sum(x**2)

        Ws = [torch.ones((3, 3)) for _ in range(2)]
        jit(tfun.grad(loss, argnums=(0, 1)))(Ws, torch.ones(3))  # doesn't crash (JAX lowers it)
