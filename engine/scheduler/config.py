"""The scheduler's limits, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from wavecore.engine.executors.batch import Executor

from .speculative import SpeculativeConfig


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Limits of one scheduler.

    `max_num_batched_tokens` caps the tokens of one forward pass (decodes count one
    each); `max_num_seqs` caps the running requests. `prefill_interval` throttles
    admission: new requests are admitted only on steps where
    `step % prefill_interval == 0`. `eos_token_id` finishes a request (STOP) unless its
    sampling says `ignore_eos`. `async_scheduling` allows two steps in flight: the next
    is scheduled before the last one's samples are known (the batch queue).
    `speculative` turns on speculative decoding (`speculative.SpeculativeConfig`).
    `max_loras` caps the distinct LoRA adapters among the running requests and the
    pinned adapters (None: no adapters).
    """

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    prefill_interval: int = 1
    eos_token_id: int | None = None
    async_scheduling: bool = False
    speculative: SpeculativeConfig | None = None
    max_loras: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "num_kv_blocks",
            "block_size",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_interval",
        ):
            _check_positive(name, getattr(self, name))
        if self.max_loras is not None:
            _check_positive("max_loras", self.max_loras)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError("SchedulerConfig.enable_prefix_caching must be a bool")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError("SchedulerConfig.async_scheduling must be a bool")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError("SchedulerConfig.speculative must be a SpeculativeConfig")
        if self.eos_token_id is not None and (
            isinstance(self.eos_token_id, bool)
            or not isinstance(self.eos_token_id, int)
            or self.eos_token_id < 0
        ):
            raise ValueError(
                f"SchedulerConfig.eos_token_id must be None or a non-negative int, "
                f"got {self.eos_token_id!r}"
            )

    @classmethod
    def for_executor(cls, executor: Executor, **limits: object) -> SchedulerConfig:
        """A config whose KV geometry and length limit are the executor's."""
        return cls(
            num_kv_blocks=executor.num_kv_blocks,
            block_size=executor.block_size,
            max_model_len=executor.max_model_len,
            **limits,  # type: ignore[arg-type]
        )

    @property
    def max_sequence_len(self) -> int:
        """The longest a request may grow: the model's limit or the whole KV pool."""
        return min(self.max_model_len, self.num_kv_blocks * self.block_size)
