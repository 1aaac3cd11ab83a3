"""tfun's Inductor post-grad pass: the graph rewrites `tfun.jit` asks of Inductor.

Inductor has one slot for a custom pass that runs on every graph it compiles (the forward,
the backward, and each loop body and branch inside them): `post_grad_custom_pre_pass`.
`PostGradPass` fills it with tfun's rewrites, in order:

1. `tfun._hoist_constants.rewrite`: tensor constants inside a loop body or a branch become
   operands of their HOP (torch 2.11 and 2.13 fail at run time on a constant in a body).
2. `tfun._view_copies.rewrite`: copying views that Inductor would run as ATen calls (the
   `select_copy`s of a differentiated loop body) become a view and a clone it fuses.
3. `tfun._small_matmul.rewrite`: small CPU matrix products become a broadcast multiply and a
   sum it fuses with the step's pointwise work.

Each leaves a graph it does not apply to as it was. `tfun._jit_options` adds the pass when
tfun.jit compiles with Inductor in its default mode; `options={"post_grad_custom_pre_pass":
None}` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
from typing import Any

import torch

from . import _compat, _hoist_constants, _small_matmul, _view_copies

__all__ = ["PostGradPass"]

# Part of the pass's cache key (`uuid`): bump it when a rewrite changes.
_VERSION = 3


class PostGradPass(_compat.CustomGraphPass):  # type: ignore[misc, valid-type]
    """tfun's rewrites as an Inductor custom post-grad pass, with a cache key of its own
    (`uuid`): a graph compiled with it is never taken from Inductor's caches for one compiled
    without it, or with another tfun."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        _hoist_constants.rewrite(graph)
        _view_copies.rewrite(graph)
        _small_matmul.rewrite(graph)

    def uuid(self) -> Any:
        return ("tfun.PostGradPass", _VERSION, _small_matmul.MAX_MULTIPLY_ADDS, _source_hash())


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """A hash of tfun's own source files, in the pass's cache key. Inductor's caches key a
    compiled graph by its ops, not by what a custom op's fake kernel said when it was
    compiled: a graph compiled by another tfun (a `tfun.nn` op whose fake kernel changed) would
    be taken from the cache as it was. With tfun's source in the key, a graph compiled by
    `tfun.jit` is reused only by the same tfun."""
    root = pathlib.Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
