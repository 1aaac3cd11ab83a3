"""`unroll=` of scan and fori_loop under tfun.jit: `k` steps per iteration of the compiled loop.

The oracle is the eager float64 loop (where `unroll` changes nothing). Each case compares the
jitted outputs and the gradients of every input, and a recording backend checks that the
compiled graph really holds `k` steps per iteration.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tfun
from tfun import lax

from tests.helpers import assert_tree_allclose


def _body(c: Any, x: Any) -> tuple[Any, Any]:
    h, n = c["h"], c["n"]
    h = torch.tanh(h * 0.9 + x["a"]) + 0.1 * x["b"].sum()
    return {"h": h, "n": n + 1}, (h.sum(), None, h * 2)


def _data(T: int, dtype: torch.dtype, seed: int = 0) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)  # drawn in float64, then cast: the same values in both
    h, a, b = (torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in ((3,), (T, 3), (T, 2)))
    return {"h": h, "n": torch.tensor(0)}, {"a": a, "b": b}


def _loss(init: Any, xs: Any, reverse: bool, unroll: Any) -> Any:
    c, ys = lax.scan(_body, init, xs, reverse=reverse, unroll=unroll)
    return c, ys, (c["h"] ** 2).sum() + (ys[0] * torch.arange(ys[0].shape[0], dtype=ys[0].dtype)).sum() + ys[2].sum()


def _check(T: int, reverse: bool, unroll: Any, backend: str) -> None:
    init64, xs64 = _data(T, torch.float64)
    leaves = [init64["h"], xs64["a"], xs64["b"]]
    for t in leaves:
        t.requires_grad_(True)
    want_c, want_ys, want_l = _loss(init64, xs64, reverse, 1)
    want_g = torch.autograd.grad(want_l, leaves)

    init, xs = _data(T, torch.float32)
    got_leaves = [init["h"], xs["a"], xs["b"]]
    for t in got_leaves:
        t.requires_grad_(True)
    run = tfun.jit(_loss, static_argnums=(2, 3), backend=backend)
    got_c, got_ys, got_l = run(init, xs, reverse, unroll)
    got_g = torch.autograd.grad(got_l, got_leaves)
    assert got_c["n"].item() == T and got_c["n"].dtype == torch.int64
    assert_tree_allclose((got_c, got_ys), tfun.tree.tree_map(lambda t: t.detach().float() if t.is_floating_point() else t, (want_c, want_ys)), rtol=1e-4, atol=1e-5)
    for u, v in zip(got_g, want_g):
        torch.testing.assert_close(u, v.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reverse", [False, True])
# CI's second torch phase keeps T=1, an uneven split, unroll=1, False and unroll > T (`heavy`)
@pytest.mark.parametrize(("T", "unroll"), [(1, 4), (7, 3), (6, 1), (3, False), (4, 9)] + [
    pytest.param(T, u, marks=pytest.mark.heavy) for T, u in [(7, 2), (8, 4), (8, True), (5, 0)]])
def test_scan_unroll_matches_eager_float64(T: int, unroll: Any, reverse: bool) -> None:
    _check(T, reverse, unroll, "aot_eager")


# (Inductor: the first length of test_one_jitted_function_at_several_lengths's inductor cells
# is the same static, differentiated, unrolled scan, in both directions.)


@pytest.mark.heavy
# 8 examples: under CI's derandomized profile they are T=1, an uneven split, unroll=0, False,
# True and > T, both directions; the grid above has the other corners
@settings(max_examples=8, deadline=None)
@given(T=st.integers(1, 13), unroll=st.one_of(st.integers(0, 15), st.booleans()), reverse=st.booleans())
def test_scan_unroll_hypothesis(T: int, unroll: Any, reverse: bool) -> None:
    _check(T, reverse, unroll, "aot_eager")


def _graph_tanh_count(fn: Any, *args: Any) -> tuple[int, int]:
    """(tanh calls, scan nodes) over every graph `fn` compiles to, subgraphs included."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    tfun.jit(fn, backend=backend)(*args)
    tanh = scans = 0
    for gm in graphs:
        for mod in gm.modules():
            if isinstance(mod, torch.fx.GraphModule):
                for node in mod.graph.nodes:
                    tanh += node.op == "call_function" and "tanh" in str(node.target)
                    scans += node.op == "call_function" and "scan" in str(node.target)
    return tanh, scans


@pytest.mark.parametrize(("unroll", "tanh", "scans"), [(1, 1, 1), (4, 4, 1), (3, 3 + 2, 2), (True, 8, 1)])
def test_scan_unroll_puts_k_steps_in_the_graph(unroll: Any, tanh: int, scans: int) -> None:
    # 8 steps. unroll=3: a scan over two blocks of 3 steps (3 tanh in its body), then one
    # block of the 2 left over (2 more); unroll=True: one block of all 8.
    def f(h: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        return lax.scan(lambda c, x: (torch.tanh(c + x), None), h, xs, unroll=unroll)[0]

    assert _graph_tanh_count(f, torch.zeros(3), torch.randn(8, 3)) == (tanh, scans)


@pytest.mark.parametrize(("unroll", "tanh"), [(1, 1), (3, 3 + 1), (True, 7)])
def test_fori_loop_unroll_under_jit(unroll: Any, tanh: int) -> None:
    W = torch.randn(4, 4, dtype=torch.float64) / 2
    x0 = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return lax.fori_loop(0, 7, lambda i, x: 0.9 * x + 0.1 * torch.sin(x @ W) * i, x, unroll=unroll)

    want = f(x0)
    (want_g,) = torch.autograd.grad(want.sum(), x0)
    got = tfun.jit(f, backend="aot_eager")(x0)
    (got_g,) = torch.autograd.grad(got.sum(), x0)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_g, want_g)
    tanh_like = _graph_tanh_count(lambda x: lax.fori_loop(0, 7, lambda i, x: torch.tanh(x), x, unroll=unroll), x0.detach())
    assert tanh_like[0] == tanh  # 7 steps: blocks of 3 and one of the 1 left over


def test_scan_unroll_carry_error_is_the_same_as_without() -> None:
    def bad(c: torch.Tensor, x: torch.Tensor) -> Any:
        return c.double(), None

    msgs = []
    for unroll in (1, 2):
        with pytest.raises(tfun.errors.TfunError) as e:
            tfun.jit(lambda xs: lax.scan(bad, torch.zeros(()), xs, unroll=unroll), backend="aot_eager")(torch.ones(4))
        msgs.append((type(e.value), str(e.value)))
    assert msgs[0] == msgs[1]


@pytest.mark.filterwarnings("ignore:torch.compile is ignored when called inside torch.export region:UserWarning")
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_unroll_under_export_gives_eagers_values_and_gradients(strict, reverse):
    """`scan(..., unroll=2)` under non-strict `torch.export` (hunt 24: a raw
    UncapturedHigherOrderOpError, the unrolled body unflattening with a treedef from outside
    its trace) and strict export, an odd length (a left-over block), values and gradients
    against float64 eager."""

    def f(W, xs, h0):
        return lax.scan(lambda h, x: (torch.tanh(h @ W + x["a"]), h * x["b"]), h0, xs, unroll=2, reverse=reverse)

    class M(torch.nn.Module):
        def forward(self, W, a, b, h0):
            return f(W, {"a": a, "b": b}, h0)

    g = torch.Generator().manual_seed(2)
    want_in = [torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True) for s in ((3, 3), (7, 3), (7, 3), (3,))]
    got_in = [w.detach().float().requires_grad_() for w in want_in]
    ep = torch.export.export(M(), tuple(x.detach() for x in got_in), strict=strict)
    (h, ys), (hw, ysw) = ep.module()(*got_in), M()(*want_in)
    torch.testing.assert_close(ys.double(), ysw.detach(), rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(h.sum() + ys.sum(), got_in)
    for gr, w in zip(grads, torch.autograd.grad(hw.sum() + ysw.sum(), want_in)):
        torch.testing.assert_close(gr.double(), w, rtol=1e-4, atol=1e-4)


# (unroll=True has no blocks, its steps unrolled in the graph: its aot_eager cell covers it)
@pytest.mark.parametrize(
    ("unroll", "backend"), [(3, "aot_eager"), (True, "aot_eager"), pytest.param(3, "inductor", marks=pytest.mark.heavy)]
)
@pytest.mark.parametrize("reverse", [False, True])
def test_one_jitted_function_at_several_lengths(reverse: bool, unroll: Any, backend: str) -> None:
    """Hunt 26, F1: a jitted, differentiated `scan(..., unroll=k)` traced again at a second
    length (Dynamo's automatic dynamic shapes) made the block size `min(k, T)` symbolic, which
    torch's scan could not save for its backward: a JitError about a size the body "closes
    over". Hunt 27: under Inductor the symbolic length itself failed ("KeyError: s86" lowering
    the blocks' view). The length of an unrolled scan is static now (a graph per length, as
    under jax.jit); each length gives eager's float64 values and every input's gradient.
    (The inductor cells' first length is also the module's static Inductor check: values,
    gradients and the int64 counter of a differentiated unrolled scan, both directions.)"""
    torch._dynamo.reset()
    run = tfun.jit(lambda init, xs: _loss(init, xs, reverse, unroll), backend=backend)
    # 5 (a block of 3 and 2 left over), then a second length: under aot_eager 7 (1 left over)
    # and 2 (shorter than k) for unroll=3; unroll=True has no blocks (no left-over to vary)
    for T in (5, 8) if backend == "inductor" or unroll is True else (5, 7, 2):
        init, xs = _data(T, torch.float64, seed=T)
        leaves = [init["h"], xs["a"], xs["b"]]
        for t in leaves:
            t.requires_grad_(True)
        want_c, want_ys, want_l = _loss(init, xs, reverse, 1)
        want_g = torch.autograd.grad(want_l, leaves)
        got_c, got_ys, got_l = run(init, xs)
        got_g = torch.autograd.grad(got_l, leaves)
        assert got_c["n"].item() == T and got_c["n"].dtype == torch.int64
        assert_tree_allclose((got_c, got_ys), tfun.tree.tree_map(lambda t: t.detach(), (want_c, want_ys)), rtol=1e-12, atol=1e-12)
        for u, v in zip(got_g, want_g):
            torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)
