"""Shared helpers of the LoRA tests: a tiny random Llama as a Hugging Face directory
(byte vocabulary, so the engine runs it with the `ByteTokenizer`), adapters in PEFT's
file format from a seed, the core builder rank processes unpickle (module level), and
greedy references computed on a bare executor, one request alone at a time."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_byte_model import (  # noqa: F401 - the LoRA tests' names for them
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    LAYERS,
    SHAPES,
    VOCAB,
    write_tiny_model,
)

from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.errors import LoRAError
from wavecore.engine.executors.batch import ModelBatch, SequenceChunk
from wavecore.engine.executors.rpc import remote_callable
from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.executor import ModelExecutor
from wavecore.engine.model.resolve import resolve_model_source
from wavecore.engine.sampling.byte_tokenizer import EOS_TOKEN_ID, ByteTokenizer
from wavecore.engine.sampling_params import SamplingParams

HANG_GUARD = 120  # seconds; only ever reached if an engine hangs
ALL_TARGETS = tuple(SHAPES)
# The tiny model's config, for tests that build adapters without an executor.
TINY_CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=INTER,
    num_layers=LAYERS,
    num_heads=HEADS,
    num_kv_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    context_length=512,
    tie_word_embeddings=True,
    qkv_bias=False,
)


def write_adapter(
    directory: Path,
    *,
    seed: int,
    rank: int = 4,
    alpha: float = 8.0,
    targets: Sequence[str] = ALL_TARGETS,
    rslora: bool = False,
    shapes: dict[str, tuple[int, int]] = SHAPES,
    layers: int = LAYERS,
) -> Path:
    """An adapter as PEFT's `save_pretrained` writes it, large enough to change the
    tiny model's greedy output."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for target in targets:
            block = "self_attn" if target[0] in "qkvo" else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            fan_in, fan_out = shapes[target]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.3
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "target_modules": list(targets),
        "bias": "none",
        "lora_dropout": 0.0,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


class LoRATestExecutor(ModelExecutor):
    """The model executor with a remote switch that makes one rank (by the pid of its
    process) refuse every adapter it is asked to add."""

    fail_add_pid: int | None = None

    @remote_callable
    def pid(self) -> int:
        return os.getpid()

    @remote_callable
    def fail_add_in(self, pid: int | None) -> None:
        self.fail_add_pid = pid

    def add_lora(self, request: LoRARequest) -> None:
        if self.fail_add_pid == os.getpid():
            raise LoRAError(f"injected refusal of {request.name!r} in pid {os.getpid()}")
        super().add_lora(request)


def build_lora_core(config: EngineConfig) -> EngineCore:
    """The tiny model at `config.model`, float32, with the config's LoRA settings."""
    executor = LoRATestExecutor(
        resolve_model_source(config.model),
        device="cpu",
        dtype="float32",
        weights="float32",
        kv_cache_memory=config.kv_cache_memory,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        enable_lora=config.enable_lora,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
    )
    return EngineCore(
        executor=executor, tokenizer=ByteTokenizer(), config=config, eos_token_id=EOS_TOKEN_ID
    )


def greedy_alone(
    executor: ModelExecutor, prompt: Sequence[int], count: int, lora: str | None
) -> list[int]:
    """`count` greedy tokens of `prompt` under `lora`, alone, from the first blocks."""
    tokens = list(prompt)
    blocks = tuple(range(-(-(len(tokens) + count) // executor.block_size)))
    computed = 0
    params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)
    for _ in range(count):
        chunk = SequenceChunk(
            request_id="alone",
            token_ids=tokens[computed:],
            start_pos=computed,
            block_table=blocks,
            sample=True,
            sampling=params,
            all_token_ids=tokens,
            prompt_len=len(prompt),
            lora=lora,
        )
        computed = len(tokens)
        output = executor.execute(ModelBatch(chunks=(chunk,)))
        tokens = [*tokens, output.sampled[0].token_id]
    return tokens[len(prompt) :]
