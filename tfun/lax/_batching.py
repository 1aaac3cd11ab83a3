"""Data-dependent predicates under `torch.func.vmap`.

Inside `vmap`, a predicate computed from batched inputs is a *batched* tensor: it holds
one value per example, so no single branch can be taken and no single loop can stop. JAX
then evaluates every branch and selects per example (`cond`, `switch`), and runs a loop
until every example is done, freezing the finished ones (`while_loop`). tfun does the
same; these helpers detect the case and read the physical (all-examples) values.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from torch._C import _functorch as _ft
except ImportError:  # pragma: no cover
    _ft = None  # type: ignore[assignment]


def _unwrap_once(t: torch.Tensor) -> torch.Tensor | None:
    if _ft is None:
        return None
    if _ft.is_batchedtensor(t) or _ft.is_gradtrackingtensor(t) or _ft.is_functionaltensor(t):
        return _ft.get_unwrapped(t)
    return None


def is_batched(t: Any) -> bool:
    """Whether `t` carries a vmap batch dimension at some functorch level."""
    if _ft is None or not isinstance(t, torch.Tensor):
        return False
    for _ in range(64):
        if _ft.is_batchedtensor(t):
            return True
        u = _unwrap_once(t)
        if u is None:
            return False
        t = u
    return False


def physical(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every functorch wrapper (all batch dims materialized)."""
    for _ in range(64):
        u = _unwrap_once(t)
        if u is None:
            return t
        t = u
    return t


def any_true(pred: torch.Tensor) -> bool:
    """Whether the predicate is true for at least one example of the batch."""
    return bool(physical(pred).any())


__all__ = ["is_batched", "physical", "any_true"]
