"""Every difference between the torch (and triton) releases tfun supports, in one place.

Each entry is *feature detection*: it asks the installed torch whether it has a thing, never
compares version strings. The supported range and what was run on each release are in
`docs/compatibility.md`. (The lowering's use of torch's private higher-order-op entry points is
feature-detected in `tfun/lax/_hop.py`, the one module that calls them.)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import inspect
import itertools
import sys
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch

__all__ = ["add_batch_dim", "bitcast", "close_forward_ad_levels", "compile_error", "compile_takes_recompile_limit", "complex_of_float", "CustomGraphPass", "cond_autograd_fixes", "cond_vmap_fixes", "cpp_transposes_indirect_index", "comptime_local_sizes", "current_interpreter", "dynamo_comptime", "dynamo_inspects_wrapped_functions", "dynamo_treedefs", "fake_mode_of", "forward_ad_level", "forward_ad_level_active", "forward_ad_ready", "functorch_interpreters", "functorch_missing", "get_unwrapped", "grad_leaf", "hop_calls_take_proxies", "import_torch_scripted_modules", "is_batchedtensor", "is_exporting", "is_functionaltensor", "is_functorch_wrapped_tensor", "is_gradtrackingtensor", "is_hashable", "loop_hop_cache_marks", "maybe_get_bdim", "maybe_get_level", "outside_fake_mode", "peek_interpreter_stack", "raised_args", "record_raised", "same_treedef", "scan_autograd_fixes", "selective_checkpoint_vmaps", "sizes_now", "scan_backward_dense", "scan_vmap_batch_first", "scan_vmap_fixes", "subgraph_input_asserts_off", "traced_by_dynamo", "triton_launcher", "unwrap_batched", "unwrap_for_grad", "vmap_decrement_nesting", "vmap_increment_nesting", "while_loop_autograd_fixes", "wrap_for_grad", "wraps"]

_FWD_READY = False


def _complex_of_float() -> dict[torch.dtype, torch.dtype]:
    """The complex dtype a weakly typed Python complex scalar takes beside each floating
    dtype (`scan(f, 0j, x_bf16)`'s carry): torch's type promotion (`x * 1j`), asked of the
    installed torch since releases differ, unless torch cannot compute in that dtype on the
    CPU. torch 2.14 added `bcomplex32` for bfloat16 with no arithmetic kernels ("add_stub" not
    implemented for 'BComplex32'; hunt 26, F2); there, as on earlier releases and in JAX
    (which has no complex bfloat16), it is complex64."""
    out = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        c = torch.result_type(torch.empty(0, dtype=dtype), 1j)
        try:
            with warnings.catch_warnings():  # ("ComplexHalf support is experimental")
                warnings.simplefilter("ignore", UserWarning)
                (torch.ones(1, dtype=c) + torch.ones(1, dtype=c)) * torch.ones(1, dtype=c)
        except (NotImplementedError, RuntimeError):  # feature detection: no kernels for `c`
            c = torch.complex64
        out[dtype] = c
    return out


complex_of_float: dict[torch.dtype, torch.dtype] = _complex_of_float()


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


def forward_ad_level_active() -> bool:
    """Whether a `torch.autograd.forward_ad` dual level is open (`with forward_ad.dual_level():`).

    torch keeps the open level in `torch.autograd.forward_ad._current_level` (-1 when none), a
    private module global since forward AD appeared. Conservatively True where this torch has
    no such attribute: callers use the answer to avoid kernels without forward-mode formulas.
    """
    level = getattr(getattr(torch.autograd, "forward_ad", None), "_current_level", None)
    return not isinstance(level, int) or level >= 0


def forward_ad_level() -> int | None:
    """The open `torch.autograd.forward_ad` dual level (-1 when none), or None where this torch
    keeps it elsewhere (see `forward_ad_level_active`)."""
    level = getattr(getattr(torch.autograd, "forward_ad", None), "_current_level", None)
    return level if isinstance(level, int) else None


def close_forward_ad_levels(down_to: int | None) -> None:
    """Exit the forward-AD dual levels opened above `down_to` and left open.

    When Dynamo stops tracing with an error inside a forward-mode transform (`tfun.jvp` in a
    loop body that torch cannot compile), torch 2.13 does not unwind the dual level the
    transform entered: every later `jvp` in the process then fails ("Nested forward mode AD
    is not supported at the moment"). Python's record of the level (`_current_level`) is
    restored with the trace's other side effects, but torch's own (C++) level stays open.
    `tfun.jit` calls this after a failed call, with the level it found before it: the
    level above it is exited in C++ where it is open (torch answers a level that is not open
    with a RuntimeError, the only way to ask it), and Python's record set back. Nothing
    happens where the level cannot be read."""
    if down_to is None:
        return
    forward_ad = torch.autograd.forward_ad
    while (level := forward_ad_level()) is not None and level > down_to:
        forward_ad.exit_dual_level(level=level)
    exit_cpp = getattr(torch._C, "_exit_dual_level", None)
    if exit_cpp is None:
        return
    try:
        exit_cpp(level=down_to + 1)
    except RuntimeError as e:
        if "not the last that was created" not in str(e):
            raise


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


# ----------------------------------------------------------------------------------------
# torch.func's private internals, resolved once here (None where this torch lacks one)
# ----------------------------------------------------------------------------------------
#
# Every private functorch name tfun uses outside this module and `_context` is bound here,
# at import, by feature detection; a feature that needs a name this torch lacks raises a
# tfun error naming it (`functorch_missing`), never an AttributeError or ImportError.
# Where they come from (torch 2.11, the floor in pyproject.toml, cannot be installed here;
# checked in pytorch/pytorch's source as the search index stores it, undated commits, so
# not against the v2.11.0 tag itself): `torch/_functorch/pyfunctorch.py` defines
# `retrieve_all_functorch_interpreters()`; `torch/_functorch/predispatch.py` (commit 01c4d4c)
# defines `_add_batch_dim(self, batch_dim, level)`, its pre-dispatch wrapper of the C one;
# `torch/csrc/functorch/init.cpp` binds `_unwrap_batched` (`unwrapBatched`: tensor, level ->
# (tensor, bdim)), `_unwrap_for_grad(tensor, level)`, `is_batchedtensor`,
# `is_gradtrackingtensor`, `is_functionaltensor`, `is_functorch_wrapped_tensor`,
# `get_unwrapped`, `maybe_get_level` and `peek_interpreter_stack` into `torch._C._functorch`.
# Every one resolves on torch 2.13.0, 2.14.1 and 2.15.0 (tests/test_compat.py).

_FUNCTORCH_C: Any = getattr(torch._C, "_functorch", None)


def _private(module: str, name: str) -> Any:
    """`module.name` where this torch has it, else None (a torch without it: the feature
    that needs it raises, see `functorch_missing`)."""
    try:
        mod = importlib.import_module(module)
    except ImportError:  # pragma: no cover - every supported torch has these modules
        return None
    return getattr(mod, name, None)


#: `retrieve_all_functorch_interpreters()`: the live `torch.func` interpreters, outermost
#: first (read by `_context.transform_stack`, the one reader of the stack).
functorch_interpreters: Callable[[], Any] | None = _private("torch._functorch.pyfunctorch", "retrieve_all_functorch_interpreters")
#: `_unwrap_batched(t, level) -> (t, bdim)`: `t` with the batch dimension of vmap `level` taken off.
unwrap_batched: Callable[[torch.Tensor, int], tuple[torch.Tensor, Any]] | None = getattr(_FUNCTORCH_C, "_unwrap_batched", None)
#: `_unwrap_for_grad(t, level)`: `t` with the grad/jvp wrapper of `level` taken off.
unwrap_for_grad: Callable[[torch.Tensor, int], torch.Tensor] | None = getattr(_FUNCTORCH_C, "_unwrap_for_grad", None)
#: `_wrap_for_grad(t, level)`: `t` wrapped for the grad/jvp transform of `level` (as
#: `torch.func.jvp` wraps its inputs).
wrap_for_grad: Callable[[torch.Tensor, int], torch.Tensor] | None = getattr(_FUNCTORCH_C, "_wrap_for_grad", None)
#: `retrieve_current_functorch_interpreter()`: the innermost live interpreter, whose `lower()`
#: runs code at the level below it and whose `level()` is its level.
current_interpreter: Callable[[], Any] | None = _private("torch._functorch.pyfunctorch", "retrieve_current_functorch_interpreter")
#: `_vmap_decrement_nesting()` / `_vmap_increment_nesting(batch_size, randomness)`: leave the
#: innermost vmap level / enter a new one (what `torch.func.vmap` does around its function; in
#: traced code Dynamo records them in the graph).
vmap_decrement_nesting: Callable[[], Any] | None = _private("torch._functorch.predispatch", "_vmap_decrement_nesting")
vmap_increment_nesting: Callable[[Any, str], Any] | None = _private("torch._functorch.predispatch", "_vmap_increment_nesting")
#: `_add_batch_dim(t, bdim, level)`: `t` batched at vmap `level` along `bdim`.
add_batch_dim: Callable[[torch.Tensor, int, int], torch.Tensor] | None = _private("torch._functorch.predispatch", "_add_batch_dim")
#: Tensor-wrapper predicates and accessors of functorch.
is_batchedtensor: Callable[[torch.Tensor], bool] | None = getattr(_FUNCTORCH_C, "is_batchedtensor", None)
is_gradtrackingtensor: Callable[[torch.Tensor], bool] | None = getattr(_FUNCTORCH_C, "is_gradtrackingtensor", None)
is_functionaltensor: Callable[[torch.Tensor], bool] | None = getattr(_FUNCTORCH_C, "is_functionaltensor", None)
is_functorch_wrapped_tensor: Callable[[torch.Tensor], bool] | None = getattr(_FUNCTORCH_C, "is_functorch_wrapped_tensor", None)
get_unwrapped: Callable[[torch.Tensor], torch.Tensor] | None = getattr(_FUNCTORCH_C, "get_unwrapped", None)
maybe_get_level: Callable[[torch.Tensor], int] | None = getattr(_FUNCTORCH_C, "maybe_get_level", None)
maybe_get_bdim: Callable[[torch.Tensor], int] | None = getattr(_FUNCTORCH_C, "maybe_get_bdim", None)
peek_interpreter_stack: Callable[[], Any] | None = getattr(_FUNCTORCH_C, "peek_interpreter_stack", None)

_FUNCTORCH_WHERE = {
    "functorch_interpreters": "torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters",
    "unwrap_batched": "torch._C._functorch._unwrap_batched",
    "unwrap_for_grad": "torch._C._functorch._unwrap_for_grad",
    "wrap_for_grad": "torch._C._functorch._wrap_for_grad",
    "current_interpreter": "torch._functorch.pyfunctorch.retrieve_current_functorch_interpreter",
    "add_batch_dim": "torch._functorch.predispatch._add_batch_dim",
    "vmap_decrement_nesting": "torch._functorch.predispatch._vmap_decrement_nesting",
    "vmap_increment_nesting": "torch._functorch.predispatch._vmap_increment_nesting",
    "is_batchedtensor": "torch._C._functorch.is_batchedtensor",
    "is_gradtrackingtensor": "torch._C._functorch.is_gradtrackingtensor",
    "is_functionaltensor": "torch._C._functorch.is_functionaltensor",
    "is_functorch_wrapped_tensor": "torch._C._functorch.is_functorch_wrapped_tensor",
    "get_unwrapped": "torch._C._functorch.get_unwrapped",
    "maybe_get_level": "torch._C._functorch.maybe_get_level",
    "maybe_get_bdim": "torch._C._functorch.maybe_get_bdim",
    "peek_interpreter_stack": "torch._C._functorch.peek_interpreter_stack",
}


_FUNCTORCH_BOUND: dict[str, Any] = {name: globals()[name] for name in _FUNCTORCH_WHERE}


def functorch_missing(*names: str) -> tuple[str, ...]:
    """The torch paths of those of `names` (names bound above) this torch lacks: `()` where
    it has them all. A feature that needs them raises a tfun error naming them."""
    return tuple(_FUNCTORCH_WHERE[n] for n in names if _FUNCTORCH_BOUND[n] is None)


# Under tfun.jit, Dynamo runs it as plain Python (a constant answer about this torch).
functorch_missing._dynamo_marked_constant = True  # type: ignore[attr-defined]


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


def scan_hop() -> Any:
    """torch's scan higher-order op itself (`torch._higher_order_ops.scan.scan_op`), or None
    where this torch has none.

    Under Dynamo tfun calls it directly with its flat lists (`tfun.lax._hop.scan_flat`) instead
    of through torch's Python wrapper `scan()`, which flattens the same lists again with torch's
    pytree, validates and builds its own `functools.partial` for Dynamo's scan handler: Python
    that Dynamo traces one instruction at a time (a seventh of the traced instructions of a
    jitted scan's gradient). Dynamo's handler takes any `functools.partial` with a `combine_fn`
    keyword (torch 2.11, 2.13 and 2.14.1: checked by tests/test_compat.py), and the graph it
    records is the wrapper's.
    """
    try:
        from torch._higher_order_ops.scan import scan_op
    except ImportError:  # pragma: no cover - a torch without torch's scan op
        return None
    return scan_op


_SCAN_AUTOGRAD_PATCHED = False


def scan_autograd_fixes() -> None:
    """Give torch's scan autograd the two fixes of torch 2.13 that tfun's gradients need.

    Both concern the backward of `torch._higher_order_ops.scan`, which is itself a scan whose
    step is the partitioned backward graph of the body; both bite where a scan input does not
    require grad, which tfun's scans have all the time (`fori_loop`'s integer index as `xs`,
    a constant `xs`, a zero `init`). torch 2.11 lacks both; each is feature-detected on its
    own and installed only where it is missing, as torch 2.13 writes it. Idempotent.

    1. The backward step returns an input as it is (the partitioner saves `zeros_like(input)`
       as a forward intermediate and returns it as that input's gradient), which scan's own
       check refuses: "scan might be aliasing the input or the output". torch 2.13 clones such
       outputs (`ScanAutogradImpl._break_bw_input_output_aliasing`, run after
       `_optimize_forward_intermediates`); where that method is missing it is added here.
    2. An `init` that does not require grad is dropped from the joint graph's differentiable
       inputs, which severs the carry chain: the gradients reaching earlier steps are
       silently zero (wrong gradients, no error). torch 2.13's `scan_autograd` turns
       `requires_grad` on for such `init` tensors while it partitions the body (and off
       again); where `scan_autograd` does not (its code calls no `requires_grad_`), scan's
       autograd kernel is replaced by one that does.

    And one speed fix, which no torch release has (2.11 - 2.13 at least):

    3. The partitioner saves, as a per-step intermediate, a transposed copy of a tensor the
       body closes over (`W.t()` for the gradient of `h @ W`): scan's forward writes a
       `(length, *W.shape)` stack of identical copies, the backward flips (copies) it and
       reads it, which made `tfun.jit` of an RNN's gradient slower than eager (see
       `_add_invariant_rematerialization`). Such intermediates are recomputed in the
       backward step from the tensor itself, which the backward then reads in place.
    """
    global _SCAN_AUTOGRAD_PATCHED
    if _SCAN_AUTOGRAD_PATCHED:
        return
    _SCAN_AUTOGRAD_PATCHED = True
    scan_mod = _scan_module()
    if scan_mod is None:  # pragma: no cover - a torch whose scan moved: nothing to patch
        return
    impl = getattr(scan_mod, "ScanAutogradImpl", None)
    if (
        impl is not None
        and not hasattr(impl, "_break_bw_input_output_aliasing")
        and hasattr(impl, "_optimize_forward_intermediates")
        and hasattr(impl, "_insert_clone")
    ):
        _add_break_bw_aliasing(impl)
    autograd = getattr(scan_mod, "scan_autograd", None)
    if autograd is not None and "requires_grad_" not in autograd.__code__.co_names:
        _replace_scan_autograd(scan_mod)
        _densify_scan_backward(scan_mod)
    if impl is not None and hasattr(impl, "_optimize_forward_intermediates"):
        _add_invariant_rematerialization(impl)
    if not _SCAN_BACKWARD_DENSE:
        _contiguous_scan_backward(scan_mod)


# Under tfun.jit, Dynamo runs it as plain Python (it cannot trace `setattr` on a class).
scan_autograd_fixes._dynamo_marked_constant = True  # type: ignore[attr-defined]


_SUBGRAPH_ASSERTS_PATCHED = False


def subgraph_input_asserts_off() -> None:
    """Inductor's Python wrapper checks the size and stride of every input of a subgraph (a
    `while_loop`'s condition and body, a `cond` branch) each time the subgraph runs:
    `assert_size_stride` calls that cost a lowered scan's step more than its arithmetic on
    small states (torch 2.13, CPU, B=4, H=32, T=1024: 11.5 ms -> 8.4 ms for the forward and
    30 -> 21-24 ms for forward+backward without them; 2.15 groups them and gains less). Those
    inputs are buffers of the parent graph whose layouts Inductor fixed itself when it
    lowered the HOP (`ir.WhileLoop` requires exact strides of the carried inputs and of the
    body's outputs and checks them when compiling), so the per-step check repeats a
    compile-time one. This turns the input asserts of subgraphs off (the top-level graph
    keeps its input asserts, and every graph keeps those on the outputs of extern kernels,
    which catch a custom op whose fake kernel disagrees with its real one).
    Feature-detected: `SubgraphPythonWrapperCodegen` inheriting `codegen_input_size_asserts`.
    Idempotent; called where tfun lowers a control-flow op (`tfun.lax._hop`).
    """
    global _SUBGRAPH_ASSERTS_PATCHED
    if _SUBGRAPH_ASSERTS_PATCHED:
        return
    _SUBGRAPH_ASSERTS_PATCHED = True
    try:
        wrapper = importlib.import_module("torch._inductor.codegen.wrapper")
    except ImportError:  # pragma: no cover - no Inductor in this torch
        return
    sub = getattr(wrapper, "SubgraphPythonWrapperCodegen", None)
    if sub is None or "codegen_input_size_asserts" in sub.__dict__ or not hasattr(sub, "codegen_input_size_asserts"):
        return  # pragma: no cover - a torch whose subgraph wrapper differs: leave it as it is

    def codegen_input_size_asserts(self: Any) -> None:
        return None

    codegen_input_size_asserts.__doc__ = "tfun: none per subgraph call (see tfun._compat.subgraph_input_asserts_off)"
    sub.codegen_input_size_asserts = codegen_input_size_asserts


# Under tfun.jit, Dynamo runs it as plain Python (it cannot trace `setattr` on a class).
subgraph_input_asserts_off._dynamo_marked_constant = True  # type: ignore[attr-defined]


_SCAN_VMAP_PATCHED = False


def _scan_module() -> Any:
    """`torch._higher_order_ops.scan`, or None for a torch whose scan moved (nothing to patch)."""
    try:
        return importlib.import_module("torch._higher_order_ops.scan")
    except ImportError:  # pragma: no cover
        return None


def _vmap_rule(module: Any, op_name: str) -> tuple[Any, dict[Any, Any] | None, Any]:
    """HOP `op_name` of `module`, its `functorch_table` when that holds a vmap rule (else
    None), and functorch's vmap key: where tfun's vmap rules for scan and cond are installed."""
    op = getattr(module, op_name, None)
    table = getattr(op, "functorch_table", None)
    key = getattr(getattr(_FUNCTORCH_C, "TransformType", None), "Vmap", None)
    return op, (table if isinstance(table, dict) and key in table else None), key


def scan_vmap_fixes() -> None:
    """Replace torch's vmap rule for scan by one that keeps the batch dimension first. Idempotent.

    torch's rule (torch 2.11 - 2.15 at least) moves each batched operand's batch dimension
    *last*, as a view, and the body's batched outputs too. Two things follow:

    - speed: the compiled loop body then computes on states laid out (features, batch), and
      reads the loop's other tensors (the saved forward, the stacked outputs) in (batch,
      features): Inductor's kernels for a step's small products gather one of them element by
      element. `tfun.jit(tfun.vmap(rnn))` trained 2.1x slower than the same RNN batched by
      hand (4.9 against 2.3 ms, `benchmarks/vs_jax.py`'s `vmap_rnn`, 2-core CPU, torch 2.13),
      and per-example gradients 3.2x (8.6 against 2.7 ms, `per_example`);
    - correctness of the layout check: torch's scan autograd compares that `init` view with the
      body's new carry, a contiguous tensor, stride for stride ("Expected init and carry to have
      same metadata ... differ in 'stride'").

    The rule here is torch's with other dimensions: a batched `init` and additional input enter
    with their batch dimension first, a batched `xs` with it second (after the scanned axis),
    each batched body output leaves with it first, so the stacked outputs have it second; the
    operands and outputs are made contiguous there, so a batched carry is laid out as the hand-
    batched program's and as the body's new carry. Values are the same (where a dimension sits
    in memory, no arithmetic). Installed where scan's vmap rule is in its `functorch_table` with
    the parameters of torch 2.11 - 2.14 and torch's `restore_vmap` / `wrap_batched` /
    `unwrap_batched` exist (feature-detected, not by version); elsewhere torch's rule stays."""
    global _SCAN_VMAP_PATCHED
    if _SCAN_VMAP_PATCHED:
        return
    _SCAN_VMAP_PATCHED = True
    op, table, vmap_key = _vmap_rule(_scan_module(), "scan_op")
    try:
        functorch_vmap = importlib.import_module("torch._functorch.vmap")
    except ImportError:  # pragma: no cover
        return
    restore_vmap = getattr(functorch_vmap, "restore_vmap", None)
    wrap_batched = getattr(functorch_vmap, "wrap_batched", None)
    unwrap_batched = getattr(functorch_vmap, "unwrap_batched", None)
    if table is None or None in (restore_vmap, wrap_batched, unwrap_batched):
        return
    rule = table[vmap_key]
    if getattr(rule, "_tfun_batch_first", False):
        return
    params = list(inspect.signature(rule).parameters)
    if params[:5] != ["interpreter", "combine_fn", "init", "xs", "additional_inputs"]:
        return  # pragma: no cover - a torch whose rule takes other arguments: leave it as it is
    from torch.utils import _pytree

    def moved(tree: Any, dims: Any, to: int, dense: bool) -> Any:
        def move(t: Any, d: Any) -> Any:
            if d is None:
                return t
            t = t.movedim(d, to)
            return t.contiguous() if dense else t

        return _pytree.tree_map(move, tree, dims)

    @functools.wraps(rule)
    def scan_batch_rule(
        interpreter: Any, combine_fn: Any, init: Any, xs: Any, additional_inputs: Any, *args: Any, **kwargs: Any
    ) -> Any:
        (init, xs, additional_inputs), (d_init, d_xs, d_add) = unwrap_batched(
            (init, xs, additional_inputs), interpreter.level()
        )
        init = moved(init, d_init, 0, True)
        xs = moved(xs, d_xs, 1, True)  # (scanned axis, batch, ...)
        additional_inputs = moved(additional_inputs, d_add, 0, False)
        # the body's operands, flat: carries, slices of xs, additional inputs; batch first
        body_dims = tuple(0 if d is not None else None for d in [*d_init, *d_xs, *d_add])
        n_carry = len(init)
        out_dims: list[Any] = []
        with interpreter.lower():

            def body(*operands: Any) -> Any:
                outs, dims = restore_vmap(combine_fn, body_dims, interpreter.batch_size(), interpreter.randomness())(
                    *operands
                )
                out_dims[:] = list(dims)
                return tuple(o if d is None else o.movedim(d, 0).contiguous() for o, d in zip(outs, dims))

            out = op(body, init, xs, additional_inputs, *args, **kwargs)
        if len(out_dims) != len(out):
            raise AssertionError(f"tfun's scan vmap rule: {len(out_dims)} output dims for {len(out)} outputs")
        # carries come first, batched first; the stacked ys have the scanned axis first
        dims = tuple(None if d is None else (0 if i < n_carry else 1) for i, d in enumerate(out_dims))
        return wrap_batched(out, dims, interpreter.level())

    scan_batch_rule._tfun_batch_first = True  # type: ignore[attr-defined]
    table[vmap_key] = scan_batch_rule


scan_vmap_fixes._dynamo_marked_constant = True  # type: ignore[attr-defined]


def scan_vmap_batch_first() -> bool:
    """Whether scan's vmap rule is tfun's batch-first one (`scan_vmap_fixes` installs it where
    torch's rule has the parameters it expects). With torch's own rule, a `cond` in a
    differentiated loop body under `tfun.jit(tfun.vmap(f))` got wrong gradients from Inductor
    (hunt 22), and tfun refuses it there (`tfun.lax._hop.refuse_cond_in_vmapped_grad_body`)."""
    scan_vmap_fixes()
    _, table, vmap_key = _vmap_rule(_scan_module(), "scan_op")
    return table is not None and bool(getattr(table[vmap_key], "_tfun_batch_first", False))


scan_vmap_batch_first._dynamo_marked_constant = True  # type: ignore[attr-defined]


_COND_VMAP_PATCHED = False


def cond_vmap_fixes() -> None:
    """Replace torch's vmap rule for `torch.cond` with an unbatched predicate. Idempotent.

    torch's rule (torch 2.11 - 2.14 at least) vmaps each branch over the operands' batch
    dimensions with `torch.vmap(branch, in_dims)`, and `torch.cond` then checks that the two
    branches' outputs agree stride for stride. Two valid programs fail there under
    `tfun.jit(tfun.vmap(f))`, as torch's "sorted order of strides of the two branches' output
    doesn't match" or "Expected at least one Tensor to vmap over" (hunt 26, F6):

    - a branch whose output does not depend on a batched operand (`lambda h: h * 1` where `h`
      is a scan carry still unbatched at the first step, and the other branch adds a batched
      `x`): `torch.vmap` returns it broadcast (stride 0) beside the other's dense output;
    - a cond whose operands are all unbatched, nested in a branch of a cond that is batched:
      the rule runs under the vmap regardless and `torch.vmap` refuses in_dims all None.

    The rule here is torch's for an unbatched predicate with two changes: with no batched
    operand it runs the cond unbatched (its outputs stay unbatched, as under JAX's batching
    rule), and every branch output is made contiguous after the vmap, so a broadcast output is
    materialized as the batched value JAX's rule would produce. Values are unchanged. A batched
    predicate still goes to torch's rule (tfun never passes one: it selects, `tfun.lax.cond`).
    Installed where cond's vmap rule is in its `functorch_table` with torch 2.11 - 2.14's
    parameters and functorch's batching accessors exist (feature-detected, not by
    version); elsewhere torch's rule stays."""
    global _COND_VMAP_PATCHED
    if _COND_VMAP_PATCHED:
        return
    _COND_VMAP_PATCHED = True
    try:
        cond_module = importlib.import_module("torch._higher_order_ops.cond")
    except ImportError:  # pragma: no cover
        return
    op, table, vmap_key = _vmap_rule(cond_module, "cond_op")
    if table is None or None in (is_batchedtensor, get_unwrapped, maybe_get_bdim, add_batch_dim):
        return
    rule = table[vmap_key]
    if getattr(rule, "_tfun_dense_branches", False):
        return
    if list(inspect.signature(rule).parameters)[:5] != ["interpreter", "pred", "true_fn", "false_fn", "inputs"]:
        return  # pragma: no cover - a torch whose rule takes other arguments: leave it as it is

    def dense(branch: Any) -> Callable[..., Any]:
        def dense_branch(*args: Any) -> Any:
            out = branch(*args)
            return tuple(o.contiguous() for o in out) if isinstance(out, (tuple, list)) else out.contiguous()

        return dense_branch

    @functools.wraps(rule)
    def cond_batch_rule(interpreter: Any, pred: Any, true_fn: Any, false_fn: Any, inputs: Any) -> Any:
        if isinstance(pred, torch.Tensor) and is_batchedtensor(pred):
            return rule(interpreter, pred, true_fn, false_fn, inputs)
        # (an operand may be a SymInt: a symbolic size Dynamo lifts into torch.cond's operands,
        # which `is_batchedtensor` refuses, hunt 30 F5)
        batched = tuple(isinstance(t, torch.Tensor) and is_batchedtensor(t) for t in inputs)
        tensors = tuple(get_unwrapped(t) if b else t for t, b in zip(inputs, batched))
        in_dims = tuple(maybe_get_bdim(t) if b else None for t, b in zip(inputs, batched))
        if all(d is None for d in in_dims):
            with interpreter.lower():
                return op(pred, true_fn, false_fn, tensors)
        with interpreter.lower():
            result = op(
                pred,
                dense(torch.vmap(true_fn, in_dims=in_dims)),
                dense(torch.vmap(false_fn, in_dims=in_dims)),
                tensors,
            )
        result = result if isinstance(result, tuple) else (result,)
        return tuple(add_batch_dim(r, 0, interpreter.level()) for r in result)

    cond_batch_rule._tfun_dense_branches = True  # type: ignore[attr-defined]
    table[vmap_key] = cond_batch_rule


cond_vmap_fixes._dynamo_marked_constant = True  # type: ignore[attr-defined]


_SCAN_BACKWARD_DENSE = False


def scan_backward_dense() -> bool:
    """Whether torch's scan backward, as `scan_autograd_fixes` left it, makes the gradients
    reaching it contiguous itself.

    tfun's scan lowering makes them contiguous under grad mode (inductor computes wrong values
    from a backward scan whose tangents have stride 0, the gradient of `out.sum()`) with a
    hook on each output (`Tensor.register_hook` in traced code). Dynamo 2.11 writes such a
    hook as an `autograd_function_apply` that takes the symbolic sizes of the gradient, and
    once a second input shape makes the sizes symbolic, AOTAutograd then loses them from the
    graph ("Node scan referenced nonexistent value s44"). So where `scan_autograd_fixes`
    replaced scan's autograd kernel (torch 2.11), it also wraps `ScanAutogradOp.backward` to
    clone the gradients into contiguous tensors (as torch 2.13's while_loop backward does),
    and this answers True: the lowering then adds no hook. Elsewhere False.
    """
    scan_autograd_fixes()
    return _SCAN_BACKWARD_DENSE


scan_backward_dense._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _densify_scan_backward(scan_mod: Any) -> None:
    """`ScanAutogradOp.backward` starting from contiguous gradients (see `scan_backward_dense`)."""
    global _SCAN_BACKWARD_DENSE
    fn = getattr(scan_mod, "ScanAutogradOp", None)
    backward = getattr(fn, "backward", None)
    if backward is None:  # pragma: no cover - neither 2.11's nor 2.13's layout
        return
    fn.backward = staticmethod(_dense_grads(backward))
    _SCAN_BACKWARD_DENSE = True


def _contiguous_scan_backward(scan_mod: Any) -> None:
    """`ScanAutogradOp.backward` with each incoming gradient that is not contiguous made so
    (where `_densify_scan_backward` did not already clone them all).

    The backward is a scan whose `init` is the gradient of the final carry, and scan's
    autograd compares that `init` with the backward step's (contiguous) carry, stride for
    stride. Under a traced `vmap` the gradient reaches it in a layout of the vmap rule's
    making (the batch dimension moved last: strides `(1, C)` for a `(C, B)` carry), and
    tfun's gradient hook on the scan's outputs (`_scan`) sees only the per-example tensor:
    "Expected init and carry to have same metadata ... stride" (per-example gradients of a
    scan whose final carry is weighted, `tfun.jit(tfun.vmap(tfun.grad(loss)))`, torch 2.13).
    A contiguous gradient is passed as it is."""
    fn = getattr(scan_mod, "ScanAutogradOp", None)
    backward = getattr(fn, "backward", None)
    if backward is None or getattr(backward, "_tfun_contiguous", False):  # pragma: no cover
        return

    def contiguous_backward(ctx: Any, *grads: Any) -> Any:
        grads = tuple(
            g.contiguous() if isinstance(g, torch.Tensor) and not g.is_contiguous() else g for g in grads
        )
        return backward(ctx, *grads)

    contiguous_backward._tfun_contiguous = True  # type: ignore[attr-defined]
    fn.backward = staticmethod(contiguous_backward)


def _add_break_bw_aliasing(impl: Any) -> None:
    """Fix 1 of `scan_autograd_fixes`: torch 2.13's `_break_bw_input_output_aliasing`."""

    def _break_bw_input_output_aliasing(self: Any) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        bw_gm = self.hop_partitioned_graph.bw_gm
        bw_output_node = next(iter(bw_gm.graph.find_nodes(op="output")))
        bw_outputs = bw_output_node.args[0]
        ph_storages: set[Any] = set()
        for ph in bw_gm.graph.find_nodes(op="placeholder"):
            val = ph.meta.get("val", None)
            if isinstance(val, torch.Tensor):
                ph_storages.add(StorageWeakRef(val._typed_storage()))

        def aliases_placeholder(node: torch.fx.Node) -> bool:
            if node.op == "placeholder":
                return True
            val = node.meta.get("val", None)
            return isinstance(val, torch.Tensor) and StorageWeakRef(val._typed_storage()) in ph_storages

        new_outputs = []
        rewrote = False
        for out in bw_outputs:
            if isinstance(out, torch.fx.Node) and aliases_placeholder(out):
                new_outputs.append(self._insert_clone(out, bw_output_node))
                rewrote = True
            else:
                new_outputs.append(out)
        if rewrote:
            bw_output_node.args = (tuple(new_outputs),)
            bw_gm.graph.lint()
            bw_gm.recompile()

    optimize = impl._optimize_forward_intermediates

    def _optimize_forward_intermediates(self: Any) -> None:
        optimize(self)
        self._break_bw_input_output_aliasing()

    impl._break_bw_input_output_aliasing = _break_bw_input_output_aliasing
    impl._optimize_forward_intermediates = _optimize_forward_intermediates


#: Ops that the backward step may recompute from a scan input for free, or nearly: views
#: (as traced, and as functionalized into `*_copy` ops), layout copies, and tensors that
#: depend on their input's shape only.
_REMAT_OPS = frozenset(
    name
    for name in (
        "t.default", "t_copy.default", "permute.default", "permute_copy.default", "transpose.int",
        "transpose_copy.int", "view.default", "view_copy.default", "_unsafe_view.default",
        "expand.default", "expand_copy.default", "unsqueeze.default", "unsqueeze_copy.default",
        "squeeze.dim", "squeeze_copy.dim", "alias.default", "alias_copy.default", "detach.default",
        "detach_copy.default", "clone.default", "zeros_like.default", "ones_like.default",
    )
)
#: Consumers that take any strides, so a trailing layout `clone` in front of them is not recomputed.
_STRIDED_OK = frozenset(("mm.default", "addmm.default", "bmm.default", "baddbmm.default"))


def _aten_name(node: torch.fx.Node) -> str | None:
    """`"t_copy.default"` for a call of `torch.ops.aten.t_copy.default`, else None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "aten":
        return None
    return f"{target._schema.name.split('::', 1)[1]}.{target._overloadname}"


def _recomputable_chain(node: torch.fx.Node, sources: set[torch.fx.Node]) -> tuple[Any, list[torch.fx.Node]]:
    """(`src`, ops) when `node` is `src` (a placeholder in `sources`) through a chain of
    `_REMAT_OPS` whose only tensor argument is the previous link; else (None, [])."""
    chain: list[torch.fx.Node] = []
    while _aten_name(node) in _REMAT_OPS:
        nodes: list[torch.fx.Node] = []
        torch.fx.node.map_arg((node.args, node.kwargs), nodes.append)
        if len(nodes) != 1 or not node.args or node.args[0] is not nodes[0]:
            return None, []
        chain.append(node)
        node = nodes[0]
    if not chain or node not in sources:
        return None, []
    return node, chain[::-1]


def _rematerialize_invariants(impl_self: Any) -> None:
    """Fix 3 of `scan_autograd_fixes`, on one `ScanAutogradImpl` before it sorts its forward
    intermediates.

    Its forward graph `fw_gm` takes (*init, *x_t, *additional_inputs) and returns the body's
    outputs followed by the intermediates its backward graph `bw_gm` takes first. An
    intermediate that is a view-like chain (`_REMAT_OPS`) of one xs or additional-input
    placeholder is replaced by that placeholder, and the chain is rebuilt in `bw_gm` on the
    input it now receives. torch's scan then saves the placeholder as it is (the policies
    REMOVE_XS / REMOVE_ADDITIONAL_INPUTS: no per-step stack, no flip) instead of stacking a
    copy per step. The values `bw_gm` computes are the same ops on the same values: gradients
    are unchanged. A trailing layout `clone` whose every consumer is a matmul is not rebuilt
    (the matmul reads the strided view, as the eager backward does). Carry placeholders are left
    alone: a carry changes every step, so torch stacks it anyway. A placeholder is saved once:
    a second intermediate of the same one (`W.t()` and `zeros_like(W)` where the body takes a
    gradient, `tfun.grad` in a loop body) is left as torch saves it, since the same tensor
    saved twice reaches the backward scan as two aliasing inputs, which torch's scan refuses
    ("scan might be aliasing the input or the output").
    """
    graph = impl_self.hop_partitioned_graph
    fw_gm, bw_gm, n_out = graph.fw_gm, graph.bw_gm, graph.n_fw_outputs
    phs = list(fw_gm.graph.find_nodes(op="placeholder"))
    n_init = len(impl_self.init)
    sources = set(phs[n_init:])  # the step's xs slices and the additional inputs
    out_node = next(iter(fw_gm.graph.find_nodes(op="output")))
    outs = list(out_node.args[0])
    bw_phs = list(bw_gm.graph.find_nodes(op="placeholder"))
    saved = {o for o in outs[n_out:] if isinstance(o, torch.fx.Node) and o in sources}
    changed = False
    for i in range(n_out, len(outs)):
        if not isinstance(outs[i], torch.fx.Node):
            continue
        src, chain = _recomputable_chain(outs[i], sources)
        if src is None or src in saved:
            continue
        saved.add(src)
        ph = bw_phs[i - n_out]
        users = list(ph.users)
        if all(_aten_name(u) in _STRIDED_OK for u in users):
            while chain and _aten_name(chain[-1]) == "clone.default":
                chain.pop()
        value, at = ph, ph
        for op in chain:
            with bw_gm.graph.inserting_after(at):
                value = bw_gm.graph.call_function(op.target, (value, *op.args[1:]), dict(op.kwargs))
            value.meta = dict(op.meta)
            at = value
        for user in users:
            user.replace_input_with(ph, value)
        ph.meta = dict(ph.meta)
        ph.meta["val"] = src.meta.get("val")
        outs[i] = src
        changed = True
    if changed:
        out_node.args = (tuple(outs),)
        fw_gm.graph.eliminate_dead_code()
        fw_gm.graph.lint()
        fw_gm.recompile()
        bw_gm.graph.lint()
        bw_gm.recompile()


def _copy_repeated_intermediates(impl_self: Any) -> None:
    """Where the partitioner saves one forward node twice as an intermediate (seen for a body
    that takes a gradient with torch.func, `tfun.grad` in the body of a scan nested in a scan
    body: `expand_copy` of the inner gradient's seed), the forward scan's step returns the
    same tensor twice, which torch's scan refuses ("scan might be aliasing the input or the
    output"). The repeats are returned as copies (same values; one more per-step copy)."""
    graph = impl_self.hop_partitioned_graph
    fw_gm, n_out = graph.fw_gm, graph.n_fw_outputs
    out_node = next(iter(fw_gm.graph.find_nodes(op="output")))
    outs = list(out_node.args[0])
    seen: set[Any] = set()
    changed = False
    for i, o in enumerate(outs):
        if not isinstance(o, torch.fx.Node):
            continue
        if i >= n_out and o in seen and o.op != "placeholder":
            with fw_gm.graph.inserting_before(out_node):
                copy = fw_gm.graph.call_function(torch.ops.aten.clone.default, (o,))
            copy.meta = dict(o.meta)
            outs[i] = copy
            changed = True
        seen.add(o)
    if changed:
        out_node.args = (tuple(outs),)
        fw_gm.graph.lint()
        fw_gm.recompile()


def _add_invariant_rematerialization(impl: Any) -> None:
    """Install fix 3 of `scan_autograd_fixes` (`_rematerialize_invariants`, and
    `_copy_repeated_intermediates`) in front of
    `ScanAutogradImpl._optimize_forward_intermediates`."""
    optimize = impl._optimize_forward_intermediates

    def _optimize_forward_intermediates(self: Any) -> None:
        _rematerialize_invariants(self)
        _copy_repeated_intermediates(self)
        optimize(self)

    impl._optimize_forward_intermediates = _optimize_forward_intermediates


def _replace_scan_autograd(scan_mod: Any) -> None:
    """Fix 2 of `scan_autograd_fixes`: scan's autograd kernel as torch 2.13 writes it."""
    from torch._C import DispatchKey

    op = scan_mod.scan_op
    partitioner = scan_mod.HopGraphMinCutPartitioner
    autograd_op = scan_mod.ScanAutogradOp
    disable_proxy_modes_tracing = scan_mod.disable_proxy_modes_tracing

    def scan_autograd(combine_fn: Any, init: Any, xs: Any, additional_inputs: Any) -> Any:
        with disable_proxy_modes_tracing():
            flipped = [t for t in init if (t.dtype.is_floating_point or t.dtype.is_complex) and not t.requires_grad]
            try:
                for t in flipped:
                    t.requires_grad_(True)
                graph = partitioner.create_partitioned_graph(
                    combine_fn, (*init, *[x[0] for x in xs], *additional_inputs), always_recompute_complex_exprs=True
                )
            finally:
                for t in flipped:
                    t.requires_grad_(False)
        return autograd_op.apply(graph, len(init), len(xs), len(additional_inputs), *init, *xs, *additional_inputs)

    # `py_autograd_impl` refuses a second kernel for a key: the old one is removed first
    # (it registers a wrapper that calls `scan_autograd` and clears the dispatch cache)
    op.py_kernels.pop(DispatchKey.Autograd, None)
    op.py_autograd_impl(scan_autograd)
    scan_mod.scan_autograd = scan_autograd


def outside_fake_mode() -> Any:
    """A context in which tensors are real again inside a fake kernel (torch's dispatch modes,
    the fake-tensor mode among them, are set aside while it is active): for a fake kernel that
    asks a real kernel for a size the kernel decides itself (`tfun.nn._rnn_fused`)."""
    disable = _private("torch.utils._python_dispatch", "_disable_current_modes")
    if disable is None:  # pragma: no cover - every supported torch has it
        raise RuntimeError(f"tfun: torch {torch.__version__} has no torch.utils._python_dispatch._disable_current_modes")
    return disable()


def _compile_takes(name: str) -> bool:
    try:
        return name in inspect.signature(torch.compile).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


#: Whether `torch.compile` takes a per-region `recompile_limit=` (else tfun.jit patches Dynamo's
#: global `recompile_limit` around each call).
compile_takes_recompile_limit: bool = _compile_takes("recompile_limit")


def _custom_graph_pass() -> type:
    """Inductor's base class for a custom graph pass with a cache key
    (`torch._inductor.custom_graph_pass.CustomGraphPass`), or `object` where this torch has none
    (then tfun adds no pass: `tfun._jit_options.compile_options`)."""
    try:
        module = importlib.import_module("torch._inductor.custom_graph_pass")
    except ImportError:  # pragma: no cover - a torch without Inductor's custom passes
        return object
    base = getattr(module, "CustomGraphPass", None)
    return base if isinstance(base, type) else object


CustomGraphPass: type = _custom_graph_pass()


#: torch's control-flow HOPs that tfun.jit's graphs hold (`map_impl` is `map`'s;
#: `while_loop_stack_output` is the forward of a differentiated `while_loop`).
_LOOP_HOPS = ("cond", "while_loop", "while_loop_stack_output", "scan", "map_impl")


_HOP_PROXIES_PATCHED = False


def hop_calls_take_proxies() -> None:
    """Let a graph module whose code calls a control-flow HOP be rebuilt from its code.

    Unpickling an `fx.GraphModule` re-traces its code symbolically, calling each op on
    `fx.Proxy` arguments. torch 2.11-2.14's `cond`, `scan` and `while_loop` (and its
    `while_loop_stack_output`) first check that their operands are tensors or ints
    (`validate_subgraph_args_types`), which a proxy is not, so such a module cannot be rebuilt.
    AOTAutograd's cache pickles the backward graph with each entry, and its subgraphs (a loop
    body, a branch) are rebuilt when the entry is read: an entry whose backward holds a HOP
    inside another's body (a scan in a cond branch) failed to load, with a logged traceback,
    and was compiled again. The check now passes proxies through (the HOP then records itself
    in the graph being traced, as it does for any proxy); tensors are checked as before.
    Feature-detected (the check refusing a proxy); idempotent; called by
    `loop_hop_cache_marks`."""
    global _HOP_PROXIES_PATCHED
    if _HOP_PROXIES_PATCHED:
        return
    _HOP_PROXIES_PATCHED = True
    utils = importlib.import_module("torch._higher_order_ops.utils")
    check = getattr(utils, "validate_subgraph_args_types", None)
    if check is None:  # pragma: no cover - a torch without the check
        return
    probe = torch.fx.Proxy(torch.fx.Graph().placeholder("x"))
    try:
        check((probe,))
        return  # pragma: no cover - a torch whose check takes proxies
    except AssertionError:
        pass

    def validate_subgraph_args_types(lifted_args: Any) -> None:
        if any(isinstance(a, torch.fx.Proxy) for a in lifted_args):
            return
        check(lifted_args)

    validate_subgraph_args_types.__doc__ = "tfun: proxies pass (see tfun._compat.hop_calls_take_proxies)"
    for name in ("cond", "scan", "while_loop", "associative_scan", "switch"):
        try:
            module = importlib.import_module(f"torch._higher_order_ops.{name}")
        except ImportError:
            continue
        if getattr(module, "validate_subgraph_args_types", None) is check:
            module.validate_subgraph_args_types = validate_subgraph_args_types


def loop_hop_cache_marks(key: str) -> dict[str, str]:
    """The value for Inductor's `unsafe_marked_cacheable_functions` option that lets its
    compiled-graph caches (the FX graph cache and AOTAutograd's) keep graphs holding torch's
    control-flow HOPs, each marked with `key` (part of the cache key), or `{}` where this torch
    has no such option.

    torch 2.11-2.14 bypass both caches for any graph with a HOP, by caution rather than a known
    fault (pytorch/pytorch#123325: user-defined Triton kernels, whose HOP reads a side table;
    #135877 added this opt-in), so every process compiled tfun's loops from scratch. For these
    HOPs the cache key is sound: their operands are the loop bodies and branches, submodules
    whose code Inductor's key pickles with the graph's, tensors and constants. Before marking,
    tfun's fixes to torch's rules for these HOPs (autograd, vmap, Inductor's per-step input
    asserts) are applied, so that every graph compiled and cached with the marks was compiled
    under the same rules (tfun applies each on its first traced loop otherwise); `key` names
    torch's version and tfun's source (`tfun._jit_options`), so another tfun's rules never
    reuse an entry, with or without tfun's passes."""
    from torch._inductor import config

    if not isinstance(getattr(config, "unsafe_marked_cacheable_functions", None), dict):
        return {}
    cond_autograd_fixes()
    cond_vmap_fixes()
    scan_autograd_fixes()
    scan_vmap_fixes()
    while_loop_autograd_fixes()
    subgraph_input_asserts_off()
    hop_calls_take_proxies()
    marks = {}
    for name in _LOOP_HOPS:
        op = getattr(torch.ops.higher_order, name, None)
        if isinstance(op, torch._ops.HigherOrderOperator):
            marks[f"{op.__module__}.{op.__name__}"] = key
    return marks


def inductor_unrolled_reduction_size() -> int:
    """The largest reduction Inductor unrolls into pointwise code (`unroll_reductions_threshold`,
    8 in torch 2.11-2.14), whose arithmetic its consumers then inline; 8 where the option is
    missing."""
    from torch._inductor import config

    return int(getattr(config, "unroll_reductions_threshold", 8))


def expm1(x: torch.Tensor) -> torch.Tensor:
    """`exp(x) - 1`, accurate for small `|x|` eagerly and however Inductor compiles it.

    Inductor's vectorized CPU code for `torch.expm1` computes `exp(x) - 1` in torch 2.11 and
    2.13 (`expm1(1e-7)` gives `1.19e-7` in float32; 2.14 and 2.15 compute it accurately), which
    undid the accuracy `tfun.nn`'s zero-order hold relies on: S4D's and S5's gradients in `A`
    under `tfun.jit` were off by a relative 8% at a step of `1e-3` and by 2.7x at `1e-4`.
    There is no cheap probe for it, so every release takes the same formula: for `|x| < 1/2`,
    `2 t / (1 - t)` with `t = tanh(x / 2)` (an identity; `tanh` is accurate near 0 in every
    release's compiled code, and its derivative is `exp(x)` again); elsewhere `exp(x) - 1`,
    which cancels nothing there. The small branch reads a clamped `x`, so the branch not taken
    is finite and its zero gradient stays zero."""
    small = x.abs() < 0.5
    t = torch.tanh(0.5 * torch.where(small, x, torch.zeros_like(x)))
    return torch.where(small, 2 * t / (1 - t), torch.exp(x) - 1)


def fake_mode_of(values: Any) -> Any:
    """The fake-tensor mode of the fake tensors among `values` (a graph node's `val`s), or None."""
    detect = getattr(importlib.import_module("torch._guards"), "detect_fake_mode", None)
    return detect(values) if detect is not None else None


def dynamo_comptime() -> Any:
    """`torch._dynamo.comptime.comptime`: `comptime(fn)` in code that Dynamo traces runs
    `fn(ctx)` at trace time, with `ctx` reading the traced frame's variables (their fake
    tensors and symbolic sizes). None where this torch lacks it. Imports Dynamo: called at
    trace time only (`_hop.trace_sizes`)."""
    return _private("torch._dynamo.comptime", "comptime")


def _size_hint(s: Any) -> int | None:
    """A size as the int it has in the call being traced: a symbolic size's hint, None for
    one without (a data-dependent size)."""
    if isinstance(s, int):
        return s
    node = getattr(s, "node", None)
    has_hint = getattr(node, "has_hint", None)
    if has_hint is None or not has_hint():
        return None
    hint = node.hint
    return int(hint) if hint is not None else None


def sizes_now(x: Any) -> tuple[int | None, ...] | None:
    """The sizes of tensor `x` in the call being traced (`_size_hint` of each); None for a
    value that is not a tensor. Plain Python: not for code that Dynamo traces (there,
    `comptime_local_sizes`)."""
    if not isinstance(x, torch.Tensor):
        return None
    return tuple(_size_hint(s) for s in x.shape)


def comptime_local_sizes(ctx: Any, name: str) -> tuple[int | None, ...] | None:
    """In a `dynamo_comptime` callback: `sizes_now` of the traced frame's local `name`."""
    var = ctx.get_local(name)
    if not issubclass(var.python_type(), torch.Tensor):
        return None
    size = var.size()
    return tuple(_size_hint(s) for s in size)


def is_exporting() -> bool:
    """Whether `torch.export` is tracing (strict or not), as `torch.compiler.is_exporting()`
    answers outside Dynamo.

    Inside code that Dynamo traces, torch 2.11's Dynamo folds `torch.compiler.is_exporting()`
    to True under plain `torch.compile` too (as it folds `is_compiling()`), so tfun's
    lowerings took every `tfun.jit` for an export (and dropped the workarounds that scan
    autograd needs, e.g. the integer carries' encoding: "outs_to_grad length (2) != tangents
    length (3)"); torch 2.13's Dynamo answers with the flag that export sets. This function
    reads that flag (`torch.compiler._is_exporting_flag`, where the release has it) and
    Dynamo runs it as plain Python, so every release answers alike.
    """
    if hasattr(torch.compiler, "_is_exporting_flag"):
        return bool(torch.compiler._is_exporting_flag)
    f = getattr(torch.compiler, "is_exporting", None)  # pragma: no cover - a torch without the flag
    return bool(f()) if f is not None else False


is_exporting._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _code_names(code: Any) -> set[str]:
    """The names (globals, attributes) that a code object and the code nested in it use."""
    names = set(code.co_names)
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            names |= _code_names(c)
    return names


_PATCHED: set[str] = set()


def _dense_grads(backward: Callable[..., Any]) -> Callable[..., Any]:
    """`backward` (an autograd Function's) called with its incoming gradients cloned into
    contiguous tensors (a view such as the stride-0 gradient of `out.sum()` becomes dense)."""

    def dense_backward(ctx: Any, *grads: Any) -> Any:
        grads = tuple(
            g.clone(memory_format=torch.contiguous_format) if isinstance(g, torch.Tensor) else g for g in grads
        )
        return backward(ctx, *grads)

    return dense_backward


def _wrap_backward_once(
    module: str,
    class_name: str,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
    fixed: Callable[[Callable[..., Any]], bool],
) -> bool:
    """Replace `module.class_name.backward` (a HOP's autograd Function) by `wrap(backward)`,
    once per process, unless that class is missing (a torch whose HOP moved: nothing to patch)
    or `fixed(backward)` says this torch already does what the wrapper would. Returns whether
    it wrapped (False on every later call)."""
    key = f"{module}.{class_name}.backward:{getattr(wrap, '__name__', wrap)}"
    if key in _PATCHED:
        return False
    _PATCHED.add(key)
    try:
        mod = importlib.import_module(module)
    except ImportError:  # pragma: no cover - a torch whose HOP moved: nothing to patch
        return False
    cls = getattr(mod, class_name, None)
    backward = getattr(cls, "backward", None)
    if backward is None or fixed(backward):
        return False
    cls.backward = staticmethod(wrap(backward))
    return True


def _names_contiguous(backward: Callable[..., Any]) -> bool:
    """Whether a backward's code (or code nested in it) makes tensors contiguous itself."""
    code = getattr(backward, "__code__", None)
    return code is not None and bool({"contiguous", "contiguous_format"} & _code_names(code))


def while_loop_autograd_fixes() -> None:
    """Make torch's while_loop backward start from dense (contiguous) gradients.

    The backward of `torch.while_loop` is a while_loop whose carries start as the gradients
    of the forward outputs. Autograd may pass those as views: the gradient of `out.sum()` is
    an expanded tensor with stride (0, 0), while each backward step returns a dense one, and
    while_loop's own check refuses the pair ("Expected carried_inputs and body_output to have
    same metadata ... stride: (0, 0) vs (3, 1)"); `tfun.grad` under `tfun.jit` meets it in the
    fake run of `torch.autograd.grad`. torch 2.13's `WhileLoopAutogradOp.backward` clones the
    gradients into contiguous tensors first; where it does not (its code never names
    `contiguous_format`: torch 2.11), it is wrapped by one that does. Idempotent.
    """
    _wrap_backward_once("torch._higher_order_ops.while_loop", "WhileLoopAutogradOp", _dense_grads, _names_contiguous)
    _wrap_backward_once(
        "torch._higher_order_ops.while_loop", "WhileLoopAutogradOp", _differentiate_every_carry, lambda backward: False
    )
    _wrap_backward_once("torch._higher_order_ops.while_loop", "WhileLoopAutogradOp", _zero_trip_grads, lambda backward: False)
    _wrap_backward_once(
        "torch._higher_order_ops.while_loop", "WhileLoopAutogradOp", _dense_additional_inputs, lambda backward: False
    )


def _differentiate_every_carry(backward: Callable[..., Any]) -> Callable[..., Any]:
    """`WhileLoopAutogradOp.backward` that differentiates each step through every floating carry.

    torch's while_loop backward (2.11 through 2.14, and so on every torch tfun supports) is a
    reverse while_loop whose step is the body's joint graph, built with each carry requiring
    grad only if the loop's *initial* carry did (`fw_carry.requires_grad_(carry.requires_grad)`);
    for a carry that does not, the step's gradient through it is a zero. But a carry that
    starts constant becomes a function of the parameters after one step (`c = tanh(c @ W)`
    from a zero or data `c`, the usual recurrent state): the gradient reaching earlier steps
    was cut, and the parameters' gradient silently wrong (measured: an error as large as the
    gradient, with `torch.compile` of torch's own while_loop and under `tfun.jit`). The
    wrapper makes every floating carry of the saved forward a leaf that requires grad before
    torch's backward reads it; carries that did require grad are left as they are. Exact
    (a gradient is only added where it was wrongly zero), and it applies whatever torch's
    version, as no torch so far differentiates every carry itself."""

    def backward_every_carry(ctx: Any, *grads: Any) -> Any:
        carries = getattr(ctx, "carries", None)
        if carries is not None:
            ctx.carries = tuple(
                c.detach().requires_grad_()
                if isinstance(c, torch.Tensor) and (c.is_floating_point() or c.is_complex()) and not c.requires_grad
                else c
                for c in carries
            )
        return backward(ctx, *grads)

    return backward_every_carry


def _dense_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t` that requires grad where `t` did (a copy made in a backward,
    where grad mode is off, would not: torch's backward then differentiates nothing through
    it, and the gradient is silently zero)."""
    dense = t.detach().contiguous()
    return dense.requires_grad_() if t.requires_grad else dense


def _dense_additional_inputs(backward: Callable[..., Any]) -> Callable[..., Any]:
    """`WhileLoopAutogradOp.backward` for a body that reads a non-contiguous tensor.

    torch's while_loop backward carries one gradient accumulator per tensor the body reads
    (its additional inputs), made by `zeros_like` with that tensor's strides, while each
    backward step returns a contiguous gradient; its own check then refuses the pair
    ("Expected carried_inputs and body_output to have same metadata ... stride: (1, 4) vs
    (3, 1)"), for a transposed, expanded or channels-last tensor closed over by a
    `while_loop` (or tensor-bound `fori_loop`) body under `tfun.jit` with gradients, on
    every torch tfun supports (hunt 33, F6). The wrapper hands torch's backward contiguous
    copies of those tensors (the same values; the gradients come back dense, which autograd
    accepts for any layout)."""

    def backward_dense_inputs(ctx: Any, *grads: Any) -> Any:
        extra = getattr(ctx, "additional_inputs", None)
        if extra is not None:
            ctx.additional_inputs = tuple(
                _dense_like(a) if isinstance(a, torch.Tensor) and not a.is_contiguous() else a for a in extra
            )
        return backward(ctx, *grads)

    return backward_dense_inputs


def _zero_trip_grads(backward: Callable[..., Any]) -> Callable[..., Any]:
    """`WhileLoopAutogradOp.backward` that is right for a loop whose body never ran.

    torch's forward stacks each step's carries, and for a loop of zero steps it stacks the
    initial carry once (so the stack is never empty); its backward then runs one reverse step
    per row, so a loop that ran zero times gets one step of the body's derivative: the initial
    carry's gradient was the body's vector-Jacobian product instead of the incoming gradient,
    and every closed-over tensor (a weight) got a nonzero gradient instead of zero. Silently
    wrong under `tfun.jit` with gradients, on every torch tfun supports (2.11 through 2.14.1),
    for a `while_loop` whose condition is false at the start (an iteration that has already
    converged) and a `fori_loop` with tensor bounds and `lower >= upper` (hunt 31, F1). The
    wrapper evaluates the loop's condition at the initial carry and, where it is false, takes
    the zero-step loop's gradients instead: each carry's incoming gradient, zeros for the
    closed-over inputs (`torch.where`, so a traced backward needs no data-dependent branch).
    torch's phantom step still runs, on the initial carry; what it computes is discarded."""

    def backward_zero_trip(ctx: Any, *grads: Any) -> Any:
        out = list(backward(ctx, *grads))
        carries, extra = tuple(ctx.carries), tuple(ctx.additional_inputs)
        with torch.no_grad():
            ran = ctx.fw_cond_fn(*carries, *extra)
        if not isinstance(ran, torch.Tensor):
            if bool(ran):
                return tuple(out)
            ran = torch.tensor(False)
        first = len(out) - len(carries) - len(extra)  # after the cond_fn/body_fn/count slots
        for k, g in enumerate(out[first:]):
            if not isinstance(g, torch.Tensor):
                continue
            incoming = grads[k] if k < len(carries) and isinstance(grads[k], torch.Tensor) else None
            zero_trip = incoming.to(g.dtype) if incoming is not None else torch.zeros_like(g)
            out[first + k] = torch.where(ran.to(g.device), g, zero_trip)
        return tuple(out)

    return backward_zero_trip


_TOP_SAVED_TENSOR_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, and so
    `torch.utils.checkpoint`'s non-reentrant mode and `save_on_cpu`) are active on this
    thread. False where torch cannot say (every supported release can)."""
    if _TOP_SAVED_TENSOR_HOOKS is None:  # pragma: no cover - every supported torch has it
        return False
    return _TOP_SAVED_TENSOR_HOOKS(False) is not None


def allow_scalar_outputs_in_trace(trace: Any) -> None:
    """Allow data-dependent scalars on the fake mode of `trace` (Dynamo's `TracingContext`
    of the graph being traced, None eagerly), for the loops Inductor lowers.

    Inductor (plain `torch.compile`'s default backend) lowers a `scan` or `map` by
    decomposing it into a `while_loop` (its post-grad pass `decompose_scan_to_while_loop`),
    whose body reads the step counter with `.item()`, traced under the graph's fake mode.
    That mode allows scalar outputs only in a one-graph trace (`fullgraph=True`, so
    `tfun.jit`); with a plain `torch.compile(f)` every scan, forward alone included, failed
    with torch's `InductorError` (`DataDependentOutputException`; hunt 33, F5, torch 2.11
    through 2.14.1). torch's own while_loop backward reads its step index the same way,
    which failed AOTAutograd's trace of the backward under such a compile (hunt 31, F6: a
    `fori_loop` with tensor bounds or a `while_loop`, then `.backward()`; Dynamo then mixed
    eager and traced loop code, a StructureMismatchError blaming tfun's `w_body`). Called at
    trace time by every tfun lowering. The trace is that compile's
    own. The flag that counts is its `ShapeEnv`'s, which Dynamo sets from `fullgraph` and
    shares with the fresh fake mode it hands the backend (the mode's own flag is not
    copied). Dynamo reads its own `capture_scalar_outputs` option for a user's `.item()`,
    which still breaks the graph as before."""
    shape_env = getattr(getattr(trace, "fake_mode", None), "shape_env", None)
    if shape_env is None or getattr(shape_env, "allow_scalar_outputs", True) is not False:
        return
    settings = getattr(shape_env, "settings", None)  # a frozen dataclass (torch 2.11 through 2.14.1)
    if dataclasses.is_dataclass(settings) and "allow_scalar_outputs" in {f.name for f in dataclasses.fields(settings)}:
        shape_env.settings = dataclasses.replace(settings, allow_scalar_outputs=True)
    else:  # pragma: no cover - a torch that keeps the flag as a plain attribute
        shape_env.allow_scalar_outputs = True


# Under tfun.jit, Dynamo runs it as plain Python (it cannot trace `setattr` on a class).
while_loop_autograd_fixes._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _dense_outputs(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def dense(*args: Any) -> Any:
        out = fn(*args)
        dense_out = [o.contiguous() if isinstance(o, torch.Tensor) else o for o in out]
        return type(out)(dense_out) if isinstance(out, (tuple, list)) else dense_out

    dense._tfun_dense = True  # type: ignore[attr-defined]
    return dense


def _dense_branch_grads(backward: Callable[..., Any]) -> Callable[..., Any]:
    """`CondAutogradOp.backward` whose two backward branches return contiguous gradients."""

    def dense_backward(ctx: Any, *grads: Any) -> Any:
        for name in ("_true_bw_fn", "_false_bw_fn"):
            fn = getattr(ctx, name, None)
            if fn is not None and not getattr(fn, "_tfun_dense", False):
                setattr(ctx, name, _dense_outputs(fn))
        return backward(ctx, *grads)

    return dense_backward


def cond_autograd_fixes() -> None:
    """Make torch.cond's backward branches return dense (contiguous) gradients.

    The backward of `torch.cond` is a cond of the branches' backward functions, whose outputs
    are the gradients of the operands (closed-over tensors included); its fake-tensor rule
    merges the two branches' outputs into one and asserts that their strides agree. Where one
    branch's gradient of an operand is a broadcast (stride 0: the gradient of `w.sum()`) and
    the other's a dense tensor (or a zero), torch 2.11 through 2.14 fail to compile
    ("AssertionError: expected b_val == 0 when a_val == 0", `_merge_output` in
    torch/_higher_order_ops/cond.py). Where `CondAutogradOp.backward` does not make the
    gradients contiguous itself (its code never names `contiguous`: every torch tfun supports
    so far), it is wrapped by one that makes every gradient the branches return contiguous
    first (a no-op for those already dense). Idempotent; Dynamo runs it as plain Python under
    tfun.jit.
    """
    _wrap_backward_once("torch._higher_order_ops.cond", "CondAutogradOp", _dense_branch_grads, _names_contiguous)


cond_autograd_fixes._dynamo_marked_constant = True  # type: ignore[attr-defined]


#: torch's module that scripts its own classes when first imported (`torch.jit.script_method`),
#: which torch 2.11 and 2.13 deprecate with a `DeprecationWarning` at that import.
_SCRIPTS_AT_IMPORT = "torch.utils.mkldnn"


def import_torch_scripted_modules() -> None:
    """Import torch's `torch.utils.mkldnn` now (once; about 16 ms), with the deprecation warning
    about `torch.jit.script_method` its import issues ignored.

    A traced gradient of a loop imports it (torch's HOP partitioner imports
    `torch._inductor.compile_fx`, which imports it), with `backend="aot_eager"` too: under
    `python -W error` or pytest's `filterwarnings = ["error"]`, `tfun.jit(tfun.grad(f))` of a scan
    closing over a parameter failed its first compile on that warning (torch 2.11, 2.13; 2.14
    no longer warns there). It is about torch's code, not the caller's. Imported here, when
    tfun.jit is imported, the warning cannot come again (the module scripts its classes once);
    only that message and category are ignored, and only around this import, so no filter is
    touched while anything is compiled or run."""
    if _SCRIPTS_AT_IMPORT in sys.modules:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated", category=DeprecationWarning)
        importlib.import_module(_SCRIPTS_AT_IMPORT)


def compile_error(e: BaseException) -> BaseException:
    """The exception that made a compiled call fail, for `tfun.jit` to translate.

    When a backend fails to compile a graph traced inside a `torch.func` transform (`tfun.vmap`
    around a scan under `tfun.jit`), torch 2.11's Dynamo, unwinding, pops functorch's layer
    stack once too often and raises an internal assert ("!dynamicLayerStack.empty() INTERNAL
    ASSERT FAILED") while handling the real error, which it hides. That real error is the
    assert's `__context__`: it is returned instead (torch 2.13 raises it directly). torch
    2.13 does the same where an internal Dynamo error ends a trace while a custom function's
    call inside `tfun.vmap` has left the vmaps (`tfun._custom_derivatives._traced_vmap_rule_call`):
    there the assert is wrapped in an `InternalTorchDynamoError`, whose context is the assert,
    so the chain is followed to the first exception that is not the assert. Any other
    exception is returned as it is.
    """
    while isinstance(e, RuntimeError) and "dynamicLayerStack.empty()" in str(e) and e.__context__ is not None:
        e = e.__context__
    return e


def _dynamo_compares_by_dunder_eq() -> bool:
    """Whether Dynamo traces `a == b` through its `cmp_eq` polyfill, which calls
    `a.__eq__(b)` (torch 2.11). That fails for the functions Dynamo itself substitutes
    (`substitute_in_graph`): their `__eq__` method-wrapper has no traceable polyfill ("Polyfill
    handler <method-wrapper '__eq__' of function object> does not have a traceable function").
    torch 2.13's Dynamo has no such polyfill and compares those functions. Run by Dynamo as
    plain Python (a constant result); asked only while Dynamo traces, so it is loaded."""
    polyfills = importlib.import_module("torch._dynamo.polyfills")
    return hasattr(polyfills, "cmp_eq")


_dynamo_compares_by_dunder_eq._dynamo_marked_constant = True  # type: ignore[attr-defined]


def same_treedef(a: Any, b: Any) -> bool:
    """`a == b` for two treedefs (optree `PyTreeSpec`s), also in code that Dynamo traces.

    Under Dynamo a treedef is Dynamo's Python stand-in for optree's `PyTreeSpec`, a dataclass
    whose generated `__eq__` compares its fields, among them the node's unflatten function,
    which is one of the functions Dynamo substitutes. Dynamo 2.11 cannot compare two of those
    (see `_dynamo_compares_by_dunder_eq`), so a pytree carry checked in a HOP body under
    `tfun.jit` failed to compile. Where that is so, the fields are compared here one by one,
    the function by identity (which is what `==` on a function is), the children recursively:
    the same answer as `==`. Every release's stand-in also keeps a dict's keys in their
    insertion order in its fields, which optree's `==` ignores (it flattens a dict in sorted
    key order): a `combine` returning `{"b": ..., "a": ...}` for `elems` built as
    `{"a": ..., "b": ...}` ran eagerly and was refused under `tfun.jit`. So under Dynamo the
    fields are always compared here, a dict's keys as optree compares them. Elsewhere (eager
    code, non-strict export's outer code) this is `a == b`.
    """
    if torch.compiler.is_dynamo_compiling() and hasattr(a, "_unflatten_func") and hasattr(b, "_unflatten_func"):
        return _spec_fields_equal(a, b)
    return bool(a == b)


def _metadata_equal(a: Any, b: Any) -> bool:
    """The node metadata of two stand-in treedefs of the same type, equal as optree's `==`
    finds them: the keys of a dict or a `defaultdict` as a sorted sequence (its `_entries`),
    not in insertion order, and a `defaultdict`'s `default_factory` (the first item of its
    metadata). An `OrderedDict`'s keys stay ordered, as optree compares them."""
    if a._type is dict:
        return bool(a._entries == b._entries)
    if a._type is collections.defaultdict:
        return bool(a._entries == b._entries and a._metadata[0] == b._metadata[0])
    return bool(a._metadata == b._metadata)


def _spec_fields_equal(a: Any, b: Any) -> bool:
    """The fields of two of Dynamo's stand-in treedefs compared as the dataclass's `__eq__`
    compares them, the unflatten function by identity."""
    if a is b:
        return True
    if (
        a._type != b._type
        or a.num_nodes != b.num_nodes
        or a.num_leaves != b.num_leaves
        or a.num_children != b.num_children
        or a.none_is_leaf != b.none_is_leaf
        or a.namespace != b.namespace
        or a._entries != b._entries
        or not _metadata_equal(a, b)
        or a._unflatten_func is not b._unflatten_func
    ):
        return False
    for x, y in zip(a._children, b._children):
        if not _spec_fields_equal(x, y):
            return False
    return True


def dynamo_inspects_wrapped_functions() -> bool:
    """Whether Dynamo can look at a function it wraps, as tfun's trace-time rules do.

    Dynamo stands in for some functions with a `WrapperUserFunctionVariable`: a
    `torch.compile`d function, a `functools.lru_cache`d one, a `torch.jit.script_if_tracing`
    one. torch 2.13's is a `BaseUserFunctionVariable`, which `callable`, `isinstance` and
    `getattr` accept. torch 2.11's is not: each of them fails to trace on it ("Failed to trace
    builtin operator `callable`"), and nothing traceable tells such a function apart from
    another to route around it. So on torch 2.11 a `torch.compile`d or `lru_cache`d function
    passed as a `tfun.lax` body inside `tfun.jit` is a `JitError` (eagerly it works): pass the
    plain function (docs/compatibility.md). Used by the tests to expect that error."""
    functions = importlib.import_module("torch._dynamo.variables.functions")
    wrapper = getattr(functions, "WrapperUserFunctionVariable", None)
    base = getattr(functions, "BaseUserFunctionVariable", None)
    return wrapper is None or base is None or issubclass(wrapper, base)


def wraps(wrapped: Callable[..., Any], updated: tuple[str, ...] = ("__dict__",)) -> Callable[[Any], Any]:
    """`functools.wraps(wrapped, updated=updated)`, also for a builtin `wrapped` in code that
    Dynamo traces (`tfun.vmap(torch.linalg.det)` inside `tfun.jit`).

    `functools.update_wrapper` reads each attribute in a `try`/`except AttributeError`; Dynamo
    2.11 turns a builtin's missing `__annotations__` into an internal error there instead of
    the `AttributeError` the code catches ("'builtin_function_or_method' object has no
    attribute '__annotations__'"), a `JitError`. Later releases trace it. For a builtin,
    `hasattr`, which every release traces, gives the same wrapper; anything else takes
    `functools.wraps` (Dynamo answers `hasattr` wrongly for some, e.g. a `functools.partial`'s
    `__name__`, and then fails on the `getattr`). With the default `updated`, that is called
    as `functools.wraps(wrapped)`: the one form Dynamo recognizes without tracing
    `functools.update_wrapper`, whose `__dict__.update` Dynamo 2.11 cannot trace (with
    `updated=` spelled out, every `tfun.grad` made inside `tfun.jit` was a JitError on 2.11)."""
    if not isinstance(wrapped, types.BuiltinFunctionType):
        if tuple(updated) == tuple(functools.WRAPPER_UPDATES):
            return functools.wraps(wrapped)
        return functools.wraps(wrapped, updated=updated)

    def decorate(wrapper: Any) -> Any:
        for name in functools.WRAPPER_ASSIGNMENTS:
            if hasattr(wrapped, name):
                setattr(wrapper, name, getattr(wrapped, name))
        for name in updated:
            if hasattr(wrapped, name):
                getattr(wrapper, name).update(getattr(wrapped, name))
        wrapper.__wrapped__ = wrapped
        return wrapper

    return decorate


def selective_checkpoint_vmaps() -> bool:
    """Whether torch's selective activation checkpointing (`torch.utils.checkpoint` with a
    `context_fn`, which a `tfun.checkpoint` policy lowers to under `tfun.jit`) can run under
    a `vmap` that Dynamo traces. torch 2.11's non-reentrant checkpoint saves its inputs through
    `_NoopSaveInputs`, an `autograd.Function` with no batching rule: under
    `tfun.jit(tfun.vmap(tfun.grad(f)))` that is a compile error ("You tried to vmap over
    _NoopSaveInputs"); later releases dropped it. Where False, `tfun.checkpoint` recomputes
    everything under a traced vmap (the same values and gradients; hunt 31, finding 3)."""
    return _SELECTIVE_CHECKPOINT_VMAPS


def _selective_checkpoint_vmaps() -> bool:
    saver = getattr(importlib.import_module("torch.utils.checkpoint"), "_NoopSaveInputs", None)
    return saver is None or bool(getattr(saver, "generate_vmap_rule", False)) or "vmap" in vars(saver)


# (read once: the function above is called in traced code)
_SELECTIVE_CHECKPOINT_VMAPS = _selective_checkpoint_vmaps()


def _cpp_tile2d_probe() -> tuple[bool, bool] | None:
    """Ask Inductor's C++ backend (`CppTile2DKernel.need_vec_transpose`, on a stand-in kernel
    with loop variables `x0`, `x1` tiled 16 x 16) whether it would transpose a 2-D tile for
    an access with stride 1 along the outer variable: `(plain, indirect)`, for the index
    `x0 + 16*x1` and for the same index plus a multiple of an indirect-index temporary
    (`tmp10`, a value the kernel loads). None where this torch's internals do not fit the
    stand-in (a missing name, another signature)."""
    try:
        from types import SimpleNamespace

        from torch._inductor.codegen.cpp import CppTile2DKernel
        from torch._inductor.utils import sympy_index_symbol
        from torch.utils._sympy.symbol import SymT, make_symbol

        x0, x1 = sympy_index_symbol("x0"), sympy_index_symbol("x1")
        tmp = make_symbol(SymT.TMP, 10, integer=True)
        kernel = SimpleNamespace(itervars=[x0, x1], outer_idx=0, tiling_idx=1, tiling_factor=16, _load_mask=None)
        plain = bool(CppTile2DKernel.need_vec_transpose(kernel, x0 + 16 * x1))
        indirect = bool(CppTile2DKernel.need_vec_transpose(kernel, x0 + 16 * x1 + 256 * tmp))
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - internals of another torch
        return None
    return plain, indirect


@functools.lru_cache(maxsize=None)
def cpp_transposes_indirect_index() -> bool:
    """Whether Inductor's C++ backend may put an access whose index holds an indirect-index
    temporary (`tmpN`, a value loaded in the kernel) into a 2-D tile transposition, which it
    emits before the loop that declares `tmpN`: the kernel then fails to compile ("'tmp10' was
    not declared in this scope", pytorch/pytorch#193581). Torch 2.11 does (a jitted RNN
    module's training step failed there once `tfun._scan_in_place` wrote a scan's stacked
    outputs at the counter tensor's index); torch 2.13 skips such accesses. Where True,
    `tfun._scan_in_place` leaves scans and maps to torch's own loop (which indexes with
    `.item()`, a plain integer). Asked once, when Inductor first runs the pass (the probe
    imports Inductor's C++ backend)."""
    probe = _cpp_tile2d_probe()
    if probe is None or not probe[0]:  # pragma: no cover - the stand-in does not model this torch
        return True  # unknown: assume the bug (scans are then left to torch: slower, right)
    return probe[1]


def dynamo_guards(compiled: Callable[..., Any]) -> list[Any] | None:
    """The guard checkers of the Dynamo cache entries of `compiled` (what `torch.compile`
    returned), in the order Dynamo tries them, or None where this torch does not expose them
    (each has `check(frame_locals) -> bool`: Dynamo's own test before it reuses a compiled
    graph, reading the arguments, closed-over values, globals and torch's global state it
    specialized on). `tfun._cuda_graphs` checks them before replaying a recorded call, since a
    replay bypasses Dynamo."""
    inner = getattr(compiled, "_torchdynamo_orig_callable", None)
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    entries_of = getattr(eval_frame, "_debug_get_cache_entry_list", None)
    code = getattr(inner, "__code__", None)
    if entries_of is None or code is None:
        return None
    checks = []
    for entry in entries_of(code):
        manager = getattr(entry, "guard_manager", None)
        if not callable(getattr(manager, "check", None)):
            return None
        checks.append(manager)
    return checks


def dynamo_frame_locals(compiled: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The local variables of the frame Dynamo sees when `compiled` is called with `args` and
    `kwargs`: its parameters (a `*args` parameter as a tuple, `**kwargs` as a dict, defaults
    filled in) and the closed-over variables of the function it compiled."""
    inner = compiled._torchdynamo_orig_callable  # type: ignore[attr-defined]
    bound = _signature_of(inner).bind(*args, **kwargs)
    bound.apply_defaults()
    frame = dict(bound.arguments)
    for name, cell in zip(inner.__code__.co_freevars, inner.__closure__ or ()):
        try:
            frame[name] = cell.cell_contents
        except ValueError:  # an empty cell: the frame has no such local yet
            pass
    return frame


_SIGNATURES: weakref.WeakKeyDictionary[Any, inspect.Signature] = weakref.WeakKeyDictionary()


def _signature_of(fn: Callable[..., Any]) -> inspect.Signature:
    """`inspect.signature(fn)`, kept while `fn` lives (a closure may hold tensors)."""
    sig = _SIGNATURES.get(fn)
    if sig is None:
        sig = _SIGNATURES[fn] = inspect.signature(fn)
    return sig


#: The key of the entry that `tfun._scan_in_place` sets in the `meta` of a rewritten scan's
#: condition subgraph: the loop's number of iterations, where it is a static int.
STATIC_TRIPS = "tfun_static_trips"


@functools.lru_cache(maxsize=None)
def counted_while_loops() -> bool:
    """Make Inductor's Python wrapper run a `while_loop` whose condition subgraph carries
    `STATIC_TRIPS` as `for _ in range(trips):` around the body, with no condition call and no
    `bool()` of a tensor per step (once per process; returns whether it applies here).

    `tfun._scan_in_place` rewrites a CPU scan of static length `n` into a `while_loop` whose
    condition is a carried bool the body sets to `i < n`: it runs exactly `n >= 1` times, and
    torch's wrapper asks the condition subgraph each time (a Python call, an argument list,
    `bool()` of the tensor: a quarter of the step of `benchmarks/vs_jax.py`'s small RNN, whose
    forward took 1.34 -> 1.00 ms counted, torch 2.13 on a 2-core CPU). Every other loop, the
    C++ wrapper (its own `codegen_while_loop`), AOT Inductor (inlined subgraphs) and wrappers of
    other classes keep torch's code. Feature-detected: where Inductor's wrapper lacks what this
    writes with, nothing changes."""
    try:
        from torch._inductor.codegen import wrapper as W
        from torch._inductor.virtualized import V
    except ImportError:
        return False
    base = getattr(W, "PythonWrapperCodegen", None)
    parts = ("codegen_while_loop", "codegen_subgraph_with_flattened_outputs", "writeline")
    if base is None or not all(hasattr(base, p) for p in parts) or not all(
        hasattr(W, n) for n in ("EnterSubgraphLine", "ExitSubgraphLine")
    ):
        return False
    original = base.codegen_while_loop
    plain = tuple(c for c in (base, getattr(W, "SubgraphPythonWrapperCodegen", None)) if c is not None)

    def codegen_while_loop(self: Any, while_loop: Any, stack_output: bool = False) -> Any:
        trips = _static_trips(while_loop)
        if stack_output or trips is None or type(self) not in plain or V.graph.aot_mode:
            return original(self, while_loop, stack_output)
        name = while_loop.get_name()
        carried = [buf.codegen_reference() for buf in while_loop.carried_inputs]
        additional = [buf.codegen_reference() for buf in while_loop.additional_inputs]
        self.writeline(f"{name} = [None] * {len(carried)}")
        for i, inp in enumerate(carried):
            self.writeline(f"{name}[{i}] = {inp}")
        inputs = [*[f"{name}[{i}]" for i in range(len(carried))], *additional]
        self.writeline(f"for _ in range({trips}):  # tfun: a loop of static length")
        self.writeline(W.EnterSubgraphLine(self, while_loop.body_subgraph.graph))
        self.codegen_subgraph_with_flattened_outputs(while_loop.body_subgraph, inputs, inputs[: len(carried)])
        self.writeline(W.ExitSubgraphLine(self))
        return None

    codegen_while_loop.__wrapped__ = original  # type: ignore[attr-defined]
    base.codegen_while_loop = codegen_while_loop
    return True


def _static_trips(while_loop: Any) -> int | None:
    """The `STATIC_TRIPS` of a while_loop IR node's condition subgraph (an int >= 1), or None."""
    module = getattr(getattr(while_loop, "cond_subgraph", None), "graph_module", None)
    trips = getattr(module, "meta", {}).get(STATIC_TRIPS)
    return trips if isinstance(trips, int) and not isinstance(trips, bool) and trips >= 1 else None


# ----------------------------------------------------------------------------------------
# Dynamo's stand-in treedefs, built ahead of tracing for the commonest structures
# ----------------------------------------------------------------------------------------

def traced_by_dynamo() -> bool:
    """`False`; where Dynamo traces the call, `True` (its stand-in, `_traced_by_dynamo`, answers).

    `torch.compiler.is_dynamo_compiling()` answers the same, but Dynamo marks a frame that asks
    it (or calls anything that does) as having "inconsistent side effects" and then compiles
    that frame even where it records no operation. Code that runs eagerly after a graph break
    has each function it calls met by Dynamo as a frame of its own: a `tfun.tree.tree_flatten`
    that asked was compiled so, and handed Dynamo's stand-in treedef to the eager code that
    called it, where optree's treedef belongs. A function with a stand-in registered by
    `torch._dynamo.substitute_in_graph` is not marked: such a frame records nothing and is left
    to run eagerly, where this answers `False`. Where this torch cannot register a stand-in
    (no `substitute_in_graph`), it is `False` everywhere (`TRACED_BY_DYNAMO_WORKS`)."""
    return False


def _register_traced_by_dynamo() -> bool:
    substitute = getattr(importlib.import_module("torch._dynamo"), "substitute_in_graph", None)
    if substitute is None:  # pragma: no cover - a torch without it (2.11-2.14 have it)
        return False

    @substitute(traced_by_dynamo)
    def _traced_by_dynamo() -> bool:
        return True

    return True


#: Whether `traced_by_dynamo` answers `True` under Dynamo on this torch.
TRACED_BY_DYNAMO_WORKS = _register_traced_by_dynamo()

#: The longest tuple / list `dynamo_treedefs` builds treedefs for.
TRACED_TREEDEF_MAX_LEN = 6


def dynamo_treedefs(namespace: str) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """Dynamo's stand-in treedefs (with the key paths of their leaves) for the structures a
    control-flow op meets most, built here in plain Python, keyed as `tfun._tree` keys them.

    Under Dynamo, optree's functions run as Dynamo's Python stand-ins
    (`torch._dynamo.polyfills.pytree`), which Dynamo traces instruction by instruction: one
    flatten of a single tensor costs about 335 traced instructions, most of them building the
    frozen dataclass that stands in for optree's `PyTreeSpec`; a `tfun.lax.scan` lowering
    flattens a dozen trees, and that is about half of Dynamo's work on a small scan (torch
    2.13). The structures built here are a leaf, `None`, and a tuple or a list of up to
    `TRACED_TREEDEF_MAX_LEN` items each a leaf or `None`, with `none_is_leaf` false and true;
    each is what Dynamo's stand-in `tree_flatten` returns for such a tree (it is called here,
    outside tracing, on a tree of that structure), so a treedef from this table and one
    Dynamo builds compare equal and unflatten alike. Keys: `"*"` a leaf, `"n"` `None` (not a
    leaf), `"t"` / `"l"` then one letter per item (`"*"` a leaf, `"n"` `None`), then `"1"`
    for `none_is_leaf`. Empty where this torch has no such stand-in (then every tree is
    flattened by the stand-ins, as before).
    """
    try:
        polyfill = importlib.import_module("torch._dynamo.polyfills.pytree")
    except ImportError:  # pragma: no cover - a torch without Dynamo's optree stand-ins
        return {}
    # (the module's `tree_flatten` calls optree's; the stand-in Dynamo traces hangs off it)
    flatten = getattr(getattr(polyfill, "tree_flatten", None), "__torch_dynamo_polyfill__", None)
    spec_class = getattr(polyfill, "PyTreeSpec", None)
    if flatten is None or spec_class is None:
        return {}  # pragma: no cover - another torch's layout: no table, no fast path
    table: dict[str, tuple[Any, tuple[Any, ...]]] = {}

    def add(key: str, skeleton: Any, none_is_leaf: bool) -> bool:
        _, spec = flatten(skeleton, none_is_leaf=none_is_leaf, namespace=namespace)
        if type(spec) is not spec_class:  # pragma: no cover - another torch's layout
            return False
        accessors = tuple(
            optree.tree_flatten_with_accessor(skeleton, none_is_leaf=none_is_leaf, namespace=namespace)[0]
        )
        table[key] = (spec, accessors)
        return True

    leaf = 0
    for none_is_leaf, suffix in ((False, ""), (True, "1")):
        if not add("*" + suffix, leaf, none_is_leaf):
            return {}  # pragma: no cover - another torch's layout: no table, no fast path
        kinds = ("*",) if none_is_leaf else ("*", "n")
        for n in range(TRACED_TREEDEF_MAX_LEN + 1):
            for items in itertools.product(kinds, repeat=n):
                values = [leaf if k == "*" else None for k in items]
                add("t" + "".join(items) + suffix, tuple(values), none_is_leaf)
                add("l" + "".join(items) + suffix, list(values), none_is_leaf)
    add("n", None, False)
    return table
