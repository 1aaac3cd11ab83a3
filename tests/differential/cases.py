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
    shape = (T, C) if axis == 0 else (C, T)
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
