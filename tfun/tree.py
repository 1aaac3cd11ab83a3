"""`tfun.tree`: pytree utilities (JAX's `jax.tree_util`, over optree's "tfun" namespace)."""

from ._tree import KeyPath as KeyPath
from ._tree import PyTreeDef as PyTreeDef
from ._tree import keystr as keystr
from ._tree import register_dataclass as register_dataclass
from ._tree import register_pytree_node as register_pytree_node
from ._tree import tree_all as tree_all
from ._tree import tree_flatten as tree_flatten
from ._tree import tree_flatten_with_path as tree_flatten_with_path
from ._tree import tree_leaves as tree_leaves
from ._tree import tree_map as tree_map
from ._tree import tree_map_with_path as tree_map_with_path
from ._tree import tree_structure as tree_structure
from ._tree import tree_unflatten as tree_unflatten
from ._tree import treedef_is_leaf as treedef_is_leaf

__all__ = [
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
]
