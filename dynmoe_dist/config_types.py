"""Does a value read from TOML fit a dataclass field's annotation? One generic check for every option.

Handles the annotations the run configuration uses: int, float (ints too), str, bool, Optional[X],
List[X], Tuple[X, ...] and fixed-length Tuple[X, Y] (TOML arrays for the last three).
"""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

# Optional[X] and X | None have different origins
_UNIONS = (Union, types.UnionType)

# scalar type -> (one value, several values), for messages like "must be a list of integers"
_KINDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("a string", "strings"),
          bool: ("true or false", "booleans")}


def _scalar_ok(value: Any, kind: type) -> bool:
    # bool is an int subclass: `true` is no integer, and 1 is no boolean.
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def conforms(value: Any, annotation: Any) -> bool:
    """Whether a TOML value fits a field annotation (one of those in the module docstring)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in _UNIONS:
        return value is None or any(conforms(value, a) for a in args if a is not type(None))
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and Ellipsis not in args:
            return len(value) == len(args) and all(conforms(v, a) for v, a in zip(value, args, strict=True))
        return all(conforms(v, args[0]) for v in value)
    if annotation not in _KINDS:  # a new field type: teach this module about it
        raise TypeError(f"config fields of type {annotation!r} are not supported by config_types")
    return _scalar_ok(value, annotation)


def describe(annotation: Any) -> str:
    """'an integer', 'a list of strings', 'a list of 2 numbers', ... for the error message."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in _UNIONS:
        return describe(next(a for a in args if a is not type(None)))
    if origin is tuple and Ellipsis not in args:
        return f"a list of {len(args)} {_KINDS[args[0]][1]}"
    if origin in (list, tuple):
        return f"a list of {_KINDS[args[0]][1]}"
    return _KINDS[annotation][0]
