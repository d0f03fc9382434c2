"""The modelled scheduler behind each simulated rank: toy requests, toy steps.

A toy request needs ``remaining`` forwards after ``stalls`` zero-token steps (a stall
models a step that scheduled nothing while work remains). Its first scheduled step
admits it, so every stall after the first is an admitted request's: the real
scheduler's preempted request waiting for a prefill step (``prefill_interval``, and no
admission on a step that preempted) can stall any number of times after admission, and
that again after each preemption, while a WAIT pause waits for it (rank rule 6).
The scheduler honours the rank machine's ``PauseScheduler`` modes as the engine's
does: ABORT finished everything (done by the caller), WAIT runs only requests already
admitted, KEEP runs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..rank_events import PauseMode, StartVote


@dataclass(frozen=True, slots=True, kw_only=True)
class ToyRequest:
    id: int
    remaining: int
    stalls: int
    admitted: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ToyRank:
    """What the modelled effects of one rank hold besides its loop."""

    requests: tuple[ToyRequest, ...] = ()
    scheduler_pause: PauseMode | None = None
    # Forwards run in the wave ``forwards_wave``: the lockstep checks compare them with
    # the step counter each rank brings to an all-reduce.
    forwards: int = 0
    forwards_wave: int = 0
    # The votes this rank started that a member of its group may still read (rank rule
    # 2), oldest first, and how many of them this rank read; the group's lists start at
    # the same vote, so index i is one all-reduce.
    votes: tuple[StartVote, ...] = ()
    votes_read: int = 0


def toy_step(
    requests: tuple[ToyRequest, ...], pause: PauseMode | None
) -> tuple[bool, tuple[ToyRequest, ...], frozenset[int]]:
    """One scheduler step: every schedulable request advances (a stall counts as a
    zero-token step). Returns (executed, remaining requests, finished ids)."""
    executed = False
    remaining: list[ToyRequest] = []
    finished: set[int] = set()
    for request in requests:
        schedulable = pause is None or (pause is PauseMode.WAIT and request.admitted)
        if not schedulable:
            remaining.append(request)
        elif request.stalls:
            remaining.append(replace(request, stalls=request.stalls - 1, admitted=True))
        else:
            executed = True
            if request.remaining > 1:
                remaining.append(replace(request, remaining=request.remaining - 1, admitted=True))
            else:
                finished.add(request.id)
    return executed, tuple(remaining), frozenset(finished)


def preempted(requests: tuple[ToyRequest, ...]) -> tuple[ToyRequest, ...]:
    """A sleep dropped the KV cache: kept requests go back to waiting, to be recomputed."""
    return tuple(replace(request, admitted=False) for request in requests)
