"""Threefry-2x32 on torch integer tensors, bit for bit as JAX's default PRNG computes it.

torch has no full set of uint32 arithmetic ops, so every 32-bit word is held in an int64
tensor with values in [0, 2**32) and every sum is masked back to 32 bits. Rotations,
xors and masks are plain integer ops, so under `tfun.jit` the 20 rounds lower to an
unrolled chain of elementwise integer ops in one graph (no loop, no custom op).

The counter layout follows JAX 0.5+ with `jax_threefry_partitionable=True` (the default
since JAX 0.5.0): element `i` of a draw of shape `s` hashes the 64-bit counter `i` as the
pair `(i >> 32, i & 0xFFFFFFFF)`; 32-bit bits are the xor of the two output words; a
split's `j`-th key is the output pair for counter `j`.
"""

from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF
_PARITY = 0x1BD11BDA  # Threefry's key-schedule constant
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _rotl(v: torch.Tensor, r: int) -> torch.Tensor:
    return ((v << r) & MASK32) | (v >> (32 - r))


def threefry2x32(
    k0: torch.Tensor, k1: torch.Tensor, x0: torch.Tensor, x1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash the counter words `(x0, x1)` under the key words `(k0, k1)`.

    All four are int64 tensors holding 32-bit values (they broadcast); returns the two
    output words, int64 in [0, 2**32). 20 rounds, key injection every 4 rounds.
    """
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    a = (x0 + ks[0]) & MASK32
    b = (x1 + ks[1]) & MASK32
    for block in range(5):
        for r in _ROTATIONS[block % 2]:
            a = (a + b) & MASK32
            b = _rotl(b, r) ^ a
        a = (a + ks[(block + 1) % 3]) & MASK32
        b = (b + ks[(block + 2) % 3] + (block + 1)) & MASK32
    return a, b


def key_words(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit words of a (validated) uint32 key of shape (..., 2), as int64."""
    k = key.to(torch.int64)
    return k[..., 0], k[..., 1]


def counters(shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """JAX's `iota_2x32_shape`: the row-major index of each element as (hi, lo) words."""
    n = math.prod(shape)
    idx = torch.arange(n, dtype=torch.int64, device=device).reshape(shape)
    return idx >> 32, idx & MASK32


def hash_shape(key: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both output words of Threefry for every element of `shape` (the partitionable scheme)."""
    k0, k1 = key_words(key)
    hi, lo = counters(shape, key.device)
    return threefry2x32(k0, k1, hi, lo)


def bits32(key: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """32 random bits per element, int64 in [0, 2**32): JAX's `random_bits(key, 32, shape)`."""
    a, b = hash_shape(key, shape)
    return a ^ b


def bits64(key: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """64 random bits per element as the bit pattern of an int64 (JAX's `random_bits(key, 64, shape)`)."""
    a, b = hash_shape(key, shape)
    return (a << 32) | b  # wraps into the sign bit: the bit pattern is what matters


def to_uint32(words: torch.Tensor) -> torch.Tensor:
    return words.to(torch.uint32)
