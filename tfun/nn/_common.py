"""Shared helpers of `tfun.nn`: input validation and the linear recurrence."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import lax
from .._errors import ArgumentTypeError, ArgumentValueError, TensorMismatchError, format_message


def _combine(x, y):
    a_i, b_i = x
    a_j, b_j = y
    return a_j * a_i, a_j * b_i + b_j


def linear_recurrence(a: torch.Tensor, b: torch.Tensor, *, axis: int = -1, init: torch.Tensor | None = None) -> torch.Tensor:
    """All states of `h_t = a_t * h_{t-1} + b_t` along `axis` (h_{-1} = `init`, or 0).

    Uses `tfun.lax.linear_scan` for real tensors (`tfun.kernels`, imported by `import tfun`
    before `tfun.nn`, registers its implementations), and `tfun.lax.associative_scan` with the
    S5 binary operator `(a_i, b_i) • (a_j, b_j) = (a_j a_i, a_j b_i + b_j)` (Smith et al. 2023)
    for complex tensors. `a` must broadcast to `b`'s shape.
    """
    ax = axis % b.dim()
    a = a.expand_as(b) if a.shape != b.shape else a
    if not (a.is_complex() or b.is_complex()):
        return lax.linear_scan(a, b, init, axis=ax)
    if init is not None:
        first = a.narrow(ax, 0, 1) * init.unsqueeze(ax) + b.narrow(ax, 0, 1)
        b = torch.cat([first, b.narrow(ax, 1, b.shape[ax] - 1)], dim=ax)
    if b.shape[ax] == 0:
        return b
    _, h = lax.associative_scan(_combine, (a, b), axis=ax)
    return h


def linear_scan_backend() -> str:
    """Which implementation `linear_recurrence` uses for real tensors."""
    return "tfun.lax.linear_scan"


def describe(x: torch.Tensor) -> str:
    return f"{x.dtype} tensor of shape {tuple(x.shape)}"


def check_tensor(layer: str, arg: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        if type(x).__name__ == "PackedSequence":
            raise ArgumentTypeError(
                format_message(
                    f"{layer}: PackedSequence input is not supported.",
                    revise="Pad the batch (torch.nn.utils.rnn.pad_packed_sequence) and pass a tensor instead.",
                )
            )
        raise ArgumentTypeError(f"{layer}: {arg} must be a torch.Tensor, but got {type(x).__name__}.")
    return x


def check_input(
    layer: str,
    x: object,
    *,
    ndims: Sequence[int],
    features: int,
    dtype: torch.dtype | None,
    layout: str,
    arg: str = "input",
) -> torch.Tensor:
    """Validate rank, last-axis size and dtype of a layer's input."""
    x = check_tensor(layer, arg, x)
    if x.dim() not in ndims:
        want = " or ".join(f"{n}-D" for n in ndims)
        raise ArgumentValueError(
            format_message(
                f"{layer}: {arg} must be {want} with layout {layout}, but it is {x.dim()}-D:",
                [f"{arg}: expected {layout}, got shape {tuple(x.shape)}"],
                revise=f"Reshape {arg} to {layout}.",
            )
        )
    if x.shape[-1] != features:
        raise ArgumentValueError(
            format_message(
                f"{layer}: the last axis of {arg} must have the layer's feature size {features}:",
                [f"{arg}: expected {layout} with last axis {features}, got shape {tuple(x.shape)}"],
                revise=f"Pass {arg} with {features} features, or build the layer with a matching size.",
            )
        )
    if dtype is not None and x.dtype != dtype:
        raise TensorMismatchError(
            format_message(
                f"{layer}: {arg} must have the dtype of the layer's parameters:",
                [f"{arg}: expected {dtype}, got {x.dtype}"],
                revise=f"Cast {arg} with .to({dtype}) or the layer with .to({x.dtype}).",
            )
        )
    return x


def check_state(layer: str, arg: str, x: object, shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Validate the exact shape (and dtype) of a recurrent state."""
    x = check_tensor(layer, arg, x)
    if tuple(x.shape) != tuple(shape):
        raise ArgumentValueError(
            format_message(
                f"{layer}: {arg} has the wrong shape:",
                [f"{arg}: expected shape {tuple(shape)}, got {tuple(x.shape)}"],
                revise=f"Pass {arg} with shape {tuple(shape)}, or omit it to start from zeros.",
            )
        )
    if dtype is not None and x.dtype != dtype:
        raise TensorMismatchError(
            format_message(
                f"{layer}: {arg} has the wrong dtype:",
                [f"{arg}: expected {dtype}, got {x.dtype}"],
                revise=f"Cast {arg} with .to({dtype}).",
            )
        )
    return x
