"""tfun.checkpoint / remat: gradients, closures, policies, torch.func composition."""

from __future__ import annotations

import pytest
import torch

import tfun
from tfun.errors import ArgumentTypeError

D = torch.float64


def t(*shape, seed=0, grad=False):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)
    return x.requires_grad_(grad)


W = t(4, 4, seed=7)


def body(x):
    return torch.tanh(torch.sin(x) @ W).sum(-1)


@pytest.mark.parametrize(
    "policy", [None, tfun.checkpoint_policies.nothing_saveable, tfun.checkpoint_policies.dots_saveable,
               tfun.checkpoint_policies.dots_with_no_batch_dims_saveable, tfun.checkpoint_policies.everything_saveable]
)
def test_backward_matches_and_gradcheck(policy):
    x = t(3, 4, grad=True)
    ref = torch.autograd.grad(body(x).sum(), x)[0]
    got = torch.autograd.grad(tfun.checkpoint(body, policy=policy)(x).sum(), x)[0]
    assert torch.allclose(got, ref)
    assert torch.autograd.gradcheck(tfun.checkpoint(body, policy=policy), (x,))


def test_closure_over_linear_receives_gradients():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).double()
    x = t(3, 4, grad=True)
    f = lambda v: torch.relu(lin(v)).pow(2).sum()
    ref = torch.autograd.grad(f(x), [x, lin.weight, lin.bias])
    got = torch.autograd.grad(tfun.checkpoint(f)(x), [x, lin.weight, lin.bias])
    for a, b in zip(got, ref):
        assert torch.allclose(a, b)
    lin.zero_grad()
    tfun.remat(f)(x).backward()
    assert torch.allclose(lin.weight.grad, ref[1]) and torch.allclose(lin.bias.grad, ref[2])


def test_under_torch_func_grad_and_vmap():
    x = t(3, 4)
    ref = tfun.grad(lambda v: body(v).sum())(x)
    assert torch.allclose(tfun.grad(lambda v: tfun.checkpoint(body)(v).sum())(x), ref)
    assert torch.allclose(torch.func.grad(lambda v: tfun.checkpoint(body)(v).sum())(x), ref)
    assert torch.allclose(tfun.vmap(tfun.grad(lambda v: tfun.checkpoint(body)(v).sum()))(x), ref)
    assert torch.allclose(tfun.grad(lambda v: tfun.vmap(tfun.checkpoint(body))(v).sum())(x), ref)
    pol = tfun.checkpoint_policies.dots_saveable
    assert torch.allclose(tfun.grad(lambda v: tfun.checkpoint(body, policy=pol)(v).sum())(x), ref)
    s = torch.tensor(0.7, dtype=D)
    gg = tfun.grad(tfun.grad(lambda z: tfun.checkpoint(lambda u: u.sin())(z * z)))(s)
    assert torch.allclose(gg, tfun.grad(tfun.grad(lambda z: (z * z).sin()))(s))


def test_closure_captured_from_enclosing_transform():
    x, w0 = t(4), t(4, seed=1)

    def outer(w):
        return tfun.checkpoint(lambda v: (v * w).sin().sum())(x)

    assert torch.allclose(tfun.grad(outer)(w0), x * torch.cos(x * w0))
    lin = torch.nn.Linear(4, 2).double()
    params = dict(lin.named_parameters())
    loss = lambda p, v: torch.func.functional_call(lin, p, (v,)).tanh().sum()
    g1 = tfun.grad(loss)(params, x)
    g2 = tfun.grad(lambda p, v: tfun.checkpoint(loss)(p, v))(params, x)
    assert all(torch.allclose(g1[k], g2[k]) for k in g1)


def test_pytrees_static_argnums_and_no_grad_path():
    def f(d, n):
        return {"y": d["a"] * n, "n": n}

    x = t(3, grad=True)
    out = tfun.checkpoint(f, static_argnums=(1,))({"a": x}, 3)
    assert out["n"] == 3
    out["y"].sum().backward()
    assert torch.allclose(x.grad, torch.full((3,), 3.0, dtype=D))
    with torch.no_grad():
        assert not tfun.checkpoint(body)(t(2, 4, grad=True)).requires_grad


def saved_storages(fn):
    ptrs = set()

    def pack(x):
        ptrs.add(x.untyped_storage().data_ptr())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return ptrs


def test_saves_only_inputs_and_closed_over_tensors():
    # what is kept is part of checkpoint's contract; the byte counts are in benchmarks/memory.py
    x = t(8, 16, grad=True)
    mats = [t(16, 16, seed=i) for i in range(3)]

    def wide(v):
        for m in mats:
            v = torch.tanh(v @ m)
        return v.sum()

    allowed = {a.untyped_storage().data_ptr() for a in [x, *mats]}
    assert saved_storages(lambda: tfun.checkpoint(wide)(x)) <= allowed
    assert not saved_storages(lambda: wide(x)) <= allowed
    dots = saved_storages(lambda: tfun.checkpoint(wide, policy=tfun.checkpoint_policies.dots_saveable)(x))
    assert len(dots - allowed) == 3  # the three matmul outputs


def test_policy_validation():
    with pytest.raises(ArgumentTypeError, match="policy must be None or a callable"):
        tfun.checkpoint(body, policy="dots")


def test_checkpoint_forward_mode_jvp_jacfwd_hessian():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3).double()
    plain = lambda x: torch.sin(lin(x)) * 2  # noqa: E731
    ck = tfun.checkpoint(plain)
    x = torch.randn(3, dtype=torch.float64)
    t = torch.randn(3, dtype=torch.float64)
    out, tan = tfun.jvp(ck, (x,), (t,))
    ref_out, ref_tan = torch.func.jvp(plain, (x,), (t,))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(tan, ref_tan)
    torch.testing.assert_close(tfun.jacfwd(ck)(x), torch.func.jacrev(plain)(x))
    torch.testing.assert_close(
        tfun.hessian(lambda v: ck(v).sum())(x), torch.func.hessian(lambda v: plain(v).sum())(x)
    )


# ---------------------------------------------------------------- randomness (dropout) inside


X_DROP = t(1000, seed=3)
W_DROP = t(1000, seed=4)


def dropped(x, w):
    return (torch.nn.functional.dropout(torch.tanh(x * w), p=0.5, training=True) * w).sum()


def _seeded(fn, *args):
    torch.manual_seed(1234)
    out = fn(*args)
    after = torch.rand(3)  # the generator must be left where the un-checkpointed run leaves it
    return out, after


def _backward_grad(f):
    def run(x, w):
        w = w.clone().requires_grad_()
        f(x, w).backward()
        return w.grad

    return run


@pytest.mark.parametrize("policy", [None, tfun.checkpoint_policies.dots_saveable])
@pytest.mark.parametrize(
    "how",
    ["backward", "tfun.grad", "torch.func.grad", "tfun.jvp"],
)
def test_dropout_inside_checkpoint_gives_the_uncheckpointed_gradients(how, policy):
    # (jacrev/jacfwd/hessian vmap over the function, and torch.func.vmap refuses random ops)
    ck = tfun.checkpoint(dropped, policy=policy)
    x, w = X_DROP, W_DROP
    transforms = {
        "backward": _backward_grad,
        "tfun.grad": lambda f: tfun.grad(f, argnums=1),
        "torch.func.grad": lambda f: torch.func.grad(f, argnums=1),
        "tfun.jvp": lambda f: lambda x, w: tfun.jvp(lambda v: f(x, v), (w,), (torch.ones_like(w),))[1],
    }
    ref, ref_after = _seeded(transforms[how](dropped), x, w)
    got, got_after = _seeded(transforms[how](ck), x, w)
    # (a different mask would differ by O(1) in about half the entries; allow only rounding)
    torch.testing.assert_close(got, ref, rtol=1e-13, atol=1e-13)
    assert torch.equal(got_after, ref_after)
    # the mask is random: about half the entries are dropped, so a fresh mask would differ
    if how in ("backward", "tfun.grad", "torch.func.grad"):
        assert 300 < int((ref == 0).sum()) < 700


def test_dropout_inside_checkpoint_without_preserving_rng_state_differs():
    # preserve_rng_state=False recomputes with the generator where it is: a different mask
    ck = tfun.checkpoint(dropped, preserve_rng_state=False)
    ref, _ = _seeded(_backward_grad(dropped), X_DROP, W_DROP)
    got, _ = _seeded(_backward_grad(ck), X_DROP, W_DROP)
    assert not torch.equal(got, ref)
    with pytest.raises(ArgumentTypeError) as e:
        tfun.checkpoint(dropped, preserve_rng_state=1)
    assert str(e.value).splitlines()[0] == "tfun.checkpoint: preserve_rng_state must be a bool, got a int leaf (1)."


def test_dropout_inside_a_checkpointed_scan_body():
    xs = t(6, 50, seed=5)

    def loss(w, h0, ck):
        def body(h, x):
            h = torch.nn.functional.dropout(torch.tanh(h * w + x), p=0.3, training=True)
            return h, h.sum()

        step = tfun.checkpoint(body) if ck else body
        return tfun.lax.scan(step, h0, xs)[1].sum()

    w, h0 = t(50, seed=6), t(50, seed=8)
    for grad in (tfun.grad, lambda f: torch.func.grad(f)):
        ref, ref_after = _seeded(grad(loss), w, h0, False)
        got, got_after = _seeded(grad(loss), w, h0, True)
        torch.testing.assert_close(got, ref, rtol=1e-13, atol=1e-13)
        assert torch.equal(got_after, ref_after)
    wr = w.clone().requires_grad_()
    torch.manual_seed(7)
    loss(wr, h0, False).backward()
    ref = wr.grad
    wr.grad = None
    torch.manual_seed(7)
    loss(wr, h0, True).backward()
    torch.testing.assert_close(wr.grad, ref, rtol=1e-13, atol=1e-13)


def test_dropout_inside_nested_checkpoints():
    inner = tfun.checkpoint(lambda x, w: torch.nn.functional.dropout(torch.tanh(x * w), 0.5, True) * w)

    def outer(x, w):
        return (torch.nn.functional.dropout(inner(x, w), 0.3, True) * w).sum()

    def plain(x, w):
        h = torch.nn.functional.dropout(torch.tanh(x * w), 0.5, True) * w
        return (torch.nn.functional.dropout(h, 0.3, True) * w).sum()

    ref, ref_after = _seeded(_backward_grad(plain), X_DROP, W_DROP)
    for f in (outer, tfun.checkpoint(outer)):
        got, got_after = _seeded(_backward_grad(f), X_DROP, W_DROP)
        torch.testing.assert_close(got, ref, rtol=1e-13, atol=1e-13)
        assert torch.equal(got_after, ref_after)


def test_nested_checkpoints_under_torch_func_and_tfun_grad():
    # A checkpoint inside a checkpointed function used to hit a torch internal assert under
    # torch.func.grad / tfun.grad (its backward ran after the outer recomputation's level
    # was gone).
    x, w = t(5, seed=1), t(5, seed=2)
    inner = tfun.checkpoint(lambda x, w: torch.tanh(x * w) * w)
    nested = tfun.checkpoint(lambda x, w: (torch.sin(inner(x, w)) * w).sum())
    plain = lambda x, w: (torch.sin(torch.tanh(x * w) * w) * w).sum()  # noqa: E731
    for grad in (tfun.grad, torch.func.grad):
        got = grad(nested, argnums=(0, 1))(x, w)
        ref = grad(plain, argnums=(0, 1))(x, w)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    hess = tfun.hessian(nested, argnums=1)(x, w)
    torch.testing.assert_close(hess, tfun.hessian(plain, argnums=1)(x, w), rtol=1e-12, atol=1e-12)


def test_complex_values_through_checkpoint():
    z = torch.randn(3, dtype=torch.complex128, generator=torch.Generator().manual_seed(0))
    f = lambda u: torch.sin(u) * u  # noqa: E731
    loss = lambda g: lambda z: torch.abs(g(z)).sum()  # noqa: E731
    torch.testing.assert_close(tfun.grad(loss(tfun.checkpoint(f)))(z), tfun.grad(loss(f))(z))
    zr = z.clone().requires_grad_()
    loss(tfun.checkpoint(f))(zr).backward()
    zp = z.clone().requires_grad_()
    loss(f)(zp).backward()
    torch.testing.assert_close(zr.grad, zp.grad)


def test_checkpoint_forward_over_forward():
    # jvp of jvp through checkpoint: the second-order tangent was silently zero
    x, t = torch.tensor(0.7, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    f = tfun.checkpoint(torch.sin)
    _, second = tfun.jvp(lambda x: tfun.jvp(f, (x,), (t,))[1], (x,), (t,))
    assert torch.allclose(second, -torch.sin(x))
    g = tfun.checkpoint(lambda x: tfun.lax.scan(lambda c, _: (torch.sin(c), None), x, None, length=2)[0])
    g0 = lambda x: tfun.lax.scan(lambda c, _: (torch.sin(c), None), x, None, length=2)[0]
    want = tfun.jvp(lambda x: tfun.jvp(g0, (x,), (t,))[1], (x,), (t,))[1]
    assert torch.allclose(tfun.jvp(lambda x: tfun.jvp(g, (x,), (t,))[1], (x,), (t,))[1], want)
    assert torch.allclose(tfun.jacfwd(tfun.grad(f))(x), -torch.sin(x))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_jit_function_called_inside_an_eager_checkpoint(backend):
    # the checkpoint's op-numbering mode must see the jitted function's ops: it runs eagerly
    # there (torch 2.11's Dynamo failed its own guard on the mode's counter); gradients equal
    # those of the plain function, on the first call and the cached ones
    mul = tfun.jit(lambda a, b: a * torch.sin(b), backend=backend)

    def f(w, x):
        a = mul(w, x)
        return (mul(a, a) * w).sum()

    def ref(w, x):
        a = w * torch.sin(x)
        return (a * torch.sin(a) * w).sum()

    for k in range(3):
        w, x = t(4, seed=k), t(4, seed=10 + k)
        got = tfun.grad(tfun.checkpoint(f), argnums=(0, 1))(w, x)
        want = tfun.grad(ref, argnums=(0, 1))(w, x)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_jax_older_policy_names():
    pol = tfun.checkpoint_policies
    assert pol.checkpoint_dots is pol.dots_saveable
    assert pol.checkpoint_dots_with_no_batch_dims is pol.dots_with_no_batch_dims_saveable
    a = torch.ones(2, 2)
    assert pol.checkpoint_dots(torch.matmul, a, a) and not pol.checkpoint_dots(torch.sin, a)
    assert not pol.checkpoint_dots_with_no_batch_dims(torch.bmm, torch.ones(1, 2, 2), torch.ones(1, 2, 2))


@pytest.mark.parametrize("kind", ["custom_vjp", "custom_jvp"])
def test_policy_with_a_custom_function_inside(kind):
    # the saving run calls the custom function itself (no gradients), the recomputation its
    # autograd.Function: the op numbering must agree, or a saved matrix product is replayed
    # in place of another op (a crash, or a wrong gradient for same-shaped products)
    if kind == "custom_vjp":
        mm = tfun.custom_vjp(lambda a, b: a @ b)
        mm.defvjp(lambda a, b: (mm(a, b), (a, b)), lambda r, g: (g @ r[1].mT, r[0].mT @ g))
    else:
        mm = tfun.custom_jvp(lambda a, b: a @ b)
        mm.defjvp(lambda p, t: (mm(*p), t[0] @ p[1] + p[0] @ t[1]))

    def f(x, w):
        h = mm(x, w)  # a product inside the custom function
        return torch.sin(x @ torch.sin(h)).sum()  # and a plain one of the same shape

    x, w = t(3, 3, seed=1), t(3, 3, seed=2)
    want = tfun.grad(f, argnums=(0, 1))(x, w)
    for policy in [tfun.checkpoint_policies.dots_saveable, lambda *_, **__: True]:
        g = tfun.checkpoint(f, policy=policy)
        torch.testing.assert_close(tfun.grad(g, argnums=(0, 1))(x, w), want)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        g(xr, wr).backward()
        torch.testing.assert_close((xr.grad, wr.grad), want)


_LAX_BEFORE_PRODUCTS = {
    "while_loop_int_counter": lambda W, x: tfun.lax.while_loop(
        lambda c: c[0] < 3, lambda c: (c[0] + 1, torch.tanh(c[1] @ W)), (torch.tensor(0), x)
    )[1],
    "while_loop": lambda W, x: tfun.lax.while_loop(lambda h: h.abs().sum() > 0.5, lambda h: torch.tanh(h @ W) * 0.8, x),
    "fori_loop_static": lambda W, x: tfun.lax.fori_loop(0, 3, lambda i, h: torch.tanh(h @ W), x),
    "fori_loop_tensor": lambda W, x: tfun.lax.fori_loop(torch.tensor(0), torch.tensor(3), lambda i, h: torch.tanh(h @ W), x),
    "switch": lambda W, x: tfun.lax.switch(1, [lambda a: a @ W, lambda a: torch.tanh(a @ W) @ W], x),
    "cond": lambda W, x: tfun.lax.cond(x.sum() > 0, lambda a: a @ W, lambda a: torch.tanh(a @ W) @ W, x),
    "scan": lambda W, x: tfun.lax.scan(lambda h, r: (torch.tanh(h @ W + r), h), x[0], x)[1],
    "map": lambda W, x: tfun.lax.map(lambda r: torch.tanh(r @ W), x),
}


@pytest.mark.parametrize("first", list(_LAX_BEFORE_PRODUCTS))
@pytest.mark.parametrize(
    "policy",
    [tfun.checkpoint_policies.dots_saveable, tfun.checkpoint_policies.dots_with_no_batch_dims_saveable],
    ids=["dots", "dots_no_batch"],
)
def test_a_policy_replays_the_right_products_after_a_lax_ops_first_call(first, policy, monkeypatch):
    """A saving policy around a tfun.lax op followed by matrix products, on the op's first
    call with its signature and on the next (hunt 24): the saving run numbered every torch
    call, and a first call's rule checks (property reads, a switch's other branch on fake
    tensors) ran only there, so a saved product stood in for another op in the
    recomputation: wrong gradients (while_loop, switch: relative error 1.5, no error), a
    fake tensor as a gradient, or an IndexError. Values and gradients against float64
    eager, with saved products replayed (counted)."""
    import tfun._rules
    from tfun import _checkpoint

    replayed = []
    real_replay = _checkpoint._replay
    monkeypatch.setattr(_checkpoint, "_replay", lambda *a: replayed.append(1) or real_replay(*a))
    block = lambda W, x: torch.sin(_LAX_BEFORE_PRODUCTS[first](W, x) @ W) @ W
    g = torch.Generator().manual_seed(8)
    W64, x64 = torch.randn(4, 4, dtype=torch.float64, generator=g) * 0.5, torch.randn(3, 4, dtype=torch.float64, generator=g)

    def grads(f, W, x):
        W, x = W.clone().requires_grad_(), x.clone().requires_grad_()
        out = f(W, x)
        return (out,) + torch.autograd.grad((out * out).sum(), (W, x))

    want = grads(block, W64, x64)
    tfun._rules.clear_cache()  # the loop's first call with this signature, as in a fresh process
    f = tfun.checkpoint(block, policy=policy)
    for _ in ("first call", "second call"):
        replayed.clear()
        for got, w in zip(grads(f, W64.float(), x64.float()), want):
            assert type(got) is torch.Tensor
            torch.testing.assert_close(got.double(), w, rtol=1e-4, atol=1e-4)
        assert replayed, "the policy saved no product to replay: the test would prove nothing"


_VMAP_INSIDE = {
    "tfun.vmap, W closed over": lambda x, W: tfun.vmap(lambda r: torch.tanh(r @ W))(x).sum(),
    "tfun.vmap, W unbatched": lambda x, W: tfun.vmap(lambda r, W: torch.tanh(r @ W), in_axes=(0, None))(x, W).sum(),
    "map batch_size=4": lambda x, W: tfun.lax.map(lambda r: torch.tanh(r @ W), x, batch_size=4).sum(),
    "map batch_size=1": lambda x, W: tfun.lax.map(lambda r: torch.tanh(r @ W), x, batch_size=1).sum(),
}


@pytest.mark.parametrize("policy", [None, "dots_saveable", "nothing_saveable"])
@pytest.mark.parametrize("case", sorted(_VMAP_INSIDE))
def test_a_vmap_inside_the_checkpointed_function(case, policy):
    """Hunt 25, finding 1: the discovery run took vmap's batched views of the inputs, which no
    torch function the mode sees creates, for tensors read from outside, and the backward
    passed them to torch.func after their level was gone: torch's raw "batched == nullptr
    INTERNAL ASSERT FAILED" on every backward."""
    f = _VMAP_INSIDE[case]
    g = torch.Generator().manual_seed(0)
    W = torch.randn(4, 4, dtype=torch.float64, generator=g, requires_grad=True)
    x = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    want = torch.autograd.grad(f(x, W), (x, W))
    pol = None if policy is None else getattr(tfun.checkpoint_policies, policy)
    ck = tfun.checkpoint(f, policy=pol)
    for got, w in zip(torch.autograd.grad(ck(x, W), (x, W)), want):
        torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)
    for got, w in zip(tfun.grad(ck, argnums=(0, 1))(x, W), want):  # and through tfun.grad
        torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)


def test_a_policy_around_a_jvp_inside_the_function():
    """Hunt 25, finding 5a: with a saving policy, a product under a `tfun.jvp` inside the
    checkpointed function was replayed by an autograd.Function without a forward-mode rule
    (raw NotImplementedError on backward); it is computed instead, with the same values."""
    g = torch.Generator().manual_seed(10)
    W = torch.randn(4, 4, dtype=torch.float64, generator=g, requires_grad=True)
    x = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    inner = lambda x, W: (torch.tanh(x @ W) ** 2).sum()  # noqa: E731
    f = lambda x, W: tfun.jvp(lambda x: inner(x, W), (x,), (torch.ones_like(x),))[1] ** 2  # noqa: E731
    want = torch.autograd.grad(f(x, W), (x, W))
    for policy in (tfun.checkpoint_policies.dots_saveable, tfun.checkpoint_policies.dots_with_no_batch_dims_saveable):
        got = torch.autograd.grad(tfun.checkpoint(f, policy=policy)(x, W), (x, W))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_torch_autograd_inside_the_function_is_a_tfun_error_that_says_what_works():
    """Hunt 25, finding 5b: a gradient penalty with `torch.autograd.grad(..., create_graph=True)`
    inside the checkpointed function raised torch's "element 0 of tensors does not require grad"
    (tfun.checkpoint's first run is without autograd). Now a tfun error; the tfun.grad it
    suggests is right."""
    from tfun.errors import ArgumentValueError

    g = torch.Generator().manual_seed(11)
    W = torch.randn(4, 4, dtype=torch.float64, generator=g, requires_grad=True)
    x = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    inner = lambda x, W: (torch.tanh(x @ W) ** 2).sum()  # noqa: E731
    with pytest.raises(ArgumentValueError, match=r"^tfun\.checkpoint: the checkpointed function differentiates with torch\.autograd") as info:
        tfun.checkpoint(lambda x, W: (torch.autograd.grad(inner(x, W), x, create_graph=True)[0] ** 2).sum())(x, W)
    assert "test_checkpoint.py" in str(info.value) and "tfun.grad" in str(info.value)
    f = lambda x, W: (tfun.grad(inner)(x, W) ** 2).sum()  # noqa: E731
    want = torch.autograd.grad(f(x, W), (x, W))
    for a, b in zip(torch.autograd.grad(tfun.checkpoint(f)(x, W), (x, W)), want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("policy", [None, "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable"])
@pytest.mark.parametrize("how", ["tfun.grad", ".backward()", "per-example tfun.vmap(tfun.grad)"])
def test_reverse_mode_around_a_vmap_of_a_checkpoint_with_a_policy(policy, how):
    """Hunt 31, finding 2: a gradient taken around `tfun.vmap` of a checkpoint with a saving
    policy raised torch's "flat_bdims must not be None" (the saved products left the Function
    as outputs whose cotangents the generated batching rule cannot take). Under a vmap the
    policy is not applied (everything recomputed): the same gradients as without it."""
    pol = None if policy is None else getattr(tfun.checkpoint_policies, policy)
    W0, xb = t(3, 3, seed=6) * 0.5, t(4, 5, 3, seed=7)
    plain = lambda W, x: (torch.tanh(x @ W) @ W).sum()
    ckpt = lambda W, x: tfun.checkpoint(lambda h: torch.tanh(h @ W) @ W, policy=pol)(x).sum()
    if how == "per-example tfun.vmap(tfun.grad)":
        want = torch.stack([torch.func.grad(plain)(W0, x) for x in xb])
        got = tfun.vmap(tfun.grad(ckpt), in_axes=(None, 0))(W0, xb)
    else:
        want = torch.func.grad(lambda W: sum(plain(W, x) for x in xb))(W0)
        loss = lambda W: tfun.vmap(ckpt, in_axes=(None, 0))(W, xb).sum()
        if how == "tfun.grad":
            got = tfun.grad(loss)(W0)
        else:
            Wr = W0.clone().requires_grad_()
            loss(Wr).backward()
            got = Wr.grad
    torch.testing.assert_close(got, want)


def _under_autocast_then_backward(g, W0, x0):
    """The usual mixed-precision step: the forward under `torch.autocast`, `.backward()` after it."""
    W, x = W0.clone().requires_grad_(), x0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = g(W, x)
    (out.float() ** 2).sum().backward()
    return out, W.grad, x.grad


@pytest.mark.parametrize("policy", [None, "dots_saveable", "nothing_saveable"])
def test_the_recompute_runs_under_the_forwards_autocast_state(policy):
    """Hunt 33 (F3): `.backward()` after a `torch.autocast` block recomputed the checkpointed
    function in float32, so the gradients were those of another function: silently off by a
    bfloat16 rounding, or of the other branch where a `cond`'s predicate lies between its
    bfloat16 and float32 values; with `dots_saveable`, torch's "expected m1 and m2 to have the
    same dtype" (a saved bfloat16 product replayed into a float32 recompute). Against the same
    step without a checkpoint."""
    g = torch.Generator().manual_seed(0)
    W0, x0 = torch.randn(16, 16, generator=g), torch.randn(4, 16, generator=g)
    s32 = (x0 @ W0).sum().item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s16 = (x0 @ W0).sum().float().item()
    assert s16 != s32
    c = (s32 + s16) / 2  # between the float32 and the bfloat16 value of the predicate

    def f(W, x):
        h = tfun.lax.cond((x @ W).sum() > c, lambda v: 3.0 * v, lambda v: -v, x @ W)
        return torch.tanh(h) @ W

    pol = None if policy is None else getattr(tfun.checkpoint_policies, policy)
    want_out, want_gW, want_gx = _under_autocast_then_backward(f, W0, x0)
    out, gW, gx = _under_autocast_then_backward(tfun.checkpoint(f, policy=pol), W0, x0)
    assert out.dtype == want_out.dtype == torch.bfloat16 and gW.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    # the replayed product's closed-form gradient rounds differently from matmul's backward
    tol = dict(rtol=0, atol=0) if policy != "dots_saveable" else dict(rtol=2e-2, atol=2e-2 * float(want_gW.abs().max()))
    torch.testing.assert_close(gW, want_gW, **tol)
    tol = dict(rtol=0, atol=0) if policy != "dots_saveable" else dict(rtol=2e-2, atol=2e-2 * float(want_gx.abs().max()))
    torch.testing.assert_close(gx, want_gx, **tol)


@pytest.mark.parametrize("policy", [None, "dots_saveable", "nothing_saveable"])
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
def test_under_jit_a_checkpoint_under_autocast_gives_the_uncheckpointed_steps_gradients(backend, policy):
    """The jitted step of the test above: `tfun.jit(tfun.checkpoint(f))` under autocast, then
    `.backward()` outside the block, gives what `tfun.jit(f)` gives (the compiled program, not
    eager, is the reference: Inductor keeps a bfloat16 product's sum in float32 without
    rounding, so its predicate may take the other branch than eager's, with or without a
    checkpoint)."""
    g = torch.Generator().manual_seed(0)
    W0, x0 = torch.randn(16, 16, generator=g), torch.randn(4, 16, generator=g)
    s32 = (x0 @ W0).sum().item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s16 = (x0 @ W0).sum().float().item()
    c = (s32 + s16) / 2

    def f(W, x):
        h = tfun.lax.cond((x @ W).sum() > c, lambda v: 3.0 * v, lambda v: -v, x @ W)
        return torch.tanh(h) @ W

    pol = None if policy is None else getattr(tfun.checkpoint_policies, policy)
    torch._dynamo.reset()
    want = _under_autocast_then_backward(tfun.jit(f, backend=backend), W0, x0)
    torch._dynamo.reset()
    got = _under_autocast_then_backward(tfun.jit(tfun.checkpoint(f, policy=pol), backend=backend), W0, x0)
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.bfloat16, torch.float32, torch.float32]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.detach().abs().max()))


def test_autocast_off_in_the_forward_stays_off_in_a_recompute_under_autocast():
    """The other way round: a forward outside autocast, differentiated inside an autocast
    block, recomputes in float32 (the forward's state, not the one the backward meets), and
    gives what the same step without a checkpoint gives (on the CPU the backward's own
    products run under the block's autocast either way)."""
    g = torch.Generator().manual_seed(1)
    W, x = torch.randn(8, 8, generator=g).requires_grad_(), torch.randn(3, 8, generator=g)
    f = lambda W, x: torch.tanh(x @ W) @ W  # noqa: E731
    grads = []
    for h in (f, tfun.checkpoint(f)):
        out = h(W, x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            grads.append(torch.autograd.grad((out**2).sum(), W)[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
