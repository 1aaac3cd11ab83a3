"""Where a call runs: the one place that answers "tracing? under torch.func? at what level?".

tfun picks a path per call: eagerly it runs Python loops; traced by `torch.compile` (so
`tfun.jit`) or `torch.export` it lowers to PyTorch's higher-order ops; under a `torch.func`
transform (`tfun.grad`, `tfun.vmap`, `tfun.jvp`) some rules read the transform's level. Every
such question is asked here, so the answer cannot differ between modules. It imports only
`_compat` (which imports no tfun module; torch's private functorch entry points are resolved
there), and `_errors` where it raises: every layer may use it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterable, Iterator

import torch

from . import _compat

__all__ = [
    "is_tracing",
    "is_dynamo_tracing",
    "functorch_active",
    "forward_mode_active",
    "reverse_mode_active",
    "transform_stack",
    "innermost_transform",
    "functorch_level",
    "in_functorch_transform",
    "in_op_recording_mode",
    "current_trace",
    "autocast_state",
    "autocast_restored",
]


def _detect_is_compiling() -> Callable[[], bool]:
    f = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if f is not None:
        return f
    return importlib.import_module("torch._dynamo").is_compiling  # pragma: no cover - older torch


_is_compiling: Callable[[], bool] = _detect_is_compiling()
_is_dynamo_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_dynamo_compiling", None) or _is_compiling


def is_tracing() -> bool:
    """True under `torch.compile` (Dynamo, so `tfun.jit`) and `torch.export.export` (strict
    and non-strict); False eagerly and under plain `torch.func` transforms.

    `torch.compiler.is_compiling()`: Dynamo constant-folds it to True, non-strict export sets
    the flag while it traces. About 0.1 us per call eagerly.
    """
    return _is_compiling()


def is_dynamo_tracing() -> bool:
    """True where Dynamo traces the code: under `torch.compile` (so `tfun.jit`) and strict
    `torch.export`; False eagerly and at the top level of a non-strict export (which runs the
    Python itself, with Dynamo only inside higher-order ops' bodies).

    `torch.compiler.is_dynamo_compiling()` (Dynamo constant-folds it to True) where the release
    has it, else `is_tracing()`.
    """
    return _is_dynamo_compiling()


def make_fx_tracing() -> bool:
    """True while `make_fx` traces (`torch.func.linearize`, `torch.fx.experimental.proxy_tensor.
    make_fx`, AOTAutograd's tracing): its proxy mode is active, and the value of a tensor it
    tracks cannot be read (`bool`, `int`, `.item()` fail in torch). About 0.3 us."""
    get_mode = getattr(torch._C, "_get_dispatch_mode", None)
    key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "PROXY", None)
    return get_mode is not None and key is not None and get_mode(key) is not None


def functorch_active() -> bool:
    """Whether a `torch.func` transform (grad, vjp, jvp, vmap, ...) is active on this thread.
    Conservatively True where torch cannot say."""
    probe = getattr(torch._C, "_are_functorch_transforms_active", None)
    return True if probe is None else bool(probe())


def _transform_on_stack(kind: str) -> bool:
    """Whether a `torch.func` interpreter of `kind` ("Jvp", "Grad", ...) is on this thread's
    interpreter stack (read by `transform_stack`, the one reader of the stack)."""
    if not functorch_active():  # the eager hot path: no transform, no stack to read
        return False
    return any(k == kind for k, _ in transform_stack())


def forward_mode_active() -> bool:
    """Whether a forward-mode `torch.func` transform (`tfun.jvp`, `jacfwd`, `hessian`) is live
    on this thread's interpreter stack."""
    return _transform_on_stack("Jvp")


def reverse_mode_active() -> bool:
    """Whether a reverse-mode `torch.func` transform (`grad`, `vjp`, `jacrev`, and `tfun.grad`
    where it uses them) is live on this thread's interpreter stack. Traced code must call it
    through a Dynamo escape hatch (plain Python at trace time, where Dynamo pushes the real
    interpreters of the transforms it traces)."""
    return _transform_on_stack("Grad")


def vmap_active() -> bool:
    """Whether a `torch.func.vmap` (`tfun.vmap`) is live on this thread's interpreter stack.
    Traced code must call it through a Dynamo escape hatch, as `reverse_mode_active`."""
    return _transform_on_stack("Vmap")


def transform_stack() -> tuple[tuple[str, int], ...]:
    """The live `torch.func` transforms on this thread as `(kind, level)` pairs, outermost
    first (`(("Vmap", 1), ("Jvp", 2))` inside `vmap(jvp(f))`); `()` where none is. Traced
    code must call it through a Dynamo escape hatch (plain Python at trace time, where Dynamo
    pushes the real interpreters of the transforms it traces)."""
    if not functorch_active():
        return ()
    interpreters = _compat.functorch_interpreters
    if interpreters is None:
        from ._errors import TfunError, format_message

        raise TfunError(
            format_message(
                f"tfun: this torch ({torch.__version__}) lacks "
                f"{', '.join(_compat.functorch_missing('functorch_interpreters'))}, which tfun needs to read "
                "the torch.func transforms active here (tfun.grad, tfun.jvp, tfun.vmap, jacfwd, ...).",
                revise="Install a torch release tfun supports (docs/compatibility.md), or call the function "
                "outside torch.func transforms.",
            )
        )
    return tuple((i.key().name, int(i.level())) for i in interpreters())


def innermost_transform() -> str | None:
    """The kind ("Jvp", "Vmap", "Grad", ...) of the innermost live `torch.func` transform on
    this thread, or None where none is."""
    stack = transform_stack()
    return stack[-1][0] if stack else None


def forward_mode_depth() -> int:
    """How many forward-mode `torch.func` transforms (`jvp`, `jacfwd`) are live on this
    thread's interpreter stack: 2 or more is forward mode over forward mode, where torch runs
    an `autograd.Function`'s `jvp` rule outside the outer transforms (its second-order
    tangent comes out zero), so tfun's Functions with a `jvp` rule avoid it there."""
    return sum(kind == "Jvp" for kind, _ in transform_stack())


def in_functorch_transform() -> bool:
    """Whether eager code runs inside a `torch.func` transform (its interpreter stack is not
    empty). Not meaningful while tracing: Dynamo models the stack itself."""
    peek = _compat.peek_interpreter_stack
    return peek is not None and peek() is not None


def in_op_recording_mode() -> bool:
    """Whether eager code runs under a torch function mode that records each op it sees (an
    eager `tfun.checkpoint` run: the mode numbers ops to replay the saved ones). A compiled
    graph would run its ops past such a mode, and torch 2.11's Dynamo fails its own guard on
    the mode's counter ("Guard failed on the same frame it was created"): `tfun.jit` runs
    the function eagerly there. A mode says so with `tfun_records_ops = True`."""
    depth = getattr(torch._C, "_len_torch_function_stack", None)
    if depth is not None and depth() == 0:  # the common case, without building the stack's list
        return False
    stack_of = getattr(torch.overrides, "_get_current_function_mode_stack", None)
    if stack_of is None:  # pragma: no cover - every supported torch has it
        return False
    return any(getattr(m, "tfun_records_ops", False) for m in stack_of())


def functorch_level(t: torch.Tensor) -> int:
    """The `torch.func` level a tensor is wrapped at (-1 for a plain tensor)."""
    get = _compat.maybe_get_level
    return -1 if get is None else int(get(t))


_TRACING_CONTEXT: list[Callable[[], object | None]] = []  # `TracingContext.try_get`, once imported


def current_trace() -> object | None:
    """The compilation being traced (Dynamo's `TracingContext`, one per traced graph, a new
    one when Dynamo restarts a trace), or None: the key of trace-time state that must not
    outlive its trace (a trace that raises skips its cleanup). Plain Python at trace time:
    traced code must call it through a Dynamo escape hatch. Also asked eagerly, once per
    custom function call (`_custom_derivatives._state`): the lookup is kept."""
    if not _TRACING_CONTEXT:
        _TRACING_CONTEXT.append(importlib.import_module("torch._guards").TracingContext.try_get)
    return _TRACING_CONTEXT[0]()


#: An autocast state: per device type, (device type, enabled, dtype); and whether the cast cache is on.
AutocastState = tuple[tuple[tuple[str, bool, torch.dtype], ...], bool]


def autocast_state(devices: Iterable[torch.device | str] = ()) -> AutocastState:
    """The `torch.autocast` state for the CPU and the device types of `devices`: what a
    computation run again later (a checkpoint's recompute, a custom rule run in the backward)
    must run under to compute what the first run did. A backward runs outside the forward's
    `torch.autocast` block in the usual mixed-precision loop (`.backward()` after it)."""
    kinds = ["cpu"]
    for d in devices:
        kind = d if isinstance(d, str) else d.type
        if kind not in kinds and torch.amp.is_autocast_available(kind):
            kinds.append(kind)
    per = tuple((k, bool(torch.is_autocast_enabled(k)), torch.get_autocast_dtype(k)) for k in kinds)
    return per, bool(torch.is_autocast_cache_enabled())


@contextlib.contextmanager
def autocast_restored(state: AutocastState | None) -> Iterator[None]:
    """Run the block under the autocast `state` (`autocast_state`), whatever is on now: enabled
    where it was, disabled where it was not. None: the current state."""
    if state is None:
        yield
        return
    per, cache = state
    with contextlib.ExitStack() as stack:
        for kind, enabled, dtype in per:
            stack.enter_context(torch.autocast(device_type=kind, dtype=dtype, enabled=enabled, cache_enabled=cache))
        yield
