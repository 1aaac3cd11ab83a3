"""Keys: `PRNGKey`/`key`, `split`, `fold_in`, `bits`, and the checks every sampler runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._compat import bitcast
from .._errors import ArgumentTypeError, ArgumentValueError, format_message
from . import _threefry as tf

_KEY_HINT = (
    "Make keys with `tfun.random.PRNGKey(seed)` (a uint32 tensor of shape (2,)) and derive new ones with "
    "`tfun.random.split` / `tfun.random.fold_in`; for a batch of keys map over it with `tfun.vmap`."
)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__} ({x!r})" if isinstance(x, (int, float, bool, str)) else f"a {type(x).__name__}"


def check_key(op: str, key: Any, *, batched: bool = False) -> torch.Tensor:
    """Validate a key argument of `tfun.random.<op>`; return it unchanged."""
    name = f"tfun.random.{op}"
    if not isinstance(key, torch.Tensor):
        raise ArgumentTypeError(
            format_message(
                f"{name}: key must be a uint32 tensor of shape (2,).",
                [f"key: got {_describe(key)}"],
                revise=_KEY_HINT,
            )
        )
    bullets = []
    if key.dtype != torch.uint32:
        bullets.append(f"key.dtype: got {key.dtype}, expected torch.uint32")
    if batched:
        if key.ndim < 1 or key.shape[-1] != 2:
            bullets.append(f"key.shape: got {tuple(key.shape)}, expected (..., 2)")
    elif tuple(key.shape) != (2,):
        bullets.append(f"key.shape: got {tuple(key.shape)}, expected (2,)")
    if bullets:
        err = ArgumentTypeError if key.dtype != torch.uint32 else ArgumentValueError
        extra = ""
        if not batched and key.dtype == torch.uint32 and key.ndim > 1 and key.shape[-1] == 2:
            extra = " It is a batch of keys: use `tfun.vmap` to draw with each of them."
        raise err(
            format_message(
                f"{name}: key must be a uint32 tensor of shape (2,) (one Threefry key).",
                bullets,
                revise=_KEY_HINT + extra,
            )
        )
    return key


def check_shape(op: str, shape: Any, arg: str = "shape") -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    ok = isinstance(shape, Sequence) and not isinstance(shape, (str, bytes))
    if ok:
        try:
            shape = tuple(int(d) for d in shape)  # type: ignore[union-attr]
        except (TypeError, ValueError):
            ok = False
    if not ok or any(d < 0 for d in shape):
        raise ArgumentValueError(
            format_message(
                f"tfun.random.{op}: {arg} must be a tuple of non-negative Python ints.",
                [f"{arg}: got {shape!r}"],
                revise=f"Pass e.g. `{arg}=(3, 4)`.",
            )
        )
    return shape  # type: ignore[return-value]


def PRNGKey(seed: int | torch.Tensor, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Create a Threefry-2x32 key from an integer seed, as `jax.random.PRNGKey` does.

    The key is a `torch.uint32` tensor of shape `(2,)`: `[0, seed mod 2**32]`, exactly the
    key JAX builds in its default 32-bit mode, so every draw from it (and from keys split
    off it) is bit-identical to `jax.random` (see `tfun.random` for the per-dtype
    guarantee). JAX with `jax_enable_x64` also stores the seed's upper 32 bits in the first
    word: for seeds outside `[0, 2**32)` its keys differ from these.

    **Arguments:**

    - `seed`: a Python int or an integer tensor of shape `()`.
    - `device`: where to put the key (default: the seed tensor's device, or the CPU).

    **Returns:**

    A `torch.uint32` tensor of shape `(2,)`.
    """
    if isinstance(seed, torch.Tensor):
        if seed.ndim != 0 or seed.dtype.is_floating_point or seed.dtype.is_complex or seed.dtype == torch.bool:
            raise ArgumentTypeError(
                format_message(
                    "tfun.random.PRNGKey: seed must be an integer scalar.",
                    [f"seed: got {_describe(seed)}"],
                    revise="Pass a Python int or an integer tensor of shape (); for many seeds use `tfun.vmap`.",
                )
            )
        lo = seed.to(torch.int64) & tf.MASK32
        dev = seed.device if device is None else device
        return torch.stack([torch.zeros_like(lo), lo]).to(device=dev, dtype=torch.uint32)
    if isinstance(seed, bool) or not isinstance(seed, int):
        # numpy integers are ints by __index__
        try:
            seed = int(seed.__index__())  # type: ignore[union-attr]
        except (AttributeError, TypeError):
            raise ArgumentTypeError(
                format_message(
                    "tfun.random.PRNGKey: seed must be an integer.",
                    [f"seed: got {_describe(seed)}"],
                    revise="Pass a Python int (e.g. `tfun.random.PRNGKey(0)`).",
                )
            ) from None
    return torch.tensor([0, seed & tf.MASK32], dtype=torch.int64, device=device).to(torch.uint32)


def key(seed: int | torch.Tensor, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Create a key from an integer seed: the same uint32 key as `tfun.random.PRNGKey`.

    JAX's `jax.random.key` returns a typed key array; tfun has one key representation, the
    raw uint32 pair, so `key(s)` equals `PRNGKey(s)` and equals `jax.random.key_data(jax.random.key(s))`.

    **Arguments:**

    - `seed`: a Python int or an integer tensor of shape `()`.
    - `device`: where to put the key.

    **Returns:**

    A `torch.uint32` tensor of shape `(2,)`.
    """
    return PRNGKey(seed, device=device)


def split(key: torch.Tensor, num: int | tuple[int, ...] = 2) -> torch.Tensor:
    """Split a key into `num` new keys (a leading axis), as `jax.random.split`.

    The `j`-th new key is the Threefry hash of the counter `j` under `key` (JAX's
    partitionable scheme), so `split(PRNGKey(s))` equals JAX's bit for bit.

    **Arguments:**

    - `key`: a key (uint32, shape `(2,)`).
    - `num`: how many keys, or a tuple for a shape of keys. Default 2.

    **Returns:**

    A uint32 tensor of shape `(num, 2)` (or `(*num, 2)`); unpack it as `key, sub = split(key)`.
    """
    key = check_key("split", key)
    shape = check_shape("split", num, "num")
    a, b = tf.hash_shape(key, shape)
    return torch.stack([a, b], dim=-1).to(torch.uint32)


def fold_in(key: torch.Tensor, data: int | torch.Tensor) -> torch.Tensor:
    """Derive a new key from `key` and a 32-bit integer, as `jax.random.fold_in`.

    **Arguments:**

    - `key`: a key (uint32, shape `(2,)`).
    - `data`: a Python int in `[0, 2**32)` or an integer tensor of shape `()` (a step
      counter in a loop carry, say; its value is taken modulo `2**32`, like JAX's cast).

    **Returns:**

    A new key (uint32, shape `(2,)`).
    """
    key = check_key("fold_in", key)
    k0, k1 = tf.key_words(key)
    if isinstance(data, torch.Tensor):
        if data.ndim != 0 or data.dtype.is_floating_point or data.dtype.is_complex or data.dtype == torch.bool:
            raise ArgumentTypeError(
                format_message(
                    "tfun.random.fold_in: data must be an integer scalar.",
                    [f"data: got {_describe(data)}"],
                    revise="Pass a Python int or an integer tensor of shape (); for many values use `tfun.vmap`.",
                )
            )
        lo = data.to(device=key.device, dtype=torch.int64) & tf.MASK32
    else:
        if isinstance(data, bool) or not isinstance(data, int) or not 0 <= data <= tf.MASK32:
            raise ArgumentValueError(
                format_message(
                    "tfun.random.fold_in: data must be an integer in [0, 2**32).",
                    [f"data: got {_describe(data)}"],
                    revise="Fold in a non-negative 32-bit value (reduce it with `% 2**32` if it may be larger).",
                )
            )
        lo = torch.tensor(data, dtype=torch.int64, device=key.device)
    a, b = tf.threefry2x32(k0, k1, torch.zeros_like(lo), lo)
    return torch.stack([a, b], dim=-1).to(torch.uint32)


_UINTS = {torch.uint8: 8, torch.uint16: 16, torch.uint32: 32, torch.uint64: 64}


def bits(key: torch.Tensor, shape: Sequence[int] = (), dtype: torch.dtype | None = None) -> torch.Tensor:
    """Uniform random bits as unsigned integers, as `jax.random.bits`.

    **Arguments:**

    - `key`: a key (uint32, shape `(2,)`).
    - `shape`: the result shape. Default `()`.
    - `dtype`: `torch.uint8`, `uint16`, `uint32` (default) or `uint64`. 8 and 16 bits are
      the low bits of the 32-bit draw, 64 bits are the two Threefry words, as in JAX.

    **Returns:**

    A tensor of `shape` and `dtype`, bit-identical to `jax.random.bits(key, shape, dtype)`.
    """
    key = check_key("bits", key)
    shape = check_shape("bits", shape)
    dtype = torch.uint32 if dtype is None else dtype
    if dtype not in _UINTS:
        raise ArgumentTypeError(
            format_message(
                "tfun.random.bits: dtype must be an unsigned integer dtype.",
                [f"dtype: got {dtype}"],
                revise="Pass torch.uint8, torch.uint16, torch.uint32 or torch.uint64.",
            )
        )
    width = _UINTS[dtype]
    if width == 64:
        return bitcast(tf.bits64(key, shape), torch.uint64)
    v = tf.bits32(key, shape)
    if width < 32:
        v = v & ((1 << width) - 1)
    return v.to(dtype)


def key_data(keys: torch.Tensor) -> torch.Tensor:
    """The uint32 words of a key or a batch of keys: the identity on tfun keys.

    Provided so that `jax.random.key_data(k)` ports name for name; tfun keys are already
    the raw `(..., 2)` uint32 words.

    **Arguments:**

    - `keys`: a key or a batch of keys (uint32, shape `(..., 2)`).

    **Returns:**

    `keys`, unchanged.
    """
    return check_key("key_data", keys, batched=True)
