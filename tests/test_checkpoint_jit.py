"""tfun.checkpoint inside tfun.jit: values and gradients against eager float64.

Traced, `tfun.checkpoint` lowers to `torch.utils.checkpoint.checkpoint(use_reentrant=False)`
(Dynamo's `tag_activation_checkpoint` op) with the policy as torch's selective activation
checkpointing. Rematerialization changes memory only, so every jitted result here must equal
the eager, un-checkpointed float64 result.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import tfun
from tfun import lax
from tfun.errors import ArgumentValueError, JitError

D = torch.float64
P = tfun.checkpoint_policies


def t(*shape, seed=0, grad=False):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)
    return x.requires_grad_(grad)


def mm_only(func, *args, **kwargs):
    """A user policy: save the outputs of `torch.mm` only."""
    return func is torch.mm


POLICIES = [
    pytest.param(None, id="default"),
    pytest.param(P.nothing_saveable, id="nothing_saveable"),
    pytest.param(P.everything_saveable, id="everything_saveable"),
    pytest.param(P.dots_saveable, id="dots_saveable"),
    pytest.param(P.dots_with_no_batch_dims_saveable, id="dots_with_no_batch_dims_saveable"),
    pytest.param(mm_only, id="custom"),
]
# Inductor compiles take seconds each on CPU: the default policy and a selective one
BACKEND_POLICY = [pytest.param("aot_eager", p.values[0], id=f"aot_eager-{p.id}") for p in POLICIES] + [
    pytest.param("inductor", None, id="inductor-default"),
    pytest.param("inductor", P.dots_saveable, id="inductor-dots_saveable"),
]


def two_layers(x, w):
    return (torch.sin(torch.sin(x @ w) @ w) * torch.cos(x)).sum()


def grads_of(f, *args):
    """Value and gradients of `f` by eager autograd, for float64 leaves."""
    args = [a.detach().requires_grad_(True) for a in args]
    y = f(*args)
    return y.detach(), torch.autograd.grad(y, args)


@pytest.mark.parametrize("backend, policy", BACKEND_POLICY)
def test_backward_after_jitted_forward(backend, policy):
    w = t(4, 4, seed=1, grad=True)  # closed over: a parameter
    x = t(3, 4, grad=True)
    want_y, (want_x, want_w) = grads_of(two_layers, x, w)

    f = tfun.jit(tfun.checkpoint(lambda x: two_layers(x, w), policy=policy), backend=backend)
    y = f(x)
    y.backward()
    assert_close(y.detach(), want_y)
    assert_close(x.grad, want_x)
    assert_close(w.grad, want_w)


@pytest.mark.parametrize("backend, policy", BACKEND_POLICY)
def test_tfun_grad_inside_jit(backend, policy):
    x, w = t(3, 4), t(4, 4, seed=1)
    _, want = grads_of(two_layers, x, w)
    got = tfun.jit(tfun.grad(tfun.checkpoint(two_layers, policy=policy), argnums=(0, 1)), backend=backend)(x, w)
    assert_close(got, want)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_tfun_grad_inside_jit_closing_over_a_parameter(backend):
    # tfun.grad of a function closing over a tensor that requires grad differentiates with
    # torch.func when traced, where torch refuses checkpoint's saved-tensor hooks: the
    # function runs un-checkpointed in that one graph (same values)
    w = t(4, 4, seed=1, grad=True)
    x = t(3, 4)
    _, (want_x, _) = grads_of(two_layers, x, w)
    got = tfun.jit(tfun.grad(tfun.checkpoint(lambda x: two_layers(x, w), policy=P.dots_saveable)), backend=backend)(x)
    assert_close(got, want_x)


def scan_loss(p, c0, xs, policy=None):
    def step(c, x):
        h = torch.tanh(c @ p + x)
        return h, (h * h).sum()

    body = step if policy == "none" else tfun.checkpoint(step, policy=policy)
    c, ys = lax.scan(body, c0, xs)
    return (c * c).sum() + ys.sum()


@pytest.mark.parametrize("backend, policy", BACKEND_POLICY)
def test_scan_body(backend, policy):
    p, c0, xs = t(4, 4, seed=1) * 0.5, t(2, 4, seed=2), t(5, 2, 4, seed=3)
    want_y, want = grads_of(lambda *a: scan_loss(*a, policy="none"), p, c0, xs)

    # jitted forward, .backward() outside
    args = [a.clone().requires_grad_(True) for a in (p, c0, xs)]
    y = tfun.jit(lambda p, c0, xs: scan_loss(p, c0, xs, policy), backend=backend)(*args)
    y.backward()
    assert_close(y.detach(), want_y)
    assert_close([a.grad for a in args], list(want))

    # tfun.grad inside tfun.jit
    got = tfun.jit(tfun.grad(lambda p, c0, xs: scan_loss(p, c0, xs, policy), argnums=(0, 1, 2)), backend=backend)(
        p, c0, xs
    )
    assert_close(got, want)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_closed_over_module_parameters(backend):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).double()
    ref = torch.nn.Linear(4, 4).double()
    ref.load_state_dict(lin.state_dict())
    x = t(3, 4)

    def block(m, x):
        return torch.tanh(m(torch.tanh(m(x)))).pow(2).sum()

    block(ref, x).backward()
    y = tfun.jit(tfun.checkpoint(lambda x: block(lin, x)), backend=backend)(x)
    y.backward()
    assert_close(y.detach(), block(ref, x).detach())
    for p, q in zip(lin.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad)


def test_pytrees_and_static_argnums():
    def f(d, n, act):
        h = act(d["a"] @ d["b"]) * n
        return {"h": h, "n": n, "pair": (h.sum(), d["a"] * 2)}

    a, b = t(3, 4), t(4, 2, seed=1)
    g = tfun.checkpoint(f, static_argnums=(1, 2))

    def loss(a, b):
        out = g({"a": a, "b": b}, 3, torch.tanh)
        assert out["n"] == 3
        return out["h"].pow(2).sum() + out["pair"][0] + out["pair"][1].sum()

    want_y, want = grads_of(lambda a, b: (f({"a": a, "b": b}, 3, torch.tanh)["h"].pow(2).sum()
                                          + f({"a": a, "b": b}, 3, torch.tanh)["pair"][0]
                                          + (a * 2).sum()), a, b)
    args = [a.clone().requires_grad_(True), b.clone().requires_grad_(True)]
    y = tfun.jit(loss, backend="aot_eager")(*args)
    y.backward()
    assert_close(y.detach(), want_y)
    assert_close([x.grad for x in args], list(want))
    assert_close(tfun.jit(tfun.grad(loss, argnums=(0, 1)), backend="aot_eager")(a, b), want)


def test_no_tensor_arguments_and_prevent_cse():
    x = t(3)
    f = tfun.jit(lambda x: tfun.remat(lambda: torch.sin(x) * 2, prevent_cse=False)(), backend="aot_eager")
    assert_close(f(x), torch.sin(x) * 2)


def test_jvp_and_vmap_inside_jit():
    g = tfun.checkpoint(lambda x: torch.sin(torch.sin(x)))
    x, v = t(5), t(5, seed=1)
    want = tfun.jvp(lambda x: torch.sin(torch.sin(x)), (x,), (v,))
    assert_close(tfun.jit(lambda x, v: tfun.jvp(g, (x,), (v,)), backend="aot_eager")(x, v), want)

    xb = t(3, 5, grad=True)
    y = tfun.jit(tfun.vmap(g), backend="aot_eager")(xb)
    y.sum().backward()
    assert_close(y.detach(), torch.sin(torch.sin(xb.detach())))
    assert_close(xb.grad, torch.cos(torch.sin(xb.detach())) * torch.cos(xb.detach()))


def _recording_backend(graphs):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))


@pytest.mark.parametrize(
    "policy, recomputed",
    [(None, 2), (P.dots_saveable, 0), (P.dots_with_no_batch_dims_saveable, 0), (mm_only, 0), (P.everything_saveable, 0)],
    ids=["default", "dots_saveable", "dots_with_no_batch_dims_saveable", "custom", "everything_saveable"],
)
def test_policy_decides_what_backward_recomputes(policy, recomputed):
    # backward's graph runs 4 products for the gradients plus the forward products it recomputes
    w = t(4, 4, seed=1, grad=True)
    graphs = {}
    f = tfun.jit(tfun.checkpoint(lambda x: two_layers(x, w), policy=policy), backend=_recording_backend(graphs))
    f(t(3, 4, grad=True)).backward()
    mms = sum(1 for n in graphs["bw"].graph.nodes if n.op == "call_function" and "aten.mm" in str(n.target))
    assert mms == 4 + recomputed


def test_batched_products_are_not_dots_with_no_batch_dims():
    w = t(2, 4, 4, seed=1, grad=True)
    graphs = {}

    def f(x):
        return torch.sin(torch.sin(x @ w) @ w).sum()

    x = t(2, 3, 4, grad=True)
    for policy, recomputed in ((P.dots_with_no_batch_dims_saveable, 2), (P.dots_saveable, 0)):
        tfun.jit(tfun.checkpoint(f, policy=policy), backend=_recording_backend(graphs))(x).backward()
        bmms = sum(1 for n in graphs["bw"].graph.nodes if n.op == "call_function" and "aten.bmm" in str(n.target))
        assert bmms == 4 + recomputed


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_dropout_mask_is_replayed_in_backward(backend):
    x = torch.ones(2000, dtype=D, requires_grad=True)
    y = tfun.jit(tfun.checkpoint(lambda x: torch.nn.functional.dropout(x * 3, 0.5)), backend=backend)(x)
    y.sum().backward()
    kept = (y != 0).to(D)
    assert 500 < kept.sum() < 1500
    assert_close(x.grad, kept * 6)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_random_draws_under_tfun_grad_inside_jit_are_right_or_a_jit_error(backend):
    # torch 2.13 refuses to recompute random draws in a graph that also holds the backward (a
    # JitError saying what to do); torch 2.11 compiles it and replays the draws: then the
    # gradient must use the forward's own dropout mask
    def f(x):
        y = torch.nn.functional.dropout(torch.sin(x), 0.5)
        return y.sum(), y

    x = torch.linspace(0.1, 1.0, 200, dtype=D)
    try:
        grad, y = tfun.jit(tfun.grad(tfun.checkpoint(f), has_aux=True), backend=backend)(x)
    except JitError as e:
        assert "tfun.random" in str(e)
        return
    assert (y == 0).any() and (y != 0).any()
    torch.testing.assert_close(grad, 2 * torch.cos(x) * (y != 0), rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_grad_of_grad_inside_jit_is_right_or_a_jit_error(backend):
    # torch 2.13 rematerializes for one gradient per graph (a JitError saying what to do);
    # torch 2.11 compiles it: then the number must be the eager one
    fn = lambda x: torch.sin(torch.sin(x)).sum()  # noqa: E731
    x = torch.tensor(0.7, dtype=D)
    try:
        out = tfun.jit(tfun.grad(tfun.grad(tfun.checkpoint(fn))), backend=backend)(x)
    except JitError as e:
        assert "Jit each gradient on its own" in str(e)
        return
    torch.testing.assert_close(out, tfun.grad(tfun.grad(fn))(x), rtol=0, atol=1e-12)


def test_static_argnums_out_of_range_under_jit():
    g = tfun.checkpoint(lambda x, n=2: x * n, static_argnums=1)
    with pytest.raises(ArgumentValueError, match="static_argnums contains 1"):
        tfun.jit(g, backend="aot_eager")(t(3))


def _scan_loop(p, xs):
    c, _ = lax.scan(lambda c, x: (torch.tanh(c @ p + x), None), torch.zeros(4, dtype=D), xs)
    return c.sum()


def _cond_fn(p, xs):
    return lax.cond(xs.sum() > 0, lambda p, xs: torch.sin(xs @ p).sum(), lambda p, xs: (xs @ p).cos().sum(), p, xs)


def _switch_fn(p, xs):
    i = (xs.sum() > 0).to(torch.int64) + 1
    branches = [lambda p, xs: p.sum(), lambda p, xs: torch.sin(xs @ p).sum(), lambda p, xs: torch.tanh(xs @ p).sum()]
    return lax.switch(i, branches, p, xs)


def _while_fn(p, xs):
    out = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, torch.sin(c[1] @ p)), (torch.tensor(0), xs))
    return out[1].sum()


def _fori_scan_fn(p, xs):  # a Python-int fori_loop: a scan; and code around it
    def body(i, c):
        return torch.tanh(c @ p) + i

    return lax.fori_loop(0, 3, body, xs).sum() + torch.exp(xs).sum()


@pytest.mark.parametrize("fn", [_scan_loop, _cond_fn, _switch_fn, _while_fn, _fori_scan_fn])
def test_checkpoint_of_control_flow_under_jit(fn):
    """A traced checkpoint of a function containing control flow checkpoints each branch and
    loop body (torch's checkpoint op refuses control flow inside it): values and gradients,
    by `.backward()` after the jitted forward and by a jitted tfun.grad, equal eager float64."""
    p, xs = t(4, 4, seed=1) * 0.5, t(5, 4, seed=2)
    y_ref, g_ref = grads_of(fn, p, xs)
    jf = tfun.jit(tfun.checkpoint(fn), backend="aot_eager")
    y, g = grads_of(jf, p, xs)
    assert_close(y, y_ref)
    assert_close(g, g_ref)
    g2 = tfun.jit(tfun.grad(tfun.checkpoint(fn), argnums=(0, 1)), backend="aot_eager")(p, xs)
    assert_close(g2, g_ref)


def test_checkpoint_of_scan_under_jit_inductor():
    p, xs = t(4, 4, seed=1) * 0.5, t(5, 4, seed=2)
    y_ref, g_ref = grads_of(_scan_loop, p, xs)
    y, g = grads_of(tfun.jit(tfun.checkpoint(_scan_loop), backend="inductor"), p, xs)
    assert_close(y, y_ref)
    assert_close(g, g_ref)


@pytest.mark.parametrize("policy", ["record", P.dots_saveable, P.dots_with_no_batch_dims_saveable, P.everything_saveable])
@pytest.mark.parametrize(
    "fn",
    # CI's second torch phase keeps the scan and while loops (`heavy`: see pyproject.toml)
    [_scan_loop, pytest.param(_cond_fn, marks=pytest.mark.heavy), pytest.param(_switch_fn, marks=pytest.mark.heavy),
     _while_fn, pytest.param(_fori_scan_fn, marks=pytest.mark.heavy)],
)
def test_policy_on_a_checkpoint_of_control_flow_under_jit(fn, policy):
    """With control flow inside, a traced checkpoint applies its policy to each branch and
    loop body (as JAX's remat of a loop applies it to the body): the policy is asked about
    the bodies' matrix products, and values and gradients equal eager float64."""
    asked = []
    record = policy == "record"
    if record:

        def policy(func, *args, **kwargs):
            asked.append(func)
            return func in (torch.mm, torch.mv)

    p, xs = t(4, 4, seed=1) * 0.5, t(5, 4, seed=2)
    y_ref, g_ref = grads_of(fn, p, xs)
    y, g = grads_of(tfun.jit(tfun.checkpoint(fn, policy=policy), backend="aot_eager"), p, xs)
    assert_close(y, y_ref)
    assert_close(g, g_ref)
    g2 = tfun.jit(tfun.grad(tfun.checkpoint(fn, policy=policy), argnums=(0, 1)), backend="aot_eager")(p, xs)
    assert_close(g2, g_ref)
    if record:  # asked about the bodies' products (`c @ p` in a loop body, `xs @ p` in a branch)
        assert {torch.mm, torch.mv} & set(asked), asked


def test_nested_checkpoints_of_control_flow_under_jit_use_the_innermost_policy():
    """A body inside two traced checkpoints with control flow is checkpointed with the
    innermost one's policy."""
    asked = {"outer": [], "inner": []}

    def recording(name):
        def policy(func, *args, **kwargs):
            asked[name].append(func)
            return False

        return policy

    def inner(p, xs):
        return lax.scan(lambda c, x: (torch.tanh(c @ p + x), None), xs[0], xs)[0]

    inner_policy = recording("inner")

    def outer(p, xs):
        h = tfun.checkpoint(inner, policy=inner_policy)(p, xs)
        return lax.cond(h.sum() > 0, lambda h: torch.sin(h @ p).sum(), lambda h: h.sum(), h)

    p, xs = t(4, 4, seed=1) * 0.5, t(5, 4, seed=2)
    y_ref, g_ref = grads_of(outer, p, xs)
    y, g = grads_of(tfun.jit(tfun.checkpoint(outer, policy=recording("outer")), backend="aot_eager"), p, xs)
    assert_close(y, y_ref)
    assert_close(g, g_ref)
    assert {torch.mm, torch.mv} & set(asked["inner"]), asked  # the scan body's c @ p
    assert {torch.mm, torch.mv} & set(asked["outer"]), asked  # the cond branch's h @ p


def test_a_failed_trace_of_a_checkpointed_loop_leaves_no_remat_scope(monkeypatch):
    """A trace that raises inside a checkpointed function with control flow skips the
    scope's exit; the next trace must not checkpoint the bodies of its own loops."""
    from tfun.lax import _hop

    def bad(x):  # a non-scalar predicate: an ArgumentTypeError while tracing, inside the scope
        y = lax.scan(lambda c, _: (torch.sin(c), None), x, None, length=2)[0]
        return lax.cond(y, lambda v: v, lambda v: -v, y)

    with pytest.raises(TypeError, match="pred"):
        tfun.jit(tfun.checkpoint(bad), backend="aot_eager")(t(3))
    wrapped = []
    wrap = _hop._REMAT[0]
    monkeypatch.setattr(_hop, "_REMAT", [lambda fn, key: (wrapped.append(fn), wrap(fn, key))[1]])
    tfun.jit(_scan_loop, backend="aot_eager")(t(4, 4), t(5, 4))
    assert wrapped == []
    tfun.jit(tfun.checkpoint(_scan_loop), backend="aot_eager")(t(4, 4), t(5, 4))
    assert len(wrapped) == 1


def _many_bodies(n):
    """`n` tiny conds and `n` one-step scans in a row: 3 * n control-flow bodies."""

    def step(p, i):
        return lambda c, _: (torch.tanh(c @ p) + i, None)

    def fn(p, x):
        for i in range(n):
            x = lax.cond(x.sum() > -1e9, lambda p, x: torch.sin(x @ p), lambda p, x: x, p, x)
            x = lax.scan(step(p, i), x, None, length=1)[0]
        return x.sum()

    return fn


def test_body_checkpoints_reuse_their_policy_key():
    """Each body's checkpoint inside a traced checkpoint names the enclosing checkpoint's
    policy by its key and reuses it: a trace registers one key for its policy, whatever the
    number of bodies, and a retrace of the same policy registers none."""
    from tfun.lax import _hop

    fn = _many_bodies(4)
    recording_mm = []

    def policy(func, *args, **kwargs):
        recording_mm.append(func)
        return func is torch.mm

    p, x = t(3, 3, seed=1) * 0.5, t(2, 3, seed=2)
    y_ref, g_ref = grads_of(fn, p, x)
    before = len(_hop._POLICIES)
    y, g = grads_of(tfun.jit(tfun.checkpoint(fn, policy=policy), backend="aot_eager"), p, x)
    assert_close(y, y_ref)
    assert_close(g, g_ref)
    assert len(_hop._POLICIES) == before + 1
    assert torch.mm in recording_mm  # the bodies' `x @ p` were asked about
    y, g = grads_of(tfun.jit(tfun.checkpoint(fn, policy=policy), backend="aot_eager"), p, x)  # a new compile
    assert_close(g, g_ref)
    assert len(_hop._POLICIES) == before + 1


def test_policy_keys_outlive_any_number_of_other_registrations(monkeypatch):
    """A traced checkpoint's policy key stays valid while the graph that names it is compiled,
    however many other policies are registered meanwhile (300 here, as 300 other traced
    checkpoints would: past the 256 keys the registry used to keep, which evicted this
    trace's key before AOTAutograd asked its policy: a KeyError at compile time)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from tfun.lax import _hop

    def compiler(gm, example_inputs):
        return make_boxed_func(gm.forward)

    aot = aot_autograd(fw_compiler=compiler, bw_compiler=compiler)
    # the 300 policies below are this test's: registered in copies, dropped after it
    monkeypatch.setattr(_hop, "_POLICIES", dict(_hop._POLICIES))
    monkeypatch.setattr(_hop, "_POLICY_KEYS", dict(_hop._POLICY_KEYS))

    def crowded_backend(gm, example_inputs):  # Dynamo has traced; AOTAutograd asks the policies next
        for _ in range(300):
            _hop.escape_policy_key(lambda func, *args, **kwargs: False)
        return aot(gm, example_inputs)

    fn = _many_bodies(2)
    p, x = t(3, 3, seed=1) * 0.5, t(2, 3, seed=2)
    y_ref, g_ref = grads_of(fn, p, x)
    y, g = grads_of(tfun.jit(tfun.checkpoint(fn, policy=mm_only), backend=crowded_backend), p, x)
    assert_close(y, y_ref)
    assert_close(g, g_ref)


_W_ID = torch.linspace(-1.0, 1.0, 16, dtype=torch.float64).reshape(4, 4)
_IDENTITY_BRANCHES = {
    "switch, static index": lambda x, W: tfun.lax.switch(1, [lambda a: a, lambda a: torch.tanh(a @ W)], x).sum(),
    "switch, tensor index": lambda x, W: tfun.lax.switch(torch.tensor(1), [lambda a: a, lambda a: torch.tanh(a @ W)], x).sum(),
    "cond, identity false branch": lambda x, W: tfun.lax.cond(x.sum() > 0, lambda a: torch.tanh(a @ W), lambda a: a, x).sum(),
    "cond, both identity": lambda x, W: (tfun.lax.cond(x.sum() > 0, lambda a: a, lambda a: a, x) @ W).sum(),
}


@pytest.mark.parametrize("how", ["backward outside", "jit(grad)"])
@pytest.mark.parametrize("case", sorted(_IDENTITY_BRANCHES))
def test_a_checkpointed_branch_that_returns_its_operand(case, how):
    """Hunt 25, finding 2: under tfun.jit, a checkpointed function whose cond or switch has a
    branch returning its operand unchanged raised Dynamo's raw AssertionError
    ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer") or a JitError
    wrapping an FX error: the branch, checkpointed as a body, returned its input out of
    torch's checkpoint op."""
    f = _IDENTITY_BRANCHES[case]
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = torch.func.grad(f, argnums=(0, 1))(x, _W_ID)
    torch._dynamo.reset()
    if how == "jit(grad)":
        got = tfun.jit(tfun.grad(tfun.checkpoint(f), argnums=(0, 1)), backend="aot_eager")(x, _W_ID)
    else:
        xr, Wr = x.clone().requires_grad_(), _W_ID.clone().requires_grad_()
        got = torch.autograd.grad(tfun.jit(tfun.checkpoint(f), backend="aot_eager")(xr, Wr), (xr, Wr))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
@pytest.mark.parametrize("how", ["jit(vmap(grad))", "jit(grad(sum of vmap))"])
def test_a_policy_checkpoint_under_a_traced_vmap(how, backend):
    """Hunt 31, findings 2 and 3: a checkpoint with a saving policy under a `tfun.vmap` traced
    by `tfun.jit` (torch 2.11's selective checkpointing has no batching rule,
    `_compat.selective_checkpoint_vmaps`; eagerly, the policy's saved outputs broke a reverse
    mode around the vmap). It equals the un-checkpointed float64 gradients."""
    W0, xb = t(3, 3, seed=6) * 0.5, t(4, 5, 3, seed=7)
    plain = lambda W, x: (torch.tanh(x @ W) @ W).sum()
    ckpt = lambda W, x: tfun.checkpoint(lambda h: torch.tanh(h @ W) @ W, policy=P.dots_saveable)(x).sum()
    if how == "jit(vmap(grad))":
        want = torch.stack([torch.func.grad(plain)(W0, x) for x in xb])
        got = tfun.jit(tfun.vmap(tfun.grad(ckpt), in_axes=(None, 0)), backend=backend)(W0, xb)
    else:
        want = torch.func.grad(lambda W: sum(plain(W, x) for x in xb))(W0)
        got = tfun.jit(tfun.grad(lambda W, xb: tfun.vmap(ckpt, in_axes=(None, 0))(W, xb).sum()), backend=backend)(W0, xb)
    assert_close(got, want)
