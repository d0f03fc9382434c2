"""Shared helpers of the engine tests: a null executor whose steps a test can hold or
fail, and a core built around it."""

from __future__ import annotations

import threading
from typing import Any

from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.executors.batch import ModelBatch
from wavecore.engine.executors.null_executor import NullExecutor
from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()


class ControlledExecutor(NullExecutor):
    """A null executor whose steps can be held at a gate, or made to fail."""

    def __init__(self) -> None:
        super().__init__(
            num_kv_blocks=256,
            max_model_len=1024,
            vocab_size=TOKENIZER.vocab_size,
            eos_token_id=TOKENIZER.eos_token_id,
        )
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.fail_with: Exception | None = None

    def execute_model(self, batch: ModelBatch) -> object:
        self.entered.set()
        self.gate.wait()
        if self.fail_with is not None:
            raise self.fail_with
        return super().execute_model(batch)


def core_with(executor: ControlledExecutor, **config: Any) -> EngineCore:
    return EngineCore(
        executor=executor,
        tokenizer=TOKENIZER,
        config=EngineConfig(executor="null", **config),
        eos_token_id=TOKENIZER.eos_token_id,
    )
