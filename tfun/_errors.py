"""tfun's exception hierarchy and the helpers that format its messages.

Every error tfun raises for bad user input is a `TfunError`. The mismatch errors also
derive from the builtin exception a Python user would expect (`TypeError` for a structure
or tensor mismatch, `RuntimeError` for a side effect, `ValueError`/`TypeError` for a bad
argument), so `except TypeError` keeps working for code ported from JAX.

Messages follow one shape:

    tfun.lax.scan: body carry input and output must have the same pytree structure.
      * carry['h'][1]: input is a tensor, output is a tuple of 2 children
    The body is `step at model.py:12`.
    Revise `step` so that it returns a carry with the structure of `init`.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._compat import record_raised

__all__ = [
    "TfunError",
    "StructureMismatchError",
    "TensorMismatchError",
    "SideEffectError",
    "JitError",
    "ArgumentTypeError",
    "ArgumentValueError",
    "PerformanceWarning",
]


class TfunError(Exception):
    """Base class of every error tfun raises for a program that breaks its rules."""

    def __init__(self, *args: object) -> None:
        # `BaseException.__new__` has set `self.args`. Under Dynamo, which runs this as
        # traced code, the arguments are also recorded where tfun.jit finds them should the
        # installed Dynamo drop them from the error it reports (see `_compat.record_raised`).
        record_raised(type(self).__name__, args)


class StructureMismatchError(TfunError, TypeError):
    """Two pytrees that must have the same structure do not.

    Raised, for example, when a `scan` body returns a carry whose structure differs from
    `init`, or when the branches of a `cond` return different structures.
    """


class TensorMismatchError(TfunError, TypeError):
    """Corresponding tensors of two pytrees differ in dtype, shape or device."""


class SideEffectError(TfunError, RuntimeError):
    """A function given to a control-flow op has a side effect it may not have.

    The forbidden side effects are: mutating a Python object the function did not create
    (list append, dict or set write, attribute assignment), rebinding a global or nonlocal
    name, and writing in place to a tensor the function did not create.
    """


class JitError(TfunError, RuntimeError):
    """`tfun.jit` could not capture a function as one graph (or compile it).

    The message names the user's `file:line` where Dynamo stopped and, where it can, what
    to change (e.g. a graph break inside a body, or a torch limitation to work around).
    """


class ArgumentTypeError(TfunError, TypeError):
    """An argument to a tfun op has the wrong type (e.g. a float index for `switch`)."""


class PerformanceWarning(UserWarning):
    """A program tfun runs correctly, but much slower than it could, with the change that
    would make it fast (e.g. a loop `tfun.jit` unrolls into hundreds of steps because the
    gradient it is in could be differentiated again)."""


class ArgumentValueError(TfunError, ValueError):
    """An argument to a tfun op has a bad value (e.g. `unroll=0`, an axis out of range)."""


def format_message(
    headline: str,
    bullets: Iterable[str] = (),
    *,
    function: str | None = None,
    revise: str | None = None,
) -> str:
    """Assemble a message: headline, one bullet per difference, the function, the fix."""
    lines = [headline]
    lines.extend(f"  * {b}" for b in bullets)
    if function is not None:
        lines.append(f"The function is `{function}`.")
    if revise is not None:
        lines.append(revise)
    return "\n".join(lines)
