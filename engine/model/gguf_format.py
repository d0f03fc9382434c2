"""Reading the header of a GGUF file: its key/value metadata and its tensor table.

A GGUF file starts with a little-endian header (magic `GGUF`, version, tensor count,
key/value count), then the key/value pairs, then one description per tensor (name,
dimensions, type code, offset), then the tensor data, aligned to `general.alignment`
(32 bytes by default). Each pair is a length-prefixed UTF-8 key, a uint32 type code
and a value; arrays carry an element type and a count.

This is the engine's one GGUF parser: the tokenizer needs only the metadata
(`read_gguf_metadata`), the model runtime needs the metadata and where each tensor's
bytes lie (`read_gguf_header`). `gguf.GGUFReader` would give the same facts, but it
builds a numpy view for every string of every array and every tensor, which takes
seconds for a 49k-token vocabulary; this reader takes a fraction of that. `keys`
restricts which values are decoded (others are skipped by length), so a caller
wanting one scalar pays little. Tensor bytes are not read here: the caller maps the
file and slices each tensor at `GGUFTensorInfo.offset`.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
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
DEFAULT_ALIGNMENT = 32

MetadataValue = int | float | bool | str | list[int] | list[float] | list[bool] | list[str]


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GGUFTensorInfo:
    """One tensor's description. `dims` is in GGUF order: the fastest-varying first."""

    name: str
    dims: tuple[int, ...]
    type_code: int  # a `gguf.GGMLQuantizationType` value
    offset: int  # absolute byte offset of the tensor's data in the file


@dataclass(frozen=True, slots=True, kw_only=True)
class GGUFHeader:
    metadata: dict[str, MetadataValue]
    tensors: tuple[GGUFTensorInfo, ...]
    file_size: int


class _Cursor:
    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data = data
        self.offset = 0
        self.path = path

    def unpack(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            raise GGUFFormatError(f"{self.path}: header runs past the end of the file")
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

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        rank = int(self.unpack("<I"))
        if rank > 8:
            raise GGUFFormatError(f"{self.path}: tensor {name!r} claims {rank} dimensions")
        dims = tuple(int(self.unpack("<Q")) for _ in range(rank))
        type_code = int(self.unpack("<I"))
        offset = int(self.unpack("<Q"))
        return name, dims, type_code, offset


def read_magic(path: Path) -> bytes:
    """The first four bytes of `path` (a GGUF file's are `GGUF_MAGIC`); OSError if unreadable."""
    with path.open("rb") as handle:
        return handle.read(4)


def _parse(
    path: Path, keys: Collection[str] | None, *, with_tensors: bool
) -> tuple[dict[str, MetadataValue], tuple[GGUFTensorInfo, ...], int]:
    with path.open("rb") as file:
        try:
            data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as error:  # an empty file cannot be mapped
            raise GGUFFormatError(f"{path}: not a GGUF file ({error})") from error
    with data:
        if data[:4] != GGUF_MAGIC:
            raise GGUFFormatError(f"{path}: not a GGUF file (magic {bytes(data[:4])!r})")
        cursor = _Cursor(data, path)
        cursor.offset = 4
        version = int(cursor.unpack("<I"))
        if version not in (2, 3):
            raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        tensor_count = int(cursor.unpack("<Q"))
        pair_count = int(cursor.unpack("<Q"))
        metadata: dict[str, MetadataValue] = {}
        alignment = DEFAULT_ALIGNMENT
        for _ in range(pair_count):
            key = cursor.string()
            value_type = int(cursor.unpack("<I"))
            # The alignment is needed to place tensors even when the caller did not ask for it.
            wanted = keys is None or key in keys
            value = cursor.value(value_type, decode=wanted or key == "general.alignment")
            if key == "general.alignment":
                alignment = _checked_alignment(path, value)
            if wanted:
                metadata[key] = value  # type: ignore[assignment]
        if not with_tensors:
            return metadata, (), len(data)
        raw = [cursor.tensor_info() for _ in range(tensor_count)]
        data_start = -(-cursor.offset // alignment) * alignment
        tensors = tuple(
            GGUFTensorInfo(name=name, dims=dims, type_code=code, offset=data_start + offset)
            for name, dims, code, offset in raw
        )
        return metadata, tensors, len(data)


def _checked_alignment(path: Path, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise GGUFFormatError(f"{path}: general.alignment {value!r} is not a power of two")
    return value


def read_gguf_metadata(
    path: str | Path, keys: Collection[str] | None = None
) -> dict[str, MetadataValue]:
    """The metadata of the GGUF file at `path`: all of it, or only `keys` (those present)."""
    metadata, _, _ = _parse(Path(path), keys, with_tensors=False)
    return metadata


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """All metadata of the GGUF file at `path` and the description of every tensor."""
    metadata, tensors, size = _parse(Path(path), None, with_tensors=True)
    return GGUFHeader(metadata=metadata, tensors=tensors, file_size=size)
