"""Every difference between the torch (and triton) releases tfun supports, in one place.

Each entry is *feature detection*: it asks the installed torch whether it has a thing, never
compares version strings. The supported range and what was run on each release are in
`docs/compatibility.md`. (The lowering's use of torch's private higher-order-op entry points is
feature-detected in `tfun/lax/_hop.py`, the one module that calls them.)
"""

from __future__ import annotations

import collections
import importlib.util
import warnings
from typing import Any

import torch

__all__ = ["bitcast", "forward_ad_ready", "grad_leaf", "is_hashable", "raised_args", "record_raised", "triton_launcher"]

_FWD_READY = False


def forward_ad_ready() -> None:
    """Import torch.func's forward-mode decompositions once, quietly.

    torch scripts them with `torch.jit.script` on first use, which warns that `torch.jit.script`
    is deprecated: a `DeprecationWarning` up to torch 2.13, a `FutureWarning` from 2.14. That
    warning is torch's, about torch's own code; a tfun user would see it on their first
    `tfun.jvp`. Later calls find the module imported and warn no more.
    """
    global _FWD_READY
    if _FWD_READY:
        return
    if importlib.util.find_spec("torch._decomp.decompositions_for_jvp") is not None:
        with warnings.catch_warnings():
            for category in (DeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*", category=category)
            importlib.import_module("torch._decomp.decompositions_for_jvp")
    _FWD_READY = True


# Under tfun.jit, Dynamo runs it as plain Python (it cannot trace `warnings.catch_warnings`).
forward_ad_ready._dynamo_marked_constant = True  # type: ignore[attr-defined]


def triton_launcher(kernel: Any) -> Any:
    """What to index with a grid to launch `kernel` so that torch.compile/export can trace it.

    A compiled kernel (`JITFunction`) goes through `torch.library.wrap_triton`. A kernel run by
    Triton's CPU interpreter (`InterpretedFunction`) is launched as it is: torch >= 2.13's
    `wrap_triton` passes it through, torch 2.11/2.12 refuse it ("wrap_triton only works on
    functions annotated with triton.jit"), and there is nothing to trace in it either way
    (tfun keeps the op opaque while interpreting).
    """
    from torch.library import wrap_triton

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - a triton build without the interpreter
        return wrap_triton(kernel)
    if isinstance(kernel, InterpretedFunction):
        return kernel
    return wrap_triton(kernel)


def _grad_leaf_eager(x: torch.Tensor) -> torch.Tensor:
    # functorch refuses `requires_grad_()` while a transform is active (AOTAutograd re-traces
    # the graph under functionalization), unless told to allow it, as torch's own tracing of
    # `requires_grad_()` does.
    prev = torch._C._functorch.get_inplace_requires_grad_allowed()
    torch._C._functorch.set_inplace_requires_grad_allowed(True)
    try:
        return x.detach().requires_grad_()
    finally:
        torch._C._functorch.set_inplace_requires_grad_allowed(prev)


def _grad_leaf_in_graph() -> bool:
    """Let Dynamo write `_grad_leaf_eager` into the graph as it is (idempotent). Run by
    Dynamo as plain Python at trace time (a constant result), before the call it concerns."""
    import torch._dynamo

    torch._dynamo.allow_in_graph(_grad_leaf_eager)
    return True


_grad_leaf_in_graph._dynamo_marked_constant = True  # type: ignore[attr-defined]


def grad_leaf(x: torch.Tensor) -> torch.Tensor:
    """`x.detach().requires_grad_()`, in eager code and in code that Dynamo traces alike.

    tfun.grad's traced path (under `tfun.jit` / `torch.compile`) differentiates with
    `torch.autograd.grad` with respect to fresh leaves. Dynamo in torch 2.11 cannot trace
    `requires_grad_()` on a tensor made inside the graph ("Unsupported Tensor.requires_grad_()
    call"), nor a factory with `requires_grad=True`; torch 2.13 traces it. So, on every torch,
    the leaf is made by one small function that Dynamo writes into the graph as it is
    (`torch._dynamo.allow_in_graph`): it runs on fake tensors at trace time and AOTAutograd
    traces it like the rest of the graph. Outside Dynamo (eager, non-strict export) it is
    called directly.
    """
    if torch.compiler.is_dynamo_compiling():
        _grad_leaf_in_graph()
    return _grad_leaf_eager(x)


#: Whether functorch has a batching rule for `Tensor.view(dtype)` (torch 2.13 has, 2.11 has not:
#: "Batching rule not implemented for aten::view.dtype"). Asked of the dispatcher once.
VIEW_DTYPE_BATCHES: bool = torch._C._dispatch_has_kernel_for_dispatch_key("aten::view.dtype", "FuncTorchBatched")


class _Bitcast(torch.autograd.Function):
    """`t.view(dtype)` with a batching rule of its own, for a functorch without one."""

    @staticmethod
    def forward(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        return t.view(dtype)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - the output is not differentiable
        return None, None

    @staticmethod
    def vmap(info: Any, in_dims: Any, t: torch.Tensor, dtype: torch.dtype) -> Any:
        # same element size: the view reinterprets each element and keeps every dimension
        return t.view(dtype), in_dims[0]


def bitcast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.view(dtype)` between dtypes of one element size (reinterpreting the bits), also
    under `torch.func.vmap` / `tfun.vmap` where functorch has no batching rule for it
    (`VIEW_DTYPE_BATCHES` False: torch 2.11): there an `autograd.Function` with a `vmap`
    rule of its own does the view on the batched tensor. Not differentiable (bits)."""
    if t.dtype.itemsize != dtype.itemsize:
        raise ValueError(f"bitcast: {t.dtype} and {dtype} differ in element size")  # tfun-internal misuse
    if VIEW_DTYPE_BATCHES or torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is None:
        return t.view(dtype)
    return _Bitcast.apply(t, dtype)


#: (class name, args) of the last TfunErrors constructed; bounded.
_RAISED: collections.deque[tuple[str, tuple[Any, ...]]] = collections.deque(maxlen=16)


def record_raised(name: str, args: tuple[Any, ...]) -> bool:
    """Remember the arguments of a TfunError being constructed (called by its `__init__`).

    Dynamo reports an exception raised in traced code as an `Observed<Name>Error` whose text
    is `raised exception Name('message')` in torch 2.13, but only
    `raised exception UserDefinedExceptionObjectVariable(Name)` in torch 2.11: the message is
    lost there. Dynamo runs this function as plain Python (a constant result), so the
    arguments are kept here for `raised_args`, which `tfun.jit` asks when the text lacks them.
    """
    _RAISED.append((name, tuple(args)))
    return True


record_raised._dynamo_marked_constant = True  # type: ignore[attr-defined]


def raised_args(name: str) -> tuple[Any, ...] | None:
    """The arguments of the last recorded TfunError of class `name`, or None."""
    for n, args in reversed(_RAISED):
        if n == name:
            return args
    return None


def is_hashable(value: Any) -> bool:
    """Whether `hash(value)` succeeds. Dynamo in torch 2.11 cannot trace the builtin `hash`
    ("Failed to trace builtin operator"), so where Dynamo traces a call of this function it
    runs it as plain Python on the (constant) value."""
    try:
        hash(value)
    except TypeError:
        return False
    return True


is_hashable._dynamo_marked_constant = True  # type: ignore[attr-defined]
