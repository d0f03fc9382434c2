"""An in-memory update's tensors as `WeightChunk`s (engine/weight_chunks.py): bounded
in size, RFC 8746 typed arrays on the wire, and whole again on the rank, or refused by
name when not."""

from __future__ import annotations

import pytest
import torch

from wavecore.channels import Codec
from wavecore.engine.errors import WeightUpdateError
from wavecore.engine.weight_chunks import ChunkAssembler, assemble, flat_tensors, tensor_chunks
from wavecore.engine.weight_messages import WeightChunk

# The CBOR head of each dtype's RFC 8746 typed-array tag (bfloat16 travels as uint16).
TYPED_ARRAY_HEADS = {torch.float32: b"\xd8\x55", torch.float16: b"\xd8\x54", torch.bfloat16: b"\xd8\x45"}  # fmt: skip


def over_the_wire(chunks: list[WeightChunk]) -> list[WeightChunk]:
    codec = Codec()
    return [codec.decode(codec.encode(chunk)) for chunk in chunks]


def assembled(chunks: list[WeightChunk]) -> dict[str, torch.Tensor]:
    assembler = ChunkAssembler()
    for chunk in chunks:
        assembler.take(chunk)
    return assemble(assembler.pop(7))


@pytest.mark.parametrize("dtype", list(TYPED_ARRAY_HEADS))
def test_chunks_are_bounded_typed_arrays_and_reassemble(dtype: torch.dtype) -> None:
    tensors = {
        "big": torch.randn(7, 13, generator=torch.Generator().manual_seed(0)).to(dtype),
        "small": torch.ones(3, dtype=dtype),
    }
    chunks = list(tensor_chunks(7, flat_tensors(tensors), max_chunk_bytes=40))
    assert all(chunk.data.nbytes <= 40 for chunk in chunks)
    big_bytes = 91 * tensors["big"].element_size()
    assert len([c for c in chunks if c.name == "big"]) == -(-big_bytes // 40)
    codec = Codec()
    assert all(TYPED_ARRAY_HEADS[dtype] in codec.encode(chunk) for chunk in chunks)
    back = assembled(over_the_wire(chunks))
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == dtype
        assert torch.equal(back[name], tensor)


def test_a_missing_chunk_is_named() -> None:
    chunks = list(tensor_chunks(7, flat_tensors({"w": torch.zeros(100)}), max_chunk_bytes=64))
    with pytest.raises(WeightUpdateError, match="tensor 'w' arrived incomplete"):
        assembled(chunks[:2] + chunks[3:])


def test_unlimited_chunks_share_the_callers_memory() -> None:
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    (chunk,) = tensor_chunks(7, flat_tensors({"w": tensor}), max_chunk_bytes=None)
    assert chunk.data.size == 6
    tensor += 1  # a view, not a copy: the rank's staging copies (see weight_update)
    assert chunk.data[0] == 1.0


def test_what_cannot_travel_is_refused_before_sending() -> None:
    with pytest.raises(WeightUpdateError, match=r"'w' has dtype torch\.int64"):
        flat_tensors({"w": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(WeightUpdateError, match=r"'w' is a list, not a torch\.Tensor"):
        flat_tensors({"w": [1.0]})
