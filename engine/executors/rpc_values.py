"""Plain data as CBOR bytes: the arguments and results of `collective_rpc`.

Only None, bool, int, float, str, bytes, lists/tuples and dicts with str keys travel
(tuples arrive as lists); anything else is refused on both sides, by a `ValueError`
naming where in the value it sits. Decoding refuses every CBOR tag, so nothing but
these types can come out of it.
"""

from __future__ import annotations

from typing import Any

import cbor2

_MAX_DEPTH = 32
_SCALARS = (type(None), bool, int, float, str, bytes)


def encode_values(value: Any, what: str) -> bytes:
    _check(value, what, 0)
    return cbor2.dumps(value)


def decode_values(data: bytes, what: str) -> Any:
    try:
        value = cbor2.loads(data, tag_hook=_refuse_tag)
    except (cbor2.CBORDecodeError, ValueError) as error:
        raise ValueError(f"{what}: not plain CBOR data ({error})") from None
    _check(value, what, 0)
    return value


def _refuse_tag(decoder: object, tag: cbor2.CBORTag) -> Any:
    raise ValueError(f"CBOR tag {tag.tag} is not plain data")


def _check(value: Any, where: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {_MAX_DEPTH} levels")
    if isinstance(value, _SCALARS):
        return
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check(item, f"{where}[{index}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: dict keys must be str, got {key!r}")
            _check(item, f"{where}[{key!r}]", depth + 1)
        return
    raise ValueError(f"{where}: a {type(value).__name__} is not plain data")
