"""Public error types of tfun. See `tfun._errors` for how messages are laid out."""

from ._errors import ArgumentTypeError as ArgumentTypeError
from ._errors import ArgumentValueError as ArgumentValueError
from ._errors import JitError as JitError
from ._errors import PerformanceWarning as PerformanceWarning
from ._errors import SideEffectError as SideEffectError
from ._errors import StructureMismatchError as StructureMismatchError
from ._errors import TensorMismatchError as TensorMismatchError
from ._errors import TfunError as TfunError

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
