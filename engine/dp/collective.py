"""The DP all-reduce: a gloo process group of the engine's own, over the client's store.

Each engine hosts its own `TCPStore` (in the client, on 127.0.0.1 port 0) and every rank
builds a `ProcessGroupGloo` over a `PrefixStore` of it, so several engines (and tests)
coexist on one machine without touching torch's global default group. Ranks reach the
store through `SignedStore` (`signed_store`): what a stranger writes there is refused.

One collective, one layout: every vote and every resume barrier is a single MAX
all-reduce of

    [kind, -kind, has_unfinished, wave, -wave, step_counter, -step_counter, votes...]

where `votes` has one slot per rank (1 where that rank votes to pause). MAX over a pair
`[x, -x]` yields both the max and the min of `x`, which is how drift (ranks meeting with
different waves or step counters) and a mixed collective (one rank in a vote, another in
the resume barrier) are detected instead of producing nonsense.

A vote does not block: `start_vote` hands the all-reduce to gloo's own thread and
returns at once, `await_vote` waits for the oldest started vote (the rank loop reads a
vote one step after it started it, so the all-reduce overlaps a forward). The barrier
blocks. Whatever blocks runs on the rank's model thread, in order with its forwards.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from wavecore.channels import ChannelKey
from wavecore.engine.dp.signed_store import open_group_store

_SYNC, _BARRIER = 1, 2


class CollectiveMismatchError(RuntimeError):
    """Ranks met in one all-reduce from different collectives (vote vs barrier)."""


class CollectiveTimeoutError(RuntimeError):
    """A peer did not join a collective within the group's timeout (it is stuck,
    stopped, or gone); the message names this rank and the peers it waited for."""


class GroupAbortedError(RuntimeError):
    """The group was aborted (`DPGroup.abort`) while this rank waited in a collective."""


# How often a collective's wait looks whether its group was aborted meanwhile: gloo's
# own abort wakes no waiter, so a wait runs in slices (a collective that completes
# returns at once, whatever the slice).
_WAIT_SLICE = timedelta(milliseconds=100)


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncResult:
    any_unfinished: bool
    pausing_ranks: int
    wave_span: tuple[int, int]
    step_counter_span: tuple[int, int]


class DPGroup:
    """This rank's handle on the DP group; build it with `DPGroup.join`."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, *, timeout_s: float) -> None:
        self._group = group
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self._options = dist.AllreduceOptions()
        self._options.reduceOp = dist.ReduceOp.MAX
        self._votes: deque[tuple[dist.Work, torch.Tensor]] = deque()
        self._aborted = False

    @classmethod
    def join(
        cls,
        *,
        host: str,
        port: int,
        prefix: str,
        rank: int,
        size: int,
        timeout_s: float,
        key: ChannelKey,
        rendezvous_timeout_s: float | None = None,
    ) -> DPGroup:
        """Wait up to `rendezvous_timeout_s` (default `timeout_s`) for every member to
        reach the store (ranks load their models at their own pace); then every
        collective of the group fails after `timeout_s` (`EngineConfig.collective_timeout`)
        if a peer never joins it. `key`: the engine's channel key, which signs the store."""
        rendezvous = timeout_s if rendezvous_timeout_s is None else rendezvous_timeout_s
        store = open_group_store(
            host, port, size=size, timeout=timedelta(seconds=rendezvous), key=key
        )
        # Every member reaches the store first, so that the group's connection (bounded
        # by its own, shorter timeout) never waits for a peer still loading its model.
        arrived = dist.PrefixStore(f"{prefix}/arrived", store)
        arrived.set(str(rank), "1")
        arrived.wait([str(member) for member in range(size)])
        timeout = timedelta(seconds=timeout_s)
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)
        return cls(group, rank, size, timeout_s=timeout_s)

    def start_vote(
        self, *, has_unfinished: bool, pending_pause: bool, wave: int, step_counter: int
    ) -> None:
        """Start this step's vote; it completes in the background."""
        tensor = self._layout(_SYNC, has_unfinished, wave, step_counter, pending_pause)
        self._votes.append((self._group.allreduce([tensor], self._options), tensor))

    def await_vote(self) -> SyncResult:
        """The oldest started vote's result (blocks until every rank started it)."""
        if not self._votes:
            raise RuntimeError(f"rank {self.rank} awaits a vote it never started")
        work, tensor = self._votes.popleft()
        self._wait(work, "a vote")
        reduced = self._checked(tensor)
        return SyncResult(
            any_unfinished=bool(reduced[2]),
            pausing_ranks=int(sum(reduced[7:])),
            wave_span=(-int(reduced[4]), int(reduced[3])),
            step_counter_span=(-int(reduced[6]), int(reduced[5])),
        )

    def barrier(self, *, has_unfinished: bool) -> bool:
        """The resume barrier: whether any rank holds work."""
        if self._votes:
            raise RuntimeError(f"rank {self.rank} enters the barrier with a vote unread")
        tensor = self._layout(_BARRIER, has_unfinished, 0, 0, False)
        self._wait(self._group.allreduce([tensor], self._options), "the resume barrier")
        return bool(self._checked(tensor)[2])

    def abort(self) -> None:
        """Close this group's connections (it broke: a peer died or is stuck), so that a
        survivor still waiting in one of its collectives fails at once, not after the
        collective timeout; a collective this rank waits in (on another thread) fails
        within a wait slice. Callable from any thread."""
        self._aborted = True
        self._group.abort()

    def _wait(self, work: dist.Work, what: str) -> None:
        """Wait for a collective; gloo's own timeout error names no rank, this one says
        which rank gave up and on whom."""
        try:
            self._wait_in_slices(work, what)
        except GroupAbortedError:
            raise
        except RuntimeError as error:
            # gloo says "Timed out waiting ..." when the wait itself expires, and
            # "Application timeout caused pair closure" when a pending send on the
            # peer's connection expired first: the same stuck peer either way.
            text = str(error).lower()
            if "timed out" not in text and "application timeout" not in text:
                raise
            peers = ", ".join(str(rank) for rank in range(self.size) if rank != self.rank)
            raise CollectiveTimeoutError(
                f"rank {self.rank} waited {self.timeout_s:g} s (collective_timeout) in "
                f"{what} for its peers (ranks {peers}); one of them did not join it"
            ) from error

    def _wait_in_slices(self, work: dist.Work, what: str) -> None:
        while True:
            try:
                work.wait(_WAIT_SLICE)
                return
            except RuntimeError:
                if work.is_completed():
                    work.wait()  # it ended meanwhile: return or raise its own outcome
                    return
                if self._aborted:
                    raise GroupAbortedError(
                        f"rank {self.rank} left its DP group while waiting in {what} "
                        "(the group was aborted: the client dropped a lost peer)"
                    ) from None

    def _layout(
        self, kind: int, has_unfinished: bool, wave: int, step_counter: int, vote: bool
    ) -> torch.Tensor:
        votes = [0] * self.size
        votes[self.rank] = int(vote)
        values = [kind, -kind, int(has_unfinished), wave, -wave, step_counter, -step_counter]
        return torch.tensor(values + votes, dtype=torch.int64)

    def _checked(self, tensor: torch.Tensor) -> list[int]:
        reduced = tensor.tolist()
        if reduced[0] != -reduced[1]:
            raise CollectiveMismatchError(
                f"rank {self.rank} met its peers in different collectives "
                f"(kinds {-reduced[1]}..{reduced[0]}; 1 = vote, 2 = resume barrier)"
            )
        return reduced
