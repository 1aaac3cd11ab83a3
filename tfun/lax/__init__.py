"""`tfun.lax`: JAX's `jax.lax` control flow on `torch.Tensor`s.

Every op takes and returns pytrees, runs eagerly as fast as a hand-written loop, and
lowers to PyTorch's control-flow higher-order ops under `tfun.jit` and `torch.export`.
"""

from ._associative_scan import associative_scan as associative_scan
from ._cond import cond as cond
from ._cond import select as select
from ._cond import switch as switch
from ._linear_scan import linear_scan as linear_scan
from ._loops import fori_loop as fori_loop
from ._loops import while_loop as while_loop
from ._map import map as map
from ._scan import scan as scan

__all__ = [
    "cond",
    "switch",
    "select",
    "while_loop",
    "fori_loop",
    "scan",
    "associative_scan",
    "map",
    "linear_scan",
]
