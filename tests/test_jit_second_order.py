"""Second-order reverse mode through tfun.lax loops under tfun.jit, against eager float64.

torch's control-flow HOPs have no double backward. Inside a traced derivative whose result is
differentiated again (`tfun.grad` of `tfun.grad`, a gradient penalty `.backward()`, a
`tfun.vjp` whose cotangents require grad, a gradient depending on a closed-over parameter),
tfun unrolls `scan`, `fori_loop` with static bounds and `map`, and runs `associative_scan`'s
tensor algorithm, in the graph (`tfun.lax._hop.unroll_scope`). Every such path must give
eager's values; `cond`, `switch`, `while_loop` and a loop past the unroll limit are a
`JitError` naming the op and the user's function.
"""

from __future__ import annotations

import pytest
import torch

import tfun
from tfun import lax
from tfun.errors import JitError
from tfun.lax import _hop

D = torch.float64


def _x(n=3, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=D)


W = torch.randn(3, 3, generator=torch.Generator().manual_seed(7), dtype=D) * 0.5


@tfun.custom_jvp
def _softplus(x):
    return torch.log1p(torch.exp(x))


_softplus.defjvp(lambda p, t: (_softplus(p[0]), torch.sigmoid(p[0]) * t[0] * 1.5))  # not the derivative


def scan_fwd(x, T):
    c, ys = lax.scan(lambda c, xt: (torch.tanh(c @ W + xt), (c * xt).sum()), x, torch.linspace(-1, 1, T * 3, dtype=D).reshape(T, 3))
    return (c**2).sum() + ys.sum()


def scan_reverse_pytree(x, T):
    def body(c, _):
        a, b = c["a"], c["b"]
        return {"a": torch.sin(a) * b, "b": b + torch.cos(a)}, a.sum()

    c, ys = lax.scan(body, {"a": x, "b": x * 0.5}, None, length=T, reverse=True)
    return (c["a"] * c["b"]).sum() + (ys * torch.arange(1, T + 1, dtype=D)).sum()


def scan_custom_jvp(x, T):
    return lax.scan(lambda c, _: (_softplus(c) * 0.5, None), x, None, length=T)[0].sum()


def nested_scans(x, T):
    def outer(c, _):
        inner = lax.scan(lambda d, _: (torch.sin(d) * 1.1, None), c, None, length=2)[0]
        return inner + c * 0.1, None

    return lax.scan(outer, x, None, length=T)[0].pow(2).sum()


def fori(x, T):
    return lax.fori_loop(0, T, lambda i, c: torch.tanh(c * 1.3 + i * 0.1), x).pow(3).sum()


def map_rows(x, T):
    return lax.map(lambda r: torch.sin(r) * r.sum(), x.reshape(3, 1).expand(3, T)).pow(2).sum()


def map_batched(x, T):
    return lax.map(lambda r: torch.sin(r) * r.sum(), x.reshape(3, 1).expand(3, T), batch_size=2).pow(2).sum()


def assoc(x, T):
    elems = (x.reshape(3, 1) * torch.linspace(0.5, 1.5, T, dtype=D)).T  # (T, 3)
    a, b = lax.associative_scan(lambda p, q: (p[0] * q[0], p[1] * q[0] + q[1]), (torch.tanh(elems), elems), reverse=True)
    return (a * b).sum()


PROGRAMS = {f.__name__: f for f in (scan_fwd, scan_reverse_pytree, nested_scans, fori, map_rows, map_batched, assoc)}


def _modes(f, T):
    """Ways a loop's gradient gets differentiated again, each a function of x."""
    loss = lambda x: f(x, T)
    v = _x(seed=5)
    return {
        "grad_of_grad": lambda x: tfun.grad(lambda y: (tfun.grad(loss)(y) ** 2).sum())(x),
        "hvp": lambda x: tfun.grad(lambda y: (tfun.grad(loss)(y) * v).sum())(x),
        "grad_of_vjp": lambda x: tfun.grad(lambda y: tfun.vjp(loss, y)[1](torch.ones((), dtype=D))[0].sum())(x),
    }


#: (program, T, mode) cells: every program and mode, T = 1 and longer (the cells compile
#: unrolled graphs, so they are chosen rather than crossed, to keep CI's time)
CELLS = [
    ("scan_fwd", 1, "grad_of_grad"),
    ("scan_fwd", 7, "grad_of_grad"),
    ("scan_fwd", 7, "hvp"),
    ("scan_fwd", 7, "grad_of_vjp"),
    ("scan_reverse_pytree", 1, "grad_of_grad"),
    ("scan_reverse_pytree", 7, "hvp"),
    ("nested_scans", 2, "grad_of_grad"),
    ("fori", 1, "grad_of_grad"),
    ("fori", 7, "grad_of_vjp"),
    ("map_rows", 7, "grad_of_grad"),
    ("map_batched", 7, "hvp"),
    ("assoc", 1, "grad_of_grad"),
    ("assoc", 7, "grad_of_grad"),
    ("assoc", 7, "grad_of_vjp"),
]


@pytest.mark.parametrize("program, T, mode", CELLS)
def test_second_order_matches_eager(program, T, mode):
    fn = _modes(PROGRAMS[program], T)[mode]
    x = _x()
    want = fn(x)
    got = tfun.jit(fn, backend="aot_eager")(x)
    torch.testing.assert_close(got, want)


# CI's second torch phase keeps `assoc` (the 32 s scan program is `heavy`: see pyproject.toml)
@pytest.mark.parametrize("program", [pytest.param("scan_reverse_pytree", marks=pytest.mark.heavy), "assoc"])
def test_second_order_matches_eager_inductor(program):
    fn = _modes(PROGRAMS[program], 7)["grad_of_grad"]
    x = _x(seed=1)
    torch.testing.assert_close(tfun.jit(fn)(x), fn(x))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_gradient_penalty_backward_reaches_arguments_and_parameters(backend):
    """`.backward()` through a jitted gradient: the second-order terms reach the argument and
    a parameter the loop closes over, as eagerly."""
    w = torch.tensor([0.7, -0.2, 1.1], dtype=D, requires_grad=True)

    def loss(x):
        return lax.scan(lambda c, _: (torch.tanh(c * w), c.sum()), x, None, length=5)[1].pow(2).sum()

    penalty = lambda x: (tfun.grad(loss)(x) ** 2).sum()
    grads = []
    for run in (penalty, tfun.jit(penalty, backend=backend)):
        x = _x(seed=2).requires_grad_(True)
        w.grad = None
        run(x).backward()
        grads.append((x.grad, w.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want)


def _refused(fn, pattern):
    with pytest.raises(JitError, match=pattern) as e:
        tfun.jit(lambda x: tfun.grad(lambda y: (tfun.grad(fn)(y) ** 2).sum())(x), backend="aot_eager")(_x())
    assert "test_jit_second_order.py:" in str(e.value), str(e.value)
    assert "outside tfun.jit" in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(
    "op, fn",
    [
        ("cond", lambda x: lax.cond(x.sum() > 0, lambda a: a * 2, lambda a: a**3, x).sum()),
        ("switch", lambda x: lax.switch((x.sum() > 0).long(), [lambda a: a * 2, lambda a: a**3], x).sum()),
        ("while_loop", lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, torch.sin(c[1])), (0, x))[1].sum()),
        ("fori_loop", lambda x: lax.fori_loop(0, (x.sum() > 0).long() + 2, lambda i, c: torch.sin(c), x).sum()),
    ],
)
def test_ops_without_an_unrolled_form_are_refused(op, fn):
    msg = _refused(fn, rf"^tfun\.lax\.{op}: under tfun\.jit, this op is inside a gradient that is differentiated again")
    assert "no second derivative of a control-flow op" in msg


@tfun.custom_vjp
def _softplus_vjp(x):
    return torch.log1p(torch.exp(x))


_softplus_vjp.defvjp(lambda x: (_softplus_vjp(x), x), lambda x, g: (torch.sigmoid(x) * g * 1.5,))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: _softplus(x).sum(),
        lambda x: _softplus_vjp(x).sum(),
        lambda x: scan_custom_jvp(x, 3),
    ],
    ids=["custom_jvp", "custom_vjp", "custom_jvp_in_scan"],
)
def test_custom_rules_in_a_gradient_differentiated_again_are_refused(fn):
    """Dynamo compiles a custom rule's backward once, without a graph: the second-order term
    would be zero (it was, silently, before this refusal). Eagerly it is the rule's."""
    msg = _refused(fn, r"^tfun\.grad: under tfun\.jit, a gradient through a tfun\.custom_jvp or tfun\.custom_vjp")
    assert "tfun.grad(tfun.grad(tfun.jit(f)))" in msg
    # with another path to the argument the outer gradient has a graph: this returned a wrong
    # number (the rule's second-order term dropped) before the refusal
    mixed = lambda x: tfun.grad(lambda y: (tfun.grad(fn)(y) ** 2).sum() + (y**2).sum())(x)
    with pytest.raises(JitError, match="a gradient through a tfun.custom_jvp or tfun.custom_vjp"):
        tfun.jit(mixed, backend="aot_eager")(_x())
    gg = lambda x: tfun.grad(lambda y: (tfun.grad(fn)(y) ** 2).sum())(x)
    assert gg(_x()).abs().sum() > 0  # eagerly: a nonzero second-order term
    # and as the fix says: differentiating around the jitted function uses the rule
    torch.testing.assert_close(tfun.grad(lambda y: (tfun.grad(tfun.jit(fn, backend="aot_eager"))(y) ** 2).sum())(_x()), gg(_x()))


def test_unroll_limit_and_unroll_true(monkeypatch):
    """Past `MAX_UNROLLED_STEPS` (nested loops multiply) a loop is refused with the fix;
    `unroll=True` on the loop unrolls it all the same, with eager's values."""
    monkeypatch.setattr(_hop, "MAX_UNROLLED_STEPS", 8)

    def nested(x, unroll=1):
        inner = lambda c, _: (lax.scan(lambda d, _: (torch.sin(d), None), c, None, length=3, unroll=unroll)[0], None)
        return lax.scan(inner, x, None, length=3)[0].sum()

    msg = _refused(nested, r"^tfun\.lax\.scan: under tfun\.jit, this loop is inside a gradient .* here that is 9 steps")
    assert "unroll=True" in msg
    fn = lambda x: tfun.grad(lambda y: (tfun.grad(lambda z: nested(z, unroll=True))(y) ** 2).sum())(x)
    torch.testing.assert_close(tfun.jit(fn, backend="aot_eager")(_x()), fn(_x()))


def test_first_order_keeps_the_loop_op():
    """Unrolling is only for a derivative differentiated again: a plain jitted gradient still
    lowers the loop to torch's scan (one loop op in the graph, not T steps)."""
    counts = []

    def backend(gm, example_inputs):
        counts.append(sum(1 for n in gm.graph.nodes if "scan" in str(n.target)))
        return gm

    fn = lambda x: tfun.grad(lambda y: scan_fwd(y, 7))(x)
    torch.testing.assert_close(tfun.jit(fn, backend=backend)(_x()), fn(_x()))
    assert counts and counts[0] >= 1


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.2)])
def test_lower_precision_matches_eager_in_that_dtype(dtype, tol):
    """float32 and bfloat16: the unrolled jitted second derivative equals eager's in the same
    dtype (the same ops), and both stay near the float64 oracle within the dtype's precision."""
    oracle = _modes(scan_fwd, 5)["grad_of_grad"](_x(seed=3))
    fn = lambda x: tfun.grad(lambda y: (tfun.grad(lambda z: scan_fwd_dtype(z, 5))(y) ** 2).sum())(x)
    x = _x(seed=3).to(dtype)
    eager = fn(x)
    got = tfun.jit(fn, backend="aot_eager")(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got, eager, atol=tol / 10, rtol=tol / 10)
    torch.testing.assert_close(got.double(), oracle, atol=tol, rtol=tol)


def scan_fwd_dtype(x, T):
    """`scan_fwd` in `x`'s dtype."""
    w, xs = W.to(x.dtype), torch.linspace(-1, 1, T * 3, dtype=D).reshape(T, 3).to(x.dtype)
    c, ys = lax.scan(lambda c, xt: (torch.tanh(c @ w + xt), (c * xt).sum()), x, xs)
    return (c**2).sum() + ys.sum()


def test_vmap_around_a_jitted_second_derivative():
    """`tfun.vmap` of a jitted second derivative through a loop gives each example's eager
    value; `tfun.jit` of a `tfun.vmap` of it (a torch.func transform around the traced
    derivative) is a tfun JitError, not a wrong number."""
    gg = _modes(scan_fwd, 4)["grad_of_grad"]
    xs = torch.stack([_x(seed=s) for s in range(4)])
    want = torch.stack([gg(x) for x in xs])
    torch.testing.assert_close(tfun.vmap(tfun.jit(gg, backend="aot_eager"))(xs), want)
    torch.testing.assert_close(tfun.vmap(gg)(xs), want)
    with pytest.raises(JitError, match="torch.func transform"):
        tfun.jit(tfun.vmap(gg), backend="aot_eager")(xs)


def test_checkpoint_in_a_jitted_second_derivative_is_refused_or_right():
    """torch 2.13+ rematerializes for one gradient per graph: a `tfun.checkpoint` body (a
    loop's, or around the loop) inside a jitted second derivative is a JitError that names
    tfun.checkpoint and says what to do (torch 2.11 compiles it: then it must equal eager);
    eagerly and around the jitted gradient it is fine."""
    body = lambda c, xt: (torch.tanh(c @ W + xt) * torch.sin(c), None)
    xs = torch.linspace(-1, 1, 12, dtype=D).reshape(4, 3)
    for loss in (
        lambda x: lax.scan(tfun.checkpoint(body), x, xs)[0].pow(2).sum(),
        tfun.checkpoint(lambda x: lax.scan(body, x, xs)[0].pow(2).sum()),
    ):
        gg = lambda x: tfun.grad(lambda y: (tfun.grad(loss)(y) ** 2).sum())(x)
        try:
            got = tfun.jit(gg, backend="aot_eager")(_x())
        except JitError as e:
            assert "two gradients through tfun.checkpoint functions" in str(e), str(e)
        else:
            torch.testing.assert_close(got, gg(_x()))
        plain = lambda x: tfun.grad(lambda y: (tfun.grad(lambda z: lax.scan(body, z, xs)[0].pow(2).sum())(y) ** 2).sum())(x)
        torch.testing.assert_close(gg(_x()), plain(_x()))
        around = lambda x: tfun.grad(lambda y: (tfun.jit(tfun.grad(loss), backend="aot_eager")(y) ** 2).sum())(x)
        torch.testing.assert_close(around(_x()), plain(_x()))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_second_derivative_through_a_jitted_functions_backward_is_refused_not_dropped(backend):
    """Hunt 25: a Hessian-vector product through a jitted function's backward
    (`torch.autograd.grad(..., create_graph=True)` then differentiated again) silently left
    the jitted part's second-order term out on torch 2.13 (torch's own refusal hangs off a
    dummy tensor that autograd prunes). Now a JitError at the create_graph backward; a plain
    backward and a first-order create_graph-free gradient are unchanged, and the rewrite the
    message suggests (both derivatives inside tfun.jit) gives the float64 eager HVP."""
    g0 = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64, generator=g0)
    W = torch.randn(3, 3, dtype=torch.float64, generator=g0)
    v = torch.randn(3, 3, dtype=torch.float64, generator=g0)

    def f(x, W):
        return (torch.sigmoid(x @ W) ** 2).sum()

    H = torch.func.hessian(f, argnums=1)(x, W)
    want = (H.reshape(9, 9) @ v.reshape(9)).reshape(3, 3) + 2 * v
    torch._dynamo.reset()
    jf = tfun.jit(f, backend=backend)
    Wr = W.clone().requires_grad_()
    L = jf(x, Wr) + (Wr**2).sum()
    with pytest.raises(JitError, match="create_graph=True") as info:
        torch.autograd.grad(L, Wr, create_graph=True)
    assert "test_jit_second_order.py" in str(info.value)
    # first order, as before
    (gW,) = torch.autograd.grad(jf(x, Wr), Wr)
    torch.testing.assert_close(gW, torch.func.grad(f, argnums=1)(x, W))
    # the rewrite: both derivatives in one compiled function
    hvp = tfun.jit(lambda x, W, v: tfun.jvp(lambda W: tfun.grad(lambda W: f(x, W) + (W**2).sum())(W), (W,), (v,))[1], backend=backend)
    torch.testing.assert_close(hvp(x, W, v), want)


def _rnn_loss(W, xs):
    h, ys = lax.scan(lambda h, x: (torch.tanh(h @ W + x), torch.tanh(h @ W + x)), torch.zeros(2, 3, dtype=W.dtype), xs)
    return (ys**2).sum()


def _scan_ops(counts):
    def backend(gm, example_inputs):
        counts.append(sum(1 for n in gm.graph.nodes if "scan" in str(n.target)))
        return gm

    return backend


@pytest.mark.parametrize("how", ["argument", "closure"])
def test_a_gradient_of_parameters_warns_before_unrolling_and_no_grad_keeps_the_loop_op(how):
    """`tfun.jit(tfun.grad(loss))(W)` with `W` an `nn.Parameter` (it requires grad), or a loss
    closing over one: the gradient stays differentiable (a `.backward()` outside may reach it),
    so the loop is unrolled, which costs compile time per step (a 1024-step RNN's gradient took
    minutes to compile). Past `WARN_UNROLLED_STEPS` tfun warns at the loop body's line, naming what
    requires grad and the fixes; under `torch.no_grad()` (or with `W.detach()`) the loop stays one
    loop op, with no warning. Values against eager float64 in each case."""
    assert _hop.WARN_UNROLLED_STEPS == 16
    g = torch.Generator().manual_seed(5)
    W0, xs = torch.randn(3, 3, generator=g, dtype=D) * 0.4, torch.randn(20, 2, 3, generator=g, dtype=D)
    want = tfun.grad(_rnn_loss)(W0, xs)
    P = torch.nn.Parameter(W0.clone())
    if how == "argument":
        fn, args, named = tfun.grad(_rnn_loss), (P, xs), "tfun.grad's argument args[0] requires grad"
        fixed = (P.detach(), xs)
    else:
        fn, args, named = tfun.grad(lambda xs: _rnn_loss(P, xs) + (xs * 0).sum()), (xs,), "closes over a tensor that requires grad"
        want = tfun.grad(lambda xs: _rnn_loss(W0, xs))(xs)
        fixed = None
    torch._dynamo.reset()
    counts: list[int] = []
    with pytest.warns(tfun.errors.PerformanceWarning, match=r"^tfun\.lax\.scan \(<lambda> at .*test_jit_second_order\.py:\d+\): under tfun\.jit this loop is unrolled into 20 steps") as rec:
        got = tfun.jit(fn, backend=_scan_ops(counts))(*args)
    msg = str(rec[0].message)
    assert named in msg and "torch.no_grad()" in msg and "unroll=True" in msg, msg
    assert rec[0].filename.endswith("test_jit_second_order.py")
    if how == "argument":  # unrolled: no loop op (a closure's probe run, dead code, keeps its own)
        assert counts == [0]
    torch.testing.assert_close(got.detach(), want)
    # the fixes the warning names: one loop op, no warning (warnings are errors here)
    torch._dynamo.reset()
    counts.clear()
    with torch.no_grad():
        got = tfun.jit(fn, backend=_scan_ops(counts))(*args)
    assert counts and counts[0] >= 1
    torch.testing.assert_close(got, want)
    if fixed is not None:
        torch._dynamo.reset()
        counts.clear()
        torch.testing.assert_close(tfun.jit(fn, backend=_scan_ops(counts))(*fixed), want)
        assert counts and counts[0] >= 1


def test_a_gradient_penalty_past_the_warning_length_is_right_and_unroll_true_silences_it():
    """The case the unrolling is for: a gradient of a Parameter, differentiated again by a
    `.backward()` outside the jitted function. Past `WARN_UNROLLED_STEPS` it warns and is right;
    with `unroll=True` on the loop it is right without a warning. Against eager float64."""
    g = torch.Generator().manual_seed(6)
    W0, xs = torch.randn(3, 3, generator=g, dtype=D) * 0.4, torch.randn(18, 2, 3, generator=g, dtype=D)

    def loss(W, xs, unroll):
        h, ys = lax.scan(lambda h, x: (torch.tanh(h @ W + x), h.sum()), torch.zeros(2, 3, dtype=W.dtype), xs, unroll=unroll)
        return (h**2).sum() + ys.sum()

    ref = W0.clone().requires_grad_()
    (tfun.grad(loss)(ref, xs, 1) ** 2).sum().backward()
    for unroll in (1, True):
        torch._dynamo.reset()
        P = torch.nn.Parameter(W0.clone())
        jitted = tfun.jit(tfun.grad(loss), backend="aot_eager", static_argnums=2)
        if unroll is True:
            gW = jitted(P, xs, unroll)
        else:
            with pytest.warns(tfun.errors.PerformanceWarning, match="unrolled into 18 steps"):
                gW = jitted(P, xs, unroll)
        (gW**2).sum().backward()
        torch.testing.assert_close(P.grad, ref.grad)


def test_past_the_unroll_limit_a_gradient_of_parameters_is_refused_with_the_no_grad_fix(monkeypatch):
    """Past `MAX_UNROLLED_STEPS`, where only the arguments' `requires_grad` asks for a
    differentiable gradient, the `JitError` says so and names `torch.no_grad()`, which works."""
    monkeypatch.setattr(_hop, "MAX_UNROLLED_STEPS", 8)
    g = torch.Generator().manual_seed(7)
    W0, xs = torch.randn(3, 3, generator=g, dtype=D) * 0.4, torch.randn(9, 2, 3, generator=g, dtype=D)
    P = torch.nn.Parameter(W0.clone())
    torch._dynamo.reset()
    with pytest.raises(JitError, match=r"^tfun\.lax\.scan: under tfun\.jit, this loop is inside a gradient that may be differentiated again \(tfun\.grad's argument args\[0\] requires grad") as e:
        tfun.jit(tfun.grad(_rnn_loss), backend="aot_eager")(P, xs)
    assert "torch.no_grad()" in str(e.value) and "test_jit_second_order.py:" in str(e.value)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(tfun.jit(tfun.grad(_rnn_loss), backend="aot_eager")(P, xs), tfun.grad(_rnn_loss)(W0, xs))
