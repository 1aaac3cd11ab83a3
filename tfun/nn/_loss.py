"""`chunked_cross_entropy`: a linear layer + cross-entropy that never materializes the logits."""


from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _context, lax
from .._errors import ArgumentTypeError, ArgumentValueError, TensorMismatchError, format_message
from ._common import check_tensor

_OP = "tfun.nn.chunked_cross_entropy"


def _chunk_body(weight: Tensor, bias: Tensor | None, ignore_index: int, ct: torch.dtype, need_h: bool):
    """The per-chunk step: logits, loss sum, and the gradients of the summed loss."""

    def body(carry: tuple[Tensor, Tensor, Tensor], xs: tuple[Tensor, Tensor]) -> tuple[tuple[Tensor, Tensor, Tensor], Any]:
        grad_w, grad_b, loss = carry
        h, t = xs
        h = h.to(ct)
        logits = torch.addmm(bias, h, weight.t()) if bias is not None else h @ weight.t()
        lse = torch.logsumexp(logits, dim=1)
        valid = t != ignore_index
        safe_t = torch.where(valid, t, torch.zeros_like(t)).unsqueeze(1)
        picked = logits.gather(1, safe_t).squeeze(1)
        mask = valid.to(ct)
        loss = loss + ((lse - picked) * mask).sum()
        # softmax in place in the chunk's logits buffer, then d(loss_sum)/d(logits)
        p = logits.sub_(lse.unsqueeze(1)).exp_()
        p.scatter_add_(1, safe_t, -torch.ones_like(picked).unsqueeze(1))
        p.mul_(mask.unsqueeze(1))
        grad_w = grad_w + p.t() @ h
        grad_b = grad_b + p.sum(0)
        grad_h = p @ weight if need_h else None
        return (grad_w, grad_b, loss), grad_h

    return body


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, chunk_size: int,
                ignore_index: int, reduction: str) -> Tensor:
        n, d = hidden.shape
        ct = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        w = weight.to(ct)
        b = bias.to(ct) if bias is not None else None
        need_h = ctx.needs_input_grad[0]
        body = _chunk_body(w, b, ignore_index, ct, need_h)
        carry = (torch.zeros_like(w), torch.zeros(w.shape[0], dtype=ct, device=w.device),
                 torch.zeros((), dtype=ct, device=w.device))
        n_full = n // chunk_size
        grads_h = []
        if n_full:
            hs = hidden[: n_full * chunk_size].reshape(n_full, chunk_size, d)
            ts = target[: n_full * chunk_size].reshape(n_full, chunk_size)
            carry, gh = lax.scan(body, carry, (hs, ts))
            if need_h:
                grads_h.append(gh.reshape(n_full * chunk_size, d))
        if n_full * chunk_size < n:
            carry, gh = body(carry, (hidden[n_full * chunk_size:], target[n_full * chunk_size:]))
            if need_h:
                grads_h.append(gh)
        grad_w, grad_b, loss = carry
        if reduction == "mean":
            denom = (target != ignore_index).sum().to(ct)
            loss = loss / denom
            grad_w = grad_w / denom
            grad_b = grad_b / denom
            grads_h = [g / denom for g in grads_h]
        grad_h = torch.cat(grads_h).to(hidden.dtype) if need_h and grads_h else None
        ctx.save_for_backward(
            grad_h if grad_h is not None else None,
            grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None,
            grad_b.to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None,
        )
        ctx.hidden_shape = hidden.shape
        return loss.to(hidden.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = lambda g: None if g is None else g * grad_out.to(g.dtype)  # noqa: E731
        return scale(grad_h), scale(grad_w), scale(grad_b), None, None, None, None


def _chunks(n: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(i, min(i + chunk_size, n)) for i in range(0, n, chunk_size)]


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, chunk_size: int) -> Any:
    """`(lo, hi, h, logits)` for each chunk of rows, in the computation dtype (float32 at
    least): one chunk's logits at a time."""
    ct = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    w = weight.to(ct)
    b = bias.to(ct) if bias is not None else None
    for lo, hi in _chunks(hidden.shape[0], chunk_size):
        h = hidden[lo:hi].to(ct)
        yield lo, hi, h, (torch.addmm(b, h, w.t()) if b is not None else h @ w.t())


class _ChunkedCENone(torch.autograd.Function):
    """reduction="none": per-row losses. The backward's per-row weights (the incoming
    gradient) are unknown in the forward, so the backward scans the chunks again: it
    recomputes each chunk's softmax and forms the gradients then. Memory stays one chunk's
    logits; the cost is a second pass over the logits."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, chunk_size: int,
                ignore_index: int) -> Tensor:
        ct = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        losses = []
        for lo, hi, _h, logits in _chunk_logits(hidden, weight, bias, chunk_size):
            t = target[lo:hi]
            valid = t != ignore_index
            safe_t = torch.where(valid, t, torch.zeros_like(t)).unsqueeze(1)
            row = torch.logsumexp(logits, dim=1) - logits.gather(1, safe_t).squeeze(1)
            losses.append(row * valid.to(ct))
        ctx.save_for_backward(hidden, weight, bias, target)
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        out = torch.cat(losses) if losses else hidden.new_zeros((0,), dtype=ct)
        return out.to(hidden.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, target = ctx.saved_tensors
        ct = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        w = weight.to(ct)
        grad_w = torch.zeros_like(w)
        grad_b = torch.zeros(w.shape[0], dtype=ct, device=w.device)
        grad_h = []
        for lo, hi, h, logits in _chunk_logits(hidden, weight, bias, ctx.chunk_size):
            t = target[lo:hi]
            valid = t != ctx.ignore_index
            safe_t = torch.where(valid, t, torch.zeros_like(t)).unsqueeze(1)
            p = torch.softmax(logits, dim=1)
            p.scatter_add_(1, safe_t, -torch.ones_like(safe_t, dtype=ct))
            p.mul_((valid.to(ct) * grad_out[lo:hi].to(ct)).unsqueeze(1))
            grad_w += p.t() @ h
            grad_b += p.sum(0)
            grad_h.append(p @ w)
        gh = torch.cat(grad_h).to(hidden.dtype) if grad_h else torch.zeros_like(hidden)
        gb = grad_b.to(bias.dtype) if bias is not None else None
        return gh, grad_w.to(weight.dtype), gb, None, None, None


def _transformable(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, chunk_size: int,
                   ignore_index: int, reduction: str) -> Tensor:
    """The loss from plain differentiable ops, one chunk's logits at a time in the forward
    (autograd keeps each chunk's for the backward): what runs under torch.func transforms."""
    ct = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    rows = []
    for lo, hi, _h, logits in _chunk_logits(hidden, weight, bias, chunk_size):
        rows.append(torch.nn.functional.cross_entropy(logits, target[lo:hi], ignore_index=ignore_index, reduction="none"))
    losses = torch.cat(rows) if rows else hidden.new_zeros((0,), dtype=ct)
    if reduction == "none":
        return losses.to(hidden.dtype)
    total = losses.sum()
    if reduction == "mean":
        total = total / (target != ignore_index).sum().to(ct)
    return total.to(hidden.dtype)


def chunked_cross_entropy(
    hidden: Float[Tensor, "*rows hidden"],
    weight: Float[Tensor, "vocab hidden"],
    target: Int[Tensor, "*rows"],
    bias: Float[Tensor, " vocab"] | None = None,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Float[Tensor, "..."]:
    """`F.cross_entropy(hidden @ weight.T + bias, target)` without ever holding the full logits.

    The memory-saving loss of the PyTorch control-flow paper ("Chunked Loss Computation",
    appendix F.3; after Hsu et al. 2024, Liger kernel): a `torch.autograd.Function` whose
    forward runs `tfun.lax.scan` over chunks of `chunk_size` rows. For each chunk it computes
    the logits, the loss, and the gradients of the loss with respect to `hidden`, `weight`
    and `bias`, accumulating the latter two in the scan carry; only one chunk's logits
    `(chunk_size, vocab)` exist at a time. The backward multiplies the saved gradients by the
    incoming gradient. Logits are computed in float32 (or float64 for float64 inputs).

    Semantics: `F.cross_entropy((hidden @ weight.T + bias).reshape(-1, vocab), target.reshape(-1),
    ignore_index=ignore_index, reduction=reduction)`.

    **Arguments:**

    - `hidden`: `(*rows, hidden)` final hidden states.
    - `weight`: `(vocab, hidden)` output projection (e.g. an `nn.Linear`'s or tied embedding weight).
    - `target`: `(*rows,)` integer class indices.
    - `bias`: `(vocab,)` or `None`.
    - `chunk_size`: rows per chunk (a positive int).
    - `ignore_index`: target value that contributes neither loss nor gradient.
    - `reduction`: `"mean"` (over non-ignored rows), `"sum"`, or `"none"` (per-row losses,
      shape `(*rows,)`, 0 for ignored rows). With `"none"` the per-row weights of the
      backward are unknown in the forward, so the gradients are formed in a second chunked
      pass during the backward instead (same memory, a second matmul per chunk).

    **Returns:** the loss: a scalar, or `(*rows,)` with `reduction="none"`. With `.backward()`
    / `torch.autograd` it is differentiable once (no double backward). Under `torch.func`
    transforms (`tfun.grad`, `tfun.vmap`, `tfun.jvp`, `hessian`, eagerly) it is computed from
    plain ops one chunk at a time, differentiable to any order; autograd then keeps each
    chunk's logits for the backward, so the memory saving is that of the forward only.
    """
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        check_tensor(_OP, name, t)
    if reduction not in ("mean", "sum", "none"):
        raise ArgumentValueError(f"{_OP}: reduction must be 'mean', 'sum' or 'none', but got {reduction!r}.")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ArgumentValueError(f"{_OP}: chunk_size must be a positive int, but got {chunk_size!r}.")
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ArgumentValueError(
            format_message(
                f"{_OP}: hidden must be (*rows, hidden) and weight (vocab, hidden) with the same hidden size:",
                [f"hidden: shape {tuple(hidden.shape)}", f"weight: shape {tuple(weight.shape)}"],
                revise="Pass weight with shape (vocab, hidden), as nn.Linear stores it.",
            )
        )
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ArgumentValueError(
            format_message(
                f"{_OP}: target must have hidden's shape without its last axis:",
                [f"target: expected shape {tuple(hidden.shape[:-1])}, got {tuple(target.shape)}"],
                revise="Pass one class index per row of hidden.",
            )
        )
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ArgumentTypeError(f"{_OP}: target must hold integer class indices, but it is {target.dtype}.")
    if bias is not None and tuple(check_tensor(_OP, "bias", bias).shape) != (weight.shape[0],):
        raise ArgumentValueError(
            format_message(f"{_OP}: bias must be (vocab,):",
                           [f"bias: expected shape {(weight.shape[0],)}, got {tuple(bias.shape)}"])
        )
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise TensorMismatchError(
            format_message(f"{_OP}: hidden and weight must share a floating dtype:",
                           [f"hidden: {hidden.dtype}", f"weight: {weight.dtype}"],
                           revise="Cast them to one dtype.")
        )
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = target.reshape(-1)
    if _context.in_functorch_transform():
        # under torch.func (`tfun.grad`, `tfun.vmap`, `tfun.jvp`, jacrev, ... eagerly): plain
        # differentiable ops per chunk, which every transform and derivative order goes
        # through; the Functions below (old-style, gradients formed in the forward) were
        # refused by torch.func ("must override the setup_context staticmethod", hunt 27)
        out = _transformable(h2, weight, bias, t1, chunk_size, ignore_index, reduction)
        return out.reshape(target.shape) if reduction == "none" else out
    if reduction == "none":
        return _ChunkedCENone.apply(h2, weight, bias, t1, chunk_size, ignore_index).reshape(target.shape)
    return _ChunkedCE.apply(h2, weight, bias, t1, chunk_size, ignore_index, reduction)
