"""tfun._scan_in_place: CPU scans under tfun.jit (Inductor) compile as loops that update their
state in place, with nothing allocated per step.

Every compiled result and gradient is compared with the float64 eager result, with the rewrite
on (tfun.jit's default) and, where it matters, off; `REWRITES` shows it was really applied (or
not), and the generated code is read for what a step does. The caller's tensors must come back
unchanged: the loop writes into its own copy of `init`.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import tfun
from tfun import _compat, _scan_in_place
from tfun.errors import JitError

from .helpers import tree_allclose

pytestmark = pytest.mark.skipif(_compat.CustomGraphPass is object, reason="no custom graph passes")

lax = tfun.lax
OFF = {"post_grad_custom_post_pass": None}


@pytest.fixture(autouse=True)
def _compile_every_graph():
    """Inductor's caches off: these tests count the rewrites (`REWRITES`), which a graph taken
    from a cache (tfun.jit lets the caches keep loop graphs: `_compat.loop_hop_cache_marks`)
    does not run again."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
#: the tests of scans (and maps) rewritten: not on a torch whose C++ backend can fail on a kernel
#: indexed by a loaded value (there the pass leaves scans to torch; the last test checks that)
scan_rewrite = pytest.mark.skipif(
    _compat.cpp_transposes_indirect_index(),
    reason=f"torch {torch.__version__}: scans are left to torch (_compat.cpp_transposes_indirect_index)",
)


def _f64(tree):
    return tfun.tree.tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def _rewrites(fn, *args, kind="scan", **jit_kwargs):
    """(result, loops of `kind` ("scan", "map_impl", "while_loop") rewritten) of a fresh
    tfun.jit(fn)'s first call."""
    torch._dynamo.reset()
    before = _scan_in_place.REWRITES[kind]
    out = tfun.jit(fn, **jit_kwargs)(*args)
    return out, _scan_in_place.REWRITES[kind] - before


def _rnn(reverse=False):
    def f(W, xs, h0):
        return lax.scan(lambda h, x: (lambda n: (n, n))(torch.tanh(h @ W + x)), h0, xs, reverse=reverse)

    return f


def _data(T, B=3, H=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, H, generator=g) / H**0.5, torch.randn(T, B, H, generator=g), torch.randn(B, H, generator=g)


@scan_rewrite
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("reverse", [False, True])
def test_rnn_forward_matches_float64_and_is_rewritten(T, reverse):
    args = _data(T)
    copies = [a.clone() for a in args]
    f = _rnn(reverse)
    with torch.no_grad():
        out, n = _rewrites(f, *args)
    assert n == 1
    ref = f(*_f64(args))
    assert tree_allclose(_f64(out), ref, rtol=1e-5, atol=1e-5)
    if T > 1 and not reverse:  # torch's own loop gives the same float32 result
        with torch.no_grad():
            off, n_off = _rewrites(f, *args, options=OFF)
        assert n_off == 0
        assert tree_allclose(off, out, rtol=1e-6, atol=1e-6)
    for a, c in zip(args, copies):  # the loop wrote into its own copy of h0, nothing of the caller's
        assert torch.equal(a, c)


@scan_rewrite
@pytest.mark.parametrize("reverse", [False, True])
def test_gradients_match_float64_with_forward_and_backward_scans_rewritten(reverse):
    args = _data(6)
    f = _rnn(reverse)

    def loss(W, xs, h0):
        h, ys = f(W, xs, h0)
        return (ys * ys).sum() + h.sum()

    vg = tfun.value_and_grad(loss, argnums=(0, 1, 2))
    (v, g), n = _rewrites(vg, *args)
    assert n >= 2  # the forward's scan and the backward's
    rv, rg = vg(*_f64(args))
    assert tree_allclose(_f64((v, g)), (rv, rg), rtol=1e-5, atol=1e-5)
    # and through .backward() outside the compiled call
    leaves = [a.clone().requires_grad_(True) for a in args]
    torch._dynamo.reset()
    tfun.jit(loss)(*leaves).backward()
    assert tree_allclose(_f64([t.grad for t in leaves]), list(rg), rtol=1e-5, atol=1e-5)


@scan_rewrite
def test_carries_read_at_other_positions_than_they_are_written():
    """The new carry reads the old one at other indices (a flip, a transpose, a shift): writing
    it in place must not let a step see its own writes."""

    def f(h, xs):
        def step(c, x):
            a, b, s = c
            na = torch.flip(a, [0]) + x
            nb = b.t() @ a[:2] + 0.5 * b  # b is square
            ns = torch.roll(s, 1) + s
            return (na, nb, ns), (a, nb.sum())  # y: the *old* a, and a scalar

        return lax.scan(step, h, xs)

    g = torch.Generator().manual_seed(1)
    h = (torch.randn(4, 2, generator=g), torch.randn(2, 2, generator=g), torch.randn(5, generator=g))
    xs = torch.randn(9, 4, 2, generator=g)
    with torch.no_grad():
        out, n = _rewrites(f, h, xs)
    assert n == 1
    assert tree_allclose(_f64(out), f(_f64(h), _f64(xs)), rtol=1e-5, atol=1e-5)


@scan_rewrite
def test_pytree_int_bool_and_aliased_carries_and_no_ys():
    def f(h0, xs):
        def step(c, x):
            h, k, flag, h2 = c
            nh = torch.tanh(h + x)
            return (nh, k + 1, ~flag, h2 * 0.5 + nh), None

        return lax.scan(step, (h0, torch.tensor(0), torch.tensor(True), h0), xs)

    g = torch.Generator().manual_seed(2)
    h0, xs = torch.randn(3, generator=g), torch.randn(5, 3, generator=g)
    with torch.no_grad():
        out, n = _rewrites(f, h0, xs)
    assert n == 1
    ref = f(h0.double(), xs.double())
    assert tree_allclose(_f64(out), ref, rtol=1e-6, atol=1e-6)
    assert out[0][1].dtype == torch.int64 and int(out[0][1]) == 5 and bool(out[0][2]) is False


@scan_rewrite
def test_non_contiguous_init_and_closed_over_tensors():
    W, xs, h0 = _data(5, B=4, H=4)
    h0t = h0.t()  # (H, B), strides (1, H)

    def f(W, xs, h0t):
        return lax.scan(lambda h, x: (torch.tanh(W @ h + x.t()), h.sum(0)), h0t, xs)

    with torch.no_grad():
        out, n = _rewrites(f, W, xs, h0t)
    assert n == 1
    assert tree_allclose(_f64(out), f(*_f64((W, xs, h0t))), rtol=1e-5, atol=1e-5)


@scan_rewrite
def test_nested_scans_and_scan_in_cond_are_rewritten_and_right():
    def f(W, xs, h0, p):
        def outer(h, x):
            inner_h, _ = lax.scan(lambda c, z: (torch.tanh(c @ W + z), None), h, x.unsqueeze(0).expand(3, *x.shape))
            return inner_h, inner_h.sum()

        h, ys = lax.scan(outer, h0, xs)
        return lax.cond(p, lambda: _rnn()(W, xs, h)[0], lambda: h * 2.0), ys

    W, xs, h0 = _data(4)
    for p in (torch.tensor(True), torch.tensor(False)):
        with torch.no_grad():
            out, n = _rewrites(f, W, xs, h0, p)
        assert n >= 3
        assert tree_allclose(_f64(out), f(*_f64((W, xs, h0)), p), rtol=1e-5, atol=1e-5)


@scan_rewrite
@pytest.mark.parametrize("reverse", [False, True])
def test_symbolic_shapes_are_rewritten_too(reverse):
    """tfun.jit recompiles with symbolic sizes when a shape changes (automatic dynamic): the
    loop of that graph is rewritten as well, and serves every later length and batch."""
    f = _rnn(reverse)
    jf = tfun.jit(f)
    torch._dynamo.reset()
    before = _scan_in_place.REWRITES["scan"]
    with torch.no_grad():
        for T, B in ((6, 3), (9, 3), (4, 5), (2, 2)):  # the 2nd call recompiles with symbols
            args = _data(T, B=B, seed=T)
            assert tree_allclose(_f64(jf(*args)), f(*_f64(args)), rtol=1e-5, atol=1e-5), (T, B)
    # the static graph, and each recompile with symbols (the length's, then the batch's)
    assert _scan_in_place.REWRITES["scan"] - before == 3


@pytest.mark.heavy  # CI's second torch phase leaves it out (27 s there); `test_symbolic_shapes_are_rewritten_too` stays
@scan_rewrite
def test_symbolic_shapes_gradients_map_and_while_loop():
    def loss(W, xs, h0):
        h, ys = _rnn()(W, xs, h0)
        m = lax.map(lambda y: torch.sin(y).sum(), ys)
        k, h = lax.while_loop(lambda c: c[0] < xs.shape[0], lambda c: (c[0] + 1, torch.tanh(c[1] * 0.5)), (torch.tensor(0), h))
        return (ys * ys).sum() + m.sum() + h.sum()

    vg = tfun.value_and_grad(loss, argnums=(0, 1, 2))
    jvg = tfun.jit(vg, dynamic=True)
    torch._dynamo.reset()
    before = _scan_in_place.REWRITES.copy()
    for T, B in ((5, 3), (8, 2)):
        args = _data(T, B=B, seed=T)
        assert tree_allclose(_f64(jvg(*args)), vg(*_f64(args)), rtol=1e-5, atol=1e-5), (T, B)
    after = _scan_in_place.REWRITES
    assert after["scan"] - before["scan"] >= 2  # the forward's scan and the backward's
    assert after["map_impl"] - before["map_impl"] >= 1


def _loop_code(fn=None, args=None, **jit_kwargs):
    """The generated wrapper's loop body and condition for `fn(*args)` (the small RNN by default)."""
    fn, args = (_rnn(), _data(16, B=4, H=32)) if fn is None else (fn, args)
    torch._dynamo.reset()
    with torch.no_grad():
        _, codes = run_and_get_code(tfun.jit(fn, **jit_kwargs), *args)
    code = "\n".join(codes)
    body = re.search(r"def while_loop_body_graph_\w+\(args\):\n(.*?)\n\n", code, re.S)
    cond = re.search(r"def while_loop_cond_graph_\w+\(args\):\n(.*?)\n\n", code, re.S)
    assert body, code
    return body.group(1), (cond.group(1) if cond else None), code


@scan_rewrite
def test_a_step_allocates_no_state_and_reads_no_counter():
    """What the rewrite is for: in the generated wrapper, the loop body reads no counter with
    `.item()` and allocates no new carry or counter (what is left is the step's own scratch,
    here the matrix product's sum), and the condition runs no kernel and allocates nothing."""
    body, cond, code = _loop_code()
    body_off, cond_off, _ = _loop_code(options=OFF)
    assert ".item()" in body_off and ".item()" not in body
    assert "empty_strided_cpu((), ()" in body_off and "empty_strided_cpu((), ()" not in body
    assert body.count("empty_strided") < body_off.count("empty_strided"), (body, body_off)
    assert cond_off is not None and "cpp_fused" in cond_off
    # the scan's 16 steps are counted: no condition is asked per step (`_compat.counted_while_loops`)
    assert cond is None and "for _ in range(16):  # tfun: a loop of static length" in code, code
    assert "while should_loop" not in code


@pytest.mark.parametrize("packed", [False, True], ids=["tensor", "one_tuple"])
def test_a_while_loop_of_one_tensor_compiles_and_equals_float64(packed):
    """A while_loop whose state is one tensor (bare or in a 1-tuple): the rewrite's replacement
    has one result, which Inductor's pattern matcher put in the place of the loop node itself,
    so the loop's `res[0]` indexed the tensor ("getitem is not an OpOverload": every such loop
    failed to compile under tfun.jit, with a float condition as with an int one)."""
    def f(x):
        if packed:
            return lax.while_loop(lambda c: c[0].sum() < 50.0, lambda c: (c[0] * 1.5 + 1.0,), (x,))[0]
        return lax.while_loop(lambda c: c.sum() < 50.0, lambda c: c * 1.5 + 1.0, x)

    x = torch.tensor([1.0, 0.5, 0.25])
    torch._dynamo.reset()
    before = _scan_in_place.REWRITES["while_loop"]
    got = tfun.jit(f)(x)
    assert _scan_in_place.REWRITES["while_loop"] == before + 1
    torch.testing.assert_close(got.double(), f(x.double()))


@scan_rewrite
def test_only_a_static_length_is_counted():
    """A while_loop whose condition depends on the data keeps asking it each step (its condition
    is computed in the step's kernel, without a kernel or buffer of its own); so does a scan of
    symbolic length."""
    def f(x):
        return lax.while_loop(lambda c: c[0].sum() < 50.0, lambda c: (c[0] * 1.5 + 1.0,), (x,))[0]

    body, cond, code = _loop_code(f, (torch.ones(3),))
    assert cond is not None and "cpp_fused" not in cond and "empty_strided" not in cond, cond
    assert "while should_loop" in code and "# tfun: a loop of static length" not in code
    torch.testing.assert_close(tfun.jit(f)(torch.ones(3)), f(torch.ones(3)))
    rnn = _rnn()
    _, cond, code = _loop_code(rnn, _data(16, B=4, H=32), dynamic=True)
    assert "# tfun: a loop of static length" not in code


def test_options_turn_it_off_and_other_backends_never_see_it():
    with torch.no_grad():
        _, n = _rewrites(_rnn(), *_data(3), options=OFF)
        assert n == 0
        _, n = _rewrites(_rnn(), *_data(3), backend="aot_eager")
        assert n == 0


@scan_rewrite
@pytest.mark.parametrize("T", [1, 6])
def test_map_is_rewritten_too_values_and_gradients(T):
    """`lax.map` is a scan without a carry: its loop gets the same treatment."""
    g = torch.Generator().manual_seed(3)
    W, xs, b = torch.randn(4, 4, generator=g), torch.randn(T, 2, 4, generator=g), torch.randn(4, generator=g)

    def f(W, xs, b):
        return lax.map(lambda x: (torch.tanh(x @ W + b), x.sum()), xs)

    with torch.no_grad():
        out, n = _rewrites(f, W, xs, b, kind="map_impl")
    assert n == 1
    assert tree_allclose(_f64(out), f(*_f64((W, xs, b))), rtol=1e-5, atol=1e-5)

    def loss(W, xs, b):
        y, s = f(W, xs, b)
        return (y * y).sum() + s.sum()

    vg = tfun.value_and_grad(loss, argnums=(0, 1, 2))
    torch._dynamo.reset()
    got = tfun.jit(vg)(W, xs, b)
    assert tree_allclose(_f64(got), vg(*_f64((W, xs, b))), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------
# while_loop (and fori_loop with traced bounds): the condition computed inside the step
# ----------------------------------------------------------------------------------------


def _decay(n):
    def f(W, x, k0):
        def body(c):
            i, x = c
            return i + 1, 0.9 * x + 0.1 * torch.sin(x @ W)

        return lax.while_loop(lambda c: c[0] < n, body, (k0, x))

    return f


@pytest.mark.parametrize("k0", [0, 4, 9])  # 9 steps, 5 steps, none (the condition is false at once)
def test_while_loop_matches_float64_and_is_rewritten(k0):
    W, x, _ = _data(1, B=3, H=5)
    x = x[0]
    k = torch.tensor(k0)
    copies = [t.clone() for t in (W, x, k)]
    f = _decay(9)
    with torch.no_grad():
        out, n = _rewrites(f, W, x, k, kind="while_loop")
    assert n == 1
    ref = f(W.double(), x.double(), k)
    assert int(out[0]) == max(k0, 9)
    assert tree_allclose(_f64(out), ref, rtol=1e-5, atol=1e-6)
    for a, c in zip((W, x, k), copies):  # the loop wrote into its own copy of the state
        assert torch.equal(a, c)


def test_while_loop_condition_on_state_and_closed_over_tensors_with_swaps_and_a_bool_carry():
    """The condition reads several state leaves and a closed-over tensor; the body swaps two
    leaves, passes one through unchanged and flips a bool carry that the condition returns as is
    (the loop's own `go` must be a copy of it, not the carry itself)."""

    def f(a, b, limit):
        def body(c):
            a, b, keep, flag, k = c
            return b, a + 1.0, keep, ~flag, k + 1

        def cond(c):
            return c[3] & (c[0].sum() + c[1].sum() < limit) & (c[4] < 50)

        return lax.while_loop(cond, body, (a, b, a * 2.0, torch.tensor(True), torch.tensor(0)))

    a, b = torch.zeros(3), torch.ones(3)
    for limit in (5.0, 40.0, 1e9):
        with torch.no_grad():
            out, n = _rewrites(f, a, b, torch.tensor(limit), kind="while_loop")
        assert n == 1
        ref = f(a.double(), b.double(), torch.tensor(limit, dtype=torch.float64))
        assert tree_allclose(_f64(out), ref, rtol=1e-6, atol=1e-6), (limit, out, ref)


def test_fori_loop_with_traced_bounds_is_a_rewritten_while_loop():
    W, x, _ = _data(1, B=3, H=5)
    x = x[0]

    def f(W, x, lo, hi):
        return lax.fori_loop(lo, hi, lambda i, x: torch.tanh(x @ W + i), x)

    for lo, hi in ((0, 7), (3, 3), (5, 2)):
        lo_t, hi_t = torch.tensor(lo), torch.tensor(hi)
        with torch.no_grad():
            out, n = _rewrites(f, W, x, lo_t, hi_t, kind="while_loop")
        assert n == 1
        assert tree_allclose(_f64(out), f(W.double(), x.double(), lo_t, hi_t), rtol=1e-5, atol=1e-6)


@scan_rewrite
def test_while_loop_around_a_scan_and_inside_one():
    W, xs, h0 = _data(4)

    def f(W, xs, h0):
        def body(c):
            k, h = c
            h, _ = _rnn()(W, xs, h)
            return k + 1, h

        k, h = lax.while_loop(lambda c: c[0] < 3, body, (torch.tensor(0), h0))

        def step(h, x):
            _, h = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, torch.tanh(c[1] + x)), (torch.tensor(0), h))
            return h, h.sum()

        return lax.scan(step, h, xs)

    with torch.no_grad():
        torch._dynamo.reset()
        before = _scan_in_place.REWRITES.copy()
        out = tfun.jit(f)(W, xs, h0)
        after = _scan_in_place.REWRITES
    assert after["while_loop"] - before["while_loop"] >= 2
    assert after["scan"] - before["scan"] >= 2
    assert tree_allclose(_f64(out), f(*_f64((W, xs, h0))), rtol=1e-5, atol=1e-5)


def test_while_loop_step_allocates_no_state_and_the_condition_runs_no_kernel():
    W, x, _ = _data(1, B=4, H=32)
    args = (W, x[0], torch.tensor(0))

    body, cond, _ = _loop_code(_decay(100), args)
    body_off, cond_off, _ = _loop_code(_decay(100), args, options=OFF)
    assert "cpp_fused" in cond_off and "cpp_fused" not in cond and "empty_strided" not in cond, cond
    assert "empty_strided_cpu((), ()" in body_off and "empty_strided_cpu((), ()" not in body
    assert body.count("empty_strided") < body_off.count("empty_strided"), (body, body_off)


def test_while_loop_gradients_are_torchs_and_right():
    """A differentiated while_loop is torch's (its autograd form is not a plain while_loop);
    its gradient under tfun.jit still matches float64, with the rewrite on."""
    W, x, _ = _data(1, B=3, H=4)
    x = x[0]
    f = _decay(5)

    def loss(W, x):
        return (f(W, x, torch.tensor(0))[1] ** 2).sum()

    g = tfun.grad(loss, argnums=(0, 1))
    torch._dynamo.reset()
    got = tfun.jit(g)(W, x)
    assert tree_allclose(_f64(got), g(W.double(), x.double()), rtol=1e-5, atol=1e-6)


def test_vmap_inside_jit_rewritten_scan_matches_float64():
    """tfun.vmap of a scan inside tfun.jit: torch batches the scan (its batch axis moved last),
    and the batched loop is the one rewritten; the values must still be float64's. (Where the
    installed torch cannot batch a control-flow op under torch.compile, tfun.jit refuses it
    with its own error: tests/test_jit_matrix.py.)"""
    W, _, _ = _data(1, H=5)
    g = torch.Generator().manual_seed(4)
    xs, h0 = torch.randn(4, 7, 3, 5, generator=g), torch.randn(4, 3, 5, generator=g)
    f = tfun.vmap(_rnn(), in_axes=(None, 0, 0))
    with torch.no_grad():
        try:
            out, n = _rewrites(f, W, xs, h0)
        except JitError as e:  # the installed torch cannot trace it: tfun's error, never a wrong value
            assert "could not compile" in str(e)
            return
    # (left to torch where tfun does not rewrite scans: torch 2.11, `scan_rewrite` above)
    assert n == (0 if _compat.cpp_transposes_indirect_index() else 1)
    assert tree_allclose(_f64(out), f(*_f64((W, xs, h0))), rtol=1e-5, atol=1e-5)


@scan_rewrite
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
def test_vmap_of_a_scan_with_a_cond_in_its_step_matches_float64():
    """Under a traced vmap the step of a scan can be traced on a contiguous slice while the
    batched `xs` is laid out batch-last; a `cond` inside the step reads its operands in the
    strides it was traced with, so the rewritten loop, which passes `xs[i]` as it lies, gave
    transposed values (max error 3 before the fix). Such a loop is left to torch; a step
    whose slices agree with its subgraph (the same program without vmap) is still rewritten."""

    def f(x):
        def step(c, xt):
            i, h = c
            h = lax.cond(i % 2 == 0, lambda h: h + xt, lambda h: h * 0.5 - xt, h)
            return (i + 1, h), h.sum()

        return lax.scan(step, (torch.tensor(0), torch.zeros(3, dtype=x.dtype)), x)

    x = torch.randn(4, 6, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, _ = _rewrites(tfun.vmap(f), x)
        assert tree_allclose(_f64(out), tfun.vmap(f)(x.double()), rtol=1e-5, atol=1e-5)
        out, n = _rewrites(f, x[0])
    assert n == 1
    assert tree_allclose(_f64(out), f(x[0].double()), rtol=1e-5, atol=1e-5)


@scan_rewrite
@pytest.mark.parametrize("kind", ["scan", "map"])
def test_a_cond_reading_a_slice_of_non_contiguous_xs_matches_float64(kind):
    """The same without vmap: `xs` transposed, so a step's slice is not contiguous, and a
    `cond` in the step reads it. The rewritten loop gave the slice's values in transposed
    order, forward (max error 3-5) and gradient (hunt 22); such loops are left to torch, and
    values and gradients equal eager float64."""

    def f(x):
        xs = x.transpose(1, 2)
        if kind == "map":
            return lax.map(lambda r: lax.cond(r.sum() > 0, lambda v: v * 2, lambda v: v - 1, r), xs)

        def step(c, xt):
            i, h = c
            h = lax.cond(i % 2 == 0, lambda h: h + xt, lambda h: h * 0.5 - xt, h)
            return (i + 1, h), h.sum()

        return lax.scan(step, (torch.tensor(0), torch.zeros(4, 3, dtype=x.dtype)), xs)

    x = torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    xg = x.clone().requires_grad_()
    out = tfun.jit(f)(xg)
    x64 = x.double().requires_grad_()
    want = f(x64)
    assert tree_allclose(_f64(out), want, rtol=1e-5, atol=1e-5)
    loss = lambda o: sum((t.double() ** 2).sum() for t in tfun.tree.tree_leaves(o) if t.is_floating_point())
    (g,) = torch.autograd.grad(loss(out), xg)
    (w,) = torch.autograd.grad(loss(want), x64)
    torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["map", "scan", "while_loop"])
def test_a_convolution_in_the_step_leaves_the_loop_to_torch_and_matches_float64(kind):
    """A per-frame `conv2d` in a map, scan or while_loop step. Inductor lowers a body holding a
    convolution with its layout optimization, and returned a copy of the loop state in
    another layout instead of the buffer it wrote in place: the rewritten loop's later steps
    went into copies, the stacked outputs were uninitialized memory from step 1 on (errors up
    to 1e37, no error raised; hunt 23), and the gradient of a scan through a padded conv was
    garbage or NaN. Such loops are left to torch (`_keeps_layouts`): values and gradients
    equal eager float64, the caller's tensors are unchanged."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(3)
    k, xs = torch.randn(3, 3, 3, 3, generator=g) * 0.2, torch.randn(6, 3, 2, 3, generator=g)

    def f(k, xs):
        conv = lambda x: F.conv2d(x[None], k, padding=1)[0]
        if kind == "map":
            return lax.map(conv, xs)
        if kind == "scan":
            return lax.scan(lambda h, x: (torch.tanh(h + conv(x)), conv(x)), torch.zeros(3, 2, 3, dtype=k.dtype), xs)
        return lax.fori_loop(0, xs.shape[0], lambda i, h: torch.tanh(h + F.conv2d(h[None], k, padding=1)[0]), xs[0])

    kg, xg = k.clone().requires_grad_(), xs.clone().requires_grad_()
    k64, x64 = k.double().requires_grad_(), xs.double().requires_grad_()
    loop = {"map": "map_impl", "scan": "scan", "while_loop": "while_loop"}[kind]
    out, n = _rewrites(f, kg, xg, kind=loop)
    want = f(k64, x64)
    assert tree_allclose(_f64(out), want, rtol=1e-5, atol=1e-5)
    loss = lambda o: sum((t.double() ** 2).sum() for t in tfun.tree.tree_leaves(o))
    got_g = torch.autograd.grad(loss(out), (kg, xg))
    want_g = torch.autograd.grad(loss(want), (k64, x64))
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # forward alone: torch's loop, not a rewritten one
        out, n = _rewrites(f, k, xs, kind=loop)
    assert n == 0
    assert tree_allclose(_f64(out), f(k.double(), xs.double()), rtol=1e-5, atol=1e-5)
    assert torch.equal(xs, xg.detach())


def test_symbolic_sizes_torch_cannot_rebuild_are_left_to_torch():
    """Under `dynamic=True`, `ys` of shape (T, A, B, C) has a stride `A*B*C`: torch 2.13 rebuilds
    such a product in the graph as an n-ary node Inductor cannot run, so that loop keeps torch's
    (tests/test_view_copies.py met it first); the values are right either way."""
    g = torch.Generator().manual_seed(5)
    xs, h0 = torch.randn(4, 2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)

    def f(xs, h0):
        return lax.scan(lambda h, x: (torch.tanh(h + x), h * x), h0, xs)

    with torch.no_grad():
        out, n = _rewrites(f, xs, h0, dynamic=True)
    assert n == 0
    assert tree_allclose(_f64(out), f(xs.double(), h0.double()), rtol=1e-6, atol=1e-6)


def test_scans_are_left_to_torch_where_its_cpp_backend_cannot_index_by_a_loaded_value(monkeypatch):
    """Where `_compat.cpp_transposes_indirect_index()` (torch 2.11: a kernel that writes `ys` at
    the counter tensor's index failed to compile, "'tmp10' was not declared in this scope"), no
    scan or map is rewritten, while_loops still are, and the values are right."""
    monkeypatch.setattr(_compat, "cpp_transposes_indirect_index", lambda: True)
    args = _data(5)
    with torch.no_grad():
        out, n = _rewrites(_rnn(), *args)
        assert n == 0
        out_map, n_map = _rewrites(lambda xs: lax.map(torch.tanh, xs), args[1], kind="map_impl")
        assert n_map == 0
        W, x = args[0], args[2][0]
        out_while, n_while = _rewrites(_decay(9), W, x, torch.tensor(0), kind="while_loop")
    assert n_while == 1
    assert tree_allclose(_f64(out_while), _decay(9)(*_f64((W, x, torch.tensor(0)))), rtol=1e-5, atol=1e-5)
    assert tree_allclose(_f64(out), _rnn()(*_f64(args)), rtol=1e-5, atol=1e-5)
    assert torch.allclose(out_map.double(), torch.tanh(args[1].double()), rtol=1e-5, atol=1e-6)


def test_the_cpp_backend_probe_models_this_torch():
    """The stand-in kernel `_compat._cpp_tile2d_probe` asks must still model this torch's
    `CppTile2DKernel` (a plain index with stride 1 along the outer variable is transposed):
    if not, the probe answers "unknown" and every scan is left to torch, which this catches."""
    probe = _compat._cpp_tile2d_probe()
    assert probe is not None and probe[0] is True
    assert _compat.cpp_transposes_indirect_index() is probe[1]
