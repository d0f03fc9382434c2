"""The hand-written CBOR encoder behind `Codec.encode`.

cbor2's encoder costs about a microsecond per container and per tag, which made a
256-request step output cost milliseconds. Messages have declared field types, so the
registry compiles one writer per class (see `registry`) and encoding is a flat loop that
appends byte chunks to a list, joined once at the end. The bytes are plain CBOR, exactly
what cbor2 reads back: `tag([field0, field1, ...])`.

Two encodings go beyond "what cbor2 would write":

* A field declared `tuple[int, ...]` or `list[int]` holding at least
  `MIN_TYPED_INT_SEQUENCE` plain ints travels as ONE RFC 8746 little-endian typed array
  (uint32, else int64, else uint64: the first that holds every value) instead of an
  array of integers; the receiver turns it back into a tuple/list of ints (see `fields`).
  Shorter sequences, or ones holding anything but `int`, are written element by element.
* numpy arrays and torch tensors are written as `40([dims, typed array])` with the array's
  buffer as its own chunk, so the only copy on the way out is the final join.

Anything outside the supported field types raises `EncodeError`.
"""

from __future__ import annotations

import array
import enum
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import EncodeError
from .typed_arrays import TAG_DTYPE_MARKER, TAG_MULTI_DIM_ARRAY, typed_array_tag

Chunks = list[bytes | memoryview]
Write = Callable[[Chunks, Any], None]

MIN_TYPED_INT_SEQUENCE = 8

_PACK_B = struct.Struct(">BB").pack
_PACK_H = struct.Struct(">BH").pack
_PACK_I = struct.Struct(">BI").pack
_PACK_Q = struct.Struct(">BQ").pack
_PACK_DOUBLE = struct.Struct(">Bd").pack
# The one-byte heads (argument < 24) of every major type, precomputed.
_SMALL_HEADS = [[bytes((major << 5 | n,)) for n in range(24)] for major in range(8)]
_UINT = _SMALL_HEADS[0]
_TEXT = _SMALL_HEADS[3]
_NULL, _FALSE, _TRUE = b"\xf6", b"\xf4", b"\xf5"


def head(major: int, argument: int) -> bytes:
    """The initial bytes of a CBOR item: major type and its argument (length, value, tag)."""
    if argument < 24:
        return _SMALL_HEADS[major][argument]
    lead = major << 5
    if argument < 0x100:
        return _PACK_B(lead | 24, argument)
    if argument < 0x10000:
        return _PACK_H(lead | 25, argument)
    if argument < 0x100000000:
        return _PACK_I(lead | 26, argument)
    if argument < 0x10000000000000000:
        return _PACK_Q(lead | 27, argument)
    raise EncodeError(f"{argument} does not fit CBOR's 64-bit argument")


def _write_int(out: Chunks, value: int) -> None:
    if 0 <= value < 24:
        out.append(_UINT[value])
    elif value >= 0:
        out.append(head(0, value))
    elif value >= -0x10000000000000000:
        out.append(head(1, -1 - value))
    else:
        raise EncodeError(f"integer {value} is outside CBOR's 64-bit range")


def _write_str(out: Chunks, value: str) -> None:
    data = value.encode()
    size = len(data)
    out.append(_TEXT[size] if size < 24 else head(3, size))
    out.append(data)


def _write_bytes(out: Chunks, value: bytes) -> None:
    out.append(head(2, len(value)))
    out.append(value)


def _write_float(out: Chunks, value: float) -> None:
    out.append(_PACK_DOUBLE(0xFB, value))


def _write_bool(out: Chunks, value: bool) -> None:
    out.append(_TRUE if value else _FALSE)


def _write_none(out: Chunks, value: None) -> None:
    out.append(_NULL)


# (array typecode, typed-array tag head) in order of preference for int sequences.
_INT_CARRIERS = tuple(
    (code, head(6, typed_array_tag(np.dtype(name))))
    for name, code in (("uint32", "I"), ("int64", "q"), ("uint64", "Q"))
    if array.array(code).itemsize == np.dtype(name).itemsize
)
_ONLY_INT = {int}
_BIG_ENDIAN = sys.byteorder == "big"


def packed_ints(values: tuple[int, ...] | list[int]) -> list[bytes] | None:
    """`values` as typed-array chunks, or None when they are not all plain 64-bit ints."""
    if set(map(type, values)) != _ONLY_INT:
        return None
    for code, tag_head in _INT_CARRIERS:
        try:
            packed = array.array(code, values)
        except OverflowError:
            continue
        if _BIG_ENDIAN:
            packed.byteswap()
        data = packed.tobytes()
        return [tag_head, head(2, len(data)), data]
    return None


def _write_ndarray(out: Chunks, value: np.ndarray, marked: str | None = None) -> None:
    if value.dtype == np.bool_:
        _write_ndarray(out, value.view(np.uint8), "bool")
        return
    tag = typed_array_tag(value.dtype)
    little = np.ascontiguousarray(value.astype(value.dtype.newbyteorder("<"), copy=False))
    if marked is not None:
        out.append(head(6, TAG_DTYPE_MARKER))
        out.append(b"\x82")
        _write_str(out, marked)
    out.append(head(6, TAG_MULTI_DIM_ARRAY))
    out.append(b"\x82")
    # Dims from `value`: np.ascontiguousarray turns a 0-d array into a 1-d one.
    out.append(head(4, value.ndim))
    for size in value.shape:
        _write_int(out, size)
    out.append(head(6, tag))
    out.append(head(2, little.nbytes))
    out.append(memoryview(little.reshape(-1)).cast("B"))


def _write_tensor(out: Chunks, value: Any) -> None:
    import torch

    host = value.detach().to("cpu").contiguous()
    if host.dtype == torch.bfloat16:
        _write_ndarray(out, host.view(torch.uint16).numpy(), "bfloat16")
    else:
        _write_ndarray(out, host.numpy())


# How `CborWriter.add_message` writes one field value `v`, by declared kind.
_FIELD_SOURCE: dict[str, list[str]] = {
    "str": [
        "    if type(v) is str:",
        "        data = v.encode()",
        "        size = len(data)",
        "        append(TEXT[size] if size < 24 else head(3, size))",
        "        append(data)",
        "    else:",
        "        write_any(out, v)",
    ],
    "int": [
        "    if type(v) is int and 0 <= v < 24:",
        "        append(UINT[v])",
        "    else:",
        "        write_any(out, v)",
    ],
    "ints": [
        "    if type(v) is tuple or type(v) is list:",
        "        packed = len(v) >= MIN_PACKED and packed_ints(v)",
        "        if packed:",
        "            out += packed",
        "        else:",
        "            write_sequence(out, v)",
        "    else:",
        "        write_any(out, v)",
    ],
    "any": [
        "    if v is None:",
        "        append(NULL)",
        "    else:",
        "        write_any(out, v)",
    ],
}


class CborWriter:
    """Writes registered messages and the values their fields may hold."""

    def __init__(self) -> None:
        self._by_type: dict[type, Write] = {
            int: _write_int,
            str: _write_str,
            bytes: _write_bytes,
            float: _write_float,
            bool: _write_bool,
            type(None): _write_none,
            tuple: self._write_sequence,
            list: self._write_sequence,
            dict: self._write_map,
            np.ndarray: _write_ndarray,
        }

    def add_message(self, cls: type, tag: int, fields: tuple[tuple[str, str], ...]) -> None:
        """Compile the writer of one registered class: its tag, then its fields in order.

        `fields` pairs each field name with its kind from `fields.field_kind`.

        The writer is generated straight-line code (as `dataclasses` generates `__init__`):
        each field is read as an attribute and, when its value has the declared simple
        type, written inline; anything else goes through `write_any`.
        """
        namespace: dict[str, Any] = {
            "prefix": head(6, tag) + head(4, len(fields)),
            "write_any": self.write_any,
            "head": head,
            "TEXT": _TEXT,
            "UINT": _UINT,
            "MIN_PACKED": MIN_TYPED_INT_SEQUENCE,
            "packed_ints": packed_ints,
            "write_sequence": self._write_sequence,
            "NULL": _NULL,
        }
        lines = ["def write_message(out, value):", "    append = out.append", "    append(prefix)"]
        for name, kind in fields:
            lines.append(f"    v = value.{name}")
            lines += _FIELD_SOURCE[kind]
        # The source is built from field names (identifiers) and the fixed snippets above.
        exec("\n".join(lines), namespace)
        self._by_type[cls] = namespace["write_message"]

    def encode(self, message: Any) -> bytes:
        write = self._by_type.get(type(message))
        if write is None:
            raise EncodeError(f"{type(message).__qualname__} is not a registered message type")
        out: Chunks = []
        write(out, message)
        return b"".join(out)

    def write_any(self, out: Chunks, value: Any) -> None:
        write = self._by_type.get(type(value))
        if write is not None:
            write(out, value)
        elif isinstance(value, enum.Enum):
            self.write_any(out, value.value)
        elif type(value).__module__.startswith("torch") and _is_tensor(value):
            _write_tensor(out, value)
        elif isinstance(value, np.ndarray):
            _write_ndarray(out, value)
        else:
            raise EncodeError(f"{type(value).__qualname__} values cannot be sent (not registered)")

    def _write_sequence(self, out: Chunks, value: tuple[Any, ...] | list[Any]) -> None:
        out.append(head(4, len(value)))
        by_type = self._by_type
        append = out.append
        for item in value:
            # Strings and nulls (request ids, finish reasons) inline: columns are long.
            kind = type(item)
            if kind is str:
                data = item.encode()
                size = len(data)
                append(_TEXT[size] if size < 24 else head(3, size))
                append(data)
            elif item is None:
                append(_NULL)
            else:
                write = by_type.get(kind)
                if write is None:
                    self.write_any(out, item)
                else:
                    write(out, item)

    def _write_map(self, out: Chunks, value: dict[Any, Any]) -> None:
        out.append(head(5, len(value)))
        for key, item in value.items():
            self.write_any(out, key)
            self.write_any(out, item)


def _is_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)
