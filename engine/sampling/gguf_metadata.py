"""Reading the key/value metadata at the head of a GGUF file, and nothing else.

A GGUF file starts with a little-endian header (magic `GGUF`, version, tensor count,
key/value count), then the key/value pairs, then the tensor descriptions and data.
Each pair is a length-prefixed UTF-8 key, a uint32 type code and a value; arrays carry
an element type and a count. The tokenizer lives entirely in these pairs, so this
reader parses only them and stops where the tensor descriptions begin.

`gguf.GGUFReader` would give the same values, but it also builds a numpy view for
every string of every array and every tensor, which takes seconds for a 49k-token
vocabulary; this reader takes a fraction of that. `keys` restricts which values are
decoded (others are skipped by length), so a caller wanting one scalar pays little.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
_STRING = 8
_ARRAY = 9
_SCALARS: dict[int, str] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}

MetadataValue = int | float | bool | str | list[int] | list[float] | list[bool] | list[str]


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


class _Cursor:
    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data = data
        self.offset = 0
        self.path = path

    def unpack(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            raise GGUFFormatError(f"{self.path}: metadata runs past the end of the file")
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += size
        return value

    def string_bytes(self) -> bytes:
        length = int(self.unpack("<Q"))
        end = self.offset + length
        if end > len(self.data):
            raise GGUFFormatError(f"{self.path}: a string runs past the end of the file")
        raw = self.data[self.offset : end]
        self.offset = end
        return raw

    def string(self) -> str:
        return self.string_bytes().decode("utf-8", errors="replace")

    def value(self, value_type: int, *, decode: bool) -> MetadataValue | None:
        if value_type == _STRING:
            raw = self.string_bytes()
            return raw.decode("utf-8", errors="replace") if decode else None
        if value_type == _ARRAY:
            return self.array(decode=decode)
        fmt = _SCALARS.get(value_type)
        if fmt is None:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {value_type}")
        return self.unpack(fmt)

    def array(self, *, decode: bool) -> list | None:
        element_type = int(self.unpack("<I"))
        count = int(self.unpack("<Q"))
        if element_type == _STRING:
            strings = [self.string_bytes() for _ in range(count)]
            return [s.decode("utf-8", errors="replace") for s in strings] if decode else None
        if element_type == _ARRAY:
            nested = [self.array(decode=decode) for _ in range(count)]
            return nested if decode else None
        fmt = _SCALARS.get(element_type)
        if fmt is None:
            raise GGUFFormatError(f"{self.path}: unknown array element type {element_type}")
        size = struct.calcsize(fmt) * count
        if self.offset + size > len(self.data):
            raise GGUFFormatError(f"{self.path}: an array runs past the end of the file")
        values = None
        if decode:
            values = np.frombuffer(self.data, dtype=np.dtype(fmt), count=count, offset=self.offset)
            values = values.tolist()
        self.offset += size
        return values


def read_gguf_metadata(
    path: str | Path, keys: Collection[str] | None = None
) -> dict[str, MetadataValue]:
    """The metadata of the GGUF file at `path`: all of it, or only `keys` (those present)."""
    path = Path(path)
    with path.open("rb") as file:
        try:
            data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as error:  # an empty file cannot be mapped
            raise GGUFFormatError(f"{path}: not a GGUF file ({error})") from error
    with data:
        if data[:4] != _MAGIC:
            raise GGUFFormatError(f"{path}: not a GGUF file (magic {bytes(data[:4])!r})")
        cursor = _Cursor(data, path)
        cursor.offset = 4
        version = int(cursor.unpack("<I"))
        if version not in (2, 3):
            raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        cursor.unpack("<Q")  # tensor count: the tensors are not read here
        pair_count = int(cursor.unpack("<Q"))
        metadata: dict[str, MetadataValue] = {}
        for _ in range(pair_count):
            key = cursor.string()
            value_type = int(cursor.unpack("<I"))
            wanted = keys is None or key in keys
            value = cursor.value(value_type, decode=wanted)
            if wanted:
                metadata[key] = value  # type: ignore[assignment]
        return metadata
