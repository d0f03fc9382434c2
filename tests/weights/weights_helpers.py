"""Shared helpers of the weight-update tests: a null executor with test-only remote
methods (module-level, so spawned rank processes can unpickle its builder), and the
null executor's expected tokens under a `token_shift`."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.errors import WeightUpdateError
from wavecore.engine.executors.null_executor import NullExecutor, null_continuation
from wavecore.engine.executors.rpc import remote_callable
from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer

HANG_GUARD = 60  # seconds; only ever reached if an engine hangs
TOKENIZER = ByteTokenizer()


class RpcTestExecutor(NullExecutor):
    """A null executor with remote methods that let a test single out one rank (by the
    pid of its process) to fail or stall."""

    fail_stage_pid: int | None = None
    slow_stage: tuple[int, float] | None = None

    @remote_callable
    def pid(self) -> int:
        return os.getpid()

    @remote_callable
    def echo(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"args": list(args), "kwargs": kwargs}

    @remote_callable
    def raise_in(self, pid: int) -> str:
        if os.getpid() == pid:
            raise RuntimeError(f"injected failure in pid {pid}")
        return "fine"

    @remote_callable
    def stall_in(self, pid: int, seconds: float) -> str:
        if os.getpid() == pid:
            time.sleep(seconds)  # the slow rank under test
        return "fine"

    @remote_callable
    def fail_stage_in(self, pid: int | None) -> None:
        self.fail_stage_pid = pid

    @remote_callable
    def slow_stage_in(self, pid: int, seconds: float) -> None:
        self.slow_stage = (pid, seconds)

    @remote_callable
    def not_plain(self) -> object:
        return object()

    def stage_weights(self, tensors: Mapping[str, Any], *, partial: bool, origin: str) -> int:
        if os.getpid() == self.fail_stage_pid:
            raise WeightUpdateError(f"{origin}: injected refusal in pid {os.getpid()}")
        if self.slow_stage is not None and self.slow_stage[0] == os.getpid():
            time.sleep(self.slow_stage[1])  # an update that takes a while on this rank
            self.slow_stage = None
        return super().stage_weights(tensors, partial=partial, origin=origin)


def build_test_core(config: EngineConfig) -> EngineCore:
    core = EngineCore.from_config(config)
    null = core.executor
    core.executor = RpcTestExecutor(
        num_kv_blocks=null.num_kv_blocks,
        block_size=null.block_size,
        max_model_len=null.max_model_len,
        vocab_size=TOKENIZER.vocab_size,
        eos_token_id=TOKENIZER.eos_token_id,
    )
    return core


def shift(value: float) -> dict[str, torch.Tensor]:
    return {"token_shift": torch.tensor([float(value)])}


def check_null_tokens(prompt: str, deltas: list[Any], shifts: Mapping[str | None, int]) -> None:
    """Every token is what the null executor outputs after the tokens before it, under
    the shift of the weight version its delta names (a teacher-forced check)."""
    context = list(prompt.encode())
    for delta in deltas:
        for token in delta.token_ids:
            (want,) = null_continuation(
                context,
                1,
                vocab_size=TOKENIZER.vocab_size,
                eos_token_id=TOKENIZER.eos_token_id,
                token_shift=shifts[delta.weight_version],
            )
            assert token == want, (len(context), delta.weight_version)
            context.append(token)


def tokens_of(deltas: list[Any]) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]
