"""Executor methods that `Engine.collective_rpc` may call on every rank.

Only a method its class marks with `@remote_callable` can be called by name: no other
attribute, no arbitrary code. Arguments and results are plain data (None, bool, int,
float, str, bytes, lists, tuples and str-keyed dicts of those), which travel through
cbor2 as they are (`values`), never pickled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "__wavecore_remote_callable__"


def remote_callable(method: F) -> F:
    """Mark an executor method as callable through `collective_rpc`."""
    setattr(method, _MARK, True)
    return method


def remote_method(executor: object, name: str) -> Callable[..., Any]:
    """The bound method `name` of `executor` if its class marks it remote, else
    `LookupError` naming the method and the ones that are."""
    attribute = getattr(type(executor), name, None) if isinstance(name, str) else None
    if attribute is None or not getattr(attribute, _MARK, False):
        raise LookupError(
            f"{type(executor).__name__} has no remotely callable method {name!r} "
            f"(callable: {', '.join(remote_methods(executor)) or 'none'})"
        )
    return getattr(executor, name)  # type: ignore[no-any-return]


def remote_methods(executor: object) -> list[str]:
    kind = type(executor)
    return sorted(name for name in dir(kind) if getattr(getattr(kind, name, None), _MARK, False))
