"""tfun: JAX-shaped functional control flow on plain `torch.Tensor`s.

Submodules: `tfun.lax` (control-flow ops), `tfun.tree` (pytrees), `tfun.errors`.
"""

from . import errors as errors
from . import tree as tree

# --- lax (issue 2) ---
from . import lax as lax

# --- transforms (issue 3) ---
from ._checkpoint import checkpoint as checkpoint
from ._checkpoint import checkpoint_policies as checkpoint_policies
from ._checkpoint import remat as remat
from ._custom_derivatives import custom_jvp as custom_jvp
from ._custom_derivatives import custom_vjp as custom_vjp
from ._grad import grad as grad
from ._grad import hessian as hessian
from ._grad import jacfwd as jacfwd
from ._grad import jacrev as jacrev
from ._grad import jvp as jvp
from ._grad import linearize as linearize
from ._grad import stop_gradient as stop_gradient
from ._grad import value_and_grad as value_and_grad
from ._grad import vjp as vjp
from ._vmap import vmap as vmap

# --- jit (issue 4) ---
from ._jit import jit as jit

# --- kernels (issue 5) ---
from . import kernels as kernels  # registers the "torch" and "triton" impls of tfun.lax.linear_scan

# --- nn (issue 6) ---
from . import nn as nn

# --- random and at (issue 17) ---
from . import random as random
from ._at import at as at

__version__ = "0.1.0"

__all__ = [
    "errors",
    "tree",
    # --- __all__ lax ---
    "lax",
    # --- __all__ transforms ---
    "grad",
    "value_and_grad",
    "jvp",
    "linearize",
    "vjp",
    "jacfwd",
    "jacrev",
    "hessian",
    "stop_gradient",
    "vmap",
    "custom_vjp",
    "custom_jvp",
    "checkpoint",
    "remat",
    "checkpoint_policies",
    # --- __all__ jit ---
    "jit",
    # --- __all__ kernels ---
    "kernels",
    # --- __all__ nn ---
    "nn",
    # --- __all__ random and at ---
    "random",
    "at",
    "__version__",
]
