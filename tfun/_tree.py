"""Pytrees over optree, in tfun's own registry namespace ``"tfun"``.

Tuples, lists, dicts (flattened in sorted-key order, as JAX does), `OrderedDict`,
`defaultdict`, `NamedTuple`s and registered dataclasses are nodes; `None` is a node with
no children (an empty subtree), exactly as in JAX. Everything else is a leaf.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import optree
import torch
from optree import PyTreeSpec

from . import _compat

NAMESPACE = "tfun"

T = TypeVar("T")
Leaf = Any
PyTree = Any
KeyPath = optree.PyTreeAccessor
PyTreeDef = PyTreeSpec

__all__ = [
    "NAMESPACE",
    "PyTreeSpec",
    "PyTreeDef",
    "KeyPath",
    "tree_map",
    "tree_map_with_path",
    "tree_leaves",
    "tree_structure",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_unflatten",
    "tree_all",
    "treedef_is_leaf",
    "register_pytree_node",
    "register_dataclass",
    "keystr",
    "Partition",
    "partition",
    "is_tensor",
]


def tree_flatten(
    tree: PyTree,
    is_leaf: Callable[[Any], bool] | None = None,
    *,
    none_is_leaf: bool = False,
) -> tuple[list[Leaf], PyTreeSpec]:
    """Flatten `tree` into its leaves and a `PyTreeDef` that rebuilds it.

    **Arguments:**

    - `tree`: any pytree.
    - `is_leaf`: optional predicate; a subtree for which it returns `True` is a leaf.
    - `none_is_leaf`: treat `None` as a leaf instead of an empty subtree (JAX's default
      is an empty subtree, and so is tfun's).

    **Returns:** `(leaves, treedef)`.
    """
    if _HAS_TRACED and _traced_by_dynamo():
        key = _structure_key(tree, is_leaf, none_is_leaf)
        if key is not None:
            return _traced_leaves(tree, none_is_leaf), getattr(_TRACED, key)[0]
    return optree.tree_flatten(tree, is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


# ----------------------------------------------------------------------------------------
# Under Dynamo: the commonest structures without Dynamo's optree stand-ins
# ----------------------------------------------------------------------------------------

#: Dynamo's stand-in treedefs (and leaf key paths) of a leaf, `None` and short tuples and lists
#: of leaves and `None`s, built before any tracing (`_compat.dynamo_treedefs`). Dynamo traces
#: optree's stand-ins instruction by instruction (some hundreds per flatten of one tensor);
#: `tree_flatten`, `tree_leaves`, `tree_structure` and `tree_flatten_with_path` of such a tree
#: under Dynamo read its treedef here and collect its leaves in a few instructions. Each
#: treedef is the one Dynamo's stand-in builds for that structure, so the results are the
#: same; any other tree goes to optree as before.
#: (The table is read by attribute: Dynamo guards each attribute it reads, where reading a dict
#: made it guard on every entry, some 20 us per call of the compiled function.)
_TRACED: Any = types.SimpleNamespace(**_compat.dynamo_treedefs(NAMESPACE))
_HAS_TRACED = bool(vars(_TRACED)) and _compat.TRACED_BY_DYNAMO_WORKS
_TRACED_MAX_LEN = _compat.TRACED_TREEDEF_MAX_LEN
_traced_by_dynamo: Callable[[], bool] = _compat.traced_by_dynamo


def _is_plain_leaf(x: Any) -> bool:
    """A leaf whatever the registry holds: a tensor, or a Python bool, int or float."""
    return isinstance(x, torch.Tensor) or type(x) in (bool, int, float)


def _structure_key(tree: PyTree, is_leaf: Callable[[Any], bool] | None, none_is_leaf: bool) -> str | None:
    """The `_TRACED` key of `tree`'s structure (see `_compat.dynamo_treedefs`), or `None` where
    it has none. A tensor is a leaf for any `is_leaf`; a container is looked at only without one.

    Read only under Dynamo (`_HAS_TRACED and _traced_by_dynamo()`, checked in each caller, which
    keeps the eager path at one call: about 60 ns a flatten). Asked with
    `_compat.traced_by_dynamo`, not `torch.compiler.is_dynamo_compiling`: see there why a
    `tree_flatten` that asked the latter handed eager code Dynamo's treedef.
    """
    suffix = "1" if none_is_leaf else ""
    if _is_plain_leaf(tree):
        return "*" + suffix
    if is_leaf is not None:
        return None
    if tree is None:
        return "*1" if none_is_leaf else "n"
    kind = type(tree)
    if kind is tuple:
        key = "t"
    elif kind is list:
        key = "l"
    else:
        return None
    if len(tree) > _TRACED_MAX_LEN:
        return None
    for x in tree:
        if x is None:
            key += "*" if none_is_leaf else "n"
        elif _is_plain_leaf(x):
            key += "*"
        else:
            return None
    return key + suffix


def _traced_leaves(tree: PyTree, none_is_leaf: bool) -> list[Leaf]:
    """The leaves of a tree that has a `_TRACED` key."""
    if type(tree) is tuple or type(tree) is list:
        return [x for x in tree if none_is_leaf or x is not None]
    if tree is None and not none_is_leaf:
        return []
    return [tree]


def tree_unflatten(treedef: PyTreeSpec, leaves: Iterable[Leaf]) -> PyTree:
    """Rebuild a pytree from `treedef` (from `tree_flatten`) and an iterable of leaves."""
    return optree.tree_unflatten(treedef, leaves)


def tree_leaves(
    tree: PyTree,
    is_leaf: Callable[[Any], bool] | None = None,
    *,
    none_is_leaf: bool = False,
) -> list[Leaf]:
    """The leaves of `tree`, in flattening order."""
    if _HAS_TRACED and _traced_by_dynamo() and _structure_key(tree, is_leaf, none_is_leaf) is not None:
        return _traced_leaves(tree, none_is_leaf)
    return optree.tree_leaves(tree, is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def tree_structure(
    tree: PyTree,
    is_leaf: Callable[[Any], bool] | None = None,
    *,
    none_is_leaf: bool = False,
) -> PyTreeSpec:
    """The `PyTreeDef` of `tree`: its structure with the leaves left out."""
    if _HAS_TRACED and _traced_by_dynamo():
        key = _structure_key(tree, is_leaf, none_is_leaf)
        if key is not None:
            return getattr(_TRACED, key)[0]  # type: ignore[no-any-return]
    return optree.tree_structure(tree, is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def tree_flatten_with_path(
    tree: PyTree,
    is_leaf: Callable[[Any], bool] | None = None,
    *,
    none_is_leaf: bool = False,
) -> tuple[list[tuple[KeyPath, Leaf]], PyTreeSpec]:
    """Like `tree_flatten`, but each leaf comes with its key path.

    **Returns:** `([(path, leaf), ...], treedef)`; format a path with `keystr`.
    """
    if _HAS_TRACED and _traced_by_dynamo():
        key = _structure_key(tree, is_leaf, none_is_leaf)
        if key is not None:
            treedef, paths = getattr(_TRACED, key)
            return list(zip(paths, _traced_leaves(tree, none_is_leaf))), treedef
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(
        tree, is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE
    )
    return list(zip(accessors, leaves)), treedef


def tree_map(
    f: Callable[..., Any],
    tree: PyTree,
    *rest: PyTree,
    is_leaf: Callable[[Any], bool] | None = None,
    none_is_leaf: bool = False,
) -> PyTree:
    """Apply `f` to the leaves of `tree` (and the matching leaves of each of `rest`).

    `rest` must have `tree`'s structure (or have it as a prefix, as in JAX). Returns a
    pytree of `tree`'s structure holding `f(leaf, *rest_leaves)`.
    """
    return optree.tree_map(f, tree, *rest, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def tree_map_with_path(
    f: Callable[..., Any],
    tree: PyTree,
    *rest: PyTree,
    is_leaf: Callable[[Any], bool] | None = None,
    none_is_leaf: bool = False,
) -> PyTree:
    """Like `tree_map`, but `f` is called as `f(path, leaf, *rest_leaves)`."""
    return optree.tree_map_with_accessor(
        f, tree, *rest, is_leaf=is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE
    )


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def unflatten_kept(
    treedef: PyTreeSpec,
    leaves: Sequence[Leaf],
    source: PyTree,
    is_leaf: Callable[[Any], bool] | None = None,
    *,
    none_is_leaf: bool = False,
) -> PyTree:
    """`tree_unflatten(treedef, leaves)` for a `treedef` flattened from `source` before a call
    to user code, used after that call.

    Under `torch.compile` a treedef is Dynamo's stand-in for optree's. Where a graph break in
    the user's code falls between the flatten and the unflatten (a `print` in a loss under a
    plain `torch.compile(tfun.grad(loss))`), Dynamo rebuilds the stand-in for the code that
    resumes with a dict node's key record as a pair of lists, which optree's dict unflatten
    cannot hash (torch 2.11-2.14: a raw `TypeError: unhashable type: 'list'`). That stand-in,
    and only a stand-in, is taken again from `source` when it fails so; optree's own treedef,
    and a stand-in that works, are used as they are (flattening `source` again in every trace
    would cost each transform some hundreds of Dynamo steps). A `TypeError` raised again with
    the fresh structure (a custom node's own unflatten) propagates.
    """
    if not isinstance(leaves, list):
        leaves = list(leaves)  # (read twice where the stand-in fails)
    try:
        return tree_unflatten(treedef, leaves)
    except TypeError:
        if type(treedef) is PyTreeSpec:
            raise
    return tree_unflatten(tree_structure(source, is_leaf, none_is_leaf=none_is_leaf), leaves)


_NO_SOURCE: Any = object()  # a Partition built without the tree its treedef came from


@dataclasses.dataclass(frozen=True)
class Partition:
    """A pytree's leaves split into the dynamic ones and the static rest, with what puts
    them back together: Equinox's `partition`/`combine`, flat. Every transform uses it for
    the pytrees it is called with (the tensors cross the transform, the rest is held here).

    - `dynamic`: the dynamic leaves, in leaf order.
    - `combine(new)`: the pytree again, with `new` in place of the dynamic leaves.
    - `map_static(f)`: the same split with `f` applied to each static leaf.
    - `with_leaves(leaves)`: the same structure over other leaves, none of them dynamic.

    Build one with `partition`, or directly from leaves a transform has checked one by one
    (then pass `source`, the tree `treedef` was flattened from, with its `is_leaf` and
    `none_is_leaf`).

    `source` keeps `combine` right across a graph break in the user's code between the two
    (`unflatten_kept`).
    """

    treedef: PyTreeSpec
    leaves: tuple[Any, ...]
    positions: tuple[int, ...]
    source: Any = dataclasses.field(default=_NO_SOURCE, repr=False, compare=False)
    is_leaf: Callable[[Any], bool] | None = dataclasses.field(default=None, repr=False, compare=False)
    none_is_leaf: bool = False

    @property
    def dynamic(self) -> list[Any]:
        return [self.leaves[k] for k in self.positions]

    def unflatten(self, leaves: Sequence[Any]) -> PyTree:
        """The tree of `leaves` (one per leaf) in this partition's structure (`unflatten_kept`
        where the source is known)."""
        if self.source is _NO_SOURCE:
            return tree_unflatten(self.treedef, leaves)
        return unflatten_kept(self.treedef, leaves, self.source, self.is_leaf, none_is_leaf=self.none_is_leaf)

    def combine(self, dynamic: Sequence[Any]) -> PyTree:
        leaves = list(self.leaves)
        for k, x in zip(self.positions, dynamic):
            leaves[k] = x
        return self.unflatten(leaves)

    def map_static(self, f: Callable[[Any], Any]) -> Partition:
        """The same partition with `f` applied to each static leaf."""
        dynamic = set(self.positions)
        leaves = tuple(x if k in dynamic else f(x) for k, x in enumerate(self.leaves))
        return Partition(self.treedef, leaves, self.positions, self.source, self.is_leaf, self.none_is_leaf)

    def with_leaves(self, leaves: Sequence[Any]) -> Partition:
        """The same structure over `leaves` (one per leaf), none of them dynamic:
        `p.with_leaves(xs).combine(())` is the tree of `xs`."""
        return Partition(self.treedef, tuple(leaves), (), self.source, self.is_leaf, self.none_is_leaf)


def partition(
    tree: PyTree,
    is_dynamic: Callable[[Any], bool] = is_tensor,
    *,
    is_leaf: Callable[[Any], bool] | None = None,
    none_is_leaf: bool = False,
) -> Partition:
    """Split `tree`'s leaves by `is_dynamic` (by default: tensors are dynamic).

    **Arguments:**

    - `tree`: any pytree.
    - `is_dynamic`: which leaves cross the transform.
    - `is_leaf`, `none_is_leaf`: as for `tree_flatten`.

    **Returns:** a `Partition`; `partition(t).combine(partition(t).dynamic)` rebuilds `t`.
    """
    leaves, treedef = tree_flatten(tree, is_leaf, none_is_leaf=none_is_leaf)
    positions = tuple(k for k, x in enumerate(leaves) if is_dynamic(x))
    return Partition(treedef, tuple(leaves), positions, tree, is_leaf, none_is_leaf)


def tree_all(tree: PyTree, *, is_leaf: Callable[[Any], bool] | None = None) -> bool:
    """True if every leaf of `tree` is truthy: `all(tree_leaves(tree))`. An empty tree gives True."""
    return all(tree_leaves(tree, is_leaf))


def treedef_is_leaf(treedef: PyTreeSpec) -> bool:
    """Whether `treedef` is the structure of a single leaf."""
    return treedef.is_leaf()


def keystr(path: Sequence[Any]) -> str:
    """Format a key path as Python accessor code, e.g. `['h'][1].weight`.

    Accepts a path from `tree_flatten_with_path` / `tree_map_with_path`, or a plain tuple
    of keys (strings format as `['key']`, integers as `[i]`).
    """
    if isinstance(path, optree.PyTreeAccessor):
        return path.codify("")
    out = []
    for k in path:
        if isinstance(k, optree.PyTreeEntry):
            out.append(k.codify(""))
        elif isinstance(k, int):
            out.append(f"[{k}]")
        else:
            out.append(f"[{k!r}]")
    return "".join(out)


def register_pytree_node(
    cls: type[T],
    flatten_fn: Callable[[T], tuple[Iterable[Any], Any]],
    unflatten_fn: Callable[[Any, Iterable[Any]], T],
) -> type[T]:
    """Register `cls` as a pytree node, with JAX's calling convention.

    **Arguments:**

    - `cls`: the type to register.
    - `flatten_fn`: `x -> (children, aux_data)`; `aux_data` must be hashable and is part
      of the structure.
    - `unflatten_fn`: `(aux_data, children) -> x`.

    **Returns:** `cls`, so it can be used inline.
    """
    optree.register_pytree_node(cls, flatten_fn, unflatten_fn, namespace=NAMESPACE)  # type: ignore[arg-type]
    return cls


def register_dataclass(
    cls: type[T] | None = None,
    *,
    data_fields: Sequence[str] | None = None,
    meta_fields: Sequence[str] | None = None,
) -> Any:
    """Register a dataclass as a pytree node: its data fields are children.

    Usable as `@register_dataclass` or `register_dataclass(cls, data_fields=[...],
    meta_fields=[...])` (JAX's `jax.tree_util.register_dataclass`). By default every field
    is a data field, except fields declared with `metadata={"static": True}`, which are
    meta fields: hashable, part of the structure, not leaves. Key paths show fields as
    `.name`.
    """

    def register(c: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(c):
            from ._errors import ArgumentTypeError

            raise ArgumentTypeError(
                f"tfun.tree.register_dataclass: {c.__qualname__} is not a dataclass.\n"
                "Decorate it with @dataclasses.dataclass first (below @register_dataclass)."
            )
        fields = [f for f in dataclasses.fields(c)]
        if data_fields is None and meta_fields is None:
            data = [f.name for f in fields if not f.metadata.get("static", False)]
            meta = [f.name for f in fields if f.metadata.get("static", False)]
        else:
            data = list(data_fields or [])
            meta = list(meta_fields or [])
            declared = {f.name for f in fields if f.init}
            missing = declared - set(data) - set(meta)
            if missing:
                from ._errors import ArgumentValueError

                raise ArgumentValueError(
                    f"tfun.tree.register_dataclass: fields {sorted(missing)} of {c.__qualname__} are "
                    "in neither data_fields nor meta_fields.\nList every init field in one of them."
                )

        def flatten(x: Any) -> tuple[list[Any], tuple[Any, ...], list[str]]:
            return [getattr(x, n) for n in data], tuple(getattr(x, n) for n in meta), data

        def unflatten(aux: tuple[Any, ...], children: Iterable[Any]) -> Any:
            kwargs = dict(zip(data, children))
            kwargs.update(zip(meta, aux))
            return c(**kwargs)

        optree.register_pytree_node(
            c, flatten, unflatten, path_entry_type=optree.GetAttrEntry, namespace=NAMESPACE  # type: ignore[arg-type]
        )
        return c

    if cls is None:
        return register
    return register(cls)
