"""Small matrix products as fused loops, for `tfun.jit` on the CPU.

A compiled loop body on the CPU runs its steps from Inductor's wrapper, and a matrix product
there is an *extern* call: ATen's `addmm`/`mm`/`bmm` with an output buffer allocated for it,
each step. For the small products of a recurrent step (`h @ W` with a batch of 4 and a state of
32: 4,096 multiply-adds) that call and allocation cost more than the arithmetic: measured on a
2-core CPU, torch 2.13, a tanh RNN step under `tfun.jit` took 7.7 us with the extern `addmm`
and 4.7 us with the product written as a broadcast multiply and a sum, which Inductor fuses with
the step's other pointwise work into one generated C++ kernel (benchmarks/RESULTS.md).

`rewrite` is that rewrite, run by Inductor as part of tfun's post-grad pass
(`tfun._inductor_pass.PostGradPass`, on every graph it compiles: the forward, the backward,
and each loop body and branch inside them). It rewrites `aten.mm`, `aten.addmm` and
`aten.bmm` nodes

- on the CPU (every other device keeps its GEMM library),
- in a floating dtype (float16 and bfloat16 are multiplied and summed in float32 and rounded
  once, as ATen's CPU kernels accumulate them),
- with static sizes whose product `batch * M * K * N` is at most `MAX_MULTIPLY_ADDS`
  (2^18, where the fused loop stopped winning in the same measurement).

- summing more than Inductor's `unroll_reductions_threshold` (8) terms (`K`), or else used
  only by pointwise ops of its own shape and transposes up to the graph's output (a recurrent
  step's weight gradient `hᵀ g`, summed over a batch of 4, added to its carry). Inductor turns a sum of at
  most 8 terms into pointwise code, which each consumer of the product inlines through its
  views; through a flipped, strided scatter (the backward of a reversed `associative_scan` of
  2x2 matrices) torch 2.11-2.13 printed that index arithmetic with C's `%`, which is negative
  for a negative operand: the backward read outside its buffers and returned garbage
  gradients (found by a correctness hunt, session 19; tests/test_small_matmul.py). A larger
  sum stays a reduction, which Inductor writes to its own buffer, as it does ATen's result.

Anything else is left to ATen. The result is the same matrix product with another summation
order: float32 results differ from the extern kernel's by rounding only (the tests compare
both with the float64 eager result).

`tfun.jit` adds that pass to Inductor's options when it compiles with Inductor in its default
mode (`tfun._jit_options`).
"""

from __future__ import annotations

from typing import Any

import torch

from . import _compat

__all__ = ["MAX_MULTIPLY_ADDS", "rewrite"]

MAX_MULTIPLY_ADDS = 1 << 18

_aten = torch.ops.aten
_prims = torch.ops.prims  # post-grad graphs convert dtypes with prims, not aten._to_copy
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _static_ints(shape: Any) -> list[int] | None:
    out = []
    for s in shape:
        if not isinstance(s, int):  # a SymInt: a size known only at run time
            return None
        out.append(s)
    return out


def _operands(node: torch.fx.Node) -> tuple[Any, Any] | None:
    """The two matrix operands of an mm/addmm/bmm node whose product is small and on the CPU,
    else None."""
    target = node.target
    if target is _aten.mm.default or target is _aten.bmm.default:
        if len(node.args) != 2 or node.kwargs:
            return None
        a, b = node.args
    elif target is _aten.addmm.default:
        if len(node.args) != 3:
            return None
        a, b = node.args[1], node.args[2]
    else:
        return None
    va, vb = _val(a), _val(b)
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return None
    if va.device.type != "cpu" or vb.device.type != "cpu" or va.dtype != vb.dtype or not va.dtype.is_floating_point:
        return None
    sa, sb = _static_ints(va.shape), _static_ints(vb.shape)
    if sa is None or sb is None or len(sa) != len(sb) or len(sa) not in (2, 3):
        return None
    work = sa[-2] * sa[-1] * sb[-1] * (sa[0] if len(sa) == 3 else 1)
    if work == 0 or work > MAX_MULTIPLY_ADDS:
        return None
    if sa[-1] <= _compat.inductor_unrolled_reduction_size() and not _elementwise_to_output(node, tuple(node.meta["val"].shape)):
        return None  # see the module's docstring
    return a, b


#: Views that only reorder dimensions: indexing through them needs no division or remainder.
_PERMUTATIONS = (_aten.permute.default, _aten.t.default, _aten.transpose.int)


def _elementwise_to_output(node: torch.fx.Node, shape: tuple[int, ...], seen: set[torch.fx.Node] | None = None) -> bool:
    """Whether every path from `node` to the graph's output runs through pointwise ops of its
    shape and dimension permutations only (so Inductor, inlining the product into them,
    indexes it with no division or remainder). Each node is visited once."""
    seen = set() if seen is None else seen
    for user in node.users:
        if user.op == "output" or user in seen:
            continue
        seen.add(user)
        val = _val(user)
        if user.op != "call_function" or not isinstance(val, torch.Tensor):
            return False
        if user.target in _PERMUTATIONS:
            if not _elementwise_to_output(user, tuple(val.shape), seen):
                return False
            continue
        if (
            torch.Tag.pointwise not in getattr(user.target, "tags", ())
            or tuple(val.shape) != shape
            or not _elementwise_to_output(user, shape, seen)
        ):
            return False
    return True


class _Builder:
    """Inserts aten calls before `anchor`, each with its `val` computed on fake tensors."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node, fake_mode: Any) -> None:
        self.graph, self.anchor, self.fake_mode = graph, anchor, fake_mode

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        vals = [_val(a) if isinstance(a, torch.fx.Node) else a for a in args]
        kvals = {k: (_val(v) if isinstance(v, torch.fx.Node) else v) for k, v in kwargs.items()}
        with self.fake_mode:
            val = op(*vals, **kvals)
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(op, tuple(args), kwargs)
        node.meta["val"] = val
        return node


def _rewrite_node(graph: torch.fx.Graph, node: torch.fx.Node, a: Any, b: Any) -> None:
    fake_mode = _compat.fake_mode_of([_val(a), _val(b)])
    if fake_mode is None:
        return
    call = _Builder(graph, node, fake_mode)
    dtype = _val(a).dtype
    acc = torch.float32 if dtype in _LOW_PRECISION else dtype

    def up(x: Any) -> Any:
        return x if acc == dtype else call(_prims.convert_element_type.default, x, acc)

    # (..., M, K, 1) * (..., 1, K, N) summed over K: Inductor fuses the product into the sum
    prod = call(_aten.mul.Tensor, call(_aten.unsqueeze.default, up(a), -1), call(_aten.unsqueeze.default, up(b), -3))
    out = call(_aten.sum.dim_IntList, prod, [-2])
    if node.target is _aten.addmm.default:
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if alpha != 1:
            out = call(_aten.mul.Tensor, out, alpha)
        if beta != 0:  # ATen: with beta == 0 the input is ignored (nan and inf included)
            bias = up(node.args[0])
            out = call(_aten.add.Tensor, out, bias if beta == 1 else call(_aten.mul.Tensor, bias, beta))
    if acc != dtype:
        out = call(_prims.convert_element_type.default, out, dtype)
    out.meta.update({k: v for k, v in node.meta.items() if k != "val"})  # stack trace, source names
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def rewrite(graph: torch.fx.Graph) -> int:
    """Rewrite the small CPU matrix products of `graph` in place; returns how many."""
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        found = _operands(node)
        if found is not None:
            _rewrite_node(graph, node, *found)
            n += 1
    return n
