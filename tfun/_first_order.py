"""A traced gradient kept first-order: its loops stay loop ops, and a backward that reaches it
fails loudly.

Under `tfun.jit`, `tfun.grad(loss)(W)` with `W` requiring grad (an `nn.Parameter`: the usual
training step) returns a gradient that an outer `.backward()` could differentiate again (a
gradient penalty, `W - lr * g` differentiated later). torch's loop ops (scan, while_loop,
cond, map) have no second derivative, so an exact differentiable gradient means unrolling every
loop into the graph, which costs compile time per step (minutes for a 1024-step RNN). Almost
every such gradient is only read.

So the gradient is computed first-order (`create_graph=False`: the loops stay loop ops) and
then passed through `keep_first_order(grads, anchors, message)`: an opaque `torch.library` op
that returns the gradients unchanged, but as functions of `anchors` (the differentiated
arguments, or the loss value where the gradient depends on closed-over tensors), so that the
compiled function's outputs require grad as eagerly. Its backward is `refuse_second_order`,
whose kernel checks the cotangents that reached the gradient at run time:

- all zero (a `.backward()` of something else, with the gradient's cotangent materialized as
  zeros): the second-order term is a linear function of that cotangent, so it is exactly zero,
  and zeros are returned;
- any nonzero: the second-order term the compiled graph cannot compute is needed, and a
  `tfun.errors.JitError` is raised (`message`, built at trace time: the op, the user's
  function, and the fixes: `unroll=True` on the loops, which keeps the exact differentiable
  gradient, or the second-order term outside `tfun.jit`).

Nothing is dropped silently: a wrong second-order gradient cannot come out of this path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._errors import JitError

__all__ = ["keep_first_order"]


@torch.library.custom_op("tfun::keep_first_order", mutates_args=())
def _keep_first_order(grads: list[torch.Tensor], anchors: list[torch.Tensor], message: str) -> list[torch.Tensor]:
    return [g.clone() for g in grads]


@_keep_first_order.register_fake
def _keep_first_order_fake(grads: list[torch.Tensor], anchors: list[torch.Tensor], message: str) -> list[torch.Tensor]:
    return [torch.empty_like(g) for g in grads]


@torch.library.custom_op("tfun::refuse_second_order", mutates_args=())
def _refuse_reached(cts: list[torch.Tensor], anchors: list[torch.Tensor], message: str) -> list[torch.Tensor]:
    # (the check reads the cotangents: a device synchronization, paid only by a backward that
    # reaches the gradient)
    if any(bool(torch.any(c != 0)) for c in cts):
        raise JitError(message)
    return [torch.zeros_like(a) for a in anchors]


@_refuse_reached.register_fake
def _refuse_reached_fake(cts: list[torch.Tensor], anchors: list[torch.Tensor], message: str) -> list[torch.Tensor]:
    return [torch.zeros_like(a) for a in anchors]


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: list[torch.Tensor]) -> None:
    grads, anchors, message = inputs
    ctx.save_for_backward(*anchors)
    ctx.message, ctx.n_grads = message, len(grads)


def _backward(ctx: torch.autograd.function.FunctionCtx, cts: list[torch.Tensor]) -> tuple:
    anchors = list(ctx.saved_tensors)
    # (an output no cotangent reached may come as None: it holds nothing to check)
    cts = [c for c in cts if c is not None]
    # (one entry per input, a list for a list: torch checks the structure)
    return [None] * ctx.n_grads, _refuse_reached(cts, anchors, ctx.message), None


_keep_first_order.register_autograd(_backward, setup_context=_setup_context)


def keep_first_order(
    grads: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor], message: str
) -> list[torch.Tensor]:
    """`grads` unchanged (copies), differentiable with respect to `anchors` (tensors that
    require grad) with a derivative that is zero where the cotangent is zero and a `JitError`
    with `message` where it is not (see the module docstring). Traced code only."""
    return _keep_first_order(list(grads), list(anchors), message)
