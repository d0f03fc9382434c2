"""numpy arrays and torch tensors as RFC 8746 typed arrays.

An array travels as tag 40 (multi-dimensional array, row-major) over a little-endian
typed-array tag: `40([dims, 85(h'...')])` for a float32 array. Two dtypes have no
typed-array tag: `bool` travels as uint8 and `bfloat16` as uint16, each wrapped in
`TAG_DTYPE_MARKER([dtype name, 40([...])])` so that the receiver restores the dtype.

Decoding checks that the dims are non-negative integers whose product matches the
payload length, then wraps the received byte string without copying
(`np.frombuffer` / `torch.frombuffer`). Such arrays are read-only views of the frame: copy
them (`array.copy()`, `tensor.clone()`) before writing in place.

Encoding is done by `writer` (which also sends long int sequences as plain 1-D typed
arrays); this module holds the tag plan and the decoding side. `DecodedArray` keeps the
payload bytes until a field asks for numpy, torch or a list of ints.

torch is optional: it is imported only when a tensor field is registered or a tensor is
decoded; encoding recognises a tensor only if torch is already imported.
"""

from __future__ import annotations

import array
import math
import sys
import warnings
from typing import Any

import cbor2
import numpy as np

from .errors import DecodeError, EncodeError

TAG_MULTI_DIM_ARRAY = 40
# The one application tag for arrays; see `registry` for the whole tag plan.
TAG_DTYPE_MARKER = 30001

# RFC 8746 little-endian (or endian-free) typed-array tags.
_TAG_BY_DTYPE: dict[str, int] = {
    "uint8": 64,
    "uint16": 69,
    "uint32": 70,
    "uint64": 71,
    "int8": 72,
    "int16": 77,
    "int32": 78,
    "int64": 79,
    "float16": 84,
    "float32": 85,
    "float64": 86,
}
_DTYPE_BY_TAG: dict[int, np.dtype[Any]] = {
    tag: np.dtype(name).newbyteorder("<") for name, tag in _TAG_BY_DTYPE.items()
}
# Marked dtypes: the dtype name on the wire -> the carrier dtype it travels as.
_MARKED_CARRIERS = {"bool": "uint8", "bfloat16": "uint16"}
TYPED_ARRAY_TAGS = frozenset(_DTYPE_BY_TAG) | {TAG_MULTI_DIM_ARRAY, TAG_DTYPE_MARKER}
# Integer typed arrays by tag -> the stdlib `array` typecode of the same width here (a
# platform where one is missing cannot receive that dtype into an int sequence).
_INT_CODE_BY_TAG = {
    _TAG_BY_DTYPE[name]: code
    for name, code in (
        ("uint8", "B"),
        ("int8", "b"),
        ("uint16", "H"),
        ("int16", "h"),
        ("uint32", "I"),
        ("int32", "i"),
        ("uint64", "Q"),
        ("int64", "q"),
    )
    if array.array(code).itemsize == np.dtype(name).itemsize
}
_BIG_ENDIAN = sys.byteorder == "big"


class DecodedArray:
    """A received array before the field type decides between numpy, torch or int list.

    It keeps the payload bytes and builds the numpy view only when asked (`array`), so an
    int sequence (see `ints`) never pays for numpy. Built only by `decode_array_tag`,
    after the payload length and dims have been checked against the dtype.
    """

    __slots__ = ("data", "marked_dtype", "shape", "tag")

    def __init__(
        self,
        data: bytes,
        tag: int,  # the RFC 8746 typed-array tag, which names the dtype
        shape: tuple[int, ...] | None = None,
        marked_dtype: str | None = None,  # "bool" or "bfloat16" when the carrier differs
    ) -> None:
        self.data = data
        self.tag = tag
        self.shape = shape  # None: one-dimensional, straight from a typed-array tag
        self.marked_dtype = marked_dtype

    @property
    def dtype(self) -> np.dtype[Any]:
        return _DTYPE_BY_TAG[self.tag]

    @property
    def array(self) -> np.ndarray:
        flat = np.frombuffer(self.data, dtype=self.dtype)
        return flat if self.shape is None else flat.reshape(self.shape)

    def ints(self) -> list[int]:
        """The elements of a one-dimensional integer array as Python ints."""
        code = _INT_CODE_BY_TAG.get(self.tag)
        if code is None or self.marked_dtype is not None:
            raise DecodeError(
                f"expected int, got a typed array of {self.marked_dtype or self.dtype.name}"
            )
        if self.shape is not None and len(self.shape) != 1:
            raise DecodeError(
                f"expected a one-dimensional int array, got {len(self.shape)} dimensions"
            )
        values = array.array(code)
        values.frombytes(self.data)
        if _BIG_ENDIAN:
            values.byteswap()
        return values.tolist()

    def to_numpy(self) -> np.ndarray:
        if self.marked_dtype == "bfloat16":
            raise DecodeError("a bfloat16 array can only be received into a torch.Tensor field")
        if self.marked_dtype == "bool":
            return self.array.view(np.bool_)
        return self.array

    def to_torch(self) -> Any:
        import torch

        carrier = self.array
        with warnings.catch_warnings():
            # The view is read-only by contract (see the module docstring).
            warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
            tensor = torch.from_numpy(carrier)
        if self.marked_dtype == "bfloat16":
            return tensor.view(torch.bfloat16)
        if self.marked_dtype == "bool":
            return tensor.view(torch.bool)
        return tensor


def typed_array_tag(dtype: np.dtype[Any]) -> int:
    """The RFC 8746 little-endian tag for arrays of `dtype` (see `writer`)."""
    tag = _TAG_BY_DTYPE.get(dtype.name)
    if tag is None:
        raise EncodeError(f"arrays of dtype {dtype} cannot be sent (no RFC 8746 tag)")
    return tag


def decode_array_tag(tag: cbor2.CBORTag) -> DecodedArray:
    """Build an array from a typed-array, tag-40 or dtype-marker tag (already inner-decoded)."""
    number, value = tag.tag, tag.value
    if number == TAG_DTYPE_MARKER:
        return _decode_marked(value)
    if number == TAG_MULTI_DIM_ARRAY:
        return _decode_multi_dim(value)
    dtype = _DTYPE_BY_TAG.get(number)
    if dtype is None:
        raise DecodeError(f"typed-array tag {number} is not supported (little-endian only)")
    if type(value) is not bytes:
        raise DecodeError(f"typed-array tag {number} must wrap a byte string")
    if len(value) % dtype.itemsize:
        raise DecodeError(
            f"typed array of {dtype.name}: {len(value)} bytes is not a multiple of {dtype.itemsize}"
        )
    return DecodedArray(value, number)


def _decode_multi_dim(value: object) -> DecodedArray:
    if type(value) is not tuple or len(value) != 2:
        raise DecodeError("tag 40 must wrap [dims, typed array]")
    dims, flat = value
    if type(dims) is not tuple or any(type(d) is not int or d < 0 for d in dims):
        raise DecodeError("tag 40 dims must be an array of non-negative integers")
    if type(flat) is not DecodedArray or flat.marked_dtype is not None or flat.shape is not None:
        raise DecodeError("tag 40 must wrap a typed array")
    size = len(flat.data) // flat.dtype.itemsize
    if math.prod(dims) != size:
        raise DecodeError(f"tag 40 dims {list(dims)} do not match {size} elements")
    return DecodedArray(flat.data, flat.tag, dims)


def _decode_marked(value: object) -> DecodedArray:
    if type(value) is not tuple or len(value) != 2:
        raise DecodeError(f"tag {TAG_DTYPE_MARKER} must wrap [dtype name, array]")
    name, inner = value
    carrier = _MARKED_CARRIERS.get(name) if type(name) is str else None
    if carrier is None:
        raise DecodeError(f"unknown marked dtype {name!r}")
    if type(inner) is not DecodedArray or inner.marked_dtype is not None:
        raise DecodeError(f"tag {TAG_DTYPE_MARKER} must wrap an array")
    if inner.dtype.name != carrier:
        raise DecodeError(f"{name} arrays must travel as {carrier}, got {inner.dtype.name}")
    return DecodedArray(inner.data, inner.tag, inner.shape, name)
