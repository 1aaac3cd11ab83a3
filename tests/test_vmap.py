"""tfun.vmap: pytree in_axes/out_axes, None, axis_size, errors, JAX differential tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tfun
from tfun.errors import ArgumentTypeError, ArgumentValueError, StructureMismatchError

from .helpers import State, assert_tree_allclose

D = torch.float64


def t(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def loop_ref(f, args, in_axes, n):
    """vmap as a Python loop: slice each mapped leaf, stack outputs on axis 0."""
    outs = []
    for i in range(n):
        sl = tfun.tree.tree_map(lambda ax, a: a if ax is None else a.select(ax, i), in_axes, args, none_is_leaf=True)
        outs.append(f(*sl))
    return tfun.tree.tree_map(lambda *xs: torch.stack(xs), *outs)


def test_pytree_in_axes_with_none():
    f = lambda d, s: {"y": d["a"].sum(-1) * s + d["b"], "z": d["a"] * 2}
    args = ({"a": t(3, 5), "b": t(5, seed=1)}, torch.tensor(2.0, dtype=D))
    in_axes = ({"a": 1, "b": 0}, None)
    out = tfun.vmap(f, in_axes=in_axes)(*args)
    assert_tree_allclose(out, loop_ref(f, args, in_axes, 5))
    assert out["z"].shape == (5, 3)
    # a list at the top level reads as a tuple, as in JAX
    assert_tree_allclose(tfun.vmap(f, in_axes=list(in_axes))(*args), out)


@given(st.integers(1, 4), st.integers(1, 3), st.sampled_from([0, 1, -1]))
def test_vmap_matches_loop(n, m, ax):
    x = t(n, m) if ax == 0 else t(m, n)
    f = lambda p, c: {"s": torch.sin(p["x"]) * c, "k": p["x"].sum()}
    axis = ax if ax != -1 else 1
    out = tfun.vmap(f, in_axes=({"x": ax}, None))({"x": x}, torch.tensor(3.0, dtype=D))
    ref = loop_ref(f, ({"x": x}, torch.tensor(3.0, dtype=D)), ({"x": axis}, None), n)
    assert_tree_allclose(out, ref)


def test_prefix_none_and_dataclass():
    s = State(t(4, 2), {"k": t(2, seed=1)})
    out = tfun.vmap(lambda s: s.h * s.c["k"], in_axes=(State(0, None),))(s)
    assert torch.allclose(out, s.h * s.c["k"])


def test_out_axes_and_none():
    x, w = t(4, 3), t(3, seed=1)
    y, c = tfun.vmap(lambda a: (a * w, w), out_axes=(1, None))(x)
    assert y.shape == (3, 4) and torch.allclose(y, (x * w).T) and torch.allclose(c, w)
    d = tfun.vmap(lambda a: {"p": a, "q": a.sum()}, out_axes={"p": -1, "q": 0})(x)
    assert d["p"].shape == (3, 4) and d["q"].shape == (4,)


def test_axis_size_and_kwargs():
    out = tfun.vmap(lambda c: c * 2, in_axes=None, axis_size=3)(torch.ones(2))
    assert out.shape == (3, 2)
    out = tfun.vmap(lambda a, *, b: a + b)(t(4, 2), b=t(4, 2, seed=1))
    assert torch.allclose(out, t(4, 2) + t(4, 2, seed=1))


def test_compositions_with_grad():
    x = t(4, 3)
    assert torch.allclose(tfun.vmap(tfun.grad(lambda r: (r**2).sum()))(x), 2 * x)
    assert torch.allclose(tfun.grad(lambda r: tfun.vmap(lambda q: (q**3).sum())(r).sum())(x), 3 * x**2)
    assert tfun.vmap(tfun.vmap(lambda a: a.sum()), in_axes=1)(t(2, 3, 4)).shape == (3, 2)


# ---------------------------------------------------------------- errors


def test_error_in_axes_structure():
    def fn(d):
        return d["a"]

    with pytest.raises(StructureMismatchError) as e:
        tfun.vmap(fn, in_axes=({"a": 0, "c": 1},))({"a": t(2), "b": t(2)})
    msg = str(e.value)
    assert msg.startswith("tfun.vmap: in_axes must be a tree prefix of the positional arguments.")
    assert "  * args[0]: in_axes has a dict with keys ['a', 'c'], the arguments have a dict with keys ['a', 'b']" in msg
    assert "  * in_axes structure: PyTreeSpec(({'a': *, 'c': *},), NoneIsLeaf)" in msg
    assert "  * arguments structure: PyTreeSpec(({'a': *, 'b': *},))" in msg
    assert "fn at " in msg
    with pytest.raises(StructureMismatchError, match="in_axes is a tuple of 1 entries, but the function was called with 2"):
        tfun.vmap(lambda a, b: a, in_axes=(0,))(t(2), t(2))


def test_error_sizes_and_axes():
    with pytest.raises(ArgumentValueError) as e:
        tfun.vmap(lambda a, b: a + b)(t(3), t(4))
    assert "  * args[0]: axis 0 of a tensor of shape (3,) has size 3" in str(e.value)
    assert "  * args[1]: axis 0 of a tensor of shape (4,) has size 4" in str(e.value)
    with pytest.raises(ArgumentValueError, match="no argument is mapped"):
        tfun.vmap(lambda a: a, in_axes=None)(t(3))
    with pytest.raises(ArgumentValueError, match=r"in_axes 2 is out of range .*\n  \* args\[0\]\['x'\]"):
        tfun.vmap(lambda d: d, in_axes=({"x": 2},))({"x": t(3, 2)})
    with pytest.raises(ArgumentTypeError, match=r"every leaf of in_axes must be an int or None.\n  \* in_axes\[0\]"):
        tfun.vmap(lambda a: a, in_axes=("x",))
    with pytest.raises(ArgumentValueError, match="an output with out_axes None depends on the mapped axis"):
        tfun.vmap(lambda a: a, out_axes=None)(t(3))
    with pytest.raises(ArgumentValueError, match="axis_size: 5"):
        tfun.vmap(lambda a: a, axis_size=5)(t(3))


# ---------------------------------------------------------------- JAX


def test_jax_vmap_differential():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    tf = lambda d, s: {"y": d["a"].sum(-1) * s + d["b"], "z": (d["a"] * 2, s)}
    jf = lambda d, s: {"y": d["a"].sum(-1) * s + d["b"], "z": (d["a"] * 2, s)}
    d = {"a": t(3, 5), "b": t(3, seed=1)}
    s = t(3, seed=2)
    in_axes = ({"a": 0, "b": None}, 0)
    out_axes = {"y": 1, "z": (0, None)}
    with pytest.raises(Exception):
        jax.vmap(jf, in_axes=in_axes, out_axes=out_axes)(tfun.tree.tree_map(lambda a: a.numpy(), d), s.numpy())
    out_axes = {"y": 0, "z": (1, 0)}
    mine = tfun.vmap(tf, in_axes=in_axes, out_axes=out_axes)(d, s)
    ref = jax.vmap(jf, in_axes=in_axes, out_axes=out_axes)(tfun.tree.tree_map(lambda a: a.numpy(), d), s.numpy())
    for a, b in zip(tfun.tree.tree_leaves(mine), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(a.numpy(), np.asarray(b), rtol=1e-12)
    # axis_size with every argument unmapped
    r1 = tfun.vmap(lambda c: c * 2, in_axes=None, axis_size=2)(torch.ones(3, dtype=D))
    r2 = jax.vmap(lambda c: c * 2, in_axes=None, axis_size=2)(jnp.ones(3))
    np.testing.assert_allclose(r1.numpy(), np.asarray(r2))


# --------------------------------------------------------------------------------------
# in_axes / out_axes trees inside tfun.jit (porting-guide row jit-vmap-in-axes-tuple, gone)
# --------------------------------------------------------------------------------------


_AXES_CASES = [
    pytest.param((0, {"w": None, "s": 0}), ({"sum": 0, "vec": 0}, (0,)), id="tuple-dict"),
    pytest.param((0, {"s": 0, "w": None}), 0, id="dict-key-order"),
    pytest.param([0, {"w": None, "s": 0}], ({"sum": 0, "vec": 1}, 0), id="list-nested-out1"),
]


def _axes_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=g, dtype=dtype)
    d = {"w": torch.randn(3, generator=g, dtype=dtype), "s": torch.randn(4, generator=g, dtype=dtype)}
    return x, d


@pytest.mark.parametrize(("in_axes", "out_axes"), _AXES_CASES)
def test_vmap_axes_trees_under_jit_match_eager_float64(in_axes, out_axes):
    def fn(x, d):
        y = torch.tanh(x * d["w"]) * d["s"]
        return {"sum": y.sum(), "vec": y}, (y.max(),)

    def run(x, d):
        return tfun.vmap(fn, in_axes=in_axes, out_axes=out_axes)(x, d)

    x64, d64 = _axes_inputs(torch.float64)
    x32, d32 = _axes_inputs(torch.float32)
    try:
        want = run(x64, d64)
    except StructureMismatchError as eager:
        # out_axes None for a mapped output: the same tfun error under tfun.jit
        with pytest.raises(StructureMismatchError) as got:
            tfun.jit(run, backend="aot_eager")(x32, d32)
        assert str(got.value) == str(eager)
        return

    def loss(x, d):
        out, (m,) = run(x, d)
        return out["vec"].square().sum() + out["sum"].sum() + m.sum()

    # (one compile of the vmap and of its gradient, each checked)
    got, ggot = tfun.jit(lambda x, d: (run(x, d), tfun.grad(loss, argnums=(0, 1))(x, d)), backend="aot_eager")(x32, d32)
    assert tfun.tree.tree_structure(got) == tfun.tree.tree_structure(want)
    assert_tree_allclose(got, tfun.tree.tree_map(lambda t: t.to(torch.float32), want), rtol=1e-5, atol=1e-5)
    gwant = tfun.grad(loss, argnums=(0, 1))(x64, d64)
    assert_tree_allclose(ggot, tfun.tree.tree_map(lambda t: t.to(torch.float32), gwant), rtol=1e-4, atol=1e-5)


def test_jit_of_vmap_with_tuple_in_axes_built_inside():
    # jax's test_issue2511: the vmap is built inside the jitted function
    arr = torch.randn(5, 2, 2, dtype=torch.float64)
    got = tfun.jit(lambda x: tfun.vmap(torch.linalg.det, (0,))(x), backend="aot_eager")(arr)
    torch.testing.assert_close(got, torch.linalg.det(arr))


@pytest.mark.parametrize(
    ("in_axes", "args"),
    [
        pytest.param(({"a": 0},), "tensor", id="dict-vs-tensor"),
        pytest.param(([0, 0],), "tuple", id="list-vs-tuple"),
        pytest.param(({"a": 0, "b": 0},), "dict", id="dict-keys"),
        pytest.param((0, (0, 0)), "two", id="nested-arity"),
    ],
)
def test_bad_in_axes_prefix_same_error_under_jit(in_axes, args):
    x = torch.ones(3, 2)
    call_args = {
        "tensor": (x,),
        "tuple": ((x, x),),
        "dict": ({"a": x, "c": x},),
        "two": (x, (x, x, x)),
    }[args]
    f = tfun.vmap(lambda *a: a[0], in_axes=in_axes)
    with pytest.raises(StructureMismatchError) as eager:
        f(*call_args)
    assert "in_axes must be a tree prefix" in str(eager.value)
    with pytest.raises(StructureMismatchError) as jitted:
        tfun.jit(f, backend="aot_eager")(*call_args)
    assert str(jitted.value) == str(eager.value)


def test_bad_out_axes_prefix_same_error_under_jit():
    f = tfun.vmap(lambda x: {"a": x, "b": (x, x)}, out_axes={"a": 0, "b": [0, 0]})
    x = torch.ones(3, 2)
    with pytest.raises(StructureMismatchError) as eager:
        f(x)
    assert "out_axes must be a tree prefix" in str(eager.value)
    with pytest.raises(StructureMismatchError) as jitted:
        tfun.jit(f, backend="aot_eager")(x)
    assert str(jitted.value) == str(eager.value)


# ----------------------------------------------------------------------------------------
# Per-example gradients under tfun.jit: `vmap(grad(f))` is traced as the gradient of the
# summed, vmapped loss (`tfun._vmap._per_example_gradients`), so loops inside compile. Every
# cell is compared with a per-example Python loop of eager float64 `tfun.grad`.
# ----------------------------------------------------------------------------------------


def _rnn_loss(p, x, scale=1.0):
    """A scan RNN over one example's sequence `x` (T, 4), with aux outputs."""

    def step(h, xt):
        h = torch.tanh(h @ p["W"] + xt + p["b"])
        return h, h.sum()

    h, ys = tfun.lax.scan(step, torch.zeros(4, dtype=x.dtype), x)
    return (h * h).sum() * scale + ys.sum(), {"last": h, "ys": ys}


_P = {"W": t(4, 4, seed=3) * 0.3, "b": t(4, seed=4)}
_XS = t(3, 5, 4, seed=5)  # 3 examples, T=5


def _per_example_cells():
    loss = lambda p, x: _rnn_loss(p, x)[0]
    xs_t = _XS.transpose(0, 1).contiguous()  # mapped over axis 1
    loop = lambda g, args, n=3, axes=(None, 0): loop_ref(g, args, axes, n)
    return {
        "grad": (tfun.vmap(tfun.grad(loss), in_axes=(None, 0)), (_P, _XS), lambda: loop(tfun.grad(loss), (_P, _XS))),
        "grad_has_aux": (
            tfun.vmap(tfun.grad(_rnn_loss, has_aux=True), in_axes=(None, 0)),
            (_P, _XS),
            lambda: loop(tfun.grad(_rnn_loss, has_aux=True), (_P, _XS)),
        ),
        "value_and_grad_has_aux": (
            tfun.vmap(tfun.value_and_grad(_rnn_loss, has_aux=True), in_axes=(None, 0)),
            (_P, _XS),
            lambda: loop(tfun.value_and_grad(_rnn_loss, has_aux=True), (_P, _XS)),
        ),
        "argnums_both_in_axes_1": (
            tfun.vmap(tfun.grad(loss, argnums=(0, 1)), in_axes=(None, 1)),
            (_P, xs_t),
            lambda: loop(tfun.grad(loss, argnums=(0, 1)), (_P, xs_t), axes=(None, 1)),
        ),
        "out_axes_1": (
            tfun.vmap(tfun.grad(loss, argnums=(0, 1)), in_axes=(None, 0), out_axes=1),
            (_P, _XS),
            lambda: tfun.tree.tree_map(lambda a: a.movedim(0, 1), loop(tfun.grad(loss, argnums=(0, 1)), (_P, _XS))),
        ),
        "mapped_parameter": (
            tfun.vmap(tfun.grad(loss), in_axes=({"W": 0, "b": None}, 0)),
            ({"W": _P["W"] * torch.arange(1, 4, dtype=D)[:, None, None], "b": _P["b"]}, _XS),
            lambda: loop(
                tfun.grad(loss),
                ({"W": _P["W"] * torch.arange(1, 4, dtype=D)[:, None, None], "b": _P["b"]}, _XS),
                axes=({"W": 0, "b": None}, 0),
            ),
        ),
        "python_float_argument": (
            tfun.vmap(tfun.grad(lambda s, x: _rnn_loss(_P, x, s)[0]), in_axes=(None, 0)),
            (2.0, _XS),
            lambda: torch.stack([tfun.grad(lambda s, x: _rnn_loss(_P, x, s)[0])(2.0, x) for x in _XS]),
        ),
        "allow_int": (
            tfun.vmap(tfun.grad(lambda a, x: a[0] * x.sum() * a[1], allow_int=True), in_axes=(None, 0)),
            ((torch.tensor(2.0, dtype=D), torch.tensor(3)), _XS),
            lambda: loop(
                tfun.grad(lambda a, x: a[0] * x.sum() * a[1], allow_int=True), ((torch.tensor(2.0, dtype=D), torch.tensor(3)), _XS)
            ),
        ),
        "weighted_outputs_reverse_pytree_carry": (
            tfun.vmap(tfun.grad(_weighted_scan_loss, argnums=(0, 1, 2)), in_axes=(0, 0, 0)),
            (t(3, 2, 2, seed=6) * 0.5, t(3, 4, 2, seed=7), t(3, 2, seed=8)),
            lambda: loop(
                tfun.grad(_weighted_scan_loss, argnums=(0, 1, 2)), (t(3, 2, 2, seed=6) * 0.5, t(3, 4, 2, seed=7), t(3, 2, seed=8)), axes=(0, 0, 0)
            ),
        ),
    }


def _weighted_scan_loss(W, xs, h0):
    """A reversed scan with a weighted final carry (the carry's gradient reaches the backward
    scan in the vmap rule's batch-last layout)."""

    def step(h, x):
        h = torch.tanh(h @ W + x)
        return h, h * x

    h, ys = tfun.lax.scan(step, h0, xs, reverse=True)
    w = torch.tensor([0.5, -2.0], dtype=h.dtype)
    return (h * w).sum() + (ys * w).sum()


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)]
)
@pytest.mark.parametrize("name", sorted(_per_example_cells()))
def test_per_example_gradients_under_jit_equal_eager_float64(name, backend):
    torch._dynamo.reset()
    fn, args, want = _per_example_cells()[name]
    got = tfun.jit(fn, backend=backend)(*args)
    assert_tree_allclose(got, want())
    assert_tree_allclose(fn(*args), want())  # (eager: torch.func's vmap of grad)


def test_per_example_gradients_under_jit_check_each_loss_is_a_scalar():
    """The per-example scalar check runs under jit too, with eager's message: a summed batched
    loss must not hide a non-scalar one."""
    g = tfun.vmap(tfun.grad(lambda W, x: x @ W), in_axes=(None, 0))
    with pytest.raises(ArgumentTypeError, match=r"must return a scalar") as eager:
        g(_P["W"], _XS)
    with pytest.raises(ArgumentTypeError, match=r"must return a scalar") as traced:
        tfun.jit(g, backend="aot_eager")(_P["W"], _XS)
    assert str(traced.value).split("The function is")[0] == str(eager.value).split("The function is")[0]


def test_per_example_gradients_of_parameters_that_require_grad_stay_differentiable():
    """Arguments that require grad (a module's parameters): the per-example gradients keep
    their graph, as torch.func's do eagerly, so a loss on them differentiates back (here
    without a loop: with one, a second derivative through a loop is refused under jit)."""
    W = _P["W"].clone().requires_grad_()
    g = tfun.vmap(tfun.grad(lambda W, x: torch.tanh(x @ W).sum()), in_axes=(None, 0))
    penalty = lambda W, xs: (g(W, xs) ** 2).sum()
    want = torch.autograd.grad(penalty(W, _XS), W)[0]
    got = torch.autograd.grad(tfun.jit(penalty, backend="aot_eager")(W, _XS), W)[0]
    torch.testing.assert_close(got, want)


def test_per_example_gradients_of_arguments_that_require_grad_unroll_a_long_loop_with_a_warning():
    """Per-example gradients in arguments that require grad stay differentiable, so a loop
    inside is unrolled in the graph (torch's loop ops have no second derivative): past
    `WARN_UNROLLED_STEPS` (16) a `PerformanceWarning` at the loop body's own line names the
    steps and the ways out (`tfun._funcinfo.warn_at`); at 16 steps, none (the suite turns
    warnings into errors). The gradients are eager's either way, in float64."""
    from tfun.errors import PerformanceWarning
    from tfun.lax import _hop

    def f(w, x):
        return tfun.lax.scan(lambda c, xt: (torch.tanh(c * w + xt), None), torch.zeros(3, dtype=D), x)[0].sum()

    g = torch.Generator().manual_seed(3)
    assert _hop.WARN_UNROLLED_STEPS == 16
    for T, warns in ((16, False), (17, True)):
        torch._dynamo.reset()
        w = torch.randn(4, 3, dtype=D, generator=g, requires_grad=True)
        x = torch.randn(4, T, 3, dtype=D, generator=g)
        jitted = tfun.jit(tfun.vmap(tfun.grad(f)), backend="aot_eager")
        if warns:
            with pytest.warns(PerformanceWarning, match=rf"^tfun\.lax\.scan \(<lambda> at .*test_vmap\.py:\d+\): under tfun\.jit this loop is unrolled into {T} steps") as info:
                got = jitted(w, x)
            ours = [r for r in info if r.category is PerformanceWarning]
            assert {r.filename for r in ours} == {__file__}
            assert "torch.no_grad()" in str(ours[0].message)
        else:
            got = jitted(w, x)
        torch.testing.assert_close(got, tfun.vmap(tfun.grad(f))(w, x))


def test_per_example_gradients_under_jit_check_out_axes_as_eagerly():
    """An out_axes past a per-example scalar's gradient: the same ArgumentValueError eagerly
    (torch.func's vmap) and under jit (the rewrite places the batch dimension itself)."""
    b = torch.tensor(0.5, dtype=D)
    g = tfun.vmap(tfun.grad(lambda b, x: (torch.tanh(x * b) ** 2).sum()), in_axes=(None, 0), out_axes=1)
    with pytest.raises(ArgumentValueError, match=r"out_axes 1 is out of range for an output with 1 dimensions") as eager:
        g(b, _XS)
    with pytest.raises(ArgumentValueError, match=r"out_axes 1 is out of range for an output with 1 dimensions") as traced:
        tfun.jit(g, backend="aot_eager")(b, _XS)
    assert str(traced.value).splitlines()[0] == str(eager.value).splitlines()[0]


@pytest.mark.parametrize("pred", ["python", "unbatched tensor", "switch", "vmap(grad)"])
def test_jit_vmap_cond_with_an_unbatched_predicate_at_a_second_length(pred):
    """Hunt 30 F5: at a second sequence length Dynamo makes the size symbolic and lifts it into
    torch.cond's operands, and tfun's cond batching rule (`_compat`) passed that SymInt to
    `is_batchedtensor`: a raw TypeError. Every length now gives eager's values."""
    w = torch.tensor(0.5)
    p = True if pred == "python" else w > 0
    f = lambda r: tfun.lax.cond(p, lambda r: r.sin() * w, lambda r: r.cos(), r)  # noqa: E731
    if pred == "switch":
        f = lambda r: tfun.lax.switch(1, [lambda r: r.sin(), lambda r: r.cos() * w, lambda r: r], r)  # noqa: E731
    if pred == "vmap(grad)":
        f = tfun.grad(lambda r: tfun.lax.cond(w > 0, lambda r: (r.sin() * w).sum(), lambda r: r.cos().sum(), r))
    g = tfun.jit(tfun.vmap(f), backend="aot_eager")
    for shape in [(2, 5, 3), (2, 7, 3), (3, 4, 3)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(g(x), tfun.vmap(f)(x))


_EMPTY_BATCH = {
    "scan": lambda r: tfun.lax.scan(lambda c, t: (c + t, c), torch.tensor(0.0), r),
    "associative_scan": lambda r: tfun.lax.associative_scan(torch.add, r),
    "linear_scan": lambda r: tfun.lax.linear_scan(r.sigmoid(), r),
    "while_loop": lambda r: tfun.lax.while_loop(lambda c: c.sum() < 5, lambda c: c + 1, r),
    "item (runs one example)": lambda r: r * float(torch.ones(()).item()),
    "out_axes None": None,
}


@pytest.mark.parametrize("case", list(_EMPTY_BATCH))
def test_vmap_over_an_empty_batch(case):
    """Hunt 30 F4: a mapped axis of size 0 (an empty last minibatch) was torch's raw IndexError
    or reshape error for scan, associative_scan and linear_scan. As jax.vmap: empty outputs with
    the per-example shapes of a batch of one, and zero gradients for the inputs."""
    z = torch.zeros(0, 4, requires_grad=True)
    if case == "out_axes None":
        out = tfun.vmap(lambda r, w: (r * w, w * 2), in_axes=(0, None), out_axes=(0, None))(z, torch.ones(4))
        assert out[0].shape == (0, 4) and torch.equal(out[1], torch.full((4,), 2.0))
        return
    f = _EMPTY_BATCH[case]
    want = [o.shape for o in tfun.tree.tree_leaves(tfun.vmap(f)(torch.zeros(1, 4)))]
    runs = [tfun.vmap(f)]
    if case in ("scan", "associative_scan", "linear_scan"):
        runs.append(tfun.jit(tfun.vmap(f), backend="aot_eager"))  # the size-0 graph traces one example
    for run in runs:
        out = tfun.tree.tree_leaves(run(z))
        assert [o.shape for o in out] == [(0, *s[1:]) for s in want]
        (g,) = torch.autograd.grad(sum(o.sum() for o in out if o.is_floating_point()), z, allow_unused=True)
        assert g is not None and g.shape == (0, 4)
