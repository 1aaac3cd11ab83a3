"""Functionalized views as views, for `tfun.jit` (Inductor).

When torch differentiates a loop (the backward of `scan`, `while_loop` and the loops tfun
lowers to them), it traces the loop body's forward and backward again under
functionalization, which writes every view of the body as its copying twin: `x[0]` becomes
`aten.select_copy`, `x[:, 1:3]` `aten.slice_copy`, `x.split(3)` `aten.split_copy`, and so on.
Inductor lowers only some of those twins (`as_strided_copy`, `diagonal_copy`,
`squeeze_copy`; `view_copy` it decomposes); the others fall back to an ATen call,
run from Inductor's wrapper with its own buffer allocation, every step of the loop. For a
small body that call costs more than the step's arithmetic: measured on a 2-core CPU, torch
2.13, the `vs_jax.py` tanh RNN (batch 4, state 32, 1024 steps) with `unroll=8` took 14.5 ms
forward+backward with eight `select_copy` calls per block in the backward, and 4.2 ms with
them rewritten (benchmarks/RESULTS.md).

`rewrite` turns each such node back into its view followed by a contiguous `clone`: the same
values in fresh, contiguous memory (what the copying twin returns), which Inductor inlines
into the kernel that reads it. Left alone: a copying twin Inductor lowers or decomposes (a
torch that learns to lower one keeps its own), a node with a size or index known only at
run time (an unbacked symbol), and a list of views used whole. It runs as part of
`tfun._inductor_pass.PostGradPass`.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from . import _compat

__all__ = ["rewrite", "view_of"]

_aten = torch.ops.aten


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def _aliases_its_input(schema: Any) -> bool:
    """Whether `schema` is a view's: it returns (a list of) aliases of its first argument and
    writes nothing."""
    args, rets = schema.arguments, schema.returns
    if not args or len(rets) != 1 or args[0].alias_info is None or args[0].alias_info.is_write:
        return False
    return rets[0].alias_info is not None and not rets[0].alias_info.is_write


def _signature(schema: Any) -> list[tuple[str, str, bool]]:
    return [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments]


@functools.lru_cache(maxsize=None)
def _twin_of(target: Any) -> Any:
    """The view op whose copying twin `target` is (`aten.select.int` for
    `aten.select_copy.int`), or None."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    namespace, _, name = target._schema.name.partition("::")
    if namespace != "aten" or not name.endswith("_copy") or target._schema.is_mutable:
        return None
    packet = getattr(_aten, name[: -len("_copy")], None)
    view = getattr(packet, target._overloadname, None) if packet is not None else None
    if not isinstance(view, torch._ops.OpOverload) or not _aliases_its_input(view._schema):
        return None
    if _signature(view._schema) != _signature(target._schema):  # the same call, another op
        return None
    return view


def view_of(target: Any) -> Any:
    """The view op whose copying twin `target` is, if `target` is one that Inductor would run
    as an ATen call; else None.

    Asked each time, not cached: Inductor registers the ATen call it falls back to as a
    lowering the first time it meets such an op (and lists it in `lowering.fallbacks`), so
    whether a twin is "lowered" changes during a process."""
    view = _twin_of(target)
    if view is None:
        return None
    from torch._inductor import decomposition, lowering

    if target in decomposition.decompositions:
        return None  # Inductor decomposes this twin itself
    if target in lowering.lowerings and target not in getattr(lowering, "fallbacks", ()):
        return None  # a lowering of Inductor's own
    return view


def _fake(fake_mode: Any, op: Any, args: tuple, kwargs: dict) -> Any:
    with fake_mode:
        return op(*(_val(a) for a in args), **{k: _val(v) for k, v in kwargs.items()})


def _contiguous_clone(graph: torch.fx.Graph, of: torch.fx.Node, fake_mode: Any, meta: dict) -> torch.fx.Node:
    kwargs = {"memory_format": torch.contiguous_format}
    node = graph.call_function(_aten.clone.default, (of,), kwargs)
    node.meta.update({k: v for k, v in meta.items() if k != "val"})
    node.meta["val"] = _fake(fake_mode, _aten.clone.default, (of,), kwargs)
    return node


def _rewrite_node(graph: torch.fx.Graph, node: torch.fx.Node, view: Any) -> bool:
    vals = [_val(a) for a in node.args if isinstance(a, torch.fx.Node)]
    fake_mode = _compat.fake_mode_of(vals)
    if fake_mode is None or any(v is None for v in vals):
        return False
    if free_unbacked_symbols([_val(a) for a in (*node.args, *node.kwargs.values())]):
        # a size or index known only at run time (`.item()`): the view's value could hold a
        # new unbacked symbol that nothing in the compiled graph defines
        return False
    val = _val(node)
    single = isinstance(val, torch.Tensor)
    if not single and not (
        isinstance(val, (list, tuple))
        and all(
            user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)
            for user in node.users
        )
    ):
        return False
    with graph.inserting_before(node):
        viewed = graph.call_function(view, node.args, dict(node.kwargs))
        viewed.meta["val"] = _fake(fake_mode, view, node.args, node.kwargs)
    if single:
        with graph.inserting_before(node):
            copy = _contiguous_clone(graph, viewed, fake_mode, node.meta)
        node.replace_all_uses_with(copy)
        graph.erase_node(node)
        return True
    # a list of views (`split_copy`): each element read is cloned
    for user in list(node.users):
        with graph.inserting_before(user):
            part = graph.call_function(operator.getitem, (viewed, user.args[1]))
            part.meta["val"] = viewed.meta["val"][user.args[1]]
            copy = _contiguous_clone(graph, part, fake_mode, user.meta)
        user.replace_all_uses_with(copy)
        graph.erase_node(user)
    graph.erase_node(node)
    return True


def rewrite(graph: torch.fx.Graph) -> int:
    """Rewrite the copying views of `graph` that Inductor would run as ATen calls into a view
    and a contiguous clone, in place; returns how many."""
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        view = view_of(node.target)
        if view is not None and _rewrite_node(graph, node, view):
            n += 1
    return n
