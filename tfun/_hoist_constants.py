"""Tensor constants inside a loop body or a branch become operands of their HOP.

A tensor literal in a body that `tfun.jit` traces (`torch.tensor([[1., 2.], [3., 4.]])` in a
scan body, a lookup table a `cond` branch builds) is a constant of the body's subgraph
(`get_attr` of a tensor attribute). Inductor's Python wrapper in torch 2.11 and 2.13 passes
such a constant to the subgraph's compiled code as something that is not a tensor, and the
compiled function fails when it runs ("_torchinductor_pyobject_tensor_data_ptr: non-tensor
input"; small 1-d literals are inlined and were fine). torch 2.14 handles them.

`rewrite` (part of tfun's post-grad pass, run on every graph Inductor compiles) moves each
such constant out: the enclosing graph holds it, the HOP takes it as one more closed-over
operand (scan's and while_loop's `additional_inputs`, cond's `operands`, map's `pos_args`),
and each of the HOP's subgraphs takes it as one more input, after its others (the subgraphs
of one HOP take the same inputs; a branch that does not read it ignores it). The values are
the same on every release; Inductor's passes run on a body before the graph around it, so a
constant of a nested body is moved out one level at a time, to the outermost graph.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["rewrite"]


def _specs() -> dict[Any, tuple[tuple[int, ...], int]]:
    """HOP -> (the positions of its subgraph arguments, the position of the operand list its
    subgraphs take last)."""
    hops = torch.ops.higher_order
    specs: dict[Any, tuple[tuple[int, ...], int]] = {}
    for name, subgraphs, operands in (
        ("scan", (0,), 3), ("while_loop", (0, 1), 3), ("while_loop_stack_output", (0, 1), 3), ("cond", (1, 2), 3),
        ("map_impl", (0,), 2),
    ):
        op = getattr(hops, name, None)
        if op is not None:
            specs[op] = (subgraphs, operands)
    return specs


def _tensor_constants(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [
        n for n in gm.graph.nodes
        if n.op == "get_attr" and isinstance(getattr(gm, str(n.target), None), torch.Tensor) and "val" in n.meta
    ]


def _fresh_name(gm: torch.nn.Module, stem: str) -> str:
    i = 0
    while hasattr(gm, f"{stem}{i}"):
        i += 1
    return f"{stem}{i}"


def _append_placeholder(gm: torch.fx.GraphModule, meta: dict[str, Any]) -> torch.fx.Node:
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names = {n.name for n in graph.nodes}
    name, i = "tfun_constant", 0
    while f"{name}_{i}" in names:
        i += 1
    where = graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(next(iter(graph.nodes)))
    with where:
        ph = graph.placeholder(f"{name}_{i}")
    ph.meta.update(meta)
    return ph


def rewrite(graph: torch.fx.Graph) -> None:
    """Move the tensor constants of the subgraphs of every HOP in `graph` into `graph`."""
    gm = graph.owning_module
    if gm is None:
        return
    specs = _specs()
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in specs:
            continue
        sub_at, ops_at = specs[node.target]
        if len(node.args) <= max(*sub_at, ops_at) or not isinstance(node.args[ops_at], (list, tuple)):
            continue
        holders = [node.args[i] for i in sub_at]
        if not all(isinstance(h, torch.fx.Node) and h.op == "get_attr" for h in holders):
            continue
        subs = [getattr(gm, str(h.target)) for h in holders]
        if not all(isinstance(s, torch.fx.GraphModule) for s in subs):
            continue
        found = [(k, c) for k, s in enumerate(subs) for c in _tensor_constants(s)]
        if not found:
            continue
        operands = list(node.args[ops_at])
        for k, const in found:
            value = getattr(subs[k], str(const.target))
            name = _fresh_name(gm, "_tfun_hoisted_constant")
            gm.register_buffer(name, value, persistent=False)
            with graph.inserting_before(node):
                outer = graph.get_attr(name)
            outer.meta.update(const.meta)
            operands.append(outer)
            for j, sub in enumerate(subs):
                ph = _append_placeholder(sub, const.meta)
                if j == k:
                    const.replace_all_uses_with(ph)
                    sub.graph.erase_node(const)
        args = list(node.args)
        args[ops_at] = type(node.args[ops_at])(operands)
        node.args = tuple(args)
        for sub in subs:
            sub.graph.lint()
            sub.recompile()
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
