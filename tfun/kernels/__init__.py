"""`tfun.kernels`: fused kernels, each beside a pure-torch reference with the same signature.

Importing this package registers the implementations of `tfun.lax.linear_scan`:
`"torch"` (always) and `"triton"` (when the `triton` package imports).
"""

from ..lax._linear_scan import register_linear_scan_impl as _register
from ._linear_scan_ref import linear_scan_torch as _torch_impl

_register("torch", _torch_impl)

try:
    import triton as _triton  # noqa: F401
except ImportError:  # pragma: no cover - the CPU-only install without triton
    HAS_TRITON = False
else:
    HAS_TRITON = True
    from ._linear_scan_triton import linear_scan_triton as _triton_impl
    from ._linear_scan_triton import triton_unavailable_reason as _triton_unavailable

    _register("triton", _triton_impl, unavailable=_triton_unavailable)

__all__ = ["HAS_TRITON"]
