"""Tensors cut into `WeightChunk`s by the front end and made whole again on a rank.

A tensor is flattened (row-major) and sent as slices of at most `max_chunk_bytes`, each
an RFC 8746 typed array (bfloat16 travels as its uint16 bits; `dtype` says so), so a
tensor of any size crosses the channels in frames of bounded size. With no limit (a
rank in this process: nothing is encoded) a tensor is one chunk that is a view of the
caller's memory; the rank's staging copies what it keeps. torch is imported only when
tensors are actually cut or assembled.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from wavecore.engine.errors import WeightUpdateError
from wavecore.engine.weight_messages import WeightChunk

# The dtypes a mapping's tensors may have: those with an RFC 8746 carrier.
SENDABLE_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True, slots=True)
class FlatTensor:
    name: str
    dtype: str  # torch's name, without "torch."
    shape: tuple[int, ...]
    carrier: Any  # a one-dimensional numpy array over the tensor's memory


def flat_tensors(source: Mapping[Any, Any]) -> list[FlatTensor]:
    """Every tensor of `source` ready to cut; `WeightUpdateError` for what cannot travel
    (checked before anything is sent)."""
    import numpy as np
    import torch

    if not source:
        raise WeightUpdateError("update_weights was given an empty mapping")
    flats = []
    for name, tensor in source.items():
        if not isinstance(name, str):
            raise WeightUpdateError(f"tensor names must be str, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in SENDABLE_DTYPES:
            raise WeightUpdateError(
                f"tensor {name!r} has dtype {tensor.dtype}, "
                f"expected one of {', '.join(SENDABLE_DTYPES)}"
            )
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        carrier = (
            flat.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else flat.numpy()
        )
        flats.append(FlatTensor(name, dtype, tuple(tensor.shape), carrier))
    return flats


def tensor_chunks(
    call_id: int, flats: list[FlatTensor], max_chunk_bytes: int | None
) -> Iterator[WeightChunk]:
    for flat in flats:
        carrier = flat.carrier
        step = carrier.size if max_chunk_bytes is None else max_chunk_bytes // carrier.itemsize
        for start in itertools.chain((0,), range(step, carrier.size, max(step, 1))):
            yield WeightChunk(
                call_id=call_id,
                name=flat.name,
                dtype=flat.dtype,
                shape=flat.shape,
                start=start,
                data=carrier[start : start + step],
            )


@dataclass(slots=True)
class _Parts:
    dtype: str
    shape: tuple[int, ...]
    parts: list[tuple[int, Any]] = field(default_factory=list)
    consistent: bool = True


class ChunkAssembler:
    """A rank's chunks, per update call, until the update is staged."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, _Parts]] = {}

    def take(self, chunk: WeightChunk) -> None:
        tensors = self._calls.setdefault(chunk.call_id, {})
        parts = tensors.setdefault(chunk.name, _Parts(chunk.dtype, chunk.shape))
        parts.parts.append((chunk.start, chunk.data))
        parts.consistent &= (parts.dtype, parts.shape) == (chunk.dtype, chunk.shape)

    def pop(self, call_id: int) -> dict[str, _Parts]:
        """The chunks of one call, forgotten here; `assemble` makes them tensors."""
        return self._calls.pop(call_id, {})


def assemble(chunks: dict[str, _Parts]) -> dict[str, Any]:
    """Whole tensors from their chunks; `WeightUpdateError` names a tensor that did not
    arrive whole and consistent."""
    import numpy as np
    import torch

    tensors: dict[str, Any] = {}
    for name, received in chunks.items():
        size = 1
        for dim in received.shape:
            size *= dim
        parts = sorted(received.parts, key=lambda part: part[0])
        position = 0
        for start, data in parts:
            if start != position:
                break
            position += data.size
        if not received.consistent or position != size:
            raise WeightUpdateError(
                f"tensor {name!r} arrived incomplete or inconsistent "
                f"({position} of {size} elements in order)"
            )
        flat = parts[0][1] if len(parts) == 1 else np.concatenate([data for _, data in parts])
        # A chunk received over a channel is a read-only view of its frame.
        tensor = torch.from_numpy(flat if flat.flags.writeable else flat.copy())
        if received.dtype == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        tensors[name] = tensor.reshape(received.shape)
    return tensors
