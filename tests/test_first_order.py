"""`tfun._first_order`: the op that keeps a traced gradient first-order. Eagerly here (its
traced use is tested end to end in tests/test_jit_second_order.py): the gradient passes
unchanged, is differentiable in the anchors, a zero cotangent gives zero, a nonzero one the
JitError built at trace time; torch's `opcheck` on both ops."""

from __future__ import annotations

import pytest
import torch

from tfun import _first_order
from tfun.errors import JitError


def _case(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(3, 3, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(2, generator=g, dtype=dtype).requires_grad_()
    grads = [torch.randn(3, 3, generator=g, dtype=dtype), torch.randn(2, generator=g, dtype=dtype)]
    return W, b, grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.complex64])
def test_values_pass_unchanged_and_zero_cotangents_give_zero(dtype):
    W, b, grads = _case(dtype)
    kept = _first_order.keep_first_order(grads, [W, b], "msg")
    for k, g in zip(kept, grads):
        assert torch.equal(k, g) and k.requires_grad and k.data_ptr() != g.data_ptr()
    # a backward of something else with the kept gradient in the graph at coefficient zero
    ((W.abs() ** 2).sum() + (kept[0] * 0).real.sum() + (kept[1] * 0).real.sum()).backward()
    torch.testing.assert_close(W.grad, 2 * W.detach().abs() ** 2 / W.detach().conj() if dtype.is_complex else 2 * W.detach())
    assert torch.equal(b.grad, torch.zeros_like(b))


def test_a_nonzero_cotangent_raises_the_message():
    W, b, grads = _case()
    kept = _first_order.keep_first_order(grads, [W, b], "tfun.grad: the message")
    with pytest.raises(JitError, match="^tfun.grad: the message$"):
        (kept[1] ** 2).sum().backward()


def test_opcheck():
    # (not opcheck's AOT-dispatch test for keep_first_order: it backpropagates random, nonzero
    # cotangents, which this op refuses by design; the compiled path is tested end to end)
    W, b, grads = _case()
    torch.library.opcheck(
        torch.ops.tfun.keep_first_order.default,
        ([g.requires_grad_() for g in grads], [W, b], "m"),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    cts = [torch.zeros(3, 3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
    torch.library.opcheck(torch.ops.tfun.refuse_second_order.default, (cts, [W.detach(), b.detach()], "m"))
