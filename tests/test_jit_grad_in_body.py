"""A derivative taken inside a loop body or a branch, under `tfun.jit`.

JAX users write inner optimisation steps (`c - lr * grad(energy)(c)`) in `lax.scan` bodies and
jit the whole program, often with an outer `grad` on top. Under `tfun.jit` a `tfun.grad`,
`tfun.value_and_grad` or `tfun.vjp` inside a HOP body (where torch runs the body with autograd
off) is traced as torch.func's transform into the body's graph (`_hop.in_body`).

The float64 eager result is the oracle for every cell: the jitted forward, `tfun.jit` of the
outer `tfun.grad`, and `.backward()` of the jitted forward into a closed-over parameter.
torch's backward of `while_loop`, `cond` and `map` differentiates such a body wrongly (checked
here with torch alone), so when one of those is differentiated tfun refuses with a `JitError`;
their forward compiles.
"""

from __future__ import annotations

import pytest
import torch

import tfun
from tfun import lax
from tfun.errors import JitError

D = torch.float64


def _energy(c, w):
    return (torch.tanh(c @ w) ** 2).sum() + (c**4).sum()


def scan_grad(c0, w, xs):
    def body(c, x):
        g = tfun.grad(_energy)(c, w)
        return c - 0.1 * x * g, (g**2).sum()

    c, ys = lax.scan(body, c0, xs)
    return c.sum() + ys.sum()


def scan_grad_reverse(c0, w, xs):
    def body(c, x):
        g = tfun.grad(_energy)(c, w)
        return c - 0.1 * x * g, g

    c, ys = lax.scan(body, c0, xs, reverse=True)
    return (c**2).sum() + (ys * xs[:, None]).sum()


def scan_value_and_grad_aux(c0, w, xs):
    def body(c, x):
        (v, aux), g = tfun.value_and_grad(lambda c: (_energy(c, w), c.sum()), has_aux=True)(c)
        return c - 0.1 * x * g, v + aux

    c, ys = lax.scan(body, c0, xs)
    return c.sum() + ys.sum()


def scan_vjp(c0, w, xs):
    def body(c, x):
        y, pull = tfun.vjp(lambda c: torch.sin(c @ w), c)
        (ct,) = pull(torch.cos(y))
        return c - 0.1 * x * ct, y.sum()

    c, ys = lax.scan(body, c0, xs)
    return c.sum() + ys.sum()


def scan_pytree_carry(c0, w, xs):
    def body(carry, x):
        c, m = carry["c"], carry["m"]
        g = tfun.grad(lambda p: _energy(p["c"], w) + (p["c"] * p["m"]).sum())({"c": c, "m": m})
        return {"c": c - 0.1 * x * g["c"], "m": 0.9 * m + g["m"]}, g["c"].sum()

    carry, ys = lax.scan(body, {"c": c0, "m": torch.zeros_like(c0)}, xs)
    return carry["c"].sum() + carry["m"].sum() + ys.sum()


def fori_grad(c0, w, xs):
    return (lax.fori_loop(0, 4, lambda i, c: c - 0.05 * tfun.grad(_energy)(c, w), c0) ** 2).sum()


SCANS = {
    "scan": scan_grad,
    "scan_reverse": scan_grad_reverse,
    "value_and_grad_aux": scan_value_and_grad_aux,
    "vjp": scan_vjp,
    "pytree_carry": scan_pytree_carry,
    "fori_loop": fori_grad,
}


def cond_grad(c0, w, xs):
    c = lax.cond(c0.sum() > 0, lambda c: c - 0.1 * tfun.grad(_energy)(c, w), lambda c: c * 2.0, c0)
    return (c**2).sum()


def switch_grad(c0, w, xs):
    c = lax.switch(1, [lambda c: c * 2.0, lambda c: c - 0.1 * tfun.grad(_energy)(c, w)], c0)
    return (c**2).sum()


def map_grad(c0, w, xs):
    gs = lax.map(lambda c: tfun.grad(_energy)(c, w), c0[None] * xs[:, None])
    return (gs**2).sum()


def while_grad(c0, w, xs):
    def body(s):
        i, c = s
        return i + 1, c - 0.05 * tfun.grad(_energy)(c, w)

    _, c = lax.while_loop(lambda s: s[0] < 4, body, (0, c0))
    return (c**2).sum()


def cond_jacrev(c0, w, xs):
    c = lax.cond(c0.sum() > 0, lambda c: c - 0.1 * tfun.jacrev(_energy)(c, w), lambda c: c * 2.0, c0)
    return (c**2).sum()


def map_vmap_grad(c0, w, xs):
    gs = lax.map(lambda c: tfun.vmap(tfun.grad(_energy), in_axes=(0, None))(c[None], w)[0], c0[None] * xs[:, None])
    return (gs**2).sum()


# (the last two returned wrong gradients without an error before 2026-11-25: torch.func
# reached the branch through tfun.jacrev and tfun.vmap(tfun.grad))
REFUSED = {
    "cond": (cond_grad, "tfun.lax.cond"),
    "switch": (switch_grad, "tfun.lax.switch"),
    "map": (map_grad, "tfun.lax.map"),
    "while_loop": (while_grad, "tfun.lax.while_loop"),
    "cond_jacrev": (cond_jacrev, "tfun.lax.cond"),
    "map_vmap_grad": (map_vmap_grad, "tfun.lax.map"),
}


def _inputs(length=5):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 3, dtype=D, generator=g)
    c0 = torch.tensor([0.5, -0.3, 0.2], dtype=D)
    xs = torch.linspace(0.5, 1.0, length, dtype=D)
    return c0, w, xs


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


# every program on aot_eager; two representative ones on Inductor as well
CELLS = [(name, "aot_eager") for name in SCANS] + [
    pytest.param("scan", "inductor", marks=pytest.mark.heavy),  # (CI's torch 2.14.1 phase: aot_eager only)
    pytest.param("vjp", "inductor", marks=pytest.mark.heavy),
]


@pytest.mark.parametrize(("name", "backend"), CELLS)
def test_scan_body_derivative_under_jit_matches_eager(name, backend):
    f = SCANS[name]
    c0, w, xs = _inputs()
    ref = f(c0, w, xs)
    ref_g = tfun.grad(f, argnums=(0, 1))(c0, w, xs)
    _close(tfun.jit(f, backend=backend)(c0, w, xs), ref)
    got = tfun.jit(tfun.grad(f, argnums=(0, 1)), backend=backend)(c0, w, xs)
    for a, b in zip(got, ref_g):
        _close(a, b)
    # .backward() of the jitted forward into a parameter the bodies close over
    wp = w.clone().requires_grad_(True)
    tfun.jit(f, backend=backend)(c0, wp, xs).backward()
    _close(wp.grad, ref_g[1])


@pytest.mark.parametrize("length", [1, 2, 7])
def test_scan_body_derivative_lengths(length):
    c0, w, xs = _inputs(length)
    ref = tfun.grad(scan_grad, argnums=(0, 1))(c0, w, xs)
    got = tfun.jit(tfun.grad(scan_grad, argnums=(0, 1)), backend="aot_eager")(c0, w, xs)
    for a, b in zip(got, ref):
        _close(a, b)


def test_scan_body_derivative_matches_finite_differences():
    """The eager oracle itself: the outer gradient of a scan whose body takes a gradient."""
    c0, w, xs = _inputs()
    g = tfun.grad(scan_grad)(c0, w, xs)
    eps = 1e-6
    for i in range(3):
        e = torch.zeros(3, dtype=D)
        e[i] = eps
        fd = (scan_grad(c0 + e, w, xs) - scan_grad(c0 - e, w, xs)) / (2 * eps)
        assert abs(float(fd) - float(g[i])) < 1e-6


@pytest.mark.parametrize("name", list(REFUSED))
def test_derivative_in_other_bodies_forward_compiles(name):
    f, _ = REFUSED[name]
    c0, w, xs = _inputs()
    _close(tfun.jit(f, backend="aot_eager")(c0, w, xs), f(c0, w, xs))


@pytest.mark.parametrize("name", list(REFUSED))
def test_derivative_in_other_bodies_differentiated_is_refused(name):
    f, op = REFUSED[name]
    c0, w, xs = _inputs()
    with pytest.raises(JitError) as info:
        tfun.jit(tfun.grad(f), backend="aot_eager")(c0, w, xs)
    msg = str(info.value)
    assert msg.startswith(op + ":"), msg
    assert "tfun refuses rather than return a wrong gradient" in msg
    assert "test_jit_grad_in_body.py" in msg  # the user's function, file:line
    wp = w.clone().requires_grad_(True)
    with pytest.raises(JitError, match="reverse-mode derivative"):
        tfun.jit(f, backend="aot_eager")(c0, wp, xs).backward()


def test_the_map_rewrite_the_error_suggests_is_right():
    """map's message says to use tfun.vmap for per-row gradients: that compiles and equals eager."""

    def vmapped(c0, w, xs):
        gs = tfun.vmap(lambda c: tfun.grad(_energy)(c, w))(c0[None] * xs[:, None])
        return (gs**2).sum()

    c0, w, xs = _inputs()
    ref = tfun.grad(map_grad)(c0, w, xs)
    _close(tfun.grad(vmapped)(c0, w, xs), ref)
    _close(tfun.jit(tfun.grad(vmapped), backend="aot_eager")(c0, w, xs), ref)


@pytest.mark.parametrize("hop", ["cond", "map"])
def test_torch_cond_and_map_backward_of_a_func_grad_body_is_wrong(hop):
    """Why cond and map refuse: torch alone (no tfun), a torch.func.grad inside the branch or
    the mapped function, compiled, differentiated. If a torch release fixes it this fails, and
    the refusal can be lifted for that release (through tfun._compat)."""
    from torch._higher_order_ops.map import map as torch_map

    def energy(c):
        return (c**4).sum()

    c0 = torch.tensor([0.5, -0.3, 0.7], dtype=D, requires_grad=True)
    if hop == "cond":

        def f(c0):
            c = torch.cond(c0.sum() > 0, lambda c: c - 0.1 * torch.func.grad(energy)(c), lambda c: c * 2.0, (c0,))
            return (c**2).sum()

        def ref(c0):
            return ((c0 - 0.1 * torch.func.grad(energy)(c0)) ** 2).sum()

    else:
        scale = torch.linspace(0.5, 1, 4, dtype=D)[:, None]

        def f(c0):
            return (torch_map(lambda c: torch.func.grad(energy)(c), c0[None] * scale) ** 2).sum()

        def ref(c0):
            return (torch.stack([torch.func.grad(energy)(c) for c in c0[None] * scale]) ** 2).sum()

    (expected,) = torch.autograd.grad(ref(c0), c0)
    (got,) = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(c0), c0)
    assert not torch.allclose(got, expected)


def _scan_intermediates_fixed() -> bool:
    """Whether tfun's fix of the intermediates torch's scan autograd saves is installed
    (`_compat.scan_autograd_fixes`, fix 3: it needs `ScanAutogradImpl._optimize_forward_intermediates`)."""
    from torch._higher_order_ops import scan as scan_mod

    impl = getattr(scan_mod, "ScanAutogradImpl", None)
    return impl is not None and hasattr(impl, "_optimize_forward_intermediates")


def ys_is_gradient(c0, w, xs):
    _, gs = lax.scan(lambda c, x: (c * x, tfun.grad(_energy)(c, w)), c0, xs)
    return (gs**2).sum()


def map_as_scan(c0, w, xs):
    _, gs = lax.scan(lambda c, x: (c, tfun.grad(_energy)(x, w)), None, c0[None] * xs[:, None])
    return (gs**2).sum()


def nested_scans(c0, w, xs):
    def outer(c, x):
        def inner(c, _):
            return c - 0.05 * x * tfun.grad(_energy)(c, w), None

        c, _ = lax.scan(inner, c, None, length=2)
        return c, c.sum()

    _, ys = lax.scan(outer, c0, xs)
    return ys.sum()


@pytest.mark.parametrize("f", [ys_is_gradient, map_as_scan, nested_scans], ids=lambda f: f.__name__)
def test_saved_intermediates_that_alias(f):
    """Bodies whose partitioned forward saves one tensor twice: the gradient returned as a
    per-step output (`W` saved as `W.t()` and `zeros_like(W)`), a scan nested in a scan body
    (the inner seed saved twice). torch's scan refused both ("scan might be aliasing the input
    or the output") until tfun's fix 3 saved them once or as copies; without that fix (a torch
    whose scan autograd lacks the hook) a JitError, never a wrong value."""
    c0, w, xs = _inputs()
    _close(tfun.jit(f, backend="aot_eager")(c0, w, xs), f(c0, w, xs))
    ref = tfun.grad(f, argnums=(0, 1))(c0, w, xs)
    try:
        got = tfun.jit(tfun.grad(f, argnums=(0, 1)), backend="aot_eager")(c0, w, xs)
    except JitError as e:
        assert not _scan_intermediates_fixed(), str(e)
        assert "could not compile" in str(e)
        return
    for a, b in zip(got, ref):
        _close(a, b)


@pytest.mark.parametrize("op", ["cond", "map"])
def test_a_derivative_in_a_body_inside_a_scan_whose_init_needs_no_grad_is_refused(op):
    """The cond (or map) sits in a scan body whose carry starts as `torch.zeros`: traced, the
    carry does not require grad, though the scan's autograd differentiates it from the second
    step on. The refusal used to be skipped there and the gradient was wrong (off by 3e4,
    hunt 22); the scan now lowers again with its carry requiring grad, and the refusal holds."""
    inner = lambda z: (z**3).sum()

    def f(x):
        def step(c, xt):
            if op == "cond":
                c2 = lax.cond(c.sum() > -100, lambda c: c + tfun.grad(inner)(c), lambda c: c * 1.0, c)
            else:
                c2 = lax.map(lambda r: r + tfun.grad(inner)(r), c[None])[0]
            return c2 * 0.5 + xt, c2.sum()

        return lax.scan(step, torch.zeros(3, dtype=x.dtype), x)

    x = torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(0)) * 0.1
    with pytest.raises(JitError, match="reverse-mode derivative"):
        out = tfun.jit(f, backend="aot_eager")(x.clone().requires_grad_())
    # forward only (nothing requires grad), it compiles and equals eager
    torch._dynamo.reset()
    got = tfun.jit(f, backend="aot_eager")(x)
    want = f(x)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_a_cond_whose_branches_both_read_the_differentiated_tensor_in_a_scan_body():
    """Both branches of a cond in a scan body read `w`, which tfun.grad differentiates under
    tfun.jit: torch.cond's tracing names two inputs of a branch graph alike and fails with a
    SyntaxError (torch 2.13, hunt 23). The JitError says so and what to write instead; the
    rewrite it suggests (the product computed before the cond) compiles and equals eager
    float64."""
    g = torch.Generator().manual_seed(4)
    W, XS = torch.randn(3, 3, generator=g) * 0.5, torch.randn(4, 3, generator=g)

    def both(w, xs):
        step = lambda h, x: (tfun.lax.cond(x.sum() > 0, lambda a: torch.sin(a @ w), lambda a: torch.cos(a @ w), h + x), None)
        return tfun.lax.scan(step, torch.zeros(3, dtype=w.dtype), xs)[0].sum()

    def before(w, xs):
        step = lambda h, x: (tfun.lax.cond(x.sum() > 0, torch.sin, torch.cos, (h + x) @ w), None)
        return tfun.lax.scan(step, torch.zeros(3, dtype=w.dtype), xs)[0].sum()

    torch._dynamo.reset()
    try:
        got = tfun.jit(tfun.grad(both), backend="aot_eager")(W, XS)
    except JitError as e:
        assert "same name" in str(e) and "before the cond" in str(e)
    else:  # a torch that names them apart: then it must be right
        torch.testing.assert_close(got.double(), tfun.grad(both)(W.double(), XS.double()), rtol=1e-5, atol=1e-5)
    got = tfun.jit(tfun.grad(before), backend="aot_eager")(W, XS)
    torch.testing.assert_close(got.double(), tfun.grad(before)(W.double(), XS.double()), rtol=1e-5, atol=1e-5)


def test_a_cond_returning_two_integer_outputs_in_a_differentiated_scan_body():
    """A cond in a differentiated scan body whose branches return a float and two integer
    outputs (hunt 24): torch's autograd gives the two integer outputs (float bits across the
    cond) one `zeros` cotangent, which the backward cond takes twice and refuses as aliasing.
    The JitError says so, not that the user's inputs share memory; the rewrite it suggests
    (the integers stacked into one output) compiles and gives float64 eager's gradients."""
    g = torch.Generator().manual_seed(6)
    W, XS, H0 = torch.randn(4, 4, generator=g) * 0.4, torch.randn(7, 4, generator=g), torch.randn(4, generator=g)

    def two(w, xs, h0):
        t = lambda h: (torch.sin(h @ w), h.argmax(), h.argmax() + 1)
        e = lambda h: (h * 2, h.argmin(), h.argmin() + 1)

        def step(h, x):
            out = lax.cond(x.sum() > 0, t, e, h)
            return out[0] + x, out[1:]

        h, (i, j) = lax.scan(step, h0, xs)
        return h.sum(), (i, j)

    def stacked(w, xs, h0):
        t = lambda h: (torch.sin(h @ w), torch.stack([h.argmax(), h.argmax() + 1]))
        e = lambda h: (h * 2, torch.stack([h.argmin(), h.argmin() + 1]))

        def step(h, x):
            out, ij = lax.cond(x.sum() > 0, t, e, h)
            return out + x, ij

        h, ij = lax.scan(step, h0, xs)
        return h.sum(), (ij[:, 0], ij[:, 1])

    torch._dynamo.reset()
    try:
        got = tfun.jit(tfun.grad(two, argnums=(0, 1, 2), has_aux=True), backend="aot_eager")(W, XS, H0)
    except JitError as e:
        assert "one zero cotangent" in str(e) and "share memory" not in str(e) and "torch.stack" in str(e)
    else:  # a torch that keeps the cotangents apart: then it must be right
        want = tfun.grad(two, argnums=(0, 1, 2), has_aux=True)(W.double(), XS.double(), H0.double())
        torch.testing.assert_close(got[0], tuple(w.float() for w in want[0]), rtol=1e-5, atol=1e-5)
    got, (i, j) = tfun.jit(tfun.grad(stacked, argnums=(0, 1, 2), has_aux=True), backend="aot_eager")(W, XS, H0)
    want, (wi, wj) = tfun.grad(two, argnums=(0, 1, 2), has_aux=True)(W.double(), XS.double(), H0.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    assert torch.equal(i, wi) and torch.equal(j, wj)
