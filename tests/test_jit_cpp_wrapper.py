"""`tfun.jit`'s default backend: Inductor with its C++ wrapper for CPU graphs with a loop HOP.

Which graphs get `cpp_wrapper=True` is checked without timing: from the backend's own record
(`Jitted._cpp_wrapper_graphs`), from the graphs Inductor lowers (`GraphLowering.cpp_wrapper`,
forward and backward), and from the choice on captured graphs (`.lower()`, no compilation).
Results under the default are compared with the float64 eager oracle, outputs and gradients.
"""

from __future__ import annotations

import pytest
import torch

import tfun
from tfun import _compat, lax
from tfun._jit import _InductorDefault

pytestmark = pytest.mark.skipif(
    _compat.inductor_backend(None, None) is None, reason="torch has no per-graph Inductor options"
)

# float32 against the float64 oracle: relative to the largest oracle magnitude (as tests/differential)
RTOL_OUT, RTOL_GRAD = 2e-4, 1e-3


@pytest.fixture
def lowered_graphs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """(cpp_wrapper, is_backward) of every graph Inductor lowers while the test runs."""
    from torch._inductor import graph as inductor_graph

    seen: list[tuple[bool, bool]] = []
    init = inductor_graph.GraphLowering.__init__

    def recording_init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        seen.append((bool(self.cpp_wrapper), bool(kwargs.get("is_backward", False))))

    monkeypatch.setattr(inductor_graph.GraphLowering, "__init__", recording_init)
    return seen


def rnn(W: torch.Tensor, h0: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def step(h, x):
        h = torch.tanh(h @ W + x)
        return h, h

    return lax.scan(step, h0, xs)


def fori(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return lax.fori_loop(0, 9, lambda i, c: torch.tanh(c @ W) + 0.5 * c, x)


def while_(W: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def body(state):
        i, c = state
        return i + 1, torch.tanh(c @ W) + 0.5 * c

    return lax.while_loop(lambda s: s[0] < 7, body, (torch.zeros((), dtype=torch.int64), x))


def _args(name: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    W = torch.randn(8, 8, generator=g, dtype=torch.float64) / 3
    if name == "scan":
        xs = torch.randn(13, 3, 8, generator=g, dtype=torch.float64)
        return tuple(t.to(dtype) for t in (W, torch.zeros(3, 8, dtype=torch.float64), xs))
    return tuple(t.to(dtype) for t in (W, torch.randn(3, 8, generator=g, dtype=torch.float64)))


PROGRAMS = {"scan": rnn, "fori_loop": fori, "while_loop": while_}


def _outs_and_grads(fn, args):  # type: ignore[no-untyped-def]
    args = tuple(a.detach().requires_grad_() for a in args)
    outs = [t for t in tfun.tree.tree_leaves(fn(*args)) if t.is_floating_point()]
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in outs]
    loss = sum((t.to(torch.float64) * w).sum() for t, w in zip(outs, weights))
    grads = torch.autograd.grad(loss, args)
    return [t.detach().double() for t in outs], [t.double() for t in grads]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        scale = max(float(b.abs().max()), 1e-6)
        assert float((a - b).abs().max()) <= rtol * scale


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_loop_on_cpu_compiles_with_cpp_wrapper_and_matches_float64_oracle(
    name: str, lowered_graphs: list[tuple[bool, bool]]
) -> None:
    fn = PROGRAMS[name]
    jitted = tfun.jit(fn)
    outs, grads = _outs_and_grads(jitted, _args(name, torch.float32))
    # torch 2.13's C++ wrapper cannot compile a differentiated while_loop: Python wrapper there
    cpp = name != "while_loop" or _compat.cpp_wrapper_differentiates_while_loop()
    assert jitted._cpp_wrapper_graphs == [cpp]
    # the forward and the backward (compiled later by AOTAutograd) both got the same wrapper
    assert lowered_graphs and all(c == cpp for c, _ in lowered_graphs)
    assert any(backward for _, backward in lowered_graphs)
    want_outs, want_grads = _outs_and_grads(fn, _args(name, torch.float64))
    _assert_close(outs, want_outs, RTOL_OUT)
    _assert_close(grads, want_grads, RTOL_GRAD)


def test_value_and_grad_step_with_scan_matches_float64_oracle() -> None:
    def loss(W, h0, xs):  # type: ignore[no-untyped-def]
        h, ys = rnn(W, h0, xs)
        return (ys**2).mean() + h.sum()

    step = tfun.jit(tfun.value_and_grad(loss))
    value, grad = step(*_args("scan", torch.float32))
    assert step._cpp_wrapper_graphs == [True]
    want_value, want_grad = tfun.value_and_grad(loss)(*_args("scan", torch.float64))
    _assert_close([value.double()], [want_value], RTOL_OUT)
    _assert_close([grad.double()], [want_grad], RTOL_GRAD)


def test_while_loop_without_gradient_compiles_with_cpp_wrapper_and_matches_float64_oracle() -> None:
    f = tfun.jit(while_)
    with torch.no_grad():
        i, out = f(*_args("while_loop", torch.float32))
    assert f._cpp_wrapper_graphs == [True]
    assert int(i) == 7
    _assert_close([out.double()], [while_(*_args("while_loop", torch.float64))[1]], RTOL_OUT)


def test_while_loop_under_traced_grad_follows_torch_support() -> None:
    def loss(W, x):  # type: ignore[no-untyped-def]
        return while_(W, x)[1].square().mean()

    step = tfun.jit(tfun.value_and_grad(loss))
    value, grad = step(*_args("while_loop", torch.float32))
    assert step._cpp_wrapper_graphs == [_compat.cpp_wrapper_differentiates_while_loop()]
    want_value, want_grad = tfun.value_and_grad(loss)(*_args("while_loop", torch.float64))
    _assert_close([value.double()], [want_value], RTOL_OUT)
    _assert_close([grad.double()], [want_grad], RTOL_GRAD)


def test_graph_without_loop_keeps_the_python_wrapper(lowered_graphs: list[tuple[bool, bool]]) -> None:
    x = torch.randn(4, 3)
    f = tfun.jit(lambda x: lax.cond(x.sum() > 0, lambda c: c * 2, lambda c: c - 1, x))
    torch.testing.assert_close(f(x), x * 2 if x.sum() > 0 else x - 1)
    assert f._cpp_wrapper_graphs == [False]
    assert lowered_graphs and not any(cpp for cpp, _ in lowered_graphs)


def _choice(fn, *args) -> bool:  # type: ignore[no-untyped-def]
    """The default backend's choice for the graph Dynamo captures for `fn(*args)` (nothing compiled)."""
    lowered = tfun.jit(fn).lower(*args)
    assert len(lowered.graph_modules) == 1
    return _InductorDefault.wants_cpp_wrapper(lowered.graph_module, list(args))


def test_choice_per_graph() -> None:
    x = torch.randn(5, 3)
    W = torch.randn(3, 3)
    assert _choice(lambda x: lax.scan(lambda c, y: (c + y, c), torch.zeros(3), x), x)
    assert _choice(lambda W, x: fori(W, x), W, x)
    assert _choice(lambda W, x: while_(W, x)[1], W, x)
    # a loop inside a cond branch is a loop of the graph
    assert _choice(
        lambda x: lax.cond(x.sum() > 0, lambda c: lax.fori_loop(0, 3, lambda i, a: a * 2, c), lambda c: c, x), x
    )
    # no loop at run time: cond, map (unrolled at trace time), plain ops
    assert not _choice(lambda x: lax.cond(x.sum() > 0, lambda c: c * 2, lambda c: c - 1, x), x)
    assert not _choice(lambda x: lax.map(lambda r: r.sin(), x), x)
    assert not _choice(lambda x: (x @ x.T).relu(), x)


def test_choice_needs_every_tensor_input_on_the_cpu() -> None:
    x = torch.randn(5, 3)
    gm = tfun.jit(lambda x: lax.scan(lambda c, y: (c + y, c), torch.zeros(3), x)).lower(x).graph_module
    assert _InductorDefault.wants_cpp_wrapper(gm, [x])
    assert not _InductorDefault.wants_cpp_wrapper(gm, [x.to("meta")])
    assert not _InductorDefault.wants_cpp_wrapper(gm, [x, torch.empty(2, device="meta")])
    assert not _InductorDefault.wants_cpp_wrapper(gm, [])


@pytest.mark.parametrize(
    "options",
    [
        {"options": {"cpp_wrapper": False}},  # the opt-out
        {"backend": "aot_eager"},
        {"mode": "default"},
        {"options": {"max_autotune": False}},
    ],
    ids=["opt_out", "other_backend", "mode", "other_options"],
)
def test_user_compile_options_bypass_the_default(options: dict, lowered_graphs: list[tuple[bool, bool]]) -> None:
    W, x = _args("fori_loop", torch.float32)
    f = tfun.jit(fori, **options)
    torch.testing.assert_close(f(W, x), fori(W, x))
    assert f._cpp_wrapper_graphs == []  # the default backend was not used
    assert not any(cpp for cpp, _ in lowered_graphs)  # torch's own default: the Python wrapper


def test_user_cpp_wrapper_option_wins_on_a_graph_without_loop(lowered_graphs: list[tuple[bool, bool]]) -> None:
    x = torch.randn(4, 3)
    f = tfun.jit(lambda x: x.sin() * 2, options={"cpp_wrapper": True})
    torch.testing.assert_close(f(x), x.sin() * 2)
    assert f._cpp_wrapper_graphs == []
    assert lowered_graphs and all(cpp for cpp, _ in lowered_graphs)
