"""Samplers, each the same sequence of operations as its `jax.random` namesake.

Bit-exactness: every sampler starts from Threefry bits (exact) and the float "mantissa
trick" (exact). What follows is float arithmetic in the sample dtype, op by op, as XLA's
CPU backend compiles it: its float32 kernels for `log` and `log1p` (Cephes), `erf_inv`
(Giles) and `erf` (Eigen's rational interpolant) are reproduced here, including which
multiply-adds LLVM fuses into one rounding (emulated through float64, see `_fma`) and a
correctly rounded `sqrt` (torch's float32 CPU `sqrt` is not). float16/bfloat16 compute
the transcendental parts in float32 and round, as XLA does. The tests compare against JAX.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .._compat import bitcast
from .._errors import ArgumentTypeError, ArgumentValueError, format_message
from . import _threefry as tf
from ._keys import check_key, check_shape, split

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _float_dtype(op: str, dtype: torch.dtype | None) -> torch.dtype:
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in _FLOATS:
        raise ArgumentTypeError(
            format_message(
                f"tfun.random.{op}: dtype must be a floating dtype.",
                [f"dtype: got {dtype}"],
                revise="Pass torch.float32 (JAX's default), torch.float64, torch.float16 or torch.bfloat16.",
            )
        )
    return dtype


def _as_tensor(x: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype)
    return torch.tensor(x, dtype=dtype, device=device)


def _check_broadcast(op: str, shape: tuple[int, ...], **params: torch.Tensor) -> None:
    bad = []
    for name, p in params.items():
        try:
            ok = torch.broadcast_shapes(shape, tuple(p.shape)) == torch.Size(shape)
        except RuntimeError:
            ok = False
        if not ok:
            bad.append(f"{name}.shape: {tuple(p.shape)} does not broadcast to shape {shape}")
    if bad:
        raise ArgumentValueError(
            format_message(
                f"tfun.random.{op}: parameters must broadcast to the requested shape.",
                bad,
                revise="Pass a `shape` that the parameters broadcast to, or leave `shape=None` where allowed.",
            )
        )


def _unit_floats(key: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Floats in [0, 1): random mantissa bits under the exponent of 1.0, minus 1 (JAX's trick)."""
    if dtype == torch.float64:
        b = tf.bits64(key, shape)
        f = ((b >> 12) & ((1 << 52) - 1)) | 0x3FF0000000000000
        one = bitcast(f, torch.float64)
    elif dtype == torch.float32:
        f = (tf.bits32(key, shape) >> 9) | 0x3F800000
        one = bitcast(f.to(torch.int32), torch.float32)
    elif dtype == torch.float16:
        f = ((tf.bits32(key, shape) & 0xFFFF) >> 6) | 0x3C00
        one = bitcast(f.to(torch.int16), torch.float16)
    else:  # bfloat16: 7 mantissa bits, drawn from 8 random bits as JAX does
        f = ((tf.bits32(key, shape) & 0xFF) >> 1) | 0x3F80
        one = bitcast(f.to(torch.int16), torch.bfloat16)
    return one - 1


def _uniform(key, shape, dtype, minval, maxval):
    floats = _unit_floats(key, shape, dtype)
    if dtype == torch.float32:
        # XLA's CPU backend contracts `floats * span + minval` into one fused multiply-add.
        scaled = _fma(floats, maxval - minval, minval)
    else:
        scaled = floats * (maxval - minval) + minval
    return torch.maximum(minval, scaled)


def uniform(
    key: torch.Tensor,
    shape: Sequence[int] = (),
    dtype: torch.dtype | None = None,
    minval: float | torch.Tensor = 0.0,
    maxval: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Uniform samples in `[minval, maxval)`, as `jax.random.uniform`.

    Bit-identical to JAX for float32 (JAX's default), float16 and bfloat16; for float64
    it equals JAX with `jax_enable_x64` (52 random mantissa bits from two Threefry words).

    **Arguments:**

    - `key`: a key (uint32, shape `(2,)`).
    - `shape`: the result shape. Default `()`.
    - `dtype`: a float dtype; default `torch.get_default_dtype()` (float32).
    - `minval`, `maxval`: bounds, floats or tensors broadcastable to `shape`.

    **Returns:**

    A tensor of `shape` and `dtype`. For float32 the affine map is one fused
    multiply-add, as XLA's CPU backend compiles it (emulated in float64: a rare halfway
    case could round differently from a true FMA; none seen in the tests).
    """
    key = check_key("uniform", key)
    shape = check_shape("uniform", shape)
    dtype = _float_dtype("uniform", dtype)
    lo = _as_tensor(minval, dtype, key.device)
    hi = _as_tensor(maxval, dtype, key.device)
    _check_broadcast("uniform", shape, minval=lo, maxval=hi)
    return _uniform(key, shape, dtype, lo, hi)


# Giles, "Approximating the erfinv function" (GPU Computing Gems), single precision; the
# coefficients XLA uses for f32 (and, after an upcast, for f16/bf16).
_ERFINV_SMALL = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                 -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_LARGE = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                 -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)
# Cephes' single-precision log (XLA's CPU kernel for f32 `log`): polynomial in three
# interleaved parts, and ln 2 split in two.
_LOG_P = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
          -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)
_LOG_Q1, _LOG_Q2 = -2.12194440e-4, 0.693359375
# Cephes' log1p rational approximation (XLA's CPU `log1p` for |x| < sqrt(2) - 1).
_LOG1P_NUM = (4.5270000862445199635215e-5, 4.9854102823193375972212e-1, 6.5787325942061044846969e0,
              2.9911919328553073277375e1, 6.0949667980987787057556e1, 5.7112963590585538103336e1,
              2.0039553499201281259648e1)
_LOG1P_DEN = (1.0, 1.5062909083469192043167e1, 8.3047565967967209469434e1, 2.2176239823732856465394e2,
              3.0909872225312059774938e2, 2.1642788614495947685003e2, 6.0118660497603843919306e1)


def _f32(v: float) -> float:
    """A Python float rounded to the nearest float32 (how XLA stores the constant)."""
    return torch.tensor(v, dtype=torch.float32).item()


def _fma(a: torch.Tensor | float, b: torch.Tensor | float, c: torch.Tensor | float) -> torch.Tensor:
    """float32 fused multiply-add `a * b + c` with one rounding, via float64.

    XLA's CPU backend lets LLVM fuse a multiply into the add that consumes it (when the
    product has no other use), so its float32 results round once per `a * b + c`. The
    product of two float32s is exact in float64; the float64 sum is rounded twice (to
    float64, then to float32), which differs from one rounding only when the float64 sum
    lands exactly halfway between two float32s - about 2**-29 of random inputs.
    """
    a64 = a.double() if isinstance(a, torch.Tensor) else a
    b64 = b.double() if isinstance(b, torch.Tensor) else b
    c64 = c.double() if isinstance(c, torch.Tensor) else c
    return (a64 * b64 + c64).float()  # type: ignore[operator, union-attr]


def log_f32(x: torch.Tensor) -> torch.Tensor:
    """XLA's CPU float32 `log`, op for op (including which multiply-adds are fused)."""
    tiny = torch.tensor(torch.finfo(torch.float32).tiny, dtype=torch.float32, device=x.device)
    xc = torch.where(x > tiny, x, tiny)
    bits = bitcast(xc, torch.int32)
    e = ((bits >> 23) - 127).to(torch.float32) + 1.0
    m = bitcast((bits & -2139095041) | 0x3F000000, torch.float32)  # mantissa in [0.5, 1)
    low = m < _f32(0.70710678118654752)
    y = (m - 1.0) + torch.where(low, m, torch.zeros_like(m))
    e = e - low.to(torch.float32)
    y2 = y * y
    y3 = y2 * y
    p = [_f32(c) for c in _LOG_P]
    a = _fma(_fma(y, p[0], p[1]), y, p[2])
    b = _fma(_fma(y, p[3], p[4]), y, p[5])
    c = _fma(_fma(y, p[6], p[7]), y, p[8])
    a = _fma(_fma(a, y3, b), y3, c)
    a = _fma(a, y3, e * _f32(_LOG_Q1))
    r = _fma(e, _LOG_Q2, _fma(y2, -0.5, y) + a)
    r = torch.where(x < 0, torch.full_like(r, math.nan), r)
    r = torch.where(x == 0, torch.full_like(r, -math.inf), r)
    r = torch.where(x == math.inf, x, r)
    return torch.where(torch.isnan(x), x, r)


def log1p_f32(x: torch.Tensor) -> torch.Tensor:
    """XLA's CPU float32 `log1p`: Cephes' rational approximation near 0, else `log(1 + x)`."""
    large = log_f32(x + 1.0)
    num = torch.full_like(x, _f32(_LOG1P_NUM[0]))
    den = torch.full_like(x, _f32(_LOG1P_DEN[0]))
    for c in _LOG1P_NUM[1:]:
        num = _fma(num, x, _f32(c))
    for c in _LOG1P_DEN[1:]:
        den = _fma(den, x, _f32(c))
    x2 = x * x
    small = x + _fma(x2, -0.5, (x * x2) * (num / den))
    return torch.where(x.abs() < _f32(0.41421356237309504880), small, large)


def erf_inv_f32(x: torch.Tensor) -> torch.Tensor:
    """XLA's float32 `erf_inv`, op for op (float32 in, float32 out)."""
    w = -log1p_f32(x * -x)
    small = w < 5.0
    # torch's float32 sqrt is not always correctly rounded on CPU; through float64 it is
    # (53 >= 2 * 24 + 2 bits, so rounding twice is exact for sqrt).
    wt = torch.where(small, w - 2.5, torch.sqrt(w.double()).float() - 3.0)
    cs = torch.tensor([_ERFINV_SMALL, _ERFINV_LARGE], dtype=torch.float32, device=x.device)
    p = torch.where(small, cs[0, 0], cs[1, 0])
    for i in range(1, len(_ERFINV_SMALL)):
        p = _fma(p, wt, torch.where(small, cs[0, i], cs[1, i]))
    p = torch.where(x.abs() == 1.0, torch.full_like(p, math.inf), p)
    return x * p


def _log(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return log_f32(x)
    if x.dtype == torch.float64:
        return torch.log(x)
    return log_f32(x.float()).to(x.dtype)


def _log1p(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return log1p_f32(x)
    if x.dtype == torch.float64:
        return torch.log1p(x)
    return log1p_f32(x.float()).to(x.dtype)


def _erf_inv(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float64:
        return torch.erfinv(x)
    if x.dtype == torch.float32:
        return erf_inv_f32(x)
    return erf_inv_f32(x.float()).to(x.dtype)


_ERF_ALPHA = (0.00022905065861350646, 0.0034082910107109506, 0.050955695062380861, 0.18520832239976145,
              1.128379143519084)
_ERF_BETA = (-1.1791602954361697e-7, 0.000023547966471313185, 0.0010179625278914885, 0.014070470171167667,
             0.11098505178285362, 0.49746925110067538, 1.0)


def erf_f32(x: torch.Tensor) -> torch.Tensor:
    """XLA's CPU float32 `erf` (Eigen's rational interpolant evaluated with FMAs)."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731 - round a constant to f32
    x2 = x * x
    p = _fma(x2, f32(_ERF_ALPHA[0]), f32(_ERF_ALPHA[1]))
    for c in _ERF_ALPHA[2:]:
        p = _fma(x2, p, f32(c))
    p = x * p
    q = _fma(x2, f32(_ERF_BETA[0]), f32(_ERF_BETA[1]))
    for c in _ERF_BETA[2:]:
        q = _fma(x2, q, f32(c))
    clamp = x.abs() >= f32(3.832506856900711)
    return torch.where(clamp, torch.copysign(torch.ones_like(x), x), p / q)


def _erf(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float64:
        return torch.erf(x)
    if x.dtype == torch.float32:
        return erf_f32(x)
    return erf_f32(x.float()).to(x.dtype)


def normal(key: torch.Tensor, shape: Sequence[int] = (), dtype: torch.dtype | None = None) -> torch.Tensor:
    """Standard normal samples, as `jax.random.normal`: `sqrt(2) * erf_inv(u)`, `u` uniform in (-1, 1).

    Bit-identical to JAX for float32, float16 and bfloat16 (XLA's CPU `erf_inv` and
    `log1p` kernels are reproduced op for op). float64 uses `torch.erfinv` (not XLA's
    float64 polynomial): within 1e-13 relative of JAX with `jax_enable_x64`.

    **Arguments:**

    - `key`: a key (uint32, shape `(2,)`).
    - `shape`: the result shape. Default `()`.
    - `dtype`: a float dtype; default `torch.get_default_dtype()` (float32).

    **Returns:**

    A tensor of `shape` and `dtype`.
    """
    key = check_key("normal", key)
    shape = check_shape("normal", shape)
    dtype = _float_dtype("normal", dtype)
    return _normal(key, shape, dtype)


def _normal(key, shape, dtype):
    dev = key.device
    if dtype in (torch.float16, torch.bfloat16):
        lo = _nextafter_toward_zero_small(dtype, dev)
    else:
        lo = torch.nextafter(torch.tensor(-1.0, dtype=dtype, device=dev), torch.tensor(0.0, dtype=dtype, device=dev))
    hi = torch.ones((), dtype=dtype, device=dev)
    u = _uniform(key, shape, dtype, lo, hi)
    return _erf_inv(u) * torch.tensor(math.sqrt(2), dtype=dtype, device=dev)


def _nextafter_toward_zero_small(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # -1 is 0xBF80 (bf16) / 0xBC00 (f16); the next value toward zero decrements the magnitude bits.
    bits = 0xBF80 - 1 if dtype == torch.bfloat16 else 0xBC00 - 1
    return bitcast(torch.tensor(bits - (1 << 16), dtype=torch.int16, device=device), dtype)


def truncated_normal(
    key: torch.Tensor,
    lower: float | torch.Tensor,
    upper: float | torch.Tensor,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Normal samples truncated to the open interval `(lower, upper)`, as `jax.random.truncated_normal`.

    `sqrt(2) * erf_inv(u)` with `u` uniform in `[erf(lower/sqrt 2), erf(upper/sqrt 2))`,
    clipped to just inside the bounds. Bit-identical to JAX for float32 and bfloat16
    (XLA's `erf`, `erf_inv` and its rewrite of `x / sqrt2` as `x * (1 / sqrt2)` are
    reproduced); float64 uses torch's `erf`/`erfinv` (close to, not bit-identical with,
    JAX's x64 results).

    **Arguments:**

    - `key`: a key (uint32, shape `(2,)`).
    - `lower`, `upper`: bounds, floats or tensors.
    - `shape`: the result shape; default the broadcast shape of `lower` and `upper`.
    - `dtype`: a float dtype; default `torch.get_default_dtype()`.

    **Returns:**

    A tensor of `shape` and `dtype`, strictly inside `(lower, upper)`.
    """
    key = check_key("truncated_normal", key)
    dtype = _float_dtype("truncated_normal", dtype)
    lo = _as_tensor(lower, dtype, key.device)
    hi = _as_tensor(upper, dtype, key.device)
    if shape is None:
        shape = tuple(torch.broadcast_shapes(lo.shape, hi.shape))
    else:
        shape = check_shape("truncated_normal", shape)
        _check_broadcast("truncated_normal", shape, lower=lo, upper=hi)
    sqrt2 = torch.tensor(math.sqrt(2), dtype=dtype, device=key.device)
    # XLA rewrites `x / sqrt2` as `x * (1 / sqrt2)` with the reciprocal rounded to `dtype`.
    inv_sqrt2 = 1 / sqrt2
    a = _erf(lo * inv_sqrt2)
    b = _erf(hi * inv_sqrt2)
    u = _uniform(key, shape, dtype, a, b)
    out = sqrt2 * _erf_inv(u)
    inf = torch.tensor(math.inf, dtype=dtype, device=key.device)
    return torch.clamp(out, torch.nextafter(lo.detach(), inf), torch.nextafter(hi.detach(), -inf))


def bernoulli(
    key: torch.Tensor, p: float | torch.Tensor = 0.5, shape: Sequence[int] | None = None, mode: str = "low"
) -> torch.Tensor:
    """Bernoulli samples (booleans), as `jax.random.bernoulli`: `uniform(key, shape) < p`.

    **Arguments:**

    - `key`: a key (uint32, shape `(2,)`).
    - `p`: the probability of `True`, a float or a float tensor (its dtype is the dtype of
      the uniform draw, float32 for a Python float). Default 0.5.
    - `shape`: the result shape; default `p.shape`.
    - `mode`: `"low"` (default) or `"high"` (two uniforms, for tiny `p`), as in JAX.

    **Returns:**

    A bool tensor of `shape`, bit-identical to JAX's for float32 `p`.
    """
    key = check_key("bernoulli", key)
    if mode not in ("low", "high"):
        raise ArgumentValueError(
            format_message("tfun.random.bernoulli: mode must be 'low' or 'high'.", [f"mode: got {mode!r}"])
        )
    if isinstance(p, torch.Tensor):
        if not p.dtype.is_floating_point:
            raise ArgumentTypeError(
                format_message(
                    "tfun.random.bernoulli: p must have a floating dtype.",
                    [f"p: got a {p.dtype} tensor"],
                    revise="Convert it, e.g. `p.float()`.",
                )
            )
        pt = p.to(key.device)
    else:
        pt = torch.tensor(float(p), dtype=torch.float32, device=key.device)
    if shape is None:
        shape = tuple(pt.shape)
    else:
        shape = check_shape("bernoulli", shape)
        _check_broadcast("bernoulli", shape, p=pt)
    zero = torch.zeros((), dtype=pt.dtype, device=key.device)
    one = torch.ones((), dtype=pt.dtype, device=key.device)
    if mode == "high":
        u = _uniform(key, (2, *shape), pt.dtype, zero, one)
        u1, u2 = u[0], u[1] * 2.0 ** -_nmant(pt.dtype)
        return u2 < pt - u1
    return _uniform(key, shape, pt.dtype, zero, one) < pt


def _nmant(dtype: torch.dtype) -> int:
    return {torch.float32: 23, torch.float64: 52, torch.float16: 10, torch.bfloat16: 7}[dtype]


def gumbel(key: torch.Tensor, shape: Sequence[int] = (), dtype: torch.dtype | None = None, mode: str = "low") -> torch.Tensor:
    """Standard Gumbel samples, as `jax.random.gumbel`: `-log(-log(u))`, `u` uniform in `[tiny, 1)`.

    Bit-identical to JAX for float32 and bfloat16 (XLA's CPU `log`/`log1p` kernels are
    reproduced). float16 in `"low"` mode differs from JAX in the last bit for a few
    percent of values (within `8 * eps * max(1, |x|)`): XLA evaluates that chain in a
    wider type. float64 uses torch's `log`.

    **Arguments:**

    - `key`: a key (uint32, shape `(2,)`).
    - `shape`: the result shape. Default `()`.
    - `dtype`: a float dtype; default `torch.get_default_dtype()`.
    - `mode`: `"low"` (JAX's default) or `"high"` (two uniforms: a larger dynamic range).

    **Returns:**

    A tensor of `shape` and `dtype`.
    """
    key = check_key("gumbel", key)
    shape = check_shape("gumbel", shape)
    dtype = _float_dtype("gumbel", dtype)
    if mode not in ("low", "high"):
        raise ArgumentValueError(
            format_message("tfun.random.gumbel: mode must be 'low' or 'high'.", [f"mode: got {mode!r}"])
        )
    return _gumbel(key, shape, dtype, mode)


def _gumbel(key, shape, dtype, mode):
    dev = key.device
    one = torch.ones((), dtype=dtype, device=dev)
    if mode == "high":
        zero = torch.zeros((), dtype=dtype, device=dev)
        u = _uniform(key, (2, *shape), dtype, zero, one)
        high, low = u[0], u[1]
        tiny = torch.finfo(dtype).tiny
        x = torch.where(high >= 0.5, high, high + 2.0 ** -_nmant(dtype) * low + tiny)
        return -_log(-_log1p(-x))
    tiny = torch.tensor(torch.finfo(dtype).tiny, dtype=dtype, device=dev)
    return -_log(-_log(_uniform(key, shape, dtype, tiny, one)))


def categorical(
    key: torch.Tensor,
    logits: torch.Tensor,
    axis: int = -1,
    shape: Sequence[int] | None = None,
    replace: bool = True,
    mode: str = "low",
) -> torch.Tensor:
    """Samples from categorical distributions given by `logits`, as `jax.random.categorical`.

    With replacement: `argmax(gumbel(key, ...) + logits, axis)` (the Gumbel-max trick);
    without: the top-`k` of `logits + gumbel` (Gumbel top-k). The drawn indices equal
    JAX's; they are returned as int64 (torch's index dtype) where JAX returns int32.

    **Arguments:**

    - `key`: a key (uint32, shape `(2,)`).
    - `logits`: unnormalized log-probabilities, a float tensor.
    - `axis`: the axis of the categories. Default -1.
    - `shape`: the result shape; must end with the batch shape (`logits.shape` without
      `axis`). Default the batch shape.
    - `replace`: sample with replacement (default) or without.
    - `mode`: the Gumbel sampler's mode, `"low"` (default) or `"high"`.

    **Returns:**

    An int64 tensor of `shape`.
    """
    key = check_key("categorical", key)
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point:
        raise ArgumentTypeError(
            format_message(
                "tfun.random.categorical: logits must be a floating tensor.",
                [f"logits: got {logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__}"],
                revise="Pass float logits (log-probabilities), e.g. `torch.log(probs)`.",
            )
        )
    nd = logits.ndim
    if not -nd <= axis < nd:
        raise ArgumentValueError(
            format_message(
                "tfun.random.categorical: axis is out of range.",
                [f"axis: got {axis} for logits of shape {tuple(logits.shape)}"],
            )
        )
    axis = axis % nd
    batch_shape = tuple(d for i, d in enumerate(logits.shape) if i != axis)
    if shape is None:
        shape = batch_shape
    else:
        shape = check_shape("categorical", shape)
        if len(shape) < len(batch_shape) or tuple(shape[len(shape) - len(batch_shape):]) != batch_shape:
            raise ArgumentValueError(
                format_message(
                    "tfun.random.categorical: shape must end with the batch shape of logits.",
                    [f"shape: got {shape}, batch shape (logits.shape without axis {axis}) is {batch_shape}"],
                    revise="Pass `shape=(*sample_shape, *batch_shape)`.",
                )
            )
    prefix = shape[: len(shape) - len(batch_shape)]
    if replace:
        g = _gumbel(key, (*prefix, *logits.shape), logits.dtype, mode)
        return torch.argmax(g + logits, dim=len(prefix) + axis)
    k = math.prod(prefix)
    n = logits.shape[axis]
    if k > n:
        raise ArgumentValueError(
            format_message(
                "tfun.random.categorical: without replacement, the number of samples cannot exceed the categories.",
                [f"samples: {k} (shape {shape}), categories: {n}"],
            )
        )
    z = logits + _gumbel(key, tuple(logits.shape), logits.dtype, mode)
    idx = torch.topk(z.movedim(axis, -1), k, dim=-1, sorted=True).indices  # batch + (k,)
    return idx.movedim(-1, 0).reshape(shape)


_INT_DTYPES = {torch.int8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64, torch.uint8: 8}
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _int_bound(op: str, name: str, v: Any, device: torch.device) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        if v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool:
            v = v.to(torch.int64)  # JAX: `minval.astype(int)`
        return v.to(device=device, dtype=torch.int64).clamp(_I32_MIN, _I32_MAX)
    if isinstance(v, bool) or not isinstance(v, int) or not _I32_MIN <= v <= _I32_MAX:
        raise ArgumentValueError(
            format_message(
                f"tfun.random.{op}: {name} must be an int in the int32 range.",
                [f"{name}: got {v!r}"],
                revise="JAX (default 32-bit mode) samples integers in 32 bits; keep bounds within "
                "[-2**31, 2**31 - 1].",
            )
        )
    return torch.tensor(v, dtype=torch.int64, device=device)


def randint(
    key: torch.Tensor,
    shape: Sequence[int],
    minval: int | torch.Tensor,
    maxval: int | torch.Tensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Uniform integers in `[minval, maxval)`, as `jax.random.randint`.

    Two 32-bit draws (from the two halves of `split(key)`) are combined modulo the span,
    JAX's construction, so the values equal JAX's in its default 32-bit mode: `int8`,
    `int16`, `uint8` and `int32` are drawn in 32 bits exactly as JAX does; `int64` is the
    int32 draw widened (what JAX without `jax_enable_x64` gives for `dtype=int64`), so
    bounds must lie in the int32 range (tensor bounds are clipped to it, like JAX's cast).

    **Arguments:**

    - `key`: a key (uint32, shape `(2,)`).
    - `shape`: the result shape.
    - `minval`, `maxval`: bounds (ints or integer tensors broadcastable to `shape`);
      where `maxval <= minval` the result is `minval`.
    - `dtype`: an integer dtype; default `torch.int32`, JAX's default.

    **Returns:**

    A tensor of `shape` and `dtype`.
    """
    key = check_key("randint", key)
    shape = check_shape("randint", shape)
    dtype = torch.int32 if dtype is None else dtype
    if dtype not in _INT_DTYPES:
        raise ArgumentTypeError(
            format_message(
                "tfun.random.randint: dtype must be an integer dtype.",
                [f"dtype: got {dtype}"],
                revise="Pass torch.int32 (JAX's default), torch.int64, torch.int16, torch.int8 or torch.uint8.",
            )
        )
    lo = _int_bound("randint", "minval", minval, key.device)
    hi = _int_bound("randint", "maxval", maxval, key.device)
    _check_broadcast("randint", shape, minval=lo, maxval=hi)
    if dtype != torch.int64:
        info = torch.iinfo(dtype)
        if _INT_DTYPES[dtype] < 32:
            lo = lo.clamp(info.min, info.max)
            hi = hi.clamp(info.min, info.max + 1)
    k1, k2 = split(key)
    higher = tf.bits32(k1, shape)
    lower = tf.bits32(k2, shape)
    span = (hi - lo) & tf.MASK32
    span = torch.where(hi <= lo, torch.ones_like(span), span)
    mult = (2**16) % span
    mult = ((mult * mult) & tf.MASK32) % span  # uint32 product wraps, as in JAX
    off = ((higher % span) * mult) & tf.MASK32
    off = (off + (lower % span)) & tf.MASK32
    off = off % span
    v = lo + off
    v = ((v + 2**31) & tf.MASK32) - 2**31  # int32 wrap-around, as XLA's add
    return v.expand(shape).to(dtype) if v.shape != torch.Size(shape) else v.to(dtype)


def _shuffle(key: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    n = x.numel()
    rounds = math.ceil(3 * math.log(max(1, n)) / math.log(tf.MASK32))
    for _ in range(rounds):
        key, sub = split(key)
        sort_keys = tf.bits32(sub, tuple(x.shape))
        order = torch.sort(sort_keys, dim=axis, stable=True).indices
        x = torch.take_along_dim(x, order, dim=axis)
    return x


def permutation(key: torch.Tensor, x: int | torch.Tensor, axis: int = 0, independent: bool = False) -> torch.Tensor:
    """A random permutation of `range(x)` or of `x` along `axis`, as `jax.random.permutation`.

    Elements are sorted by fresh 32-bit random keys (a stable sort, repeated for large
    inputs), JAX's algorithm, so the permutation equals JAX's.

    **Arguments:**

    - `key`: a key (uint32, shape `(2,)`).
    - `x`: an int `n` (permute `torch.arange(n)`, int64) or a tensor.
    - `axis`: the axis to permute along. Default 0.
    - `independent`: permute each slice along `axis` independently. Default False (one
      permutation of the slices).

    **Returns:**

    The permuted tensor (differentiable in `x`: it is a gather).
    """
    key = check_key("permutation", key)
    if not isinstance(x, torch.Tensor):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ArgumentTypeError(
                format_message(
                    "tfun.random.permutation: x must be a non-negative int or a tensor.",
                    [f"x: got {x!r}"],
                )
            )
        return _shuffle(key, torch.arange(x, device=key.device), 0)
    if x.ndim == 0:
        raise ArgumentValueError(
            format_message(
                "tfun.random.permutation: x must be an int or a tensor with at least one dimension.",
                [f"x: got a tensor of shape ()"],
                revise="Pass `int(x)` to permute `range(x)`.",
            )
        )
    if not -x.ndim <= axis < x.ndim:
        raise ArgumentValueError(
            format_message(
                "tfun.random.permutation: axis is out of range.", [f"axis: got {axis} for shape {tuple(x.shape)}"]
            )
        )
    axis = axis % x.ndim
    if independent or x.ndim == 1:
        return _shuffle(key, x, axis)
    ind = _shuffle(key, torch.arange(x.shape[axis], device=x.device), 0)
    return torch.index_select(x, axis, ind)
