"""`EngineCore`: one rank's engine, synchronous: a scheduler over an executor.

It knows nothing of tasks or threads. The async engine calls `schedule()` and
`update()` on its event loop and `execute()` on its model thread; `step()` does all
three in a row for synchronous callers (tests, benchmarks).

Pausing, sleeping and waking on one rank:

1. `pause(ABORT)` finishes every request as aborted, then admits nothing new;
   `pause(WAIT)` admits nothing new and lets running requests finish; `pause(KEEP)`
   schedules nothing and keeps every request. Requests added while paused queue.
   `pause_complete()` says when the pause holds (for WAIT: nothing left running).
2. `resume()` schedules normally again; it is refused while asleep.
3. `prepare_sleep(level)` (after a KEEP pause) drops the prefix cache and sends the
   running requests back to waiting, since the executor is about to drop their KV
   blocks; the executor then sleeps. Everything is asleep: "weights", "kv_cache" and
   "scheduling". `wake_up(tags)` wakes those tags; scheduling resumes only when
   nothing is asleep any more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from wavecore.engine.batch import Executor, ModelOutput
from wavecore.engine.config import EngineConfig
from wavecore.engine.errors import (
    DuplicateRequestError,
    EngineAsleepError,
    InvalidRequestError,
    PromptTooLongError,
)
from wavecore.engine.input_processor import EngineRequest, InputProcessor, PromptTokenizer
from wavecore.engine.scheduler import (
    PauseState,
    RequestUpdate,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from wavecore.engine.scheduler import errors as scheduler_errors
from wavecore.statemachines import FinishReason, PauseMode

SLEEP_TAGS = frozenset({"weights", "kv_cache", "scheduling"})
_EXECUTOR_TAGS = frozenset({"weights", "kv_cache"})
# The null executor stands in for a model of about this KV footprint per block.
_NULL_BYTES_PER_BLOCK = 16 * 2**10
_NULL_NOMINAL_MEMORY = 2**30
_NULL_MAX_MODEL_LEN = 8192
_PAUSE_STATES = {
    PauseMode.ABORT: PauseState.PAUSED_NEW,
    PauseMode.WAIT: PauseState.PAUSED_NEW,
    PauseMode.KEEP: PauseState.PAUSED_ALL,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    """A snapshot of one engine. `paused` and `asleep` say why requests may be waiting."""

    num_waiting: int
    num_running: int
    kv_usage: float
    prefix_cache_hit_rate: float
    num_kv_blocks: int
    block_size: int
    paused: str | None
    asleep: tuple[str, ...]
    weight_version: str | None


class EngineCore:
    def __init__(
        self,
        *,
        executor: Executor,
        tokenizer: PromptTokenizer,
        config: EngineConfig,
        eos_token_id: int | None,
    ) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(
            SchedulerConfig.for_executor(
                executor,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_prefix_caching=config.enable_prefix_caching,
                eos_token_id=eos_token_id,
            )
        )
        self.inputs = InputProcessor(tokenizer, max_model_len=executor.max_model_len)
        self._pause_mode: PauseMode | None = None
        self._asleep: frozenset[str] = frozenset()
        self.weight_version: str | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineCore:
        """Load the model (slow: call it off the event loop) and build the core."""
        if config.executor == "null":
            return cls._with_null_executor(config)
        from wavecore.engine.model import load_executor
        from wavecore.engine.sampling.tokenizer import Tokenizer

        executor = load_executor(
            config.model,
            device=config.device,
            kv_cache_memory=config.kv_cache_memory,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            seed=config.seed,
        )
        source = executor.source
        tokenizer = Tokenizer.from_source(source)
        return cls(
            executor=executor, tokenizer=tokenizer, config=config, eos_token_id=source.eos_token_id
        )

    @staticmethod
    def tokenizer_from_config(config: EngineConfig) -> PromptTokenizer:
        """The tokenizer `from_config` would build, without loading the model (for a
        data-parallel client, which tokenizes while its ranks hold the weights)."""
        if config.executor == "null":
            from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer

            return ByteTokenizer()
        from wavecore.engine.model.resolve import resolve_model_source
        from wavecore.engine.sampling.tokenizer import Tokenizer

        return Tokenizer.from_source(resolve_model_source(config.model))

    @classmethod
    def _with_null_executor(cls, config: EngineConfig) -> EngineCore:
        from wavecore.engine.null_executor import NullExecutor
        from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer

        tokenizer = ByteTokenizer()
        memory = config.kv_cache_memory
        # The null executor holds no device memory; a fraction is read as a share of a
        # nominal 1 GiB so that a config written for the model still sizes a pool.
        budget = int(memory * _NULL_NOMINAL_MEMORY) if isinstance(memory, float) else memory
        executor = NullExecutor(
            num_kv_blocks=max(1, budget // _NULL_BYTES_PER_BLOCK),
            block_size=config.block_size,
            max_model_len=config.max_model_len or _NULL_MAX_MODEL_LEN,
            vocab_size=tokenizer.vocab_size,
            eos_token_id=tokenizer.eos_token_id,
        )
        return cls(
            executor=executor,
            tokenizer=tokenizer,
            config=config,
            eos_token_id=tokenizer.eos_token_id,
        )

    # -- requests --------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        try:
            self.scheduler.add(request.request_id, request.prompt_token_ids, request.params)
        except scheduler_errors.DuplicateRequestError as error:
            raise DuplicateRequestError(str(error)) from None
        except scheduler_errors.PromptTooLongError as error:
            raise PromptTooLongError(str(error)) from None
        except scheduler_errors.InvalidPromptError as error:
            raise InvalidRequestError(str(error)) from None

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestUpdate]:
        """Finish these requests as aborted; the updates that tell their callers so."""
        return [_aborted(request_id) for request_id in self.scheduler.abort(list(request_ids))]

    def finish_stopped(self, request_id: str) -> None:
        """A stop string matched: the request is done, its blocks are freed."""
        self.scheduler.finish(request_id, FinishReason.STOP)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput | None:
        """The next step, or None when there is nothing to run now."""
        if not self.scheduler.has_work():
            return None
        step = self.scheduler.schedule()
        if step.is_empty:
            # Nothing fitted this time (e.g. the prefill throttle); close the step.
            self.scheduler.update(step, ModelOutput(sampled=()))
            return None
        return step

    def execute(self, step: SchedulerOutput) -> ModelOutput:
        return self.executor.execute(step.batch)

    def update(self, step: SchedulerOutput, output: ModelOutput) -> list[RequestUpdate]:
        return self.scheduler.update(step, output)

    def step(self) -> list[RequestUpdate]:
        step = self.schedule()
        if step is None:
            return []
        return self.update(step, self.execute(step))

    # -- pause, sleep, wake ------------------------------------------------------------

    @staticmethod
    def check_pause_mode(mode: PauseMode) -> None:
        if not isinstance(mode, PauseMode):
            raise InvalidRequestError(f"pause mode must be a PauseMode, got {mode!r}")

    def pause(self, mode: PauseMode) -> list[RequestUpdate]:
        self.check_pause_mode(mode)
        updates = (
            [_aborted(i) for i in self.scheduler.abort_all()] if mode is PauseMode.ABORT else []
        )
        self._pause_mode = mode
        self.scheduler.set_pause(_PAUSE_STATES[mode])
        return updates

    def pause_complete(self) -> bool:
        return self._pause_mode is not None and not self.scheduler.has_work()

    def resume(self) -> None:
        if self._asleep:
            raise EngineAsleepError(
                f"cannot resume while asleep ({', '.join(sorted(self._asleep))}); "
                f"call wake_up first"
            )
        self._pause_mode = None
        self.scheduler.set_pause(PauseState.UNPAUSED)

    @staticmethod
    def check_sleep_level(level: int) -> None:
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}")

    @staticmethod
    def check_wake_tags(tags: Sequence[str] | None) -> frozenset[str]:
        if tags is None:
            return SLEEP_TAGS
        if isinstance(tags, str):
            raise InvalidRequestError(f"wake_up takes a list of tags, not the string {tags!r}")
        unknown = set(tags) - SLEEP_TAGS
        if unknown:
            raise InvalidRequestError(
                f"unknown wake_up tag(s) {sorted(unknown)}; known: {sorted(SLEEP_TAGS)}"
            )
        return frozenset(tags)

    def prepare_sleep(self, level: int) -> None:
        self.check_sleep_level(level)
        self.scheduler.reset_prefix_cache()
        self.scheduler.preempt_all()
        self._asleep = SLEEP_TAGS

    def wake_executor_tags(self, tags: frozenset[str]) -> frozenset[str]:
        """The tags the executor itself must wake (those still asleep)."""
        return tags & self._asleep & _EXECUTOR_TAGS

    def finish_wake_up(self, tags: frozenset[str]) -> None:
        self._asleep -= tags
        if not self._asleep and self._pause_mode is not None:
            self.resume()

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

    # -- reporting ---------------------------------------------------------------------

    def stats(self) -> EngineStats:
        scheduler = self.scheduler.stats()
        return EngineStats(
            num_waiting=scheduler.num_waiting,
            num_running=scheduler.num_running,
            kv_usage=scheduler.kv_usage,
            prefix_cache_hit_rate=scheduler.prefix_cache_hit_rate,
            num_kv_blocks=self.executor.num_kv_blocks,
            block_size=self.executor.block_size,
            paused=None if self._pause_mode is None else self._pause_mode.name.lower(),
            asleep=tuple(sorted(self._asleep)),
            weight_version=self.weight_version,
        )

    def close(self) -> None:
        self.executor.close()


def _aborted(request_id: str) -> RequestUpdate:
    return RequestUpdate(
        request_id=request_id, new_token_ids=(), sampled=(), finish_reason=FinishReason.ABORT
    )
