"""Arguments a caller can get wrong in any engine, refused the same way at every dp size.

One engine keeps its requests in this process and another sends them to rank processes
over the wire, where text must be valid UTF-8: a lone surrogate that one engine would
tokenize and the other fail to encode (in a background task, taking the engine down)
is refused here, on the caller's own call, for both. So are the values Python would
otherwise reject with a bare `TypeError` (an unhashable request id) or let through
unnoticed (bytes taken as token ids, a NaN timeout).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from wavecore.engine.errors import InvalidRequestError


def check_text(value: str, what: str) -> None:
    """`value` must be encodable as UTF-8 (no lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(
            f"{what} is not valid Unicode text: {value[error.start : error.end]!r} at "
            f"position {error.start} (a lone surrogate) cannot be encoded"
        ) from None


def check_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
    check_text(request_id, "request_id")
    return request_id


def check_prompt(prompt: object) -> None:
    """What tokenizing cannot catch the same way everywhere: bytes, and text that is not
    valid Unicode (in a prompt or in any string of a chat message)."""
    if isinstance(prompt, bytes | bytearray | memoryview):
        raise InvalidRequestError(
            f"a prompt is text, a list of chat messages or a list of token ids, not "
            f"{type(prompt).__name__} (decode it first)"
        )
    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
    elif isinstance(prompt, list | tuple):
        for number, message in enumerate(prompt):
            if isinstance(message, Mapping):
                for key, value in message.items():
                    if isinstance(value, str):
                        check_text(value, f"chat message {number} {key!r}")


def check_params_text(params: object) -> None:
    """Every string in the sampling parameters (stop strings and any other) must travel."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        for field in dataclasses.fields(params):
            _check_strings(getattr(params, field.name), f"params.{field.name}")


def _check_strings(value: Any, where: str) -> None:
    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_strings(item, f"{where}[{index}]")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_strings(key, f"{where} key")
            _check_strings(item, f"{where}[{key!r}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _check_strings(getattr(value, field.name), f"{where}.{field.name}")


def timeout_seconds(value: object, name: str) -> float | None:
    """None, or a number of seconds >= 0 (not NaN, not a bool, not a string)."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or math.isnan(value)
        or value < 0
    ):
        raise InvalidRequestError(f"{name} must be a number of seconds >= 0 or None, got {value!r}")
    return float(value)
