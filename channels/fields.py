"""Field checkers: one small function per dataclass field, compiled from its type hint.

At registration every field's type hint becomes a `FieldCheck`: a function that takes
the value cbor2 produced (inside a tag cbor2 yields tuples and frozendicts) and returns
the value the dataclass receives, or raises `DecodeError`. Compiling once keeps decoding
to a handful of `type(x) is T` tests per field, and nothing outside the hint is ever
constructed.

Supported hints: int, float (accepts CBOR integers), str, bytes, bool, None,
`X | None` / `Optional[X]`, `tuple[X, ...]`, `tuple[X, Y]`, `list[X]`, `dict[str, X]`,
registered dataclasses, `enum.IntEnum` / `enum.StrEnum` subclasses, `numpy.ndarray`,
`torch.Tensor`. A `tuple[int, ...]` / `list[int]` field also accepts a one-dimensional
integer typed array (how `writer` sends long int sequences) and returns its ints.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import DecodeError, RegistrationError
from .typed_arrays import DecodedArray

FieldCheck = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Rejected:
    """A message whose fields failed their checks; kept in place so a batch can go on."""

    type_name: str
    reason: str


def _describe(value: object) -> str:
    if isinstance(value, Rejected):
        return f"an invalid {value.type_name} ({value.reason})"
    return type(value).__name__


def _exact(expected: type) -> FieldCheck:
    def check(value: Any) -> Any:
        if type(value) is not expected:
            raise DecodeError(f"expected {expected.__name__}, got {_describe(value)}")
        return value

    return check


def _float(value: Any) -> float:
    kind = type(value)
    if kind is float:
        return value
    if kind is int:
        return float(value)
    raise DecodeError(f"expected float, got {_describe(value)}")


def _none(value: Any) -> None:
    if value is not None:
        raise DecodeError(f"expected None, got {_describe(value)}")


def _optional(inner: FieldCheck) -> FieldCheck:
    def check(value: Any) -> Any:
        return None if value is None else inner(value)

    return check


def _elements(inner: FieldCheck, kind: str) -> Callable[[Any], list[Any]]:
    def check_all(value: Any) -> list[Any]:
        if type(value) is not tuple and type(value) is not list:
            raise DecodeError(f"expected an array for {kind}, got {_describe(value)}")
        out = []
        for index, item in enumerate(value):
            try:
                out.append(inner(item))
            except DecodeError as error:
                raise DecodeError(f"[{index}]: {error.reason}") from None
        return out

    return check_all


def _variadic_tuple(inner: FieldCheck, unchanged: frozenset[type], is_int: bool) -> FieldCheck:
    check_all = _elements(inner, "tuple")

    def check(value: Any) -> tuple[Any, ...]:
        # Fast path: every item already has a type its check returns unchanged (one
        # C-level pass over the types instead of a check call per item).
        if type(value) is tuple and set(map(type, value)) <= unchanged:
            return value
        if is_int and type(value) is DecodedArray:
            return tuple(value.ints())
        return tuple(check_all(value))

    return check


def _list(inner: FieldCheck, unchanged: frozenset[type], is_int: bool) -> FieldCheck:
    check_all = _elements(inner, "list")

    def check(value: Any) -> list[Any]:
        if type(value) is tuple and set(map(type, value)) <= unchanged:
            return list(value)
        if is_int and type(value) is DecodedArray:
            return value.ints()
        return check_all(value)

    return check


def _fixed_tuple(inners: tuple[FieldCheck, ...]) -> FieldCheck:
    def check(value: Any) -> tuple[Any, ...]:
        if type(value) is not tuple and type(value) is not list:
            raise DecodeError(f"expected an array for tuple, got {_describe(value)}")
        if len(value) != len(inners):
            raise DecodeError(f"expected {len(inners)} tuple items, got {len(value)}")
        out = []
        for index, (inner, item) in enumerate(zip(inners, value, strict=True)):
            try:
                out.append(inner(item))
            except DecodeError as error:
                raise DecodeError(f"[{index}]: {error.reason}") from None
        return tuple(out)

    return check


def _dict(inner: FieldCheck) -> FieldCheck:
    def check(value: Any) -> dict[str, Any]:
        if not isinstance(value, typing.Mapping) or isinstance(value, DecodedArray):
            raise DecodeError(f"expected a map, got {_describe(value)}")
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise DecodeError(f"map keys must be str, got {_describe(key)}")
            try:
                out[key] = inner(item)
            except DecodeError as error:
                raise DecodeError(f"[{key!r}]: {error.reason}") from None
        return out

    return check


def _enum(cls: type[enum.Enum], carrier: type) -> FieldCheck:
    def check(value: Any) -> Any:
        if type(value) is not carrier:
            raise DecodeError(
                f"expected {cls.__name__} as {carrier.__name__}, got {_describe(value)}"
            )
        try:
            return cls(value)
        except ValueError:
            raise DecodeError(f"{value!r} is not a {cls.__name__}") from None

    return check


def _message(cls: type) -> FieldCheck:
    def check(value: Any) -> Any:
        if type(value) is not cls:
            raise DecodeError(f"expected {cls.__name__}, got {_describe(value)}")
        return value

    return check


def _numpy(value: Any) -> np.ndarray:
    if type(value) is not DecodedArray:
        raise DecodeError(f"expected an array (tag 40), got {_describe(value)}")
    return value.to_numpy()


def _torch(value: Any) -> Any:
    if type(value) is not DecodedArray:
        raise DecodeError(f"expected a tensor (tag 40), got {_describe(value)}")
    return value.to_torch()


def _is_torch_tensor_type(hint: object) -> bool:
    module = getattr(hint, "__module__", "")
    return module.startswith("torch") and getattr(hint, "__name__", "") == "Tensor"


_EXACT = {int: _exact(int), str: _exact(str), bytes: _exact(bytes), bool: _exact(bool)}


def field_kind(hint: Any) -> str:
    """How `writer` writes a field: "str", "int", "ints" (sent as a typed array when
    long: `tuple[int, ...]` / `list[int]`) or "any"."""
    if hint is str or hint is int:
        return hint.__name__
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if (origin is tuple and args == (int, Ellipsis)) or (origin is list and args == (int,)):
        return "ints"
    return "any"


def _unchanged_types(hint: Any) -> frozenset[type]:
    """The value types that `hint`'s check returns as they are (maybe none)."""
    if hint in _EXACT or hint is float or _is_message_type(hint):
        return frozenset({hint})
    if hint is None or hint is type(None):
        return frozenset({type(None)})
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        others = [arg for arg in args if arg is not type(None)]
        if len(others) == 1 and len(args) == 2:
            return _unchanged_types(others[0]) | {type(None)}
    return frozenset()


def exact_type(hint: Any) -> type | None:
    """The one type whose values a field's check returns unchanged, if there is one.

    The message decoder skips the check for values of exactly this type.
    """
    unchanged = _unchanged_types(hint)
    return next(iter(unchanged)) if len(unchanged) == 1 else None


def _is_message_type(hint: Any) -> bool:
    # Decoded bottom-up, a nested message is already an instance of its class.
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def compile_check(hint: Any, where: str) -> FieldCheck:
    """The checker for one type hint; `where` names the field in registration errors."""
    if hint in _EXACT:
        return _EXACT[hint]
    if hint is float:
        return _float
    if hint is None or hint is type(None):
        return _none
    if hint is np.ndarray:
        return _numpy
    if _is_torch_tensor_type(hint):
        return _torch
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        others = [arg for arg in args if arg is not type(None)]
        if len(others) == 1 and len(args) == 2:
            return _optional(compile_check(others[0], where))
        raise RegistrationError(f"{where}: only `X | None` unions are supported, got {hint}")
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _variadic_tuple(
                compile_check(args[0], where), _unchanged_types(args[0]), args[0] is int
            )
        if not args or Ellipsis in args:
            raise RegistrationError(f"{where}: tuple hints need item types, got {hint}")
        return _fixed_tuple(tuple(compile_check(arg, where) for arg in args))
    if origin is list and len(args) == 1:
        return _list(compile_check(args[0], where), _unchanged_types(args[0]), args[0] is int)
    if origin is dict and len(args) == 2:
        if args[0] is not str:
            raise RegistrationError(f"{where}: dict keys must be str, got {hint}")
        return _dict(compile_check(args[1], where))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        if issubclass(hint, enum.IntEnum):
            return _enum(hint, int)
        if issubclass(hint, enum.StrEnum):
            return _enum(hint, str)
        raise RegistrationError(f"{where}: enums must be IntEnum or StrEnum, got {hint}")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _message(hint)
    raise RegistrationError(f"{where}: unsupported field type {hint!r}")
