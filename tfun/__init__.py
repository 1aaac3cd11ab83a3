"""tfun: JAX-shaped functional control flow on plain `torch.Tensor`s.

Submodules: `tfun.lax` (control-flow ops), `tfun.tree` (pytrees), `tfun.errors`.
"""

from . import errors as errors
from . import tree as tree

# --- lax (issue 2) ---
from . import lax as lax

# --- transforms (issue 3) ---

# --- jit (issue 4) ---

# --- kernels (issue 5) ---

# --- nn (issue 6) ---

__version__ = "0.1.0"

__all__ = [
    "errors",
    "tree",
    # --- __all__ lax ---
    "lax",
    # --- __all__ transforms ---
    # --- __all__ jit ---
    # --- __all__ kernels ---
    # --- __all__ nn ---
    "__version__",
]
