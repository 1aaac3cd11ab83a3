"""tfun.tree: pytree utilities, with jax.tree_util as an oracle where the two overlap."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tfun
from tests.helpers import Point, State, sample_trees
from tfun import tree as tt
from tfun.errors import TfunError


# A dataclass and a custom node, registered with tfun here and with JAX in the fixture.
@dataclasses.dataclass
class DC:
    w: Any
    b: Any
    name: str = dataclasses.field(default="dc", metadata={"static": True})


tt.register_dataclass(DC)


class Box:
    """A custom node: children `(lo, hi)`, static `label`."""

    def __init__(self, lo: Any, hi: Any, label: str = "box"):
        self.lo, self.hi, self.label = lo, hi, label

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Box) and (self.lo, self.hi, self.label) == (other.lo, other.hi, other.label)

    def __hash__(self) -> int:
        return hash(self.label)


def _box_flatten(b: Box) -> tuple[tuple[Any, Any], str]:
    return (b.lo, b.hi), b.label


def _box_unflatten(label: str, children: Any) -> Box:
    return Box(*children, label=label)


assert tt.register_pytree_node(Box, _box_flatten, _box_unflatten) is Box


@pytest.fixture(scope="module")
def jtu():
    jax = pytest.importorskip("jax")
    jtu = jax.tree_util
    jtu.register_dataclass(DC, data_fields=["w", "b"], meta_fields=["name"])
    jtu.register_pytree_node(Box, _box_flatten, _box_unflatten)
    return jtu


# ----------------------------------------------------------------------------------------
# Random trees over every node kind both libraries know
# ----------------------------------------------------------------------------------------


def trees(with_state: bool = False) -> st.SearchStrategy[Any]:
    def nodes(kids: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        options = [
            st.lists(kids, max_size=3).map(tuple),
            st.lists(kids, max_size=3),
            st.dictionaries(st.text("abcxyz", min_size=1, max_size=2), kids, max_size=3),
            st.builds(Point, kids, kids),
            st.builds(DC, kids, kids, st.sampled_from(["dc", "other"])),
            st.builds(Box, kids, kids, st.sampled_from(["box", "crate"])),
            st.dictionaries(st.text("pqr", min_size=1, max_size=2), kids, max_size=3).map(
                lambda d: collections.OrderedDict(sorted(d.items(), reverse=True))
            ),
        ]
        if with_state:
            options.append(st.builds(State, kids, kids))
        return st.one_of(*options)

    return st.recursive(st.one_of(st.just("leaf"), st.none()), nodes, max_leaves=8)


def label(tree: Any) -> Any:
    """Replace every leaf by a distinct int, in flattening order."""
    counter = itertools.count()
    return tt.tree_map(lambda _: next(counter), tree)


# ----------------------------------------------------------------------------------------
# Properties of tfun.tree on its own
# ----------------------------------------------------------------------------------------


@given(trees(with_state=True))
def test_flatten_unflatten_roundtrip(tree):
    tree = label(tree)
    leaves, treedef = tt.tree_flatten(tree)
    assert leaves == list(range(len(leaves)))
    assert tt.tree_unflatten(treedef, leaves) == tree
    assert tt.tree_leaves(tree) == leaves
    assert tt.tree_structure(tree) == treedef
    assert treedef.num_leaves == len(leaves)
    # a structure rebuilt with other leaves has the same structure
    assert tt.tree_structure(tt.tree_unflatten(treedef, [str(v) for v in leaves])) == treedef


@given(trees(with_state=True))
def test_tree_map_and_with_path_agree_with_flatten(tree):
    tree = label(tree)
    pairs, treedef = tt.tree_flatten_with_path(tree)
    assert [v for _, v in pairs] == tt.tree_leaves(tree)
    doubled = tt.tree_map(lambda v: v * 2, tree)
    assert tt.tree_structure(doubled) == treedef
    assert tt.tree_leaves(doubled) == [2 * v for _, v in pairs]
    summed = tt.tree_map(lambda a, b: a + b, tree, doubled)
    assert tt.tree_leaves(summed) == [3 * v for _, v in pairs]
    paths = tt.tree_map_with_path(lambda p, v: tt.keystr(p), tree)
    assert tt.tree_leaves(paths) == [tt.keystr(p) for p, _ in pairs]
    # every path reaches its leaf through ordinary indexing / attribute access (not through
    # a custom node registered without keys: its entries are flat indices)
    for p, v in pairs:
        if "<flat index" not in tt.keystr(p):
            assert p(tree) == v


def test_none_is_an_empty_subtree():
    tree = {"a": None, "b": (1, None, [None, 2])}
    assert tt.tree_leaves(tree) == [1, 2]
    assert tt.tree_map(lambda v: v + 1, tree) == {"a": None, "b": (2, None, [None, 3])}
    assert tt.tree_leaves(None) == []
    assert tt.tree_structure(None).num_leaves == 0
    assert tt.tree_unflatten(tt.tree_structure(None), []) is None
    assert tt.tree_leaves(tree, none_is_leaf=True) == [None, 1, None, None, 2]
    assert not tt.treedef_is_leaf(tt.tree_structure(None))
    assert tt.treedef_is_leaf(tt.tree_structure(torch.ones(2)))
    assert tt.tree_all([True, (None, True)]) and not tt.tree_all([True, (None, False)])


def test_dict_leaves_in_sorted_key_order_and_keystr_format():
    tree = {"b": 1, "a": {"z": 2, "y": [3, Point(4, 5)]}, "c": State(6, {"k": (7,)})}
    pairs, _ = tt.tree_flatten_with_path(tree)
    assert [v for _, v in pairs] == [3, 4, 5, 2, 1, 6, 7]
    assert [tt.keystr(p) for p, _ in pairs] == [
        "['a']['y'][0]",
        "['a']['y'][1].x",
        "['a']['y'][1].y",
        "['a']['z']",
        "['b']",
        "['c'].h",
        "['c'].c['k'][0]",
    ]
    assert tt.keystr(("a", 0, "b")) == "['a'][0]['b']"
    assert tt.keystr(()) == ""


def test_sample_trees_corpus_roundtrips_with_tensors():
    for tree in sample_trees(lambda i: torch.full((2,), float(i))):
        leaves, treedef = tt.tree_flatten(tree)
        assert all(isinstance(v, torch.Tensor) for v in leaves)
        back = tt.tree_unflatten(treedef, leaves)
        assert tt.tree_structure(back) == treedef
        assert all(a is b for a, b in zip(tt.tree_leaves(back), leaves))


def test_register_dataclass_static_fields_are_structure():
    a, b = State(1, 2, tag="p"), State(1, 2, tag="q")
    assert tt.tree_leaves(a) == [1, 2]
    assert tt.tree_structure(a) != tt.tree_structure(b)
    assert tt.tree_map(lambda v: v * 10, a) == State(10, 20, tag="p")
    assert [tt.keystr(p) for p, _ in tt.tree_flatten_with_path(a)[0]] == [".h", ".c"]

    @dataclasses.dataclass
    class Explicit:
        x: Any
        y: Any
        k: int = 3

    tt.register_dataclass(Explicit, data_fields=["y", "x"], meta_fields=["k"])
    e = Explicit(1, 2, k=4)
    assert tt.tree_leaves(e) == [2, 1]  # data_fields order
    assert tt.tree_unflatten(tt.tree_structure(e), [20, 10]) == Explicit(10, 20, k=4)
    assert tt.tree_structure(e) != tt.tree_structure(Explicit(1, 2, k=5))
    with pytest.raises(TfunError):
        tt.register_dataclass(Explicit, data_fields=["x"], meta_fields=[])
    with pytest.raises(TfunError):
        tt.register_dataclass(Box)


def test_register_pytree_node_aux_data_is_structure():
    b = Box(1, [2, 3], label="a")
    assert tt.tree_leaves(b) == [1, 2, 3]
    assert tt.tree_map(lambda v: -v, b) == Box(-1, [-2, -3], label="a")
    assert tt.tree_structure(b) != tt.tree_structure(Box(1, [2, 3], label="b"))


# ----------------------------------------------------------------------------------------
# jax.tree_util as an oracle
# ----------------------------------------------------------------------------------------


@given(trees())
def test_matches_jax_tree_util(jtu, tree):
    tree = label(tree)
    assert tt.tree_leaves(tree) == jtu.tree_leaves(tree)
    ours, our_def = tt.tree_flatten_with_path(tree)
    theirs, their_def = jtu.tree_flatten_with_path(tree)
    assert [tt.keystr(p) for p, _ in ours] == [jtu.keystr(p) for p, _ in theirs]
    assert our_def.num_leaves == their_def.num_leaves
    assert our_def.num_nodes == their_def.num_nodes
    assert tt.tree_map(lambda v: v + 1, tree) == jtu.tree_map(lambda v: v + 1, tree)
    assert tt.tree_map_with_path(lambda p, v: (tt.keystr(p), v), tree) == jtu.tree_map_with_path(
        lambda p, v: (jtu.keystr(p), v), tree
    )
    leaves = [v * 7 for v in tt.tree_leaves(tree)]
    assert tt.tree_unflatten(our_def, leaves) == jtu.tree_unflatten(their_def, leaves)


def test_defaultdict_and_ordereddict_order_matches_jax(jtu):
    dd = collections.defaultdict(list, {"y": 1, "x": 2})
    od = collections.OrderedDict([("y", 1), ("x", 2)])
    for tree in (dd, od, {"n": [dd, od]}):
        assert tt.tree_leaves(tree) == jtu.tree_leaves(tree)
        assert [tt.keystr(p) for p, _ in tt.tree_flatten_with_path(tree)[0]] == [
            jtu.keystr(p) for p, _ in jtu.tree_flatten_with_path(tree)[0]
        ]
    rebuilt = tt.tree_map(lambda v: v, dd)
    assert type(rebuilt) is collections.defaultdict and rebuilt.default_factory is list


def test_partition_combine_round_trip_and_substitution():
    from tfun._tree import partition

    x, y = torch.ones(2), torch.zeros(3)
    tree = {"a": (x, 1.5, None), "b": [y, "name"], "c": Point(x=3, y=x)}
    part = partition(tree)
    assert len(part.dynamic) == 3 and all(t is s for t, s in zip(part.dynamic, [x, y, x]))  # leaf order: a, b, c
    again = part.combine(part.dynamic)
    assert tt.tree_structure(again) == tt.tree_structure(tree)
    assert all(u is v for u, v in zip(tt.tree_leaves(again), tt.tree_leaves(tree)))
    new = part.combine([torch.full((2,), 7.0), torch.full((3,), 9.0), torch.full((2,), 8.0)])
    assert new["a"][1] == 1.5 and new["a"][2] is None and new["b"][1] == "name" and new["c"].x == 3
    assert new["a"][0][0].item() == 7.0 and new["b"][0][0].item() == 9.0 and new["c"].y[0].item() == 8.0
    # a custom predicate, and none_is_leaf as in tree_flatten
    ints = partition(tree, lambda v: isinstance(v, int), none_is_leaf=True)
    assert ints.dynamic == [3] and len(ints.leaves) == len(tt.tree_flatten(tree, none_is_leaf=True)[0])
    # map_static: the static leaves change, the dynamic ones (and the split) do not
    doubled = part.map_static(lambda v: v * 2 if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
    assert doubled.positions == part.positions and doubled.dynamic == part.dynamic
    again = doubled.combine(doubled.dynamic)
    assert again["a"][1] == 3.0 and again["c"].x == 6 and again["b"][1] == "name" and again["a"][0] is x


def test_transforms_rebuild_mixed_arguments_through_partition():
    """grad's argnums, vjp's constants and vmap's unmapped leaves ride through the Partition
    split: the non-tensor leaves reach the function unchanged, in their places."""
    seen = []

    def f(p, cfg):
        seen.append((type(p["w"]).__name__, cfg["name"], cfg["scale"]))
        return (p["w"] * cfg["scale"]).sum() + p["b"][1]

    p = {"w": torch.arange(3.0), "b": (None, torch.tensor(2.0))}
    cfg = {"name": "run", "scale": 2.0}
    g = tfun.grad(f)(p, cfg)
    assert tt.tree_structure(g) == tt.tree_structure(p)
    assert torch.equal(g["w"], torch.full((3,), 2.0)) and g["b"][0] is None and g["b"][1].item() == 1.0
    assert seen[-1][1:] == ("run", 2.0)
    out, pull = tfun.vjp(lambda q, n: (q * n).sum(), torch.ones(2), torch.tensor(3))
    gq, gn = pull(torch.tensor(1.0))
    assert torch.equal(gq, torch.full((2,), 3.0)) and gn.dtype == torch.int64 and gn.item() == 0
    ys = tfun.vmap(lambda x, cfg, k: x * cfg["scale"] + k, in_axes=(0, None, None))(torch.ones(4, 2), cfg, 1.0)
    assert torch.equal(ys, torch.full((4, 2), 3.0))
