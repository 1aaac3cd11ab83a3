"""tfun._view_copies: the copying views of a differentiated loop body (`select_copy`,
`slice_copy`, `split_copy`, ...) compile as views under tfun.jit (Inductor), not as ATen calls.

Every compiled gradient is compared with the float64 eager result, and the code Inductor
generates is read to check that no copying view is left as an ATen call.
"""

from __future__ import annotations

import operator
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import tfun
from tfun import _compat, _view_copies

pytestmark = pytest.mark.skipif(_compat.CustomGraphPass is object, reason="no custom graph passes")

_aten = torch.ops.aten
_FALLBACK = re.compile(r"torch\.ops\.aten\.(\w+_copy)\.\w+\(")


def _fallback_copies(codes: list[str]) -> list[str]:
    """The copying views the generated code runs as ATen calls."""
    return _FALLBACK.findall("\n".join(codes))


def test_view_of_names_the_view_of_each_copying_twin_inductor_does_not_lower():
    assert _view_copies.view_of(_aten.select_copy.int) is _aten.select.int
    assert _view_copies.view_of(_aten.slice_copy.Tensor) is _aten.slice.Tensor
    assert _view_copies.view_of(_aten.split_copy.Tensor) is _aten.split.Tensor
    assert _view_copies.view_of(_aten.detach_copy.default) is _aten.detach.default
    for not_a_twin in (
        _aten.select_copy.int_out,  # writes its out=
        _aten._to_copy.default,  # no `_to` view
        _aten.index_copy.default,
        _aten.copy_.default,
        _aten.view_copy.default,  # Inductor decomposes these
        _aten.unbind_copy.int,
        _aten.t_copy.default,
        _aten.squeeze_copy.dim,  # Inductor lowers it
        _aten.select.int,
        operator.getitem,
    ):
        assert _view_copies.view_of(not_a_twin) is None, not_a_twin


def _traced_graph(fn, *shapes):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*(torch.empty(s) for s in shapes))


def test_rewrite_gives_the_same_values_in_contiguous_memory():
    def fn(x, y):
        a = _aten.select_copy.int(x, 0, 1)
        b = _aten.slice_copy.Tensor(y, 1, 1, 4)  # a strided view: the clone is contiguous again
        parts = _aten.split_copy.Tensor(x, 2, 1)
        c, d = parts[0], parts[2]
        return a, b, c, d, _aten.detach_copy.default(y)

    gm = _traced_graph(fn, (3, 5), (4, 6))
    assert _view_copies.rewrite(gm.graph) == 4
    gm.graph.lint()
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert not any(_view_copies.view_of(t) for t in targets)
    assert _aten.clone.default in targets
    x, y = torch.randn(3, 5), torch.randn(4, 6)
    want, got = fn(x, y), gm(x, y)
    for w, g, node in zip(want, got, list(gm.graph.nodes)[-1].args[0]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert g.is_contiguous() and g.stride() == w.stride()
        assert node.meta["val"].shape == w.shape and node.meta["val"].stride() == w.stride()
    assert _view_copies.rewrite(gm.graph) == 0


def test_a_list_of_views_used_whole_or_without_fake_values_is_left_alone():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    parts = graph.call_function(_aten.split_copy.Tensor, (x, 2, 0))
    graph.output((parts,))  # the list itself is used, not its elements
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x.meta["val"] = torch.empty(4, 3)
        parts.meta["val"] = list(torch.empty(4, 3).split(2))
    assert _view_copies.rewrite(graph) == 0
    x.meta.pop("val")  # no fake tensor to compute the view's value with
    single = graph.call_function(_aten.select_copy.int, (x, 0, 1))
    assert _view_copies.rewrite(graph) == 0
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [_aten.split_copy.Tensor, _aten.select_copy.int]
    del single


def test_an_index_known_only_at_run_time_is_left_alone():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    graph = torch.fx.Graph()
    x, i = graph.placeholder("x"), graph.placeholder("i")
    part = graph.call_function(_aten.slice_copy.Tensor, (x, 0, i, 8))
    graph.output((part,))
    with torch._subclasses.fake_tensor.FakeTensorMode(shape_env=shape_env):
        x.meta["val"] = torch.empty(8, 3)
        i.meta["val"] = shape_env.create_unbacked_symint()  # as from `.item()`
        part.meta["val"] = torch.empty(8, 3)[i.meta["val"] :]
    # its view would hold a new unbacked size that nothing in the compiled graph defines
    assert _view_copies.rewrite(graph) == 0


# --- the loop bodies that make them ----------------------------------------------------------


def _body(W):
    def body(h, x):  # x: (2, B, H); every kind of view that functionalization copies
        a = x[0]
        b = x[:, 1:3].reshape(h.shape) if h.shape[0] == 4 else x[1]
        f, g = x.unbind(0)
        s1, s2 = x.split([2, x.shape[2] - 2], dim=2)
        d = x.permute(1, 0, 2)[:, 1]
        e = h.unsqueeze(0).expand(2, *h.shape).sum(0)
        n = torch.tanh(
            h @ W.t() + a + 0.1 * b + 0.1 * d + 0.01 * e + f * g + 0.1 * torch.cat([s2, s1], -1).sum(0)
            + x.narrow(2, 1, 2).sum() * 0.01
        )
        return n, n.narrow(1, 0, 3)

    return body


def _loss(unroll, reverse):
    def loss(W, xs, h0):
        h, ys = tfun.lax.scan(_body(W), h0, xs, unroll=unroll, reverse=reverse)
        return (h**2).sum() + (ys * ys.flip(0)).sum()

    return loss


def _args(T, B=4, H=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(T * 10 + B)
    W = torch.randn(H, H, generator=g, dtype=torch.float64) / H
    xs = torch.randn(T, 2, B, H, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (W, xs, torch.randn(B, H, generator=g, dtype=torch.float64))]


@pytest.mark.parametrize(
    ("T", "unroll", "reverse"),
    [(7, 1, False), (7, 3, True), (1, 1, False), (9, 4, False)],
    ids=["T7", "T7-unroll3-reverse", "T1", "T9-unroll4"],
)
def test_a_differentiated_scan_body_has_no_copying_view_left_and_equals_float64(T, unroll, reverse):
    loss = _loss(unroll, reverse)
    want = tfun.grad(loss, argnums=(0, 1, 2))(*_args(T))
    # compiled in float64 (to eager's last digits) and float32; the unrolled cells, whose
    # graphs hold 3-4 bodies and take 4x as long to compile, in float32 only; T1 (about the
    # one-step length) in float64 only, float32 being T7's and the unrolled cells'
    dtypes = [(torch.float64, 1e-10), (torch.float32, 1e-4)]
    dtypes = dtypes[1:] if unroll > 1 else dtypes[:1] if T == 1 else dtypes
    for dtype, tol in dtypes:
        got, codes = run_and_get_code(tfun.jit(tfun.grad(loss, argnums=(0, 1, 2))), *_args(T, dtype=dtype))
        for g, w in zip(got, want):
            assert g.dtype == dtype
            torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol)
        assert _fallback_copies(codes) == []


@pytest.mark.heavy  # CI's second torch phase leaves it out (39 s there); the module's other tests stay
def test_the_callers_own_pass_slot_keeps_the_aten_calls_and_the_rewrite_still_applies_after():
    # one body per graph (no unrolling: what is tested is the pass slot, not the body), at a
    # length no other test compiles, so that no cached graph stands in for the second compile
    loss = _loss(1, False)
    args = _args(5, dtype=torch.float32)
    want = tfun.grad(loss, argnums=(0, 1, 2))(*_args(5))
    for options, fallbacks in (({"post_grad_custom_pre_pass": None}, True), ({}, False)):
        # the first compile makes Inductor register its ATen fallback for the twins as a
        # lowering, which must not stop the second from rewriting them
        got, codes = run_and_get_code(tfun.jit(tfun.grad(loss, argnums=(0, 1, 2)), options=options), *args)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
        # the rewrite has something to do here, or the other tests prove nothing
        assert ("select_copy" in _fallback_copies(codes)) is fallbacks, options


def test_symbolic_sizes_are_rewritten_too():
    loss = _loss(2, False)
    want = tfun.grad(loss, argnums=(0, 1, 2))(*_args(6, B=5))
    got, codes = run_and_get_code(
        tfun.jit(tfun.grad(loss, argnums=(0, 1, 2)), dynamic=True), *_args(6, B=5, dtype=torch.float32)
    )
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
    assert _fallback_copies(codes) == []
