"""K-quant tensors (256-value super-blocks) load through the same path as the others.

`gguf` can read Q4_K, Q5_K and Q6_K but not write them, so the file gets random blocks
with sane scales; the loader must hand back exactly what `gguf.quants` decodes from
those bytes, reshaped and (for q and k) un-permuted, and the model must run on them.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from model_test_helpers import (
    TinySpec,
    converter_permute,
    prefill_logits,
    random_state_dict,
    write_gguf,
)

from wavecore.engine.model import resolve_model_source

Q = gguf.GGMLQuantizationType
SPEC = TinySpec(hidden_size=256, intermediate_size=512, num_layers=1)


def random_blocks(kind: Q, rows: int, columns: int, seed: int) -> np.ndarray:
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, columns // block, block_bytes), dtype=np.uint8)
    # Random float16 super-block scales could be inf or NaN: give them a sane value.
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if kind == Q.Q6_K:
        blocks[..., -2:] = scale  # d is the block's last field
    else:
        blocks[..., :4] = np.tile(scale, 2)  # d and dmin lead the block
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda k: k.name)
def test_k_quant_blocks_load_as_gguf_decodes_them(tmp_path: Path, kind: Q) -> None:
    hidden, inter = SPEC.hidden_size, SPEC.intermediate_size
    raw = {
        "blk.0.ffn_down.weight": random_blocks(kind, hidden, inter, seed=1),
        "blk.0.ffn_gate.weight": random_blocks(kind, inter, hidden, seed=2),
        "blk.0.attn_q.weight": random_blocks(kind, hidden, hidden, seed=3),
    }
    path = write_gguf(
        tmp_path / f"{kind.name}.gguf",
        SPEC,
        random_state_dict(SPEC),
        raw_blocks={name: (blocks, kind) for name, blocks in raw.items()},
    )
    tensors = resolve_model_source(str(path)).load_tensors()

    decoded = {name: gguf.quants.dequantize(blocks, kind) for name, blocks in raw.items()}
    assert decoded["blk.0.ffn_down.weight"].shape == (hidden, inter)
    assert np.isfinite(decoded["blk.0.ffn_down.weight"]).all()
    assert np.array_equal(tensors["layers.0.down"].numpy(), decoded["blk.0.ffn_down.weight"])
    assert np.array_equal(tensors["layers.0.gate"].numpy(), decoded["blk.0.ffn_gate.weight"])
    # The file holds q as a converter permuted it: loading must undo exactly that.
    assert np.array_equal(
        converter_permute(tensors["layers.0.q"].numpy(), SPEC.num_heads),
        decoded["blk.0.attn_q.weight"],
    )

    assert torch.isfinite(prefill_logits(path, [5, 17, 99, 3, 250, 42])).all()
