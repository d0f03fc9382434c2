"""Continuous batching: which tokens of which requests run in the next forward pass.

One step is `schedule()` -> executor -> `update()`, called alternately from the
engine's worker; nothing here blocks, allocates per token, or touches a tensor.

Theory of operation:

- Queues. `waiting` (a deque) holds requests without KV blocks: new ones at the back,
  preempted ones at the front, so the oldest preempted request resumes first.
  `running` (a list, oldest admission first) holds requests with blocks. A request's
  `RequestMachine` guards every move, so it is never in two queues.
- Budget. A step runs at most `max_num_batched_tokens` tokens. Running requests go
  first, oldest first: a decode costs one token, and a request still in its prefill
  continues with as large a chunk as the budget allows. What is left admits waiting
  requests, front first, each with a (possibly partial) prefill chunk starting after
  its longest cached prefix. Admission stops at the first request that does not fit
  (no reordering, so no starvation), at `max_num_seqs` running requests, on steps the
  prefill throttle skips, and on any step that had to preempt.
- Preemption by recompute. When a running request needs a block and none is free,
  the newest running request is preempted: its blocks are freed and it goes back to
  the front of `waiting` keeping its output tokens. When it is admitted again, its
  whole token list (prompt and outputs) is prefilled, and only the chunk that reaches
  its last token samples, so it continues exactly where it stopped.
- Positions are committed at schedule time: `num_computed_tokens` includes the step
  in flight. `update()` appends each sampled token, applies the stop rules, registers
  newly full blocks in the prefix cache, and frees finished requests' blocks.
- Async scheduling (the batch queue): with `config.async_scheduling` a second step may
  be scheduled before the first one's `update()`; updates come in schedule order. A
  running request whose computed tokens reach its known tokens has a sample in flight:
  it decodes that unknown token (a placeholder, `pending_tokens`, resolved on the
  model thread before the forward), with KV allocated and budget counted like any
  decode, unless that sample will finish it by length. Its sample in the later step is
  dropped by `update()` if the earlier one finished it, like any finished request's.
  A block is registered in the prefix cache once every step that computes its KV is
  launched: the model thread runs steps in order, so a later step that reads it runs
  after its KV is written.
- Aborts and finishes may arrive at any time, also between `schedule()` and
  `update()`: the request is finished and its blocks freed at once, and `update()`
  skips samples of requests that are no longer running. A freed request's block
  table is replaced, never cleared in place, because the batch in flight still
  holds the old list.
- Structured output: a request whose grammar is still compiling (`Grammar.ready` is
  false) stays where it is in `waiting` and is skipped by admission, so it holds back
  no request behind it. `update()` hands each sampled token to the request's grammar:
  a token it forbids ends the request with ERROR, a grammar that is complete ends it
  with STOP (a stop token or `max_len` still end it first).
- Speculative decoding (`config.speculative`): a decode may carry
  drafts (`speculative`: proposals, verification, back-off). It is scheduled as its
  last token plus k drafts, within the step's token budget, the request's `max_len`,
  the blocks free without preempting anyone and, with a grammar, the drafts the
  grammar accepts. `update()` accepts the drafts up to the first that differs from
  the token sampled before it, then that token; stop rules apply token by token, and
  `num_computed_tokens` falls back to the accepted tokens. Under async scheduling a
  request whose drafts are in flight sits out the step scheduled meanwhile: how many
  tokens it will have, and so where its next token goes, is unknown until they are
  verified. Drafts follow known tokens only, so a request whose sample is in flight
  leaves the step being scheduled to draft in the next, while the proposer matches its
  tokens and its drafts are accepted (`_sits_out_to_draft`); other requests keep
  their placeholder decode in every step. With a draft model the executor proposes,
  one step ahead: a sampling chunk asks for k drafts (`num_lookahead_tokens`, while
  the request is not backing off and the step leaves room for drafts), with blocks
  added for the KV the draft writes at those positions, taken only while a free
  block per running request remains (never by preempting); `update()` keeps what
  comes back (`Request.draft_token_ids`) for the request's next decode, and under
  async scheduling such a request sits out the step scheduled meanwhile. The draft
  model runs only in steps where drafts may be asked for: each chunk then tells it
  where its KV for the request stops (`draft_start_pos`, from `Request.
  draft_computed`: 0 after an admission, behind after steps it sat out), so it
  catches up; at large batches, where no request drafts, it costs nothing.
- LoRA adapters (`config.max_loras`): a request names its adapter, or none for the
  base model. The running requests' distinct adapters and the pinned ones are at most
  `max_loras` (the executor's device slots); a waiting request whose adapter would be
  one too many stops admission where it stands, as a request without blocks does, so
  it is admitted first once a running adapter's requests finish (never starved). Its
  prefix-cache hash chain starts from its adapter (`Request.prefix_root`), so no block
  is shared between adapters or with the base model.
- A request can always progress alone: prompts that could never fit are refused at
  `add`, and a request finishes with LENGTH at `min(max_model_len, KV pool tokens)`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from wavecore.engine.executors.batch import (
    ModelBatch,
    ModelOutput,
    SampledToken,
    SequenceChunk,
    accepted_drafts,
)
from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines.rank_events import PauseMode
from wavecore.statemachines.request import (
    Finish,
    FinishReason,
    Preempt,
    RequestState,
    Schedule,
)

from .block_manager import BlockManager
from .config import SchedulerConfig
from .errors import (
    DuplicateRequestError,
    InvalidPromptError,
    OutputMismatchError,
    PromptTooLongError,
    StepOrderError,
)
from .fast_build import build_chunk, build_update
from .outputs import RequestUpdate, SchedulerOutput, SchedulerStats
from .pending_tokens import PLACEHOLDER, PendingTokens
from .request import Grammar, Request
from .speculative import NgramProposer, SpecDecodeCounts

_RUNNING = RequestState.RUNNING
_PREEMPTED = RequestState.PREEMPTED
_SCHEDULE = Schedule()
_PREEMPT = Preempt()
_STOP = FinishReason.STOP
_LENGTH = FinishReason.LENGTH
_ERROR = FinishReason.ERROR


class Scheduler:
    """Continuous-batching scheduler over a `BlockManager`; see the module docstring."""

    def __init__(self, config: SchedulerConfig) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.block_manager = BlockManager(
            num_blocks=config.num_kv_blocks,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self._max_sequence_len = config.max_sequence_len
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        # The rank machine's PauseScheduler: None schedules normally, ABORT and WAIT
        # admit nothing new (running requests drain), KEEP schedules nothing at all.
        self._pause: PauseMode | None = None
        self._step = 0
        # Steps scheduled and not yet updated, oldest first: at most one, or two with
        # async scheduling.
        self._in_flight: deque[SchedulerOutput] = deque()
        self._max_in_flight = 2 if config.async_scheduling else 1
        spec = config.speculative
        # With a draft model the executor proposes: sampling chunks ask it for drafts.
        self._executor_drafts = spec is not None and spec.executor_proposes
        use_lookup = spec is not None and not self._executor_drafts
        self._proposer = NgramProposer(spec) if use_lookup else None
        self.spec_counts = SpecDecodeCounts(spec.num_speculative_tokens if spec else 0)
        self._last_stats = self._snapshot(step=0, num_seqs=0, num_tokens=0, num_preempted=0)
        # Adapters kept resident by `pin_lora`: they hold device slots of their own.
        self._pinned_loras: frozenset[str] = frozenset()

    # -- queries -------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def pause_mode(self) -> PauseMode | None:
        return self._pause

    @property
    def step_counter(self) -> int:
        """How many times `schedule()` has been called."""
        return self._step

    @property
    def last_stats(self) -> SchedulerStats:
        """The statistics of the last `schedule()` (all zeros before the first)."""
        return self._last_stats

    def stats(self) -> SchedulerStats:
        """Queue lengths and KV figures now, with the last step's scheduling figures."""
        last = self._last_stats
        return self._snapshot(
            step=last.step,
            num_seqs=last.num_scheduled_seqs,
            num_tokens=last.num_scheduled_tokens,
            num_preempted=last.num_preempted,
        )

    def has_unfinished(self) -> bool:
        """Whether any request is live (waiting, running or preempted), paused or not."""
        return bool(self._requests)

    def has_admitted(self) -> bool:
        """Whether a request this scheduler admitted is unfinished: running, or preempted
        and waiting (at the front) to be recomputed. These are what a WAIT pause lets
        finish; a step may schedule none of them (a preempted one is readmitted only on a
        prefill step: `prefill_interval`, and not on a step that preempted), so a step
        that ran nothing does not mean they are done."""
        waiting = self._waiting
        return bool(self._running) or bool(waiting and waiting[0].state is _PREEMPTED)

    def has_work(self) -> bool:
        """Whether `schedule()` could make progress in the current pause state.

        Under an ABORT or WAIT pause only running and preempted requests count, so a
        paused engine with new requests queued can still go idle; under KEEP nothing does.
        """
        if self._pause is None:
            return bool(self._requests)
        if self._pause is not PauseMode.KEEP:
            return self.has_admitted()
        return False

    def queues(self) -> tuple[tuple[Request, ...], tuple[Request, ...]]:
        """Snapshots of the running and the waiting queue, in order (for checks and debugging)."""
        return tuple(self._running), tuple(self._waiting)

    def get_request(self, request_id: str) -> Request | None:
        """The live request with this id, or None."""
        return self._requests.get(request_id)

    def running_per_lora(self) -> dict[str, int]:
        """Running requests per LoRA adapter (the base model's not counted)."""
        counts: dict[str, int] = {}
        for request in self._running:
            if request.lora is not None:
                counts[request.lora] = counts.get(request.lora, 0) + 1
        return counts

    def set_pinned_loras(self, names: Iterable[str]) -> None:
        """The adapters pinned on the executor now (each holds a slot)."""
        self._pinned_loras = frozenset(names)

    # -- requests in and out -------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        grammar: Grammar | None = None,
        lora: str | None = None,
    ) -> None:
        """Queue a new request (under LoRA adapter `lora`, None for the base model).
        Raises before changing anything if it is invalid."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already live")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        if lora is not None and self.config.max_loras is None:
            raise InvalidPromptError(
                f"request {request_id!r} names LoRA adapter {lora!r}, but LoRA is not enabled"
            )
        if isinstance(prompt_token_ids, str | bytes):
            raise InvalidPromptError(f"request {request_id!r}: prompt must be token ids, not text")
        tokens = list(prompt_token_ids)
        if not tokens:
            raise InvalidPromptError(f"request {request_id!r}: the prompt is empty")
        if not all(type(token) is int and token >= 0 for token in tokens):
            raise InvalidPromptError(
                f"request {request_id!r}: prompt token ids must be non-negative ints"
            )
        if len(tokens) >= self._max_sequence_len:
            config = self.config
            raise PromptTooLongError(
                f"request {request_id!r}: a prompt of {len(tokens)} tokens leaves no room for "
                f"an output token (max_model_len {config.max_model_len}, KV pool "
                f"{config.num_kv_blocks * config.block_size} tokens)"
            )
        request = Request(
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling=sampling,
            eos_token_id=self.config.eos_token_id,
            max_sequence_len=self._max_sequence_len,
            grammar=grammar,
            lora=lora,
        )
        self._requests[request_id] = request
        self._waiting.append(request)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Finish these requests as ABORT and free their blocks; return the ids aborted.

        Ids that are not live (unknown, or already finished) are skipped, not an error:
        an abort routinely races with the request's own finish.
        """
        if isinstance(request_ids, str):
            raise TypeError("abort() takes an iterable of request ids, not a single str")
        aborted = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                self._finish_out_of_band(request, FinishReason.ABORT)
                aborted.append(request_id)
        return aborted

    def abort_all(self) -> list[str]:
        """Abort every live request (pause mode `abort`); return their ids."""
        return self.abort(list(self._requests))

    def finish(self, request_id: str, reason: FinishReason = FinishReason.STOP) -> bool:
        """Finish a live request (e.g. the engine matched a stop string); False if not live.

        STOP and LENGTH are accepted only for a running request (`ProtocolError`
        otherwise, with nothing changed).
        """
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._finish_out_of_band(request, reason)
        return True

    # -- pause and KV state --------------------------------------------------------

    def set_pause(self, mode: PauseMode | None) -> None:
        if mode is not None and not isinstance(mode, PauseMode):
            raise TypeError(f"mode must be a PauseMode or None, got {mode!r}")
        self._pause = mode

    def preempt_all(self) -> int:
        """Send every running request back to waiting, to be recomputed; return how many.

        For when the executor drops its KV cache (sleep) while requests are kept.
        """
        running = self._running
        count = len(running)
        while running:
            self._preempt(running.pop())
        return count

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    # -- one step ------------------------------------------------------------------

    def schedule(self, step: int | None = None) -> SchedulerOutput:
        """Choose the next batch. `step` feeds the prefill throttle (default: own count)."""
        if len(self._in_flight) == self._max_in_flight:
            raise StepOrderError(
                f"schedule() called with {self._max_in_flight} step(s) in flight and not updated"
            )
        if step is None:
            step = self._step
        self._step += 1
        if self._pause is PauseMode.KEEP:
            return self._output(step, [], [], 0, 0, 0)

        config = self.config
        budget = config.max_num_batched_tokens
        block_manager = self.block_manager
        block_size = config.block_size
        running = self._running
        chunks: list[SequenceChunk] = []
        requests: list[Request] = []
        placeholders: list[tuple[list[int], str]] = []
        num_sampled = 0
        num_preempted = 0

        # Room for drafts: a step's tokens beyond `token_budget` cost their full price.
        spec = config.speculative
        draft_room = spec.token_budget - len(running) if spec is not None else 0
        # Whether the next step is likely to have room for drafts (a draft model is
        # asked for them one step ahead).
        lookahead_wanted = self._executor_drafts and draft_room > 0
        # Popping preempted victims off the end while iterating is safe: the iterator
        # stops at the shortened length, and victims are never already scheduled.
        for request in running:
            if budget == 0:
                break
            computed = request.num_computed_tokens
            tokens = request.token_ids
            total = len(tokens)
            table = request.block_table
            history: Sequence[int] = tokens
            num_drafts = 0
            if total - computed == 1:  # a decode
                end = total
                token_ids = (tokens[-1],)
                if draft_room > 0 and self._wants_drafts(request):
                    drafts = self._drafts(request, min(draft_room, budget - 1))
                    if drafts:
                        num_drafts = len(drafts)
                        draft_room -= num_drafts
                        end = total + num_drafts
                        token_ids = (tokens[-1], *drafts)
                    elif config.async_scheduling:
                        request.backoff.verified(0)  # it sat out a step for nothing
            elif computed > total:  # its drafts are in flight (async scheduling only)
                continue
            elif total == computed:  # its sample is in flight (async scheduling only)
                if draft_room > 0 and self._sits_out_to_draft(request):
                    continue
                if total + 1 >= request.max_len:
                    continue  # that sample finishes it by length
                total = end = total + 1
                token_ids = [PLACEHOLDER]
                history = PendingTokens(tokens, end, token_ids)
                # (Preempted below for want of a block, it leaves a slot filled unread.)
                placeholders.append((token_ids, request.request_id))
            else:  # a prefill that continues
                end = total if total - computed <= budget else computed + budget
                token_ids = tokens[computed:end]
            if end > len(table) * block_size:
                while not block_manager.can_append(table, end):
                    victim = running.pop()
                    self._preempt(victim)
                    num_preempted += 1
                    if victim is request:
                        break
                if request.machine.state is not _RUNNING:
                    break
                block_manager.append(table, end)
            sample = end - num_drafts == total
            num_sampled += sample
            lookahead = self._lookahead(request, end) if sample and lookahead_wanted else 0
            if sample:
                request.drafts_coming = lookahead > 0
            draft_start = self._draft_start(request, end) if lookahead_wanted else None
            chunks.append(
                build_chunk(
                    request.request_id,
                    token_ids,
                    computed,
                    table,
                    sample,
                    request.sampling,
                    history,
                    request.prompt_len,
                    num_drafts,
                    request.lora,
                    lookahead,
                    draft_start,
                )
            )
            requests.append(request)
            request.num_computed_tokens = end
            budget -= end - computed

        if num_preempted == 0 and step % config.prefill_interval == 0:
            budget, num_sampled = self._admit(
                chunks, requests, budget, num_sampled, lookahead_wanted
            )

        num_tokens = config.max_num_batched_tokens - budget
        return self._output(
            step, chunks, requests, num_sampled, num_tokens, num_preempted, tuple(placeholders)
        )

    def update(self, scheduled: SchedulerOutput, output: ModelOutput) -> list[RequestUpdate]:
        """Apply one step's samples; return one `RequestUpdate` per request that got a token.

        Requests finished, aborted or preempted since `schedule()` are skipped. Raises
        `StepOrderError` for an output that is not the oldest step's in flight, and
        `OutputMismatchError` (changing nothing) if `output` does not match its batch.
        """
        in_flight = self._in_flight
        if not in_flight or scheduled is not in_flight[0]:
            if scheduled.is_empty and not output.sampled:
                return []
            raise StepOrderError("update() got an output that is not the oldest step's in flight")
        samples = output.sampled
        chunks = scheduled.batch.chunks
        expected = [chunk.request_id for chunk in chunks for _ in range(chunk.num_samples)]
        if [sample.request_id for sample in samples] != expected:
            raise OutputMismatchError(
                f"the executor returned {len(samples)} samples for {len(expected)} sampling "
                f"rows, or in another order"
            )
        in_flight.popleft()

        block_manager = self.block_manager
        caching = block_manager.enable_prefix_caching
        block_size = block_manager.block_size
        updates: list[RequestUpdate] = []
        any_finished = False
        sample_index = 0
        for request, chunk in zip(scheduled.requests, chunks, strict=True):
            if not chunk.sample:
                # A prefill chunk that samples nothing may still fill blocks.
                if caching and request.machine.state is _RUNNING:
                    self._cache_blocks(request)
                continue
            count = chunk.num_samples
            chunk_samples = samples[sample_index : sample_index + count]
            sample_index += count
            if request.machine.state is not _RUNNING:
                continue
            if count > 1:
                chunk_samples = self._verified(request, chunk, chunk_samples)
            update = self._take_samples(request, chunk_samples)
            if count > 1:  # the KV of rejected drafts is never used
                request.num_computed_tokens = min(
                    request.num_computed_tokens, len(request.token_ids) - 1
                )
                request.draft_computed = min(request.draft_computed, request.num_computed_tokens)
            if caching and request.num_computed_tokens // block_size > len(request.block_hashes):
                self._cache_blocks(request)
            if update.finish_reason is not None:
                self._release(request, update.finish_reason)
                any_finished = True
            elif self._executor_drafts:  # they follow the tokens just taken
                request.draft_token_ids = list(output.draft_token_ids.get(request.request_id, ()))
            updates.append(update)
        if any_finished:
            self._running = [r for r in self._running if r.machine.state is _RUNNING]
        return updates

    # -- internals -----------------------------------------------------------------

    def _take_samples(self, request: Request, samples: Sequence[SampledToken]) -> RequestUpdate:
        """Append the step's tokens to `request` one by one, stopping at the first that
        finishes it; the update that says so (the request is not released here)."""
        tokens = request.token_ids
        grammar = request.grammar
        taken = 0
        reason = error = None
        for sample in samples:
            token_id = sample.token_id
            if (
                grammar is not None
                and token_id not in request.stop_token_ids
                and not grammar.accept(token_id)
            ):  # the forbidden token is not output
                reason = _ERROR
                error = f"request {request.request_id!r}: token {token_id} breaks its grammar"
                break
            tokens.append(token_id)
            taken += 1
            length = len(tokens)
            if token_id in request.stop_token_ids and length >= request.min_len:
                reason = _STOP
            elif length >= request.max_len:
                reason = _LENGTH
            elif grammar is not None and grammar.is_terminated():
                reason = _STOP
            if reason is not None:
                break
        if taken == 1 and error is None:
            return build_update(request.request_id, (tokens[-1],), (samples[0],), reason)
        return build_update(
            request.request_id,
            tuple(tokens[len(tokens) - taken :]),
            tuple(samples[:taken]),
            reason,
            error,
        )

    def _sits_out_to_draft(self, request: Request) -> bool:
        """Async scheduling: whether `request`, its sample in flight, leaves this step
        to decode with drafts in the next (drafts follow known tokens only): while the
        proposer matches its tokens so far and it is not backing off, or the draft
        model was asked for drafts with that sample. A sit-out that finds no drafts, or
        drafts all rejected, is a miss that backs it off."""
        if self._executor_drafts:
            return request.drafts_coming
        return request.backoff.may_draft() and bool(self._proposer.propose(request.token_ids, 1))

    def _wants_drafts(self, request: Request) -> bool:
        """Whether a decode of `request` looks for drafts: prompt lookup while it is not
        backing off; a draft model's when its last sampling chunk asked for them."""
        if self._executor_drafts:
            return request.drafts_coming
        return request.backoff.may_draft()

    def _lookahead(self, request: Request, end: int) -> int:
        """Drafts the draft model is to propose after a sampling chunk of `request`
        ending at `end` (0 while it backs off): k, cut to what its length allows and to
        the blocks that can be added for them while a block per running request stays
        free, so drafting never costs a decode its block. The blocks are added now: the
        draft model writes its KV there."""
        if not request.backoff.may_draft():
            return 0
        count = min(self.config.speculative.num_speculative_tokens, request.max_len - end - 1)
        table = request.block_table
        block_manager = self.block_manager
        spare = block_manager.num_free_blocks - len(self._running)
        while count > 0 and block_manager.blocks_needed(end + count) - len(table) > spare:
            count -= 1
        if count <= 0:
            return 0
        block_manager.append(table, end + count)
        return count

    @staticmethod
    def _draft_start(request: Request, end: int) -> int:
        """Where the draft model's run of a chunk of `request` ending at `end` starts
        (its KV is valid before it); the draft is then valid up to `end`, less any
        rejected drafts (`update`)."""
        start = request.draft_computed
        request.draft_computed = end
        return start

    def _drafts(self, request: Request, room: int) -> list[int]:
        """Drafts for a decode of `request`: proposed (or taken from the draft model),
        then cut to `room`, to what its length allows, to what its grammar accepts and
        to the blocks free now."""
        spec = self.config.speculative
        tokens = request.token_ids
        count = min(spec.num_speculative_tokens, room, request.max_len - len(tokens) - 1)
        if self._executor_drafts:
            drafts = request.draft_token_ids[: max(count, 0)]
            request.draft_token_ids = []
        else:
            drafts = self._lookup(request, count) if count > 0 else []
        if drafts and request.grammar is not None:
            del drafts[request.grammar.valid_prefix(drafts) :]
        table = request.block_table
        while drafts and not self.block_manager.can_append(table, len(tokens) + len(drafts)):
            drafts.pop()
        return drafts

    def _lookup(self, request: Request, count: int) -> list[int]:
        """Prompt lookup's drafts. Under a grammar, the text it forces next comes first
        (jump-forward decoding, as drafts: the target still samples each one, so a
        tokenization the model would not choose is only rejected), and the lookup
        continues after it."""
        grammar = request.grammar
        drafts = grammar.forced_tokens()[:count] if grammar is not None else []
        if len(drafts) < count:
            history = request.token_ids + drafts if drafts else request.token_ids
            drafts += self._proposer.propose(history, count - len(drafts))
        return drafts

    def _verified(
        self, request: Request, chunk: SequenceChunk, samples: Sequence[SampledToken]
    ) -> Sequence[SampledToken]:
        """The samples a decode with drafts emits: each draft that equals the token
        sampled before it, then the first sampled token that differs (or the last)."""
        drafts = chunk.token_ids[1:]
        accepted = accepted_drafts(drafts, samples)
        request.backoff.verified(accepted)
        self.spec_counts.record(len(drafts), accepted)
        return samples[: accepted + 1]

    def _admit(
        self,
        chunks: list[SequenceChunk],
        requests: list[Request],
        budget: int,
        num_sampled: int,
        lookahead_wanted: bool,
    ) -> tuple[int, int]:
        """Admit waiting requests with prefill chunks while budget, seats and blocks last."""
        waiting = self._waiting
        running = self._running
        block_manager = self.block_manager
        max_num_seqs = self.config.max_num_seqs
        new_allowed = self._pause is None
        compiling: list[Request] = []
        # The adapters holding device slots: the running requests' and the pinned ones
        # (built at the first waiting request with an adapter).
        slots: set[str] | None = None
        while waiting and budget > 0 and len(running) < max_num_seqs:
            request = waiting[0]
            if not new_allowed and request.machine.state is not _PREEMPTED:
                break
            if request.grammar is not None and not request.grammar.ready:
                compiling.append(waiting.popleft())  # put back in place below
                continue
            lora = request.lora
            if lora is not None:
                if slots is None:
                    slots = {r.lora for r in running if r.lora is not None}
                    slots |= self._pinned_loras
                if lora not in slots and len(slots) >= self.config.max_loras:  # type: ignore[operator]
                    break  # first in line once an adapter's slot frees
            tokens = request.token_ids
            hit = block_manager.lookup_prefix(tokens, request.prefix_root)
            computed = hit.num_tokens
            total = len(tokens)
            end = min(total, computed + budget)
            if not block_manager.can_allocate(hit, end):
                break
            waiting.popleft()
            request.machine.handle(_SCHEDULE)
            request.block_table = block_manager.allocate(hit, end)
            request.block_hashes = list(hit.block_hashes)
            request.num_computed_tokens = end
            running.append(request)
            if lora is not None and slots is not None:
                slots.add(lora)
            sample = end == total
            num_sampled += sample
            lookahead = self._lookahead(request, end) if sample and lookahead_wanted else 0
            request.drafts_coming = lookahead > 0
            request.draft_computed = 0  # the blocks' draft KV is unknown: run it all
            draft_start = self._draft_start(request, end) if lookahead_wanted else None
            chunks.append(
                build_chunk(
                    request.request_id,
                    tokens[computed:end],
                    computed,
                    request.block_table,
                    sample,
                    request.sampling,
                    tokens,
                    request.prompt_len,
                    0,
                    request.lora,
                    lookahead,
                    draft_start,
                )
            )
            requests.append(request)
            budget -= end - computed
        waiting.extendleft(reversed(compiling))
        return budget, num_sampled

    def _output(
        self,
        step: int,
        chunks: list[SequenceChunk],
        requests: list[Request],
        num_sampled: int,
        num_tokens: int,
        num_preempted: int,
        placeholders: tuple[tuple[list[int], str], ...] = (),
    ) -> SchedulerOutput:
        stats = self._snapshot(
            step=step, num_seqs=len(chunks), num_tokens=num_tokens, num_preempted=num_preempted
        )
        self._last_stats = stats
        output = SchedulerOutput(
            step=step,
            batch=ModelBatch(chunks=tuple(chunks)),
            requests=tuple(requests),
            num_sampled=num_sampled,
            num_preempted=num_preempted,
            stats=stats,
            placeholders=placeholders,
        )
        if chunks:
            self._in_flight.append(output)
        return output

    def _snapshot(
        self, *, step: int, num_seqs: int, num_tokens: int, num_preempted: int
    ) -> SchedulerStats:
        block_manager = self.block_manager
        return SchedulerStats(
            step=step,
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            num_scheduled_seqs=num_seqs,
            num_scheduled_tokens=num_tokens,
            num_preempted=num_preempted,
            kv_usage=block_manager.usage,
            prefix_cache_hit_rate=block_manager.prefix_cache_hit_rate,
            prefix_cache_queries=block_manager.prefix_cache_queries,
            prefix_cache_hits=block_manager.prefix_cache_hits,
        )

    def _cache_blocks(self, request: Request) -> None:
        self.block_manager.cache_full_blocks(
            request.block_table,
            request.block_hashes,
            request.token_ids,
            request.num_computed_tokens,
            request.prefix_root,
        )

    def _preempt(self, request: Request) -> None:
        request.machine.handle(_PREEMPT)
        self._free_blocks(request)
        request.num_computed_tokens = 0
        self._waiting.appendleft(request)

    def _release(self, request: Request, reason: FinishReason) -> None:
        """Finish a request and free its blocks; the caller removes it from its queue."""
        request.machine.handle(Finish(reason=reason))
        self._free_blocks(request)
        del self._requests[request.request_id]

    def _finish_out_of_band(self, request: Request, reason: FinishReason) -> None:
        state = request.machine.state
        self._release(request, reason)
        if state is _RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)

    def _free_blocks(self, request: Request) -> None:
        # New lists rather than clear(): a batch in flight may still read the old ones.
        if request.block_table:
            self.block_manager.free(request.block_table)
        request.block_table = []
        request.block_hashes = []
