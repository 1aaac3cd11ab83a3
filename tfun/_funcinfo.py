"""Naming a user's function the way JAX does: `name at file:line`."""

from __future__ import annotations

import functools
import inspect
import os
import types
import warnings
from typing import Any, Callable


def unwrap_callable(fn: Any) -> Any:
    """Follow partials, bound methods, `nn.Module`s and callable objects to a function."""
    seen = 0
    while seen < 16:
        seen += 1
        if isinstance(fn, types.FunctionType) and callable(getattr(fn, "__wrapped__", None)):
            # a `functools.wraps` wrapper (tfun.grad, tfun.vmap, tfun.checkpoint, ...) of any
            # callable (a function, a bound method, an nn.Module): name the user's function
            fn = fn.__wrapped__
        elif isinstance(fn, functools.partial):
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            fn = fn.__func__
        elif isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)):
            return fn
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        elif not isinstance(fn, type) and hasattr(type(fn), "forward") and hasattr(fn, "_call_impl"):
            fn = type(fn).forward  # an nn.Module
        elif not isinstance(fn, type) and hasattr(type(fn), "__call__"):
            fn = type(fn).__call__
        else:
            return fn
    return fn


def fn_code(fn: Any) -> types.CodeType | None:
    """The code object behind `fn`, or None for builtins and other code-less callables."""
    return getattr(unwrap_callable(fn), "__code__", None)


def describe(fn: Callable[..., Any]) -> str:
    """`name at file:line` for a user function; the repr of anything else."""
    base = unwrap_callable(fn)
    code = getattr(base, "__code__", None)
    name = getattr(base, "__name__", None) or getattr(base, "__qualname__", None) or repr(fn)
    if code is None:
        return str(name)
    return describe_code(code, str(name))


def location(fn: Callable[..., Any]) -> tuple[str, int] | None:
    """`(file, first line)` of a user function's code, or None (a builtin, a callable object
    without code)."""
    code = getattr(unwrap_callable(fn), "__code__", None)
    return None if code is None else (str(code.co_filename), int(code.co_firstlineno))


def warn_at(where: tuple[str, int] | None, message: str, category: type[Warning]) -> None:
    """`message` as a `category` warning at `where` (a user function's `location`), whatever
    the call stack: tfun's trace-time warnings are issued from inside torch.compile's tracing,
    whose frames say nothing to the user. Plain Python: call it from code Dynamo does not
    trace (a `_hop.assume_constant` function, given `location(fn)` as a constant)."""
    filename, lineno = where if where is not None else ("<unknown>", 0)
    warnings.warn_explicit(message, category, filename, lineno)


def describe_code(code: types.CodeType, name: str | None = None) -> str:
    """`name at file:line` for a code object (the path relative to the working directory
    when it lies below it)."""
    return f"{name or code.co_name} at {_display_path(code.co_filename)}:{code.co_firstlineno}"


def _display_path(filename: str) -> str:
    """`filename` relative to the working directory when it lies below it.

    Marked as a constant function for Dynamo (the marker `torch._dynamo.assume_constant_result`
    sets): under `tfun.jit` an error message is formatted while Dynamo traces, and Dynamo
    cannot trace `os.getcwd`; with the marker it runs this as plain Python on the constant
    file name, so a message names the same `file:line` eagerly and under `tfun.jit`.
    """
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel


_display_path._dynamo_marked_constant = True  # type: ignore[attr-defined]


def short_name(fn: Callable[..., Any]) -> str:
    base = unwrap_callable(fn)
    return str(getattr(base, "__name__", None) or type(fn).__name__)


def callable_param_count(fn: Callable[..., Any]) -> int | None:
    """How many positional arguments `fn` accepts, or None if unknown or variadic."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    n = 0
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            return None
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            n += 1
    return n
