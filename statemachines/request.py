"""The lifecycle of one generation request, as a pure state machine.

The scheduler drives one `RequestMachine` per request and consults it before every
queue move, so a request can never be in two places or finish twice. The machine
does no I/O and knows nothing of tokens or blocks; it only says which moves are legal.

Rules:

1. A request starts WAITING: accepted, holding no KV blocks.
2. `Schedule` moves WAITING or PREEMPTED to RUNNING: it was given KV blocks and
   takes part in forward passes (prefill chunks, then one decode token per step).
3. `Preempt` moves RUNNING to PREEMPTED: its blocks were taken back under memory
   pressure. It keeps its output tokens and recomputes their KV when rescheduled.
4. `Finish(reason)` moves a live request to FINISHED, which is final.
   STOP and LENGTH are decided by generated tokens, so they are legal only from
   RUNNING; ABORT and ERROR are legal from any live state (WAITING, RUNNING,
   PREEMPTED).
5. Any other (state, event) pair raises `ProtocolError` and leaves the machine
   exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .errors import ProtocolError


class RequestState(Enum):
    WAITING = "WAITING"
    RUNNING = "RUNNING"
    PREEMPTED = "PREEMPTED"
    FINISHED = "FINISHED"

    def __str__(self) -> str:
        return self.value


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """The request was given KV blocks and joins the running batch."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Preempt:
    """The request's KV blocks were taken back; it will be recomputed later."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Finish:
    """The request is over, for `reason`."""

    reason: FinishReason


RequestEvent = Schedule | Preempt | Finish

_LIVE = (RequestState.WAITING, RequestState.RUNNING, RequestState.PREEMPTED)

# (state, event type) -> next state. Rule 4's reason restriction is the table below.
TRANSITIONS: dict[tuple[RequestState, type], RequestState] = {
    (RequestState.WAITING, Schedule): RequestState.RUNNING,
    (RequestState.PREEMPTED, Schedule): RequestState.RUNNING,
    (RequestState.RUNNING, Preempt): RequestState.PREEMPTED,
    **{(state, Finish): RequestState.FINISHED for state in _LIVE},
}

_ANY_REASON = frozenset(FinishReason)
_EXTERNAL_REASONS = frozenset({FinishReason.ABORT, FinishReason.ERROR})

FINISH_REASONS_ALLOWED: dict[RequestState, frozenset[FinishReason]] = {
    RequestState.WAITING: _EXTERNAL_REASONS,
    RequestState.RUNNING: _ANY_REASON,
    RequestState.PREEMPTED: _EXTERNAL_REASONS,
}


class RequestMachine:
    """One request's lifecycle state; see the module docstring for the rules."""

    __slots__ = ("finish_reason", "state")

    def __init__(self) -> None:
        self.state = RequestState.WAITING
        self.finish_reason: FinishReason | None = None

    def __repr__(self) -> str:
        return f"RequestMachine(state={self.state}, finish_reason={self.finish_reason})"

    def handle(self, event: RequestEvent) -> RequestState:
        """Apply `event` and return the new state, or raise `ProtocolError` (rule 5)."""
        target = TRANSITIONS.get((self.state, type(event)))
        if target is None:
            raise ProtocolError("RequestMachine", self.state, event)
        if type(event) is Finish:
            if not isinstance(event.reason, FinishReason):
                raise ProtocolError(
                    "RequestMachine", self.state, event, "reason must be a FinishReason"
                )
            if event.reason not in FINISH_REASONS_ALLOWED[self.state]:
                raise ProtocolError(
                    "RequestMachine",
                    self.state,
                    event,
                    f"only a running request can finish with {event.reason.name}",
                )
            self.finish_reason = event.reason
        self.state = target
        return target

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED
