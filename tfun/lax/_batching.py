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

from .. import _compat

# functorch's wrapper predicates (torch's private `torch._C._functorch`, bound in `_compat`);
# a torch without them has no vmap wrappers for these helpers to see
_is_batchedtensor = _compat.is_batchedtensor
_is_gradtrackingtensor = _compat.is_gradtrackingtensor
_is_functionaltensor = _compat.is_functionaltensor
_get_unwrapped = _compat.get_unwrapped
_READY = not _compat.functorch_missing("is_batchedtensor", "is_gradtrackingtensor", "is_functionaltensor", "get_unwrapped")


def _unwrap_once(t: torch.Tensor) -> torch.Tensor | None:
    if not _READY:
        return None
    if _is_batchedtensor(t) or _is_gradtrackingtensor(t) or _is_functionaltensor(t):  # type: ignore[misc]
        return _get_unwrapped(t)  # type: ignore[misc]
    return None


def is_batched(t: Any) -> bool:
    """Whether `t` carries a vmap batch dimension at some functorch level."""
    if not _READY or not isinstance(t, torch.Tensor):
        return False
    for _ in range(64):
        if _is_batchedtensor(t):  # type: ignore[misc]
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
