"""Bounds on the work one HTTP request can ask for, and on the text it may carry.

A 5 KB body once asked for 128,000 engine requests (`prompt` x `n`), 90,000 stop strings
cost every token of every other client, a 100,000-deep JSON body was a 500
(RecursionError), and a lone surrogate (`"\\ud800"` is valid JSON) a 500 once it reached
the tokenizer or the wire. Each is refused here with a 400 naming the field:

* `check_depth`: nesting deeper than `MAX_JSON_DEPTH`, found by a scan of the bytes
  before the parser recurses;
* `check_text`: any string (or key) of the body that is not valid Unicode;
* `check_work`: more than `max_requests_per_call` engine requests, more than
  `MAX_STOP_STRINGS` stop strings or `MAX_STOP_CHARS` characters of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from wavecore.engine.serve.errors import APIError, bad_field

MAX_JSON_DEPTH = 32
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 4096
DEFAULT_MAX_REQUESTS_PER_CALL = 64

_OPEN, _CLOSE, _QUOTE, _ESCAPE = b"[{", b"]}", ord('"'), ord("\\")


def check_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON nested deeper than `limit` (arrays and objects), strings skipped."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return  # cannot nest deeper than it has brackets: no scan (most bodies)
    depth = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == _ESCAPE:
                escaped = True
            elif byte == _QUOTE:
                in_string = False
        elif byte == _QUOTE:
            in_string = True
        elif byte in _OPEN:
            depth += 1
            if depth > limit:
                raise APIError(
                    400,
                    f"the request body nests arrays and objects deeper than {limit} levels",
                    code="too_deep",
                )
        elif byte in _CLOSE:
            depth -= 1


def check_text(body: Any, where: str = "") -> None:
    """Every string and key of the parsed body must be encodable as UTF-8."""
    if isinstance(body, str):
        try:
            body.encode("utf-8")
        except UnicodeEncodeError as error:
            raise bad_field(
                where or "body",
                f"is not valid Unicode text: a lone surrogate at position {error.start}",
            ) from None
    elif isinstance(body, dict):
        for key, value in body.items():
            check_text(key, f"{where} key" if where else "key")
            check_text(value, f"{where}.{key}" if where else str(key))
    elif isinstance(body, list):
        for index, value in enumerate(body):
            check_text(value, f"{where}[{index}]")


def check_work(prompts: int, n: int, stop: Iterable[str], *, max_requests_per_call: int) -> None:
    """One call's engine requests (`prompts` x `n`) and stop strings within bounds."""
    if prompts * n > max_requests_per_call:
        raise bad_field(
            "n" if n > 1 else "prompt",
            f"{prompts} prompt(s) x n={n} is {prompts * n} generations; at most "
            f"{max_requests_per_call} per call (--max-requests-per-call)",
        )
    stop = tuple(stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_field("stop", f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS}")
    if sum(map(len, stop)) > MAX_STOP_CHARS:
        raise bad_field("stop", f"the stop strings exceed {MAX_STOP_CHARS} characters in all")
