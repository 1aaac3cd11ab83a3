"""A user program of the public API: `pyright tests/typecheck` must report no errors.

Not collected by pytest (no test_ prefix); run by tests/test_typecheck.py when pyright is
installed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

import tfun
from tfun import lax


class Carry(NamedTuple):
    h: torch.Tensor
    n: torch.Tensor


def step(c: Carry, x: torch.Tensor) -> tuple[Carry, torch.Tensor]:
    h = torch.tanh(c.h + x)
    return Carry(h, c.n + 1), h.sum()


carry, ys = lax.scan(step, Carry(torch.zeros(3), torch.tensor(0)), torch.ones(5, 3))
h: torch.Tensor = carry.h
total: torch.Tensor = ys.sum()

i, v = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (torch.tensor(0), torch.tensor(1.0)))
acc: torch.Tensor = lax.fori_loop(0, 4, lambda i, a: a + i, torch.tensor(0))
y: torch.Tensor = lax.cond(torch.tensor(True), lambda a: a + 1, lambda a: a - 1, torch.ones(2))
z: torch.Tensor = lax.switch(1, [lambda a: a, lambda a: -a], torch.ones(2))
s: torch.Tensor = lax.select(torch.tensor([True, False]), torch.ones(2), torch.zeros(2))
p: torch.Tensor = lax.associative_scan(torch.add, torch.arange(4.0))
m: torch.Tensor = lax.map(lambda a: a * 2, torch.arange(4.0), batch_size=2)
leaves, treedef = tfun.tree.tree_flatten({"a": torch.ones(1)})
rebuilt = tfun.tree.tree_unflatten(treedef, leaves)
doubled = tfun.tree.tree_map(lambda t: t * 2, rebuilt)
paths = [tfun.tree.keystr(path) for path, _ in tfun.tree.tree_flatten_with_path(doubled)[0]]
err: type[TypeError] = tfun.errors.StructureMismatchError
