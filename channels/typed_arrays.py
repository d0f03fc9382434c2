"""numpy arrays and torch tensors as RFC 8746 typed arrays.

An array travels as tag 40 (multi-dimensional array, row-major) over a little-endian
typed-array tag: `40([dims, 85(h'...')])` for a float32 array. Two dtypes have no
typed-array tag: `bool` travels as uint8 and `bfloat16` as uint16, each wrapped in
`TAG_DTYPE_MARKER([dtype name, 40([...])])` so that the receiver restores the dtype.

Decoding checks that the dims are non-negative integers whose product matches the
payload length, then wraps the received byte string without copying
(`np.frombuffer` / `torch.frombuffer`). Such arrays are read-only views of the frame: copy
them (`array.copy()`, `tensor.clone()`) before writing in place.

torch is optional: it is imported only when a tensor field is registered or a tensor is
decoded; encoding recognises a tensor only if torch is already imported.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class DecodedArray:
    """A received array before the field type decides between numpy and torch."""

    array: np.ndarray
    marked_dtype: str | None = None  # "bool" or "bfloat16" when the carrier differs

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


def _typed_array(array: np.ndarray) -> cbor2.CBORTag:
    name = array.dtype.name
    tag = _TAG_BY_DTYPE.get(name)
    if tag is None:
        raise EncodeError(f"arrays of dtype {array.dtype} cannot be sent (no RFC 8746 tag)")
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return cbor2.CBORTag(
        TAG_MULTI_DIM_ARRAY,
        [list(array.shape), cbor2.CBORTag(tag, np.ascontiguousarray(little).tobytes())],
    )


def encode_numpy(array: np.ndarray) -> cbor2.CBORTag:
    """The CBOR form of a numpy array (bool arrays get a dtype marker)."""
    if array.dtype == np.bool_:
        return cbor2.CBORTag(TAG_DTYPE_MARKER, ["bool", _typed_array(array.view(np.uint8))])
    return _typed_array(array)


def encode_torch(tensor: Any) -> cbor2.CBORTag:
    """The CBOR form of a CPU or device tensor (copied to host memory first)."""
    import torch

    host = tensor.detach().to("cpu").contiguous()
    if host.dtype == torch.bfloat16:
        carrier = host.view(torch.uint16).numpy()
        return cbor2.CBORTag(TAG_DTYPE_MARKER, ["bfloat16", _typed_array(carrier)])
    return encode_numpy(host.numpy())


def is_torch_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


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
    return DecodedArray(np.frombuffer(value, dtype=dtype))


def _decode_multi_dim(value: object) -> DecodedArray:
    if type(value) is not tuple or len(value) != 2:
        raise DecodeError("tag 40 must wrap [dims, typed array]")
    dims, flat = value
    if type(dims) is not tuple or any(type(d) is not int or d < 0 for d in dims):
        raise DecodeError("tag 40 dims must be an array of non-negative integers")
    if not isinstance(flat, DecodedArray) or flat.marked_dtype is not None:
        raise DecodeError("tag 40 must wrap a typed array")
    if math.prod(dims) != flat.array.size:
        raise DecodeError(f"tag 40 dims {list(dims)} do not match {flat.array.size} elements")
    return DecodedArray(flat.array.reshape(dims))


def _decode_marked(value: object) -> DecodedArray:
    if type(value) is not tuple or len(value) != 2:
        raise DecodeError(f"tag {TAG_DTYPE_MARKER} must wrap [dtype name, array]")
    name, inner = value
    carrier = _MARKED_CARRIERS.get(name) if type(name) is str else None
    if carrier is None:
        raise DecodeError(f"unknown marked dtype {name!r}")
    if not isinstance(inner, DecodedArray) or inner.marked_dtype is not None:
        raise DecodeError(f"tag {TAG_DTYPE_MARKER} must wrap an array")
    if inner.array.dtype.name != carrier:
        raise DecodeError(f"{name} arrays must travel as {carrier}, got {inner.array.dtype.name}")
    return DecodedArray(inner.array, name)
