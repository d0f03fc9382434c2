"""The simulated client: its view of the engines and what it refuses to do.

The client's view of (wave, running) is whatever the coordinator last published, and
may be stale; it sends FIRST_REQ whenever that view says idle. Each call it makes
carries a call id; it waits for the replies of a pause or a sleep (and of a scale's
pause and switch), and only a reply to that call id counts. It refuses what the
engine's front end refuses: a call while a pause or sleep is in flight, resume while
asleep, anything but submitting while a scale runs, a scale while paused or asleep.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rank_events import PauseMode


class ClientRefused(Exception):
    """The client refuses an operation in its current state (e.g. resume while pausing)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestSpec:
    rank: int
    steps: int = 2
    stalls: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientState:
    group: int
    # Where new requests go: ranks [0, routing); a scale down narrows it first.
    routing: int
    wave: int = 0
    running: bool = False
    submitted: int = 0
    owners: tuple[int, ...] = ()
    done: frozenset[int] = frozenset()
    # The ended requests that ended with an error (their rank died), a subset of done.
    failed: frozenset[int] = frozenset()
    held: frozenset[int] = frozenset()
    calls: int = 0
    awaited_call: int | None = None
    # The mode of the awaited pause or sleep: each rank's answer is checked against it.
    awaited_mode: PauseMode | None = None
    awaiting: frozenset[int] = frozenset()
    # The ranks that took the awaited call so far, and once a KEEP or ABORT pause
    # reached all of them, the (wave, step) by which it must be done (rank rule 7).
    arrivals: frozenset[int] = frozenset()
    pause_deadline: tuple[int, int] | None = None
    # The requests the ranks held when the awaited ABORT pause or sleep reached them:
    # each must have ended by the rank's answer (held through an earlier pause too).
    doomed: frozenset[int] = frozenset()
    paused: bool = False
    asleep: bool = False
    # The size the coordinator last published (a scale waits for its new size).
    published_size: int = 0
    # The running drain's timeout fired: it aborts what is left once, as the engine's
    # does, then waits for the aborts to end the requests.
    drain_timed_out: bool = False

    def unfinished_on(self, ranks: range) -> tuple[int, ...]:
        return tuple(
            request
            for request, rank in enumerate(self.owners)
            if rank in ranks and request not in self.done
        )


def refusal(client: ClientState, op: tuple[object, ...], scaling: bool) -> str | None:
    """Why the client would refuse ``op`` now, or None when it may go ahead."""
    kind = op[0]
    if scaling:
        return "a reconfiguration is in progress"
    if client.awaiting:
        return "a pause or sleep is still in flight"
    if kind == "resume" and client.asleep:
        return "asleep: wake up first"
    if kind == "scale" and (client.paused or client.asleep):
        return "the engines are paused or asleep"
    if kind == "scale" and op[1] == client.group:
        return f"already {client.group} ranks (a shrink got there first)"
    if kind not in ("pause", "resume", "sleep", "wake", "scale"):
        raise ValueError(f"unknown client operation {op!r}")
    return None
