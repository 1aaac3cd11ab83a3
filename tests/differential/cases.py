"""Differential cases: every `tfun.lax` op as a function of tensors, built for any shape spec.

A case is `build(spec, dtype, device) -> (fn, args)`: `fn(*args)` returns a pytree of tensors and
is differentiable in every arg. The same case, built in float64 on the CPU and run eagerly, is
the oracle for every other path (float32, bfloat16, `tfun.jit` with `aot_eager` or Inductor,
`vmap`, CUDA). Specs hold the shape knobs hypothesis draws: `T` (steps, including 1 and odd
and long), `C` (channels, including 1), `reverse`, and op-specific ones. The input values are
a pure function of the spec's seed, so every path sees the same numbers.

`harness.py` runs a case along a path; `tests/gpu/check_cuda.py` runs them all on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import tfun

lax = tfun.lax

Spec = dict[str, Any]
Case = Callable[[Spec, torch.dtype, torch.device], tuple[Callable[..., Any], tuple[torch.Tensor, ...]]]


def _randn(spec: Spec, salt: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(spec.get("seed", 0)) * 1009 + salt)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _rand(spec: Spec, salt: int, *shape: int, lo: float, hi: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(spec.get("seed", 0)) * 1009 + salt)
    return lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=torch.float64)


def _args(dtype: torch.dtype, device: torch.device, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x.to(device=device, dtype=dtype) for x in xs)


def scan_rnn(spec: Spec, dtype: torch.dtype, device: torch.device):
    """A tanh RNN with a pytree carry and pytree ys, forward or reverse."""
    T, C, reverse = spec["T"], spec["C"], spec.get("reverse", False)
    W = _randn(spec, 1, C, C, scale=0.8 / C**0.5)
    xs = _randn(spec, 2, T, C)
    h0 = _randn(spec, 3, C)

    def fn(W, xs, h0):
        def step(carry, x):
            h = torch.tanh(carry["h"] @ W + x)
            return {"h": h, "acc": carry["acc"] + h.sum()}, (h, h * x)

        init = {"h": h0, "acc": torch.zeros((), dtype=h0.dtype, device=h0.device)}
        return lax.scan(step, init, xs, reverse=reverse)

    return fn, _args(dtype, device, W, xs, h0)


def scan_stacked(spec: Spec, dtype: torch.dtype, device: torch.device):
    """Two scans, the second over the first one's ys (a 2-layer RNN), the second reversed."""
    T, C = spec["T"], spec["C"]
    W1 = _randn(spec, 1, C, C, scale=0.8 / C**0.5)
    W2 = _randn(spec, 2, C, C, scale=0.8 / C**0.5)
    xs = _randn(spec, 3, T, C)

    def fn(W1, W2, xs):
        def layer(W, xs, reverse):
            def step(h, x):
                h = torch.tanh(h @ W + x)
                return h, h

            return lax.scan(step, torch.zeros_like(xs[0]), xs, reverse=reverse)

        h1, ys1 = layer(W1, xs, False)
        h2, ys2 = layer(W2, ys1, True)
        return h1, h2, ys2

    return fn, _args(dtype, device, W1, W2, xs)


def cond(spec: Spec, dtype: torch.dtype, device: torch.device):
    C = spec["C"]
    x = _randn(spec, 1, C)
    w = _randn(spec, 2, C)

    def fn(x, w):
        return lax.cond((x * w).sum() > 0, lambda x, w: (torch.sin(x) * w, x.sum()), lambda x, w: (x * x - w, w.sum()), x, w)

    return fn, _args(dtype, device, x, w)


def switch(spec: Spec, dtype: torch.dtype, device: torch.device):
    C = spec["C"]
    x = _randn(spec, 1, C)
    branches = [lambda x: torch.sin(x), lambda x: x * x.sum(), lambda x: torch.tanh(x) * 2]

    def fn(x):
        index = (x.sum().abs() * 7).to(torch.int64) % 4  # 3 is clamped to the last branch
        return lax.switch(index, branches, x)

    return fn, _args(dtype, device, x)


def select(spec: Spec, dtype: torch.dtype, device: torch.device):
    C = spec["C"]
    x = _randn(spec, 1, C)
    y = _randn(spec, 2, C)

    def fn(x, y):
        return lax.select(x > y, x * y, x - y)

    return fn, _args(dtype, device, x, y)


def while_loop(spec: Spec, dtype: torch.dtype, device: torch.device):
    """A data-dependent trip count: contract x until its norm is small."""
    C = spec["C"]
    x = _randn(spec, 1, C, scale=3.0)
    s = _rand(spec, 2, C, lo=0.5, hi=0.8)

    def fn(x, s):
        def body(c):
            i, x = c
            return i + 1, x * s + 0.01 * torch.sin(x)

        return lax.while_loop(lambda c: (c[1].norm() > 0.3) & (c[0] < 50), body, (torch.zeros((), dtype=torch.int64, device=x.device), x))

    return fn, _args(dtype, device, x, s)


def fori_loop(spec: Spec, dtype: torch.dtype, device: torch.device):
    T, C = spec["T"], spec["C"]
    xs = _randn(spec, 1, T, C)
    w = _rand(spec, 2, C, lo=0.5, hi=1.0)

    def fn(xs, w):
        return lax.fori_loop(0, T, lambda i, h: torch.sin(h) * w + xs[i], torch.zeros_like(xs[0]))

    return fn, _args(dtype, device, xs, w)


def associative_scan(spec: Spec, dtype: torch.dtype, device: torch.device):
    """The linear recurrence as a pair scan, along `axis` of a (C, T) or (T, C) array."""
    T, C, reverse, axis = spec["T"], spec["C"], spec.get("reverse", False), spec.get("axis", 0)
    shape = (T, C) if axis in (0, -2) else (C, T)  # (a negative axis as JAX resolves it)
    a = _rand(spec, 1, *shape, lo=0.5, hi=1.0)
    b = _randn(spec, 2, *shape)

    def fn(a, b):
        def combine(x, y):
            return {"a": x["a"] * y["a"], "b": x["b"] * y["a"] + y["b"]}

        return lax.associative_scan(combine, {"a": a, "b": b}, reverse=reverse, axis=axis)

    return fn, _args(dtype, device, a, b)


def map_(spec: Spec, dtype: torch.dtype, device: torch.device):
    T, C = spec["T"], spec["C"]
    xs = _randn(spec, 1, T, C)
    W = _randn(spec, 2, C, C)
    batch_size = spec.get("batch_size")

    def fn(xs, W):
        return lax.map(lambda x: (torch.tanh(x @ W), x.sum()), xs, batch_size=batch_size)

    return fn, _args(dtype, device, xs, W)


def linear_scan(spec: Spec, dtype: torch.dtype, device: torch.device):
    T, C, reverse = spec["T"], spec["C"], spec.get("reverse", False)
    impl = spec.get("impl", "torch")
    a = _rand(spec, 1, 2, T, C, lo=0.5, hi=1.0)
    b = _randn(spec, 2, 2, T, C)
    h0 = _randn(spec, 3, 2, C)

    def fn(a, b, h0):
        return lax.linear_scan(a, b, h0, axis=1, reverse=reverse, impl=impl)

    return fn, _args(dtype, device, a, b, h0)


CASES: dict[str, Case] = {
    "scan": scan_rnn,
    "scan_stacked": scan_stacked,
    "cond": cond,
    "switch": switch,
    "select": select,
    "while_loop": while_loop,
    "fori_loop": fori_loop,
    "associative_scan": associative_scan,
    "map": map_,
    "linear_scan": linear_scan,
}


# ----------------------------------------------------------------------------------------
# Composed cases: control flow with tfun's other transforms inside it (custom derivatives,
# checkpoint). `tests/differential/test_composed.py` runs them; `harness` looks names up in
# `ALL_CASES`. Every custom rule here is deliberately NOT the derivative of its primal (a
# damped gradient, as `clip_gradient`-style rules are): a path that differentiates the primal
# instead of applying the rule gives other gradients than the eager oracle, which applies it.
# ----------------------------------------------------------------------------------------


@tfun.custom_vjp
def damped_tanh_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`tanh(x) * w`, whose rule halves the gradient in `x` (and is exact in `w`)."""
    return torch.tanh(x) * w


def _damped_tanh_mul_fwd(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    y = torch.tanh(x)
    return y * w, (y, w)


def _damped_tanh_mul_bwd(res: tuple[torch.Tensor, torch.Tensor], g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y, w = res
    return 0.5 * g * w * (1 - y * y), g * y


damped_tanh_mul.defvjp(_damped_tanh_mul_fwd, _damped_tanh_mul_bwd)


@tfun.custom_jvp
def damped_sin(x: torch.Tensor) -> torch.Tensor:
    """`sin(x)`, whose rule's tangent is `0.5 * cos(x) * t` (reverse mode transposes it)."""
    return torch.sin(x)


@damped_sin.defjvp
def _damped_sin_jvp(primals: tuple[torch.Tensor], tangents: tuple[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    (x,), (t,) = primals, tangents
    return torch.sin(x), 0.5 * torch.cos(x) * t


def custom_vjp_scan(spec: Spec, dtype: torch.dtype, device: torch.device):
    """A custom_vjp function in a scan body (closing over `w`), and once outside the scan."""
    T, C, reverse = spec["T"], spec["C"], spec.get("reverse", False)
    W = _randn(spec, 1, C, C, scale=0.8 / C**0.5)
    w = _rand(spec, 2, C, lo=0.5, hi=1.5)
    xs = _randn(spec, 3, T, C)

    def fn(W, w, xs):
        def step(h, x):
            h = damped_tanh_mul(h @ W + x, w)
            return h, h * x

        h, ys = lax.scan(step, torch.zeros_like(xs[0]), xs, reverse=reverse)
        return h, ys, damped_tanh_mul(h, w)

    return fn, _args(dtype, device, W, w, xs)


def custom_vjp_cond(spec: Spec, dtype: torch.dtype, device: torch.device):
    """A custom_vjp function in one branch of a cond, called on both operands."""
    C = spec["C"]
    x = _randn(spec, 1, C)
    w = _randn(spec, 2, C)

    def fn(x, w):
        return lax.cond(
            (x * w).sum() > 0, lambda x, w: (damped_tanh_mul(x, w), x.sum()), lambda x, w: (torch.sin(x) * w, w.sum()), x, w
        )

    return fn, _args(dtype, device, x, w)


def custom_jvp_scan(spec: Spec, dtype: torch.dtype, device: torch.device):
    """A custom_jvp function in a scan body, in a cond branch after it, and outside both."""
    T, C, reverse = spec["T"], spec["C"], spec.get("reverse", False)
    W = _randn(spec, 1, C, C, scale=0.8 / C**0.5)
    xs = _randn(spec, 2, T, C)

    def fn(W, xs):
        def step(h, x):
            h = damped_sin(h @ W + x)
            return h, damped_sin(h) * x

        h, ys = lax.scan(step, torch.zeros_like(xs[0]), xs, reverse=reverse)
        picked = lax.cond(h.sum() > 0, lambda h: damped_sin(h * 2), lambda h: torch.cos(h), h)
        return h, ys, picked + damped_sin(h)

    return fn, _args(dtype, device, W, xs)


def remat_scan(spec: Spec, dtype: torch.dtype, device: torch.device):
    """`tfun.checkpoint` of a function holding a scan with a pytree carry, and code around
    it (under `tfun.jit` the scan body is what is checkpointed)."""
    T, C, reverse = spec["T"], spec["C"], spec.get("reverse", False)
    W = _randn(spec, 1, C, C, scale=0.8 / C**0.5)
    xs = _randn(spec, 2, T, C)

    @tfun.checkpoint
    def block(W, xs):
        def step(c, x):
            h = torch.tanh(c["h"] @ W + x)
            return {"h": h, "acc": c["acc"] + (h * h).sum()}, torch.sin(h) * x

        init = {"h": torch.zeros_like(xs[0]), "acc": torch.zeros((), dtype=xs.dtype, device=xs.device)}
        c, ys = lax.scan(step, init, xs, reverse=reverse)
        return c, torch.exp(0.1 * ys)

    def fn(W, xs):
        c, ys = block(W, xs * 1.5)
        return c["h"], c["acc"], ys

    return fn, _args(dtype, device, W, xs)


def remat_cond(spec: Spec, dtype: torch.dtype, device: torch.device):
    """`tfun.checkpoint` of a function holding a cond and a switch."""
    C = spec["C"]
    x = _randn(spec, 1, C)
    w = _randn(spec, 2, C)

    @tfun.checkpoint
    def block(x, w):
        y = lax.cond((x * w).sum() > 0, lambda x, w: torch.sin(x) * w, lambda x, w: x * x - w, x, w)
        index = (y.sum().abs() * 5).to(torch.int64) % 3
        return lax.switch(index, [lambda y: torch.tanh(y), lambda y: y * torch.cos(w), lambda y: torch.exp(-y * y)], y)

    def fn(x, w):
        return block(x, w) * 2.0

    return fn, _args(dtype, device, x, w)


def remat_while(spec: Spec, dtype: torch.dtype, device: torch.device):
    """`tfun.checkpoint` of a function holding a fixed-trip-count while_loop (a tensor
    counter: the loop's trip count is data to the compiler)."""
    C = spec["C"]
    x = _randn(spec, 1, C)
    s = _rand(spec, 2, C, lo=0.5, hi=0.9)

    @tfun.checkpoint
    def block(x, s):
        def body(c):
            i, x = c
            return i + 1, torch.sin(x) * s + 0.1

        return lax.while_loop(lambda c: c[0] < 3, body, (torch.zeros((), dtype=torch.int64, device=x.device), x))

    def fn(x, s):
        return block(x, s)

    return fn, _args(dtype, device, x, s)


COMPOSED_CASES: dict[str, Case] = {
    "custom_vjp_scan": custom_vjp_scan,
    "custom_vjp_cond": custom_vjp_cond,
    "custom_jvp_scan": custom_jvp_scan,
    "remat_scan": remat_scan,
    "remat_cond": remat_cond,
    "remat_while": remat_while,
}

#: every case the harness can run, by name
ALL_CASES: dict[str, Case] = {**CASES, **COMPOSED_CASES}
