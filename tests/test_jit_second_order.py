"""Second-order reverse mode through tfun.lax loops under tfun.jit, against eager float64.

torch's control-flow HOPs have no double backward. Inside a traced derivative that the trace
differentiates again (`tfun.grad` of `tfun.grad`, `tfun.jvp` of `tfun.grad`), tfun unrolls
`scan`, `fori_loop` with static bounds and `map`, and runs `associative_scan`'s tensor
algorithm, in the graph (`tfun.lax._hop.unroll_scope`). Every such path must give eager's
values; `cond`, `switch`, `while_loop` and a loop past the unroll limit are a `JitError`
naming the op and the user's function. The outermost traced derivative, whose result stays
differentiable only because its arguments or the tensors it closes over require grad (a
training step with `nn.Parameter`s), keeps its loops as loop ops and is computed
first-order: a backward that reaches it is refused at run time, and `unroll=True` on the
loops makes it exact (`tfun/_first_order.py`)."""

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
    """`.backward()` through a jitted gradient: with `unroll=True` on the loop, the second-order
    terms reach the argument and a parameter the loop closes over, as eagerly. Without it the
    gradient of arguments that require grad is computed first-order with the loop kept as a loop
    op (`tfun._first_order`), and the backward that reaches it is a JitError at run time that
    names the loss and `unroll=True`, never a dropped term."""
    w = torch.tensor([0.7, -0.2, 1.1], dtype=D, requires_grad=True)

    def loss(x, unroll=1):
        return lax.scan(lambda c, _: (torch.tanh(c * w), c.sum()), x, None, length=5, unroll=unroll)[1].pow(2).sum()

    grads = []
    for run in (lambda x: (tfun.grad(loss)(x) ** 2).sum(), tfun.jit(lambda x: (tfun.grad(lambda y: loss(y, True))(x) ** 2).sum(), backend=backend)):
        x = _x(seed=2).requires_grad_(True)
        w.grad = None
        run(x).backward()
        grads.append((x.grad, w.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want)
    x = _x(seed=2).requires_grad_(True)
    penalty = tfun.jit(lambda x: (tfun.grad(loss)(x) ** 2).sum(), backend=backend)(x)
    with pytest.raises(JitError, match=r"^tfun\.grad: under tfun\.jit, this gradient was computed first-order") as e:
        penalty.backward()
    assert "loss at " in str(e.value) and "test_jit_second_order.py:" in str(e.value), str(e.value)
    assert "unroll=True" in str(e.value)


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
@pytest.mark.parametrize(
    "T, backend", [(20, "aot_eager"), (1500, "aot_eager"), (20, "inductor"), pytest.param(1500, "inductor", marks=pytest.mark.heavy)]
)
def test_a_gradient_of_parameters_keeps_the_loop_op_and_refuses_a_backward_through_it(how, T, backend):
    """`tfun.jit(tfun.grad(loss))(W)` with `W` an `nn.Parameter` (it requires grad), or a loss
    closing over one: the usual training step. The loop stays one loop op at any length (it was
    unrolled, costing about 0.4 s of compile time a step and refused past 1024 steps), with no
    warning, and the gradient equals eager float64's. It requires grad, as eagerly; a backward
    that reaches it (a loss at `W - lr * g`) is a JitError naming `unroll=True` at run time, and a
    backward that reaches only other outputs (a zero cotangent for the gradient) is right."""
    g = torch.Generator().manual_seed(5)
    W0, xs = torch.randn(3, 3, generator=g, dtype=D) * 0.4, torch.randn(T, 2, 3, generator=g, dtype=D)
    P = torch.nn.Parameter(W0.clone())
    if how == "argument":
        fn, args, want = tfun.value_and_grad(_rnn_loss), (P, xs), tfun.value_and_grad(_rnn_loss)(W0, xs)
    else:
        closed = lambda xs: _rnn_loss(P, xs) + (xs * 0).sum()
        fn, args, want = tfun.value_and_grad(closed), (xs,), tfun.value_and_grad(lambda xs: _rnn_loss(W0, xs))(xs)
    torch._dynamo.reset()
    counts: list[int] = []
    value, grad = tfun.jit(fn, backend=_scan_ops(counts))(*args)  # (warnings are errors here)
    assert counts and counts[0] >= 1, counts
    torch.testing.assert_close(value.detach(), want[0])
    torch.testing.assert_close(grad.detach(), want[1])
    # through the backend (AOTAutograd, and Inductor's code)
    jitted = tfun.jit(fn, backend=backend)
    value, grad = jitted(*args)
    torch.testing.assert_close(value.detach(), want[0])
    torch.testing.assert_close(grad.detach(), want[1])
    assert grad.requires_grad and value.requires_grad
    # the value's own backward is first-order: right
    value.backward()
    want_w = tfun.grad(_rnn_loss)(W0, xs)
    torch.testing.assert_close(P.grad, want_w)  # (the closure's loss is `_rnn_loss(P, xs)` too)
    # a backward through the gradient
    P.grad = None
    value, grad = jitted(*args)
    step = (P - 0.1 * grad) if how == "argument" else (xs - 0.1 * grad)
    with pytest.raises(JitError, match=r"computed first-order.*a backward has reached it") as e:
        (step**2).sum().backward()
    assert "_rnn_loss at " in str(e.value) or "<lambda> at " in str(e.value), str(e.value)
    assert "unroll=True" in str(e.value) and "torch.no_grad()" in str(e.value)
    # the usual update, under torch.no_grad(): one loop op, the eager gradient
    torch._dynamo.reset()
    counts.clear()
    with torch.no_grad():
        value, grad = tfun.jit(fn, backend=_scan_ops(counts))(*args)
    assert counts and counts[0] >= 1
    torch.testing.assert_close(grad, want[1])


def test_a_gradient_penalty_of_parameters_with_unroll_true_is_right_and_without_is_refused():
    """The case the exact (unrolled) path is for: a gradient of a Parameter, differentiated again
    by a `.backward()` outside the jitted function. With `unroll=True` on the loop it equals eager
    float64; without, the backward is a JitError (the gradient was computed first-order)."""
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
        gW = tfun.jit(tfun.grad(loss), backend="aot_eager", static_argnums=2)(P, xs, unroll)
        if unroll is True:
            (gW**2).sum().backward()
            torch.testing.assert_close(P.grad, ref.grad)
        else:
            with pytest.raises(JitError, match="unroll=True"):
                (gW**2).sum().backward()


def test_a_vjp_of_parameters_keeps_the_loop_op_and_refuses_a_backward_through_it():
    """`tfun.vjp` under tfun.jit with a primal that requires grad: as `tfun.grad`'s training step
    (one loop op, eager's cotangents; a backward that reaches them is a JitError), and a cotangent
    that requires grad is refused the same way (the pullback's derivative in it is not kept)."""
    g = torch.Generator().manual_seed(8)
    W0, xs = torch.randn(3, 3, generator=g, dtype=D) * 0.4, torch.randn(30, 2, 3, generator=g, dtype=D)
    want = tfun.vjp(_rnn_loss, W0, xs)[1](torch.tensor(2.0, dtype=D))[0]
    P = torch.nn.Parameter(W0.clone())
    counts: list[int] = []
    torch._dynamo.reset()
    pull = lambda W, xs, ct: tfun.vjp(_rnn_loss, W, xs)[1](ct)[0]
    got = tfun.jit(pull, backend=_scan_ops(counts))(P, xs, torch.tensor(2.0, dtype=D))
    assert counts and counts[0] >= 1
    torch.testing.assert_close(got.detach(), want)
    with pytest.raises(JitError, match="computed first-order"):
        (got**2).sum().backward()
    ct = torch.tensor(2.0, dtype=D, requires_grad=True)
    got = tfun.jit(pull, backend="aot_eager")(W0, xs, ct)
    torch.testing.assert_close(got.detach(), want)
    with pytest.raises(JitError, match="computed first-order"):
        (got.sum() + ct).backward()
    # without a loop op the pullback is exactly differentiable in its cotangent (its derivative
    # was dropped before: the result did not require grad)
    plain = lambda W, x, ct: tfun.vjp(lambda W: torch.tanh(x @ W).sum(), W)[1](ct)[0]
    x = torch.randn(2, 3, generator=g, dtype=D)
    for run in (plain, tfun.jit(plain, backend="aot_eager")):
        ct = torch.tensor(2.0, dtype=D, requires_grad=True)
        (run(W0, x, ct) ** 2).sum().backward()
        if run is plain:
            want_ct = ct.grad
        else:
            torch.testing.assert_close(ct.grad, want_ct)


# CI's second torch phase keeps an aot_eager cell (the Inductor one, 32 s there, is `heavy`)
@pytest.mark.parametrize("T, backend", [(20, "aot_eager"), (1500, "aot_eager"), pytest.param(20, "inductor", marks=pytest.mark.heavy)])
def test_a_vjp_of_a_function_closing_over_a_parameter_keeps_the_loop_op(T, backend):
    """`tfun.vjp` under tfun.jit of a function that closes over an `nn.Parameter` (input
    gradients inside a training step): as `tfun.grad`'s closure case, one loop op at any length
    (it was unrolled, with a PerformanceWarning, and refused past 1024 steps), eager float64's
    outputs and cotangents, the output's backward reaching the parameter exactly, and a
    backward through the cotangents refused at run time; with `unroll=True` that backward is
    exact."""
    g = torch.Generator().manual_seed(9)
    W0, xs = torch.randn(3, 3, generator=g, dtype=D) * 0.4, torch.randn(T, 2, 3, generator=g, dtype=D)
    P = torch.nn.Parameter(W0.clone())

    def loss(xs, unroll=1):
        h, ys = lax.scan(lambda h, x: (torch.tanh(h @ P + x), h.sum()), torch.zeros(2, 3, dtype=D), xs, unroll=unroll)
        return (h**2).sum() + ys.sum()

    def step(xs, ct, unroll=1):
        out, pull = tfun.vjp(lambda xs: loss(xs, unroll), xs)
        return out, pull(ct)[0]

    ct = torch.tensor(2.0, dtype=D)
    want_out, want_gx = step(xs, ct)
    want_out.backward()
    want_p, P.grad = P.grad, None
    torch._dynamo.reset()
    counts: list[int] = []
    out, gx = tfun.jit(step, backend=_scan_ops(counts))(xs, ct)  # (warnings are errors here)
    assert counts and counts[0] >= 1, counts
    run = tfun.jit(step, backend=backend)
    out, gx = run(xs, ct)
    torch.testing.assert_close(out.detach(), want_out.detach())
    torch.testing.assert_close(gx.detach(), want_gx.detach())
    assert out.requires_grad and gx.requires_grad
    out.backward()
    torch.testing.assert_close(P.grad, want_p)
    out, gx = run(xs, ct)
    with pytest.raises(JitError, match=r"computed first-order.*closes over a tensor that requires grad"):
        (gx**2).sum().backward()
    if T <= 20:
        # a penalty on the input gradient, with the loop unrolled: exact
        P.grad = None
        (step(xs, ct, True)[1] ** 2).sum().backward()
        want_p, P.grad = P.grad, None
        torch._dynamo.reset()
        (tfun.jit(step, backend=backend, static_argnums=2)(xs, ct, True)[1] ** 2).sum().backward()
        torch.testing.assert_close(P.grad, want_p)
