"""`EngineCore`: one rank's engine, synchronous: a scheduler over an executor.

It knows nothing of tasks, threads or the protocol. The rank loop's driver
(`core.rank_runner`) calls `schedule()` and `update()` on its event loop and
`execute()` on its model thread, and performs the rank machine's actions on it:
`pause_scheduler(mode)` / `resume_scheduler()` (ABORT finishes every request as
aborted, then admits nothing new; WAIT admits nothing new and lets running requests
finish; KEEP schedules nothing and keeps every request), and around the executor's
sleep `drop_kv_cache()`, which sends running requests back to waiting to be
recomputed. Whether the rank is paused or asleep is the machine's state, not the
core's. `step()` does schedule, execute and update in a row for synchronous callers
(tests, benchmarks).

Structured output splits the step as upstream's does: `execute` runs the forward
(`Executor.execute_model`), then waits for the step's grammar bitmask, which the
driver computes on the event loop while the forward runs (`bitmask_slot`,
`fill_bitmask`), and samples with it (`Executor.sample_tokens`). Grammars compile in
the background (`structured.compiler`); `schedule()` first collects the compiles that
ended, and a request whose grammar failed ends alone, its update waiting in
`take_finished_early()`.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future

from wavecore.engine.config import EngineConfig
from wavecore.engine.core.step_failure import StepFailed
from wavecore.engine.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError
from wavecore.engine.executors.batch import Executor, GrammarBitmask, ModelOutput
from wavecore.engine.interface import CoreStats
from wavecore.engine.request import EngineRequest, PromptTokenizer
from wavecore.engine.scheduler import (
    RequestUpdate,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from wavecore.engine.scheduler import errors as scheduler_errors
from wavecore.engine.structured.bitmask import compute_bitmask
from wavecore.engine.structured.compiler import GrammarCompiler, RequestGrammar
from wavecore.statemachines import FinishReason, PauseMode

# The null executor stands in for a model of about this KV footprint per block.
_NULL_BYTES_PER_BLOCK = 16 * 2**10
_NULL_NOMINAL_MEMORY = 2**30
_NULL_MAX_MODEL_LEN = 8192


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
                prefill_interval=config.prefill_interval,
                enable_prefix_caching=config.enable_prefix_caching,
                eos_token_id=eos_token_id,
                async_scheduling=config.async_scheduling,
                speculative=config.speculative,
                max_loras=config.max_loras if config.enable_lora else None,
            )
        )
        # Whether the rank runs its steps through the batch queue (`core.batch_queue`).
        self.async_scheduling = config.async_scheduling
        # Whether the rank records each forward's details (`core.iteration_details`).
        self.log_iteration_details = config.log_iteration_details
        self.weight_version: str | None = None
        self.grammars = GrammarCompiler(tokenizer, tokenizer.vocab_size)
        self._compiling: dict[str, RequestGrammar] = {}
        self._finished_early: list[RequestUpdate] = []

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
            weights=config.weights,
            dtype=config.dtype,
            kv_cache_dtype=config.kv_cache_dtype,
            compile_decode=config.compile_decode,
            kv_cache_memory=config.kv_cache_memory,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            seed=config.seed,
            enable_lora=config.enable_lora,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
        )
        if config.speculative_method == "draft_model" and config.draft_model is not None:
            from wavecore.engine.model.draft_model import DraftModel

            try:
                draft = DraftModel.load(
                    config.draft_model,
                    target=executor,
                    weights=config.draft_weights,
                    dtype=config.dtype,
                )
            except BaseException:
                executor.close()
                raise
            executor.attach_draft(draft)
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
        from wavecore.engine.executors.null_executor import NullExecutor
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
            repeat_period=config.null_repeat_period,
            step_seconds=config.null_step_seconds,
        )
        return cls(
            executor=executor,
            tokenizer=tokenizer,
            config=config,
            eos_token_id=tokenizer.eos_token_id,
        )

    # -- requests --------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        if not isinstance(request.request_id, str) or not request.request_id:
            raise InvalidRequestError(f"request id {request.request_id!r} is no non-empty str")
        vocab_size = self.tokenizer.vocab_size
        tokens = request.prompt_token_ids
        if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
            # The front end never sends one (it tokenized the prompt); the model would.
            raise InvalidRequestError(
                f"request {request.request_id!r}: a prompt token id is outside the "
                f"vocabulary of {vocab_size}"
            )
        spec = request.params.structured_outputs
        grammar = None if spec is None else self.grammars.start(spec)
        try:
            self.scheduler.add(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                grammar,
                request.lora,
            )
        except scheduler_errors.DuplicateRequestError as error:
            raise DuplicateRequestError(str(error)) from None
        except scheduler_errors.PromptTooLongError as error:
            raise PromptTooLongError(str(error)) from None
        except scheduler_errors.InvalidPromptError as error:
            raise InvalidRequestError(str(error)) from None
        if grammar is not None and grammar.compiling:
            self._compiling[request.request_id] = grammar

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestUpdate]:
        """Finish these requests as aborted; the updates that tell their callers so."""
        return [_aborted(request_id) for request_id in self.scheduler.abort(list(request_ids))]

    def finish_stopped(self, request_id: str) -> None:
        """A stop string matched: the request is done, its blocks are freed."""
        self.scheduler.finish(request_id, FinishReason.STOP)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_admitted(self) -> bool:
        return self.scheduler.has_admitted()

    # -- one step --------------------------------------------------------------------

    def schedule(self, step_counter: int | None = None) -> SchedulerOutput | None:
        """The next step, or None when there is nothing to run now. `step_counter`
        feeds the prefill cadence (default: the scheduler's own count of steps)."""
        self._collect_grammars()
        if not self.scheduler.has_work():
            return None
        step = self.scheduler.schedule(step_counter)
        if step.is_empty:
            # Nothing fitted this time (e.g. the prefill throttle); close the step.
            self.scheduler.update(step, ModelOutput(sampled=()))
            return None
        return step

    def execute(
        self, step: SchedulerOutput, bitmask: Future[GrammarBitmask | None] | None = None
    ) -> ModelOutput:
        """On the model thread: the forward, then sampling with the bitmask that the
        driver fills meanwhile (`bitmask_slot`; None when no row needs one). An error of
        either is raised as `StepFailed`, which knows the step (`core.step_failure`)."""
        try:
            forward = self.executor.execute_model(step.batch)
        except Exception as error:
            raise StepFailed(step, "forward") from error
        mask = None if bitmask is None else bitmask.result()
        try:
            return self.executor.sample_tokens(forward, mask)
        except Exception as error:
            raise StepFailed(step, "sampling") from error

    def bitmask_slot(self, step: SchedulerOutput) -> Future[GrammarBitmask | None] | None:
        """Where `fill_bitmask` puts this step's bitmask, or None if no sampling row of
        it has a grammar (then nothing waits for one)."""
        chunks = step.batch.chunks
        for chunk, request in zip(chunks, step.requests, strict=True):
            if chunk.sample and request.grammar is not None:
                return Future()
        return None

    def fill_bitmask(self, step: SchedulerOutput, slot: Future[GrammarBitmask | None]) -> None:
        """Compute the step's bitmask from its requests' grammars as they stand now (every
        earlier step's tokens accepted) and hand it to the waiting `execute`."""
        try:
            rows = []
            row = 0
            for chunk, request in zip(step.batch.chunks, step.requests, strict=True):
                if request.grammar is not None and chunk.sample:
                    drafts = list(chunk.token_ids[1:]) if chunk.num_draft_tokens else []
                    rows.append((row, request.grammar, drafts))
                row += chunk.num_samples
            slot.set_result(compute_bitmask(rows, self.grammars.vocab_size))
        except BaseException as error:  # the forward must not wait for ever
            slot.set_exception(error)
            raise

    def update(self, step: SchedulerOutput, output: ModelOutput) -> list[RequestUpdate]:
        return self.scheduler.update(step, output)

    def step(self) -> list[RequestUpdate]:
        step = self.schedule()
        finished = self.take_finished_early()
        if step is None:
            return finished
        slot = self.bitmask_slot(step)
        if slot is not None:
            self.fill_bitmask(step, slot)
        return finished + self.update(step, self.execute(step, slot))

    # -- grammars --------------------------------------------------------------------

    def grammars_compiling(self) -> bool:
        """Whether a live request waits for its grammar (the driver then waits for a
        compile to end, not in a busy loop)."""
        self._collect_grammars()
        return bool(self._compiling)

    def take_finished_early(self) -> list[RequestUpdate]:
        """The updates of requests ended outside a step (their grammar failed)."""
        finished, self._finished_early = self._finished_early, []
        return finished

    def _collect_grammars(self) -> None:
        if not self._compiling:
            return
        for request_id, grammar in list(self._compiling.items()):
            grammar.poll()
            live = self.scheduler.get_request(request_id) is not None
            if grammar.compiling and live:
                continue
            del self._compiling[request_id]
            if live and grammar.error is not None:
                self.scheduler.finish(request_id, FinishReason.ERROR)
                self._finished_early.append(
                    RequestUpdate(
                        request_id=request_id,
                        new_token_ids=(),
                        sampled=(),
                        finish_reason=FinishReason.ERROR,
                        error=grammar.error,
                    )
                )

    # -- performing the rank machine's actions -----------------------------------------

    def pause_scheduler(self, mode: PauseMode) -> list[RequestUpdate]:
        """The machine's `PauseScheduler`; the updates of the requests an ABORT ended."""
        updates = (
            [_aborted(i) for i in self.scheduler.abort_all()] if mode is PauseMode.ABORT else []
        )
        self.scheduler.set_pause(mode)
        return updates

    def resume_scheduler(self) -> None:
        self.scheduler.set_pause(None)

    def drop_kv_cache(self) -> None:
        """Before the executor drops its KV cache: cached prefixes go, and running
        requests go back to waiting, to be recomputed after the wake-up."""
        self.scheduler.reset_prefix_cache()
        self.scheduler.preempt_all()

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

    # -- reporting ---------------------------------------------------------------------

    def stats(self, *, paused: PauseMode | None, asleep: frozenset[str]) -> CoreStats:
        """This core's figures, with the protocol state the rank machine holds."""
        scheduler = self.scheduler.stats()
        spec = self.scheduler.spec_counts
        memory = self.executor.memory()
        return CoreStats(
            num_waiting=scheduler.num_waiting,
            num_running=scheduler.num_running,
            kv_usage=scheduler.kv_usage,
            prefix_cache_hit_rate=scheduler.prefix_cache_hit_rate,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            weights_bytes=memory.weights,
            offloaded_weights_bytes=memory.offloaded_weights,
            kv_cache_bytes=memory.kv_cache,
            num_kv_blocks=self.executor.num_kv_blocks,
            block_size=self.executor.block_size,
            paused=None if paused is None else paused.value,
            asleep=tuple(sorted(asleep)),
            weight_version=self.weight_version,
            grammar_compiles=self.grammars.compiles,
            grammar_compile_seconds=self.grammars.compile_seconds,
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_accepted_per_position=tuple(spec.accepted_per_position),
            lora_running=self.scheduler.running_per_lora(),
        )

    def close(self) -> None:
        self.grammars.close()
        self.executor.close()


def _aborted(request_id: str) -> RequestUpdate:
    return RequestUpdate(
        request_id=request_id, new_token_ids=(), sampled=(), finish_reason=FinishReason.ABORT
    )
