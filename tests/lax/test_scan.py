"""tfun.lax.scan: property tests against a pure-Python loop, gradients, and JAX as an oracle."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import (
    DTYPES,
    Point,
    as_tensor,
    assert_grads_close,
    assert_jit_value_and_grad_match_eager,
    assert_matches_jax,
    assert_tree_allclose,
    materialize,
    structures,
)
import tfun
from tfun import lax
from tfun.errors import ArgumentTypeError, JitError
from tfun.tree import tree_flatten, tree_leaves, tree_map, tree_unflatten

# ----------------------------------------------------------------------------------------
# The reference: JAX's documented semantics as a plain Python loop
# ----------------------------------------------------------------------------------------


def ref_scan(f: Any, init: Any, xs: Any, length: int | None = None, reverse: bool = False) -> tuple[Any, Any]:
    carry = tree_map(as_tensor, init)
    x_leaves, x_def = tree_flatten(xs)
    n = x_leaves[0].shape[0] if x_leaves else length
    assert n is not None

    def x_at(i: int) -> Any:
        return tree_unflatten(x_def, [v[i] for v in x_leaves])

    if n == 0:
        x0 = tree_unflatten(x_def, [v.new_empty(v.shape[1:]) for v in x_leaves])
        _, y0 = f(carry, x0)
        return carry, tree_map(lambda v: v.new_empty((0, *v.shape)), y0)
    ys: list[Any] = [None] * n
    for i in reversed(range(n)) if reverse else range(n):
        carry, ys[i] = f(carry, x_at(i))
    return carry, tree_map(lambda *vs: torch.stack(vs), *ys)


def _xsum(x: Any, dtype: torch.dtype) -> torch.Tensor:
    s = torch.zeros((), dtype=dtype)
    for v in tree_leaves(x):
        s = s + v.sum().to(dtype)
    return s


def _step(carry: Any, x: Any) -> Any:
    def step(c: torch.Tensor) -> torch.Tensor:
        s = _xsum(x, c.dtype)
        return c * 2 - s if not c.is_floating_point() else c * 0.5 + s

    return tree_map(step, carry)


# Three bodies with their own code objects (tfun caches per code object and input
# signature; see test_scan_closures_with_different_y_structures below).
def body_full(carry: Any, x: Any) -> tuple[Any, Any]:
    y = (tree_map(lambda c: c + 1, carry), None, {"x": tree_map(lambda v: v * 3, x), "n": _xsum(x, torch.float64)})
    return _step(carry, x), y


def body_none(carry: Any, x: Any) -> tuple[Any, Any]:
    return _step(carry, x), None


def body_carry(carry: Any, x: Any) -> tuple[Any, Any]:
    return _step(carry, x), carry


BODIES = {"full": body_full, "none": body_none, "carry": body_carry}


# ----------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------

@given(
    carry_t=structures(st.sampled_from(["t", "t", "i", "f"])),
    xs_t=st.one_of(st.none(), structures()),
    n=st.integers(0, 5),
    reverse=st.booleans(),
    give_length=st.booleans(),
    y_kind=st.sampled_from(["full", "none", "carry"]),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_scan_matches_python_loop(carry_t, xs_t, n, reverse, give_length, y_kind, dtype, seed):
    init = materialize(carry_t, dtype, seed)
    xs = materialize(xs_t, dtype, seed + 1, lead=(n,))
    has_x = bool(tree_leaves(xs))
    length = n if (give_length or not has_x) else None
    body = BODIES[y_kind]

    carry, ys = lax.scan(body, init, xs, length=length, reverse=reverse)
    ref_carry, ref_ys = ref_scan(body, init, xs, length=n, reverse=reverse)

    assert_tree_allclose(carry, ref_carry, rtol=1e-6, atol=1e-6)
    assert_tree_allclose(ys, ref_ys, rtol=1e-6, atol=1e-6)
    for v in tree_leaves(ys):
        assert v.shape[0] == n
    if y_kind == "none":
        assert ys is None


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_length_zero_returns_init_and_empty_ys(reverse):
    init = {"h": torch.randn(3), "k": 2, "f": 1.5}
    xs = Point(torch.zeros(0, 3, dtype=torch.float64), torch.zeros(0, dtype=torch.int64))

    def f(c, x):
        return c, {"a": c["h"] * x.x, "b": (x.y, c["k"]), "none": None}

    carry, ys = lax.scan(f, init, xs, reverse=reverse)
    assert torch.equal(carry["h"], init["h"])
    assert carry["k"].dtype == torch.int64 and carry["k"].item() == 2
    assert carry["f"].dtype == torch.float32 and carry["f"].item() == 1.5
    assert ys["none"] is None
    assert ys["a"].shape == (0, 3) and ys["a"].dtype == torch.float64
    assert ys["b"][0].shape == (0,) and ys["b"][0].dtype == torch.int64
    assert ys["b"][1].shape == (0,) and ys["b"][1].dtype == torch.int64

    carry, ys = lax.scan(lambda c, x: (c + 1, c * 2.0), 0, None, length=0)
    assert carry.dtype == torch.int64 and carry.item() == 0
    assert ys.shape == (0,) and ys.dtype == torch.float32


def test_scan_python_scalar_carries_become_tensors():
    def f(c, _):
        i, x = c
        return (i + 1, x * 2.0), i

    (i, x), ys = lax.scan(f, (0, 1.0), None, length=4)
    assert isinstance(i, torch.Tensor) and i.dtype == torch.int64 and i.shape == () and i.item() == 4
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.item() == 16.0
    assert ys.dtype == torch.int64 and ys.tolist() == [0, 1, 2, 3]


def test_scan_length_one_and_y_none():
    carry, ys = lax.scan(lambda c, x: (c + x, None), torch.tensor(1.0), torch.tensor([2.0]))
    assert carry.item() == 3.0 and ys is None
    carry, ys = lax.scan(lambda c, x: (c * 3, x), torch.tensor(1), None, length=3, reverse=True)
    assert carry.item() == 27 and ys is None


def test_scan_reverse_keeps_xs_order_in_ys():
    xs = torch.arange(5.0)
    # y records the carry seen at each step: reverse processes 4, 3, ..., 0
    carry, ys = lax.scan(lambda c, x: (c * 10 + x, c), torch.tensor(0.0, dtype=torch.float64), xs.double(), reverse=True)
    assert carry.item() == 43210.0
    assert ys.tolist() == [4321.0, 432.0, 43.0, 4.0, 0.0]


# ----------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------


def _rnn_body(W: torch.Tensor) -> Any:
    def f(c, x):
        h, acc = c
        h = torch.tanh(h @ W + x["a"] * x["b"])
        return (h, acc + h.sum()), {"h2": h * h, "x": x["a"] * acc}

    return f


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("n", [1, 4])
def test_scan_grad_matches_python_loop(reverse, n):
    g = torch.Generator().manual_seed(n + 10 * reverse)
    W = torch.randn(3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    a = torch.randn(n, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(n, generator=g, dtype=torch.float64, requires_grad=True)
    f = _rnn_body(W)
    init = (h0, torch.zeros((), dtype=torch.float64))
    wts = torch.randn(n, 3, generator=g, dtype=torch.float64)

    def loss(out):
        (h, acc), ys = out
        return h.sum() + 0.3 * acc + (ys["h2"] * wts).sum() + (ys["x"] * wts).sum()

    got = torch.autograd.grad(loss(lax.scan(f, init, {"a": a, "b": b}, reverse=reverse)), (W, h0, a, b))
    want = torch.autograd.grad(loss(ref_scan(f, init, {"a": a, "b": b}, reverse=reverse)), (W, h0, a, b))
    assert_grads_close(got, want, rtol=1e-10, atol=1e-12)


def test_scan_gradcheck():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(3, 2, generator=g, dtype=torch.float64, requires_grad=True)

    def fn(W, h0, xs):
        def f(h, x):
            h = torch.sin(h @ W) + x * h
            return h, h.prod()

        h, ys = lax.scan(f, h0, xs, reverse=True)
        return h, ys

    assert torch.autograd.gradcheck(fn, (W, h0, xs))


# ----------------------------------------------------------------------------------------
# JAX as a differential oracle
# ----------------------------------------------------------------------------------------

def to_jax(tree: Any) -> Any:
    import jax.numpy as jnp

    return tree_map(lambda t: jnp.asarray(t.numpy()), tree)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("n", [0, 1, 5])
def test_scan_matches_jax(jax, reverse, n):
    jnp, jlax = jax.numpy, jax.lax
    rng = np.random.default_rng(n)
    W = rng.standard_normal((3, 3))
    xs_np = {"a": rng.standard_normal((n, 3)), "k": rng.integers(-5, 5, (n,))}
    init_np = (rng.standard_normal(3), np.int64(1))

    def make(lib):
        Wl = lib.asarray(W)

        def f(c, x):
            h, k = c
            h = lib.tanh(h @ Wl + x["a"]) * 0.9
            k = k * 2 + x["k"]
            return (h, k), {"h": h, "pair": (k, None), "s": Point(h.sum(), x["k"] * k)}

        return f

    xs_t = tree_map(torch.from_numpy, xs_np)
    init_t = (torch.from_numpy(init_np[0]), torch.tensor(int(init_np[1])))
    ours = lax.scan(make(torch), init_t, xs_t, reverse=reverse)
    theirs = jlax.scan(make(jnp), to_jax(init_t), to_jax(xs_t), reverse=reverse)
    assert_matches_jax(ours, theirs, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_xs_none_matches_jax(jax, reverse):
    jnp, jlax = jax.numpy, jax.lax
    def make(lib):
        def f(c, _):
            i, x = c
            return (i + 1, x * 1.5 + i), x - i

        return f

    ours = lax.scan(make(torch), (torch.tensor(0), torch.tensor(1.0, dtype=torch.float64)), None, length=6, reverse=reverse)
    theirs = jlax.scan(make(jnp), (jnp.asarray(0, dtype=jnp.int64), jnp.asarray(1.0)), None, length=6, reverse=reverse)
    assert_matches_jax(ours, theirs, rtol=1e-12, atol=1e-9)
    # y None gives None in both
    ours = lax.scan(lambda c, _: (c + 1, None), torch.tensor(0), None, length=3)
    theirs = jlax.scan(lambda c, _: (c + 1, None), jnp.asarray(0, dtype=jnp.int64), None, length=3)
    assert ours[1] is None and theirs[1] is None
    assert_matches_jax(ours[0], theirs[0], rtol=1e-6, atol=1e-9)


def test_scan_closures_with_different_y_structures():
    # Two closures of one code object whose y structures differ (a config flag closed
    # over, as in a layer built per config). Each is a valid scan body on its own.
    def make(flag):
        def f(c, x):
            return c + x, (x * 2 if flag else None)

        return f

    xs = torch.arange(3.0)
    assert lax.scan(make(False), torch.tensor(0.0), xs)[1] is None
    carry, ys = lax.scan(make(True), torch.tensor(0.0), xs)
    assert carry.item() == 3.0
    assert ys.tolist() == [0.0, 2.0, 4.0]


def test_scan_traced_length_is_an_argument_type_error():
    # JAX's ConcretizationTypeError (a TypeError): under tfun.jit the length must be a Python int
    f = tfun.jit(lambda n, x: lax.scan(lambda c, z: (c, z), x, None, n), backend="aot_eager")
    with pytest.raises(ArgumentTypeError, match="length must be a concrete int under tfun.jit"):
        f(torch.tensor(3), torch.tensor(1.0))
    g = tfun.jit(lambda n, x: lax.scan(lambda c, z: (c, z), x, None, n)[0], static_argnums=0, backend="aot_eager")
    assert g(3, torch.tensor(1.0)).item() == 1.0


@pytest.mark.parametrize("kind", ["dict", "defaultdict"])
def test_carry_rebuilt_in_another_key_order_under_jit(kind):
    """A dict or a `defaultdict` is one pytree whatever its keys' insertion order (optree
    flattens and compares it by sorted key): a body rebuilding the carry in another order ran
    eagerly, and a `defaultdict` one was refused under `tfun.jit` with an empty list of
    differences (Dynamo's stand-in treedef keeps the insertion order; found by a correctness
    hunt, session 20). Values and gradients, against eager."""
    import collections

    make = (lambda d: dict(d)) if kind == "dict" else (lambda d: collections.defaultdict(list, d))

    def f(t):
        body = lambda c, _: (make({"b": c["b"] + c["a"], "a": c["a"] * 2}), None)
        out = lax.scan(body, make({"a": t, "b": t.sin()}), None, length=3)[0]
        return (out["a"] * out["b"]).sum()

    t = torch.linspace(-1, 1, 4, dtype=torch.float64)
    want = tfun.value_and_grad(f)(t)
    torch._dynamo.reset()
    assert_tree_allclose(tfun.jit(tfun.value_and_grad(f), backend="aot_eager")(t), want)


def test_ordered_dict_carry_in_another_key_order_is_refused_alike_eagerly_and_under_jit():
    """An `OrderedDict`'s key order is part of its structure (optree compares it in order): a
    body that reorders it is refused, with the same error class eagerly and under `tfun.jit`."""
    import collections

    from tfun.errors import TfunError

    def f(t):
        body = lambda c, _: (collections.OrderedDict(b=c["b"], a=c["a"]), None)
        return lax.scan(body, collections.OrderedDict(a=t, b=t), None, length=2)[0]

    t = torch.ones(2)
    with pytest.raises(TfunError) as eager:
        f(t)
    torch._dynamo.reset()
    with pytest.raises(TfunError) as jitted:
        tfun.jit(f, backend="aot_eager")(t)
    assert type(jitted.value) is type(eager.value)


def _scan_in_cond(x, w):
    def branch(u):
        c, ys = lax.scan(lambda c, xt: (torch.tanh(c * w + xt), c), torch.zeros(3, dtype=x.dtype), u)
        return ys.sum() + c.pow(2).sum()

    return lax.cond(x.sum() > -100, branch, lambda u: u.sum() * w, x)


def _scan_in_map(x, w):
    def row(u):
        c, ys = lax.scan(lambda c, xt: (torch.tanh(c * w + xt), c), torch.zeros(3, dtype=x.dtype), u)
        return ys.sum() + c.pow(2).sum()

    return lax.map(row, x.reshape(2, -1, 3)).sum()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("program", [_scan_in_cond, _scan_in_map], ids=["cond", "map"])
def test_differentiated_scan_inside_a_branch_or_map_body_under_jit(program, backend):
    """A scan in a cond branch or a map body, differentiated under `tfun.jit`: its lowering
    registered a gradient hook inside the other op's body, where autograd is off, and the
    compile failed ("cannot register a hook on a tensor that doesn't require gradient";
    found while fixing a correctness hunt's findings, session 20). Values and gradients
    against eager, with `tfun.grad` inside and `.backward()` after."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 3, dtype=torch.float64, generator=g)
    w = torch.tensor(0.8, dtype=torch.float64)
    want = tfun.value_and_grad(program, argnums=(0, 1))(x, w)
    torch._dynamo.reset()
    assert_tree_allclose(tfun.jit(tfun.value_and_grad(program, argnums=(0, 1)), backend=backend)(x, w), want)
    torch._dynamo.reset()
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    tfun.jit(program, backend=backend)(xx, ww).backward()
    assert_tree_allclose((xx.grad, ww.grad), want[1])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("reverse", [False, True])
def test_a_strided_xs_whose_slice_the_body_reshapes_compiles_and_matches_eager(backend, reverse):
    """`xs` a sliced, permuted view; the body reshapes its slice. torch's scan traces the body
    on a contiguous slice (the reshape becomes a view) and ran it on the strided slices: under
    `aot_eager` a raw "view size is not compatible" RuntimeError at run time (hunt 23). The
    lowering now passes contiguous `xs` leaves; values and gradients equal eager float64."""
    base = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(2))

    def f(b):
        xs = b[:, :, ::2].permute(1, 2, 0)  # (5, 2, 3), not contiguous
        return lax.scan(lambda h, x: (h + x.reshape(-1).sum(), x.reshape(-1) * h), torch.zeros((), dtype=b.dtype), xs, reverse=reverse)

    kw = {} if backend == "inductor" else {"backend": backend}
    torch._dynamo.reset()
    with torch.no_grad():
        assert_tree_allclose(tfun.jit(f, **kw)(base), f(base), rtol=1e-5, atol=1e-5)
    bg, b64 = base.clone().requires_grad_(), base.double().requires_grad_()
    out, want = tfun.jit(f, **kw)(bg), f(b64)
    assert_tree_allclose(tree_map(lambda t: t.double(), out), want, rtol=1e-5, atol=1e-5)
    (g,) = torch.autograd.grad(out[1].double().pow(2).sum(), bg)
    (w,) = torch.autograd.grad(want[1].pow(2).sum(), b64)
    torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:torch.compile is ignored when called inside torch.export region:UserWarning")
@pytest.mark.parametrize("strict", [False, True])
def test_an_integer_carry_under_export_is_differentiated_through_the_exported_module(strict):
    """An exported scan whose carry holds an integer step counter (hunt 24: the forward was
    right, and differentiating the exported module raised torch's raw "outs_to_grad length
    (2) != tangents length (3)"): the integer carry crosses the exported HOP as int64 bits, as
    under tfun.jit, and the gradients are float64 eager's."""

    def f(W, xs, h0):
        def step(c, x):
            h, n = c
            return (torch.tanh(h @ W + x) * (1 + 0.1 * n), n + 1), h * n

        return lax.scan(step, (h0, torch.tensor(0)), xs)

    class M(torch.nn.Module):
        def forward(self, W, xs, h0):
            return f(W, xs, h0)

    g = torch.Generator().manual_seed(1)
    want_in = [torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True) for s in ((4, 4), (7, 4), (4,))]
    got_in = [w.detach().float().requires_grad_() for w in want_in]
    ep = torch.export.export(M(), tuple(x.detach() for x in got_in), strict=strict)
    ((h, n), ys), ((hw, nw), ysw) = ep.module()(*got_in), f(*want_in)
    assert n.dtype == nw.dtype and int(n) == int(nw) == 7
    torch.testing.assert_close(ys.double(), ysw.detach(), rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(h.sum() + (ys * ys).sum(), got_in)
    for gr, w in zip(grads, torch.autograd.grad(hw.sum() + (ysw * ysw).sum(), want_in)):
        torch.testing.assert_close(gr.double(), w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", [None, "aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
@pytest.mark.parametrize("op", ["scan", "scan(length)", "map", "map(batch_size)"])
def test_zero_length_outputs_join_the_graph(op, backend):
    """Hunt 25 (F10), hunt 27 under tfun.jit: with T=0 the stacked outputs of scan and map were
    fresh empty tensors with no `grad_fn`, so `ys.sum().backward()` (or `torch.autograd.grad`)
    failed with torch's "does not require grad", where torch's own ops on empty tensors (and
    tfun.grad) run and give zero gradients. `backend`: eagerly (None) or under tfun.jit."""
    h0 = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(0, 3, dtype=torch.float64, requires_grad=True)

    def run(h0, xs):
        if op == "scan":
            _, ys = lax.scan(lambda c, x: (c + x, (c * x, (c * x).to(torch.int64))), h0, xs)
            return ys[0]
        if op == "scan(length)":
            return lax.scan(lambda c, x: (c * 2, c.sin()), h0, None, length=0)[1]
        if op == "map":
            return lax.map(lambda x: x * h0, xs)
        return lax.map(lambda x: x.cos(), xs, batch_size=2)

    torch._dynamo.reset()
    ys = run(h0, xs) if backend is None else tfun.jit(run, backend=backend)(h0, xs)
    assert ys.shape == (0, 3) and ys.requires_grad
    inputs = (h0,) if op == "scan(length)" else (xs,) if op == "map(batch_size)" else (h0, xs)
    grads = torch.autograd.grad(ys.sum(), inputs, allow_unused=op == "map")
    for g, x in zip(grads, inputs):
        assert g is None or torch.equal(g, torch.zeros_like(x))
    with torch.no_grad():  # no graph where autograd does not record
        assert not lax.map(lambda x: x * h0, xs).requires_grad


_READS_ITS_OWN_INPUT = {
    # a fixed-point iteration started at its input: z0 = x, z <- cos(z) / 2 + x
    "fori_loop(init=x, body reads x)": lambda x, W: lax.fori_loop(0, 5, lambda i, z: torch.cos(z) * 0.5 + x, x),
    # a matrix power series: init W, body reads W
    "fori_loop(init=W, body reads W)": lambda x, W: lax.fori_loop(0, 4, lambda i, P: P @ W + W, W),
    # init x[0], body reads x[1], xs x
    "scan(init=x[0], body reads x[1])": lambda x, W: lax.scan(lambda c, xt: (c * 0.5 + x[1] + xt, c), x[0], x),
    # each row scaled by the column sums
    "map(xs=x, body reads x)": lambda x, W: lax.map(lambda r: r * x.sum(0), x),
}


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
@pytest.mark.parametrize("name", list(_READS_ITS_OWN_INPUT))
def test_a_loop_whose_init_or_xs_the_body_also_reads_compiles(name, backend):
    """Hunt 28 (F1): under tfun.jit, a loop whose `init` (map: `xs`) is a tensor its body also
    closes over, or a view of one, was refused by torch ("scan might be aliasing the input or
    the output", "Encountered aliasing during higher order op tracing"). Eagerly and in JAX
    these are ordinary programs. Values and the gradients of both inputs against float64."""
    f = _READS_ITS_OWN_INPUT[name]
    g = torch.Generator().manual_seed(0)
    x0, W0 = torch.randn(4, 3, generator=g), torch.randn(3, 3, generator=g) * 0.3
    loss = lambda out: sum((t.double() ** 2).sum() for t in tfun.tree.tree_leaves(out))  # noqa: E731
    x64, W64 = x0.double().requires_grad_(), W0.double().requires_grad_()
    want = f(x64, W64)
    gx, gW = torch.autograd.grad(loss(want), (x64, W64), allow_unused=True)
    torch._dynamo.reset()
    x, W = x0.clone().requires_grad_(), W0.clone().requires_grad_()
    got = tfun.jit(f, backend=backend)(x, W)
    for a, b in zip(tfun.tree.tree_leaves(got), tfun.tree.tree_leaves(want)):
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-6)
    loss(got).backward()
    for grad, ref in ((x.grad, gx), (W.grad, gW)):
        if ref is None:
            assert grad is None or not grad.any()
        else:
            torch.testing.assert_close(grad.double(), ref, rtol=1e-4, atol=1e-5)


class _InitIsWhatTheBodyReads(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.name = name

    def forward(self, x, W):
        return _READS_ITS_OWN_INPUT[self.name](x, W)


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
@pytest.mark.parametrize("name", list(_READS_ITS_OWN_INPUT))
def test_a_loop_whose_init_or_xs_the_body_also_reads_under_export(name, strict):
    """Hunt 28 (F0): exported (strict and not), a fori_loop or scan whose `init` is a tensor
    the body also reads ran with wrong values and no error (off by 0.13 to 20): torch's
    exported scan passed that tensor as both `init` and an additional input (plain torch's
    exported scan is wrong the same way). tfun passes a copy as `init`. Values and gradients
    of the exported module against eager float64."""
    g = torch.Generator().manual_seed(0)
    x0, W0 = torch.randn(4, 3, generator=g), torch.randn(3, 3, generator=g) * 0.3
    module = torch.export.export(_InitIsWhatTheBodyReads(name), (x0, W0), strict=strict).module()
    loss = lambda out: sum((t.double() ** 2).sum() for t in tfun.tree.tree_leaves(out))  # noqa: E731
    x64, W64 = x0.double().requires_grad_(), W0.double().requires_grad_()
    want = _InitIsWhatTheBodyReads(name)(x64, W64)
    refs = torch.autograd.grad(loss(want), (x64, W64), allow_unused=True)
    x, W = x0.clone().requires_grad_(), W0.clone().requires_grad_()
    got = module(x, W)
    for a, b in zip(tfun.tree.tree_leaves(got), tfun.tree.tree_leaves(want)):
        torch.testing.assert_close(a.double(), b.detach(), rtol=1e-5, atol=1e-6)
    loss(got).backward()
    for grad, ref in zip((x.grad, W.grad), refs):
        if ref is None:
            assert grad is None or not grad.any()
        else:
            torch.testing.assert_close(grad.double(), ref, rtol=1e-4, atol=1e-5)


def _nested_program(inner_len, unroll):
    torch.manual_seed(0)
    W = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)  # a parameter the inner body reads

    def f(x):
        def outer(h, xt):
            steps = xt.reshape(1, 3).expand(inner_len, 3)
            h = lax.scan(lambda c, t: (torch.tanh(c @ W + t), c.sum()), h, steps, unroll=unroll)[0]
            return h, h.sum()

        return lax.scan(outer, torch.zeros(3, dtype=torch.float64), x)[1]

    return f, W


@pytest.mark.parametrize(
    "inner_len, unroll, backend",
    [(1, 1, "aot_eager"), (3, True, "aot_eager"), (4, 4, "aot_eager"), pytest.param(3, True, "inductor", marks=pytest.mark.heavy)],
)
def test_a_scan_nested_in_a_body_unrolled_or_of_one_step_is_differentiated_under_jit(inner_len, unroll, backend):
    """Hunt 30 F3: a scan in a scan body whose body reads a parameter was refused under tfun.jit
    (torch 2.13 cannot trace its HOP differentiated there), even with one step (scanning
    `tfun.nn.LSTM.step`). One step, or every step unrolled, now runs in the outer body's graph:
    values and the parameter's gradient are eager's."""
    f, W = _nested_program(inner_len, unroll)
    assert_jit_value_and_grad_match_eager(f, (torch.randn(5, 3, dtype=torch.float64),), W, backend=backend)


def test_a_differentiated_scan_nested_in_a_body_is_refused_with_the_way_out():
    f, W = _nested_program(3, 1)
    x = torch.randn(5, 3, dtype=torch.float64)
    with pytest.raises(JitError) as info:
        tfun.jit(f, backend="aot_eager")(x)
    msg = str(info.value)
    assert "inside another loop's body is differentiated" in msg and "unroll=True" in msg
    assert "torch.no_grad()" in msg and "no printing or .item()" not in msg
    with torch.no_grad():  # the way out for inference
        torch.testing.assert_close(tfun.jit(f, backend="aot_eager")(x), f(x))


def test_scanning_a_recurrent_layer_step_under_jit_with_gradients():
    """The practical form of hunt 30 F3: a generation loop over `tfun.nn.LSTM.step` (one
    step is a one-step scan), compiled, with the parameters' gradients."""
    torch.manual_seed(0)
    lstm = tfun.nn.LSTM(3, 4, batch_first=True, dtype=torch.float64)

    def generate(x):
        def body(state, xt):
            y, state = lstm.step(xt, state)
            return state, y

        return lax.scan(body, lstm.init_state(2, dtype=torch.float64), x.transpose(0, 1))[1]

    x = torch.randn(2, 6, 3, dtype=torch.float64)
    assert_jit_value_and_grad_match_eager(lambda x: generate(x).square(), (x,), list(lstm.parameters()))


def _integer_constants_program(x: torch.Tensor) -> Any:
    """Integer and bool constants (negative ones, int64 beyond float64's 2**53, int32, bool)
    carried and returned through scan, a cond inside it, switch, map and fori_loop."""
    big = torch.tensor(-(2**62) - 3)

    def step(c, xt):
        h, k, b = c
        k2 = lax.cond(xt.sum() > 0, lambda k: k - 1, lambda k: k + 2, k)
        ys = (k, torch.tensor(-5), big + 1, torch.tensor(7, dtype=torch.int32) - 9, b)
        return (h + xt * k2.to(h.dtype), k2, ~b), ys

    (h, k, b), ys = lax.scan(step, (x[0] * 0, torch.tensor(-7), torch.tensor(True)), x)
    m = lax.map(lambda r: (r.sum(), torch.tensor(-3), torch.tensor(2**62 + 11)), x)
    s = lax.switch((x.sum() > 0).long(), [lambda: torch.tensor(-4), lambda: torch.tensor(-(2**63))])
    f = lax.fori_loop(0, 3, lambda i, c: (c[0] * 0.5 + tfun.at(x)[i].get(), c[1] - i), (x[0], torch.tensor(-11)))
    return (h.sum() + m[0].sum() + f[0].sum(), (k, b, ys, m[1:], s, f[1]))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
def test_integer_constants_through_loops_and_branches_under_jit_with_gradients(backend):
    """Hunt 32, finding 1 (silent wrong numbers): under grad mode integer leaves crossed
    torch's HOPs as their int64 bits viewed as float64, a NaN pattern for a negative value;
    Inductor folded a constant one (`torch.tensor(-7)` as a scan's `init`) into the canonical
    NaN, which came back as 9221120237041090560, and the float values computed from it (and
    their gradients) were wrong. Against eager, values exact, the gradient in float64."""
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    want_g, want = tfun.grad(_integer_constants_program, has_aux=True)(x)
    torch._dynamo.reset()
    got_g, got = tfun.jit(tfun.grad(_integer_constants_program, has_aux=True), backend=backend)(x)
    got_leaves, want_leaves = tfun.tree.tree_leaves(got), tfun.tree.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for a, b in zip(got_leaves, want_leaves):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    torch.testing.assert_close(got_g, want_g)
    # and a .backward() after a jitted forward
    torch._dynamo.reset()
    xr = x.clone().requires_grad_()
    loss, aux = tfun.jit(_integer_constants_program, backend=backend)(xr)
    loss.backward()
    for a, b in zip(tfun.tree.tree_leaves(aux), want_leaves):
        assert torch.equal(a, b), (a, b)
    torch.testing.assert_close(xr.grad, want_g)


@pytest.mark.parametrize("reverse", [False, True])
def test_traced_scan_calls_torchs_scan_op_without_its_python_wrapper(reverse, monkeypatch):
    """Under tfun.jit, tfun calls torch's scan op itself with its flat lists
    (`_hop.scan_flat`, `_compat.scan_hop`): torch's Python `scan()` would flatten them again,
    Python that Dynamo traces one instruction at a time. `reverse` flips `xs` and every y as
    the wrapper did, the ys wrapped in the dicts that carry an int's dtype (grad mode) or a
    complex pair (no grad) across the HOP included: eager float64's values and gradients."""
    # (the submodule: `torch._higher_order_ops.scan` as an attribute is the function)
    module = importlib.import_module("torch._higher_order_ops.scan")

    def no_wrapper(*args, **kwargs):
        raise AssertionError("torch's scan() wrapper was called under tfun.jit")

    def f(h0, xs, W):
        def step(h, x):
            h = torch.tanh(h @ W + x)
            return h, {"h": h * 2.0, "n": h.argmax()}

        return lax.scan(step, h0, xs, reverse=reverse)

    def c(z, zs):  # complex carry and ys under no_grad (they cross as real pairs)
        return lax.scan(lambda a, b: (a * 0.5 + b, a.conj()), z, zs, reverse=reverse)

    g = torch.Generator().manual_seed(3)
    h0, xs, W = torch.randn(3, generator=g), torch.randn(6, 3, generator=g), torch.randn(3, 3, generator=g) * 0.5
    loss = lambda h0, xs, W: (f(h0, xs, W)[0] ** 2).sum() + (f(h0, xs, W)[1]["h"] * torch.arange(6.0)[:, None]).sum()  # noqa: E731
    want = f(*(t.double() for t in (h0, xs, W)))
    want_g = tfun.grad(loss, argnums=(0, 1, 2))(*(t.double() for t in (h0, xs, W)))
    z = torch.randn(2, dtype=torch.complex64, generator=g)
    zs = torch.randn(5, 2, dtype=torch.complex64, generator=g)
    want_c = c(z.to(torch.complex128), zs.to(torch.complex128))
    monkeypatch.setattr(module, "scan", no_wrapper)
    torch._dynamo.reset()
    got = tfun.jit(f, backend="aot_eager")(h0, xs, W)
    got_g = tfun.jit(tfun.grad(loss, argnums=(0, 1, 2)), backend="aot_eager")(h0, xs, W)
    with torch.no_grad():
        got_c = tfun.jit(c, backend="aot_eager")(z, zs)
    assert got[1]["n"].dtype == torch.int64
    assert_tree_allclose(tree_map(lambda t: t.double() if t.is_floating_point() else t, got), want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
    assert_tree_allclose(tree_map(lambda t: t.to(torch.complex128), got_c), want_c, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
