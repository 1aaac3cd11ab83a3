"""Run-time checking of the jaxtyping annotations of tfun.nn's methods, with typeguard.

typeguard's `@typechecked` re-compiles a function's source and misreads jaxtyping's dimension
strings, so this wrapper checks each annotated argument and the return value with
`typeguard.check_type` inside one `jaxtyping.jaxtyped` context (dimension names bind across
all of them, as the decorator would).
"""

from __future__ import annotations

import functools
import inspect
import typing

import typeguard
from jaxtyping import jaxtyped

_CACHE: dict = {}


def checked(fn):
    if fn in _CACHE:
        return _CACHE[fn]
    hints = typing.get_type_hints(fn)
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        with jaxtyped("context"):
            for name, value in bound.arguments.items():
                if name in hints:
                    typeguard.check_type(value, hints[name])
            out = fn(*args, **kwargs)
            if "return" in hints:
                typeguard.check_type(out, hints["return"])
        return out

    _CACHE[fn] = wrapper
    return wrapper
