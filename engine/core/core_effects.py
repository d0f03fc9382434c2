"""`RankEffects` on an `EngineCore`: what the rank loop does without waiting.

The scheduler is touched at once; messages are buffered, in order, until the runner
flushes them: the iteration's token updates become ONE `StepOutputs`, closed before
any reply so that a call's own updates (aborts) precede its answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from wavecore.engine import messages as m
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.interface import RankStats
from wavecore.engine.scheduler import RequestUpdate
from wavecore.statemachines import (
    NotifyStartWave,
    NotifyWaveComplete,
    PauseMode,
    ProtocolError,
    StartVote,
)

# What a rank's loop counts, reported in `RankCounters`.
COUNTERS = (
    "real_steps",
    "dummy_steps",
    "votes",
    "waves_started",
    "waves_completed",
    "requests_added",
    "requests_held",
    "last_pause_forwards",
)


class CoreEffects:
    """See the module docstring; `counts` are the runner's counters, `stats` its report."""

    def __init__(
        self,
        core: EngineCore,
        rank: int,
        counts: dict[str, int],
        stats: Callable[[], RankStats],
        start_vote: Callable[[StartVote], None],
    ) -> None:
        self._core = core
        self._start_vote = start_vote
        self._rank = rank
        self._counters = counts
        self._stats = stats
        self._outputs: list[object] = []
        self._notices: list[object] = []
        self._pause_started_at: int | None = None
        self._pause_calls: set[int] = set()
        self._failed_calls: dict[int, str] = {}
        # The current iteration's token updates, in StepOutputs' columns.
        self._ids: list[str] = []
        self._counts: list[int] = []
        self._tokens: list[int] = []
        self._finished: dict[str, str] = {}
        self._errors: dict[str, str] = {}
        self._logprobs: list[m.RequestLogprobs] = []
        # Forwards recorded since the last frame that carried them (`record_iteration`).
        self._iterations: list[m.IterationDetails] = []

    def renumber(self, rank: int) -> None:
        """A shrink gave this rank a new number: its messages carry it from now on."""
        self._rank = rank

    # -- RankEffects --------------------------------------------------------------------

    def add_request(self, request_id: str, payload: object) -> None:
        self._core.add_request(payload)  # type: ignore[arg-type]
        self._counters["requests_added"] += 1

    def abort_requests(self, request_ids: tuple[str, ...]) -> None:
        self.emit(self._core.abort_requests(request_ids))

    def stop_requests(self, request_ids: tuple[str, ...]) -> None:
        for request_id in request_ids:
            try:
                self._core.finish_stopped(request_id)
            except ProtocolError:
                # Preempted since its last token: it is not running, so abort it instead.
                self._core.abort_requests([request_id])

    def pause_scheduler(self, mode: PauseMode) -> None:
        self.emit(self._core.pause_scheduler(mode))

    def resume_scheduler(self) -> None:
        self._core.resume_scheduler()

    def reset_prefix_cache(self) -> None:
        self._core.reset_prefix_cache()

    def start_vote(self, vote: StartVote) -> None:
        self._start_vote(vote)

    def notify_coordinator(self, message: NotifyStartWave | NotifyWaveComplete) -> None:
        if isinstance(message, NotifyStartWave):
            self._counters["waves_started"] += 1
            self._notices.append(m.WaveStarted(rank=self._rank, wave=message.wave))
        else:
            self._counters["waves_completed"] += 1
            self._notices.append(m.WaveComplete(wave=message.wave))

    def announce_held(self, request_ids: tuple[str, ...], reason: str) -> None:
        self._counters["requests_held"] += 1
        self._outputs.append(
            m.RequestsHeld(rank=self._rank, request_ids=request_ids, reason=reason)
        )

    def report(self) -> object:
        stats = self._stats()
        # Only a real model has a path to report (`ModelExecutor.path_report`).
        path_report = getattr(self._core.executor, "path_report", None)
        if path_report is None:
            return stats
        return dataclasses.replace(stats, kernels=path_report())

    def fail_call(self, call_id: int, error: str) -> None:
        """Have this call's reply, whenever the loop sends it, carry `error` (a switch
        whose new group did not form: the machine completes it, the client must not
        take it for a success)."""
        self._failed_calls[call_id] = error

    def reply(self, call_id: int, *, error: str | None = None, result: object = None) -> None:
        error = self._failed_calls.pop(call_id, error)
        if call_id in self._pause_calls:
            self._pause_calls.discard(call_id)
            if not self._pause_calls and self._pause_started_at is not None:
                forwards = self._forwards() - self._pause_started_at
                self._counters["last_pause_forwards"] = forwards
                self._pause_started_at = None
        self._close_step_outputs(with_iterations=True)  # the call's own updates go first
        stats = result if isinstance(result, RankStats) else None
        self._outputs.append(
            m.UtilityResult(rank=self._rank, call_id=call_id, error=error, stats=stats)
        )

    # -- bookkeeping --------------------------------------------------------------------

    def _forwards(self) -> int:
        return self._counters["real_steps"] + self._counters["dummy_steps"]

    def pause_started(self, call_id: int) -> None:
        self._pause_calls.add(call_id)
        if self._pause_started_at is None:
            self._pause_started_at = self._forwards()

    def emit(self, updates: list[RequestUpdate]) -> None:
        for update in updates:
            request_id = update.request_id
            self._ids.append(request_id)
            self._counts.append(len(update.new_token_ids))
            self._tokens.extend(update.new_token_ids)
            if update.finish_reason is not None:
                self._finished[request_id] = str(update.finish_reason)
                if update.error is not None:
                    self._errors[request_id] = update.error
            if update.sampled and update.sampled[0].logprob is not None:
                entries = tuple((s.token_id, s.logprob, s.top_logprobs) for s in update.sampled)
                self._logprobs.append(m.RequestLogprobs(request_id=request_id, entries=entries))

    def record_iteration(self, details: m.IterationDetails) -> None:
        """A forward's details, sent with the next `StepOutputs` (see its docstring)."""
        self._iterations.append(details)

    def _close_step_outputs(self, *, with_iterations: bool = False) -> None:
        """Close the iteration's `StepOutputs`, if it has updates, or if it must carry
        the held iteration details (`with_iterations`, or too many held)."""
        held = len(self._iterations)
        if not self._ids and not (held and (with_iterations or held >= m.ITERATIONS_PER_FRAME)):
            return
        self._outputs.append(
            m.StepOutputs(
                rank=self._rank,
                request_ids=tuple(self._ids),
                token_counts=tuple(self._counts),
                token_ids=tuple(self._tokens),
                finished=self._finished,
                logprobs=tuple(self._logprobs),
                errors=self._errors,
                iterations=tuple(self._iterations),
            )
        )
        self._ids, self._counts, self._tokens = [], [], []
        self._finished, self._logprobs, self._errors = {}, [], {}
        self._iterations = []

    def take_outputs(self, *, idle: bool = False) -> list[object]:
        """What to send now; `idle`: the rank is about to wait for input, so the held
        iteration details go too."""
        self._close_step_outputs(with_iterations=idle)
        outputs, self._outputs = self._outputs, []
        return outputs

    def take_notices(self) -> list[object]:
        notices, self._notices = self._notices, []
        return notices
