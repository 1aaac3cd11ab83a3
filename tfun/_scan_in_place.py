"""CPU scans, maps and while_loops compiled as loops that allocate nothing per step, for `tfun.jit` (Inductor).

Inductor compiles a `scan` (tfun's, and the ones torch's autograd makes for its backward) by
rewriting it into a `while_loop` (torch's `decompose_scan_to_while_loop`) whose every step
runs, from Inductor's Python wrapper: the condition as a subgraph (a new 0-d bool buffer, a
kernel, `bool()` of it), `.item()` of the step counter and four Python range checks on it, a
new buffer for each carry and one for the next counter, then the step's kernels. On the CPU,
for a small step, those allocations are most of the time: measured on a 2-core x86-64 CPU,
torch 2.13, `benchmarks/vs_jax.py`'s tanh RNN (batch 4, state 32, 1024 steps), each
`empty_strided` costs 0.5-0.7 µs, `bool()` 0.3 µs and `.item()` 0.3 µs, against 0.5 µs for
the step's one fused kernel; taking the three allocations out of the generated code by hand
took the forward from 3.2 to 1.4 ms. With this rewrite, interleaved in one process: forward
3.83 -> 2.55 ms, forward+backward 9.36 -> 6.48 ms (benchmarks/RESULTS.md).

`rewrite` decomposes each such `scan` itself, before torch's pass, into a `while_loop` that
updates its state in place (and each `map`, torch's `map_impl`, which is a scan without a
carry and which Inductor decomposes the same way):

```
ys = empty(n, ...); carry = clone(init); i = 0; go = True    # once, before the loop
while go:                                                   # the condition returns `go`
    x = [x_leaf[i] for x_leaf in xs]                        # indexed by the 0-d tensor i
    new_carry, y = step(carry, x)
    ys[i] = y                                               # index_put_, in place
    carry.copy_(new_carry)                                  # in place
    i += 1; go.copy_(i < n)                                 # in place
```

so the condition is its input (no kernel, no buffer), the step indexes `xs` and writes `ys`
in its kernel from the counter tensor (no `.item()`, no Python checks: the kernel checks the
index), and Inductor fuses the copies into the step's kernel, which writes the new carry where
the old one was (a reduction over the old carry completes before the copy). Inductor
supports a `while_loop` body that mutates its carried inputs (it is how torch's own
decomposition writes `ys`); it takes mutated inputs in the order the body first mutates them,
and maps them onto outputs by position, so the body mutates its state in position order
(`ys`, carries, `i`, `go`).

Where the length `n` is a static int (at least 1), the condition subgraph of the new loop is
marked with it (`_compat.STATIC_TRIPS` in its `meta`): the loop runs exactly `n` times, and
Inductor's Python wrapper then writes `for _ in range(n):` around the step instead of calling
the condition and reading its bool back each step (`_compat.counted_while_loops`).

A `while_loop` (tfun's, and `fori_loop` with traced bounds) pays the same per step: the
condition subgraph (a buffer, a kernel, `bool()`) and a new buffer for each carry. It is
rewritten the same way, with the condition computed once before the loop and then at the end
of each step, inside the step's kernel:

```
state = clone(carried); go = cond(*state)                   # once, before the loop
while go:                                                   # the condition returns `go`
    new = body(*state)
    state.copy_(new)                                        # in place, in position order
    go.copy_(cond(*state))                                  # in place
```

(`vs_jax.py`'s `while_loop` program, a (16, 64) state and 1,000 steps: 5.5-6.2 -> 4.8-5.1 ms; a
`fori_loop` with tensor bounds 6.4 -> 5.0-5.1 ms, interleaved in one process.) A differentiated
`while_loop` is torch's autograd form (`while_loop_stack_output` forward), not a plain
`while_loop`, and keeps torch's loop.

Applied only where it is known to hold: every tensor of the loop on the CPU (on CUDA the
counter would have to live on the device, and a CPU graph's cost is what this removes), every
size and stride an int or a symbol backed by an input's size (what tfun.jit's recompile with
symbolic shapes makes: the length `n` is then a symbol, and so are the sizes of `ys`), never a
size known only from data (an unbacked symbol), at least one `xs` leaf (the length), no complex
leaf, and among the closed-over inputs only such tensors and sizes (a body reads its sizes as
closed-over symbols under `dynamic=True`), no convolution in the body (`_keeps_layouts`), and
a step holding a control-flow op of its own only where it is passed the strides it was traced
with (`_layouts_agree`). Other loops are left to torch, and so are all scans
and maps on a torch whose C++ backend can fail to compile a kernel indexed by a loaded value
(`_compat.cpp_transposes_indirect_index`: torch 2.11, not 2.13). `ScanInPlacePass` runs it as Inductor's
`post_grad_custom_post_pass`, after Inductor's own graph clean-ups: those remove a `clone`
whose result is not mutated *in that graph* (`remove_noop_ops`), and the clone of `init` here
is mutated only inside the loop body, so the rewrite must come after them, or the loop would
write into the caller's `init`. `REWRITES` counts the loops rewritten, by HOP name (tests read
it). While_loops are rewritten first: a scan's replacement is a `while_loop` already in place.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx
from torch.utils import _pytree as pytree

from . import _compat

__all__ = ["REWRITES", "ScanInPlacePass", "rewrite"]

#: loops rewritten, by HOP name ("scan", "map_impl", "while_loop"); tests read it
REWRITES: collections.Counter = collections.Counter()

# Part of the pass's cache key (`uuid`): bump it when the rewrite changes.
_VERSION = 5


def _sized(x: Any) -> bool:
    """Whether `x` is a tensor whose sizes, strides and offset are ints, or symbols backed by
    an input's size (what tfun.jit's automatic-dynamic recompile makes); a size known only from
    data (an unbacked symbol) leaves the loop to torch."""
    if not isinstance(x, torch.Tensor):
        return False
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    dims = (*x.shape, *x.stride(), x.storage_offset())
    return all(isinstance(s, (int, torch.SymInt)) for s in dims) and not free_unbacked_symbols(x)


def _rebuildable(x: torch.Tensor) -> bool:
    """Whether the rewrite can allocate a tensor of `x`'s sizes and strides in the graph: each
    symbolic one is rebuilt there from its expression, and torch 2.13 rebuilds only symbols,
    integers and sums or products of two terms into nodes Inductor takes (a product of more
    becomes one n-ary `operator.mul` node, which Inductor's fake-tensor update calls with too
    many arguments, "mul expected 2 arguments, got 4"; a `Min`/`Max` becomes a `_nary_sym_min`
    node Inductor cannot lower); other loops are left to torch."""
    for s in (*x.shape, *x.stride()):
        if isinstance(s, torch.SymInt):
            for a in sympy.preorder_traversal(s.node.expr):
                if not (a.is_Symbol or a.is_Integer or ((a.is_Mul or a.is_Add) and len(a.args) == 2)):
                    return False
    return True


def _eligible(vals: Sequence[Any]) -> bool:
    return all(
        isinstance(v, torch.Tensor) and v.device.type == "cpu" and not v.is_complex() and _sized(v) for v in vals
    )


def _closed_over(vals: Sequence[Any]) -> bool:
    """Closed-over inputs: eligible tensors, and the sizes a body reads under symbolic shapes
    (ints, or symbols backed by an input's size)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return all(
        _eligible([v]) if isinstance(v, torch.Tensor) else isinstance(v, (int, torch.SymInt)) and not free_unbacked_symbols(v)
        for v in vals
    )


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def _parts(node: torch.fx.Node) -> tuple[Any, list[Any], list[Any], list[Any]] | None:
    """(step subgraph node, init, xs, closed-over inputs) of a `scan` or `map_impl` node (a map
    is a scan without a carry), or None when the rewrite does not apply to it."""
    if node.kwargs:
        return None
    if node.target is _op("scan") and len(node.args) == 4:
        step, init, xs, additional = node.args
    elif node.target is _op("map_impl") and len(node.args) == 3:
        step, xs, additional = node.args
        init = []
    else:
        return None
    if not all(isinstance(a, (list, tuple)) for a in (init, xs, additional)) or not xs:
        return None
    out = node.meta.get("val")
    if not isinstance(out, (list, tuple)) or len(out) < len(init):
        return None
    nodes = (*init, *xs, *additional)  # type: ignore[misc]
    if not all(isinstance(n, torch.fx.Node) for n in nodes):
        return None
    if not _eligible([_val(n) for n in (*init, *xs)] + list(out)):  # type: ignore[misc]
        return None
    if not all(_rebuildable(y) for y in list(out)[len(init) :]):  # `ys` is allocated from these
        return None
    if not _closed_over([_val(n) for n in additional]):  # type: ignore[union-attr]
        return None
    if not _layouts_agree(node, step, [_val(n) for n in init], [_val(n) for n in xs]):  # type: ignore[misc]
        return None
    if not _keeps_layouts(_subgraph(node, step)):
        return None
    return step, list(init), list(xs), list(additional)  # type: ignore[arg-type]


def _subgraph(node: torch.fx.Node, sub: Any) -> Any:
    """The subgraph module a loop node's argument `sub` (a `get_attr` node) names, or None."""
    return getattr(node.graph.owning_module, sub.target, None) if isinstance(sub, torch.fx.Node) else None


def _layouts_agree(node: torch.fx.Node, step_node: Any, init: list[Any], xs: list[Any]) -> bool:
    """Whether the rewritten loop may call the step subgraph of `node`: where the step holds
    a control-flow op of its own (a `cond` in a scan body), it takes each carry in `init`'s
    strides and each slice of `xs` in the strides of `xs[0]`, what the loop passes it.

    The step's own ops are traced again on what the loop passes, but a control-flow op inside
    it reads its operands in the strides its subgraphs were traced with. Under a traced `vmap`
    (whose rule moves batch dimensions last) a step can be traced on a contiguous slice of a
    batch-last `xs`; read in other strides, the `cond`'s values came out transposed (wrong
    numbers, no error). Such a loop is left to torch."""
    step = _subgraph(node, step_node)
    if not isinstance(step, torch.fx.GraphModule):
        return False
    nested = any(
        n.op == "get_attr" and isinstance(getattr(step, str(n.target), None), torch.fx.GraphModule)
        for n in step.graph.nodes
    )
    if not nested:
        return True
    if not all(x.dim() and x.shape[0] != 0 for x in xs):
        return False
    passed = [*init, *(x[0] for x in xs)]
    phs = [n for n in step.graph.nodes if n.op == "placeholder"]
    if len(phs) < len(passed):
        return False
    for ph, v in zip(phs, passed):
        want = ph.meta.get("val")
        if not isinstance(want, torch.Tensor) or tuple(want.shape) != tuple(v.shape):
            return False
        if v.dim() and tuple(want.stride()) != tuple(v.stride()):
            return False
    return True


def _keeps_layouts(gm: Any) -> bool:
    """Whether Inductor lowers a loop body made of `gm` (a step or body subgraph, with the
    subgraphs nested in it) in the strides the rewrite passes it: False where it holds a
    convolution. A graph with one gets Inductor's layout optimization
    (`GraphLowering.decide_layout_opt`, always on the CPU with oneDNN), which may lower the
    body so that it returns a copy of a loop state in another layout instead of the buffer it
    wrote in place. Inductor's loop then writes each later step into the previous step's
    copy, while the code after the loop reads the buffer passed in, which only the first step
    wrote: a map or scan of a `conv2d` came out uninitialized from step 1 on (wrong values,
    no error). Such loops are left to torch."""
    if not isinstance(gm, torch.fx.GraphModule):
        return False
    for n in gm.graph.nodes:
        if n.op == "call_function" and "convolution" in str(n.target):
            return False
        if n.op == "get_attr":
            sub = getattr(gm, str(n.target), None)
            if isinstance(sub, torch.fx.GraphModule) and not _keeps_layouts(sub):
                return False
    return True


def _op(name: str) -> Any:
    return getattr(torch.ops.higher_order, name, None)


def _while_parts(node: torch.fx.Node) -> tuple[Any, Any, list[Any], list[Any]] | None:
    """(condition node, body node, carried inputs, closed-over inputs) of a `while_loop` node,
    or None when the rewrite does not apply to it."""
    if node.kwargs or node.target is not _op("while_loop") or len(node.args) != 4:
        return None
    cond, body, carried, additional = node.args
    if not all(isinstance(a, (list, tuple)) for a in (carried, additional)) or not carried:
        return None
    out = node.meta.get("val")
    if not isinstance(out, (list, tuple)) or len(out) != len(carried):
        return None
    nodes = (*carried, *additional)
    if not all(isinstance(n, torch.fx.Node) for n in nodes):
        return None
    if not _eligible([_val(n) for n in carried] + list(out)) or not _closed_over([_val(n) for n in additional]):
        return None
    if not (_keeps_layouts(_subgraph(node, cond)) and _keeps_layouts(_subgraph(node, body))):
        return None
    return cond, body, list(carried), list(additional)


def _predicate(out: Any) -> Any:
    """The condition subgraph's result (a 0-d bool tensor, alone or in a 1-tuple)."""
    return out[0] if isinstance(out, (list, tuple)) else out


def _outputs(values: list[Any]) -> Any:
    """A replacement's results for a loop node whose users index its result (`res[0]`...):
    Inductor's pattern matcher puts a replacement that returns one value in the place of the
    node itself, so a loop with one result returns it in a 1-tuple (else its user would index
    the tensor: "getitem is not an OpOverload", as a one-tensor while_loop did)."""
    return (values,) if len(values) == 1 else values


def _rewrite_while_loops(graph: torch.fx.Graph, done: collections.Counter) -> None:
    """Each eligible `while_loop` of `graph` as a `while_loop` whose condition is a carried bool
    tensor: `go = cond(state)` once before the loop, and each step writes the body's results
    over the state, then `go.copy_(cond(state))`, so the condition runs inside the step's kernel
    and the wrapper allocates no state per step."""
    from torch._inductor.pattern_matcher import CallFunctionVarArgs, Match, PatternMatcherPass, register_graph_pattern

    gm = graph.owning_module
    patterns = PatternMatcherPass()

    def replace(match: Match, *args: Any, **kwargs: Any) -> None:
        node = match.nodes[0]
        parts = _while_parts(node)
        if parts is None:
            return
        cond_node, body_node, fx_carried, fx_additional = parts
        cond, body = getattr(gm, cond_node.target), getattr(gm, body_node.target)
        n_s = len(fx_carried)

        def lower(*flat: Any) -> Any:
            carried, additional = flat[:n_s], flat[n_s:]
            state = [t.clone() for t in carried]
            go = torch.empty((), dtype=torch.bool, device="cpu")
            go.copy_(_predicate(cond(*state, *additional)))

            def cond_fn(*a: Any) -> Any:
                return a[n_s]

            def body_fn(*a: Any) -> tuple[Any, ...]:
                state, go, additional = a[:n_s], a[n_s], a[n_s + 1 :]
                new = body(*state, *additional)
                # in position order: Inductor maps mutated inputs onto outputs in that order
                for s, v in zip(state, new):
                    s.copy_(v)
                go.copy_(_predicate(cond(*state, *additional)))
                return (*state, go)

            res = torch.ops.higher_order.while_loop(cond_fn, body_fn, (*state, go), tuple(additional))
            return _outputs(list(res[:n_s]))

        match.replace_by_example(lower, [*fx_carried, *fx_additional], run_functional_passes=False)
        done["while_loop"] += 1

    register_graph_pattern(CallFunctionVarArgs(_op("while_loop")), pass_dict=patterns)(replace)
    patterns.apply(graph)


def rewrite(graph: torch.fx.Graph) -> int:
    """Rewrite the eligible `while_loop`, `scan` and `map_impl` nodes of `graph` (see the
    module's docstring); returns how many it rewrote."""
    from torch._inductor.pattern_matcher import CallFunctionVarArgs, Match, PatternMatcherPass, register_graph_pattern

    done: collections.Counter = collections.Counter()
    if _op("while_loop") is not None and any(n.target is _op("while_loop") for n in graph.nodes):
        # before the scans: their replacements are while_loops already in place
        _rewrite_while_loops(graph, done)
    ops = [op for op in (_op("scan"), _op("map_impl")) if op is not None]
    if _compat.cpp_transposes_indirect_index():
        # this torch's C++ backend can fail to compile a kernel that writes `ys` at the
        # counter tensor's index (`_compat.cpp_transposes_indirect_index`): torch's loop
        ops = []
    if not any(n.target in ops for n in graph.nodes):
        REWRITES.update(done)
        return sum(done.values())
    gm = graph.owning_module
    patterns = PatternMatcherPass()
    counted = _compat.counted_while_loops()

    def replace(match: Match, *args: Any, **kwargs: Any) -> None:
        node = match.nodes[0]
        parts = _parts(node)
        if parts is None:
            return
        step_node, fx_init, fx_xs, fx_additional = parts
        step = getattr(gm, step_node.target)
        n_c = len(fx_init)
        ys_vals = list(node.meta["val"])[n_c:]
        is_map = node.target is _op("map_impl")

        def lower(*flat: Any) -> Any:
            init, xs, additional = pytree.tree_unflatten(list(flat), spec)
            n = xs[0].shape[0]
            ys = [torch.empty_strided(y.shape, y.stride(), dtype=y.dtype, device=y.device) for y in ys_vals]
            carry = [t.clone() for t in init]
            i = torch.zeros((), dtype=torch.int64, device="cpu")
            go = torch.ones((), dtype=torch.bool, device="cpu")
            state = (ys, carry, i, go, list(xs))
            flat_state, state_spec = pytree.tree_flatten(state)
            _, all_spec = pytree.tree_flatten((*state, list(additional)))
            go_at = len(ys) + len(carry) + 1

            def cond_fn(*a: Any) -> Any:
                return a[go_at]

            def body_fn(*a: Any) -> tuple[Any, ...]:
                ys, carry, i, go, xs, additional = pytree.tree_unflatten(list(a), all_spec)
                x = [torch.ops.aten.index.Tensor(t, [i]) for t in xs]
                out = step(*carry, *x, *additional)
                new, y = list(out[:n_c]), list(out[n_c:])
                # in position order: Inductor maps mutated inputs onto outputs in that order
                for buf, v in zip(ys, y):
                    torch.ops.aten.index_put_.default(buf, [i], v)
                for c, v in zip(carry, new):
                    c.copy_(v)
                i.add_(1)
                go.copy_(i < n)
                return (*ys, *carry, i, go, *xs)

            res = torch.ops.higher_order.while_loop(cond_fn, body_fn, tuple(flat_state), tuple(additional))
            ys_out, carry_out, _, _, _ = pytree.tree_unflatten(list(res), state_spec)
            if is_map:  # map_impl's result is one list, as torch's own decomposition returns it
                return (list(ys_out),)  # type: ignore[return-value]
            return _outputs(list(carry_out) + list(ys_out))

        flat_args, spec = pytree.tree_flatten((fx_init, fx_xs, fx_additional))
        length = _val(fx_xs[0]).shape[0]
        counts = counted and isinstance(length, int) and length >= 1
        before = set(graph.nodes) if counts else set()
        match.replace_by_example(lower, flat_args, run_functional_passes=False)
        done[node.target.name()] += 1  # type: ignore[union-attr]
        if counts:
            # it runs exactly `length` times: Inductor's wrapper may count instead of asking
            # the condition each step (`_compat.counted_while_loops`)
            for new in graph.nodes:
                if new not in before and new.target is _op("while_loop") and new.args[0].op == "get_attr":
                    getattr(gm, new.args[0].target).meta[_compat.STATIC_TRIPS] = length

    for op in ops:
        register_graph_pattern(CallFunctionVarArgs(op), pass_dict=patterns)(replace)
    patterns.apply(graph)
    REWRITES.update(done)
    return sum(done.values())


class ScanInPlacePass(_compat.CustomGraphPass):  # type: ignore[misc, valid-type]
    """`rewrite` as Inductor's `post_grad_custom_post_pass`, with a cache key of its own."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        rewrite(graph)

    def uuid(self) -> Any:
        from ._inductor_pass import _source_hash

        return ("tfun.ScanInPlacePass", _VERSION, _source_hash())
