"""`score_sequences`: the logits at every position of token sequences, outside any
executor (calibration and quality checks at load, before the executor's cache exists).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from wavecore.engine.executors.batch import SequenceChunk
from wavecore.engine.model.batch_plan import CacheGeometry, plan_forward
from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.kv_cache import PagedKVCache
from wavecore.engine.model.llama import LlamaModel
from wavecore.engine.model.rope import RotaryTable
from wavecore.engine.model.weights import ModelWeights
from wavecore.engine.sampling_params import SamplingParams

_BLOCK_SIZE = 16


def score_sequences(
    weights: ModelWeights,
    config: ModelConfig,
    sequences: Sequence[Sequence[int]],
    kv_cache_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """float32 logits `[len, vocab]` of each sequence (cut to the model's context),
    all prefilled together in one float32 pass on the CPU, through a cache of their own
    in `kv_cache_dtype` (one pass: a load that checks quality runs a few passes, not
    dozens)."""
    cut = [list(tokens)[: config.context_length] for tokens in sequences]
    # A one-token chunk would be planned as a decode, out of order (`batch_plan.py`).
    if not cut or any(len(tokens) < 2 for tokens in cut):
        raise ValueError("score_sequences needs sequences of at least two tokens")
    cpu = torch.device("cpu")
    chunks = []
    first_block = 0
    for index, tokens in enumerate(cut):
        blocks = -(-len(tokens) // _BLOCK_SIZE)
        chunks.append(
            SequenceChunk(
                request_id=f"wavecore-score-{index}",
                token_ids=tuple(tokens),
                start_pos=0,
                block_table=tuple(range(first_block, first_block + blocks)),
                sample=True,
                sampling=SamplingParams(),
                all_token_ids=tuple(tokens),
                prompt_len=len(tokens),
            )
        )
        first_block += blocks
    longest = max(len(tokens) for tokens in cut)
    cache = PagedKVCache(
        config, num_blocks=first_block, block_size=_BLOCK_SIZE, device=cpu, dtype=kv_cache_dtype
    )
    rotary = RotaryTable(
        config, longest, rope_freqs=weights.rope_freqs, device=cpu, dtype=torch.float32
    )
    geometry = CacheGeometry(
        block_size=_BLOCK_SIZE,
        num_blocks=first_block,
        max_model_len=longest,
        vocab_size=config.vocab_size,
    )
    with torch.inference_mode():
        plan = plan_forward(tuple(chunks), geometry, cpu)
        every_row = torch.arange(plan.num_tokens)
        logits = LlamaModel(config, weights, rotary).forward(
            dataclasses.replace(plan, sample_rows=every_row), cache
        )
    return list(logits.split([len(tokens) for tokens in cut]))
