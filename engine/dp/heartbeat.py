"""Heartbeats between the DP front end and its ranks: silence is how a stopped, hung or
unreachable peer shows, where no process exit and no collective would.

Theory of operation:

1. Every `heartbeat_interval` each rank sends `RankAlive` on its output channel and the
   front end sends `FrontEndAlive` on every rank's input channel. The channels coalesce
   whatever a tick sends into one frame, so a beat rides with the traffic of its tick.
   Beats come from a task of the event loop, never from the model thread: forwards and
   collectives run on the model thread while the loop goes on beating, so a long step
   never reads as a death. A beat never holds up the judging (`_Beats`): a channel
   whose peer stopped reading makes a send wait once its batch is full.
2. Any message from a peer is a sign of life, not only its beat: a peer whose beat
   queues behind a burst of its outputs is busy, not silent.
3. A peer is silent once nothing came from it for `heartbeat_timeout`, judged every
   interval (`SilenceClock`). A tick that comes more than an interval late means the
   observer itself stood still (stopped, or its event loop blocked): what its peers
   sent meanwhile may still wait unread in its own buffers, so that tick judges no one;
   the next one does, once the receivers had an interval to catch up. (Restarting the
   count instead would let a loaded observer, late now and then, never judge at all.)
4. The front end (`RankHeartbeats`, in `DPClient`): a silent rank is lost exactly as a
   dead one (shrink, or the engine's death, by `on_rank_failure`). While a scale or a
   shrink runs it judges no rank (rank numbers change under it, and these bound their
   own waits) and counts every rank's silence afresh when it ends; it beats throughout.
5. A headless rank (`wavecore rank`, `FrontEndWatch`): a silent front end ends the rank
   with one line on stderr and exit code `FRONT_END_LOST_EXIT`; restarting it joins a
   new front end. A rank the front end spawned does not judge it: it ends with its
   parent (`parent_watch`), and a front end held in a debugger finds its ranks alive.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import anyio
import anyio.abc

from wavecore.channels import MessageSender
from wavecore.engine import messages as m
from wavecore.engine.core.rank_runner import Sink

logger = logging.getLogger("wavecore.engine.dp")

# The exit code of a headless rank whose front end went silent.
FRONT_END_LOST_EXIT = 3
# How long a headless rank that lost its front end may take to close its model and
# channels before it leaves anyway (a collective with peers that are gone could hold
# its model thread for up to collective_timeout); the kernel releases what is left.
_EXIT_GRACE_S = 5.0
_FRONT_END = -1


class SilenceClock:
    """How long each peer has been silent, counted only over time this process was
    listening (rule 3). Peers are keyed by an int: a rank number, or `_FRONT_END`."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._since = anyio.current_time()
        self._ticked = self._since
        self._heard: dict[int, float] = {}

    def heard(self, peer: int) -> None:
        self._heard[peer] = anyio.current_time()

    def restart(self) -> None:
        """Count every peer's silence from now."""
        self._since = anyio.current_time()

    async def tick(self) -> float | None:
        """Wait one interval; return the time to judge at, or None when this tick came
        more than an interval late (this process stood still: judge no one now)."""
        await anyio.sleep(self._interval)
        now = anyio.current_time()
        late = now - self._ticked > 2 * self._interval
        self._ticked = now
        return None if late else now

    def silent_for(self, peer: int, now: float) -> float:
        return now - max(self._heard.get(peer, self._since), self._since)


class RankHeartbeats:
    """The front end's side (rule 4): beats to every rank, judges their silence."""

    def __init__(self, interval: float, timeout: float) -> None:
        self._interval = interval
        self._timeout = timeout
        self._clock: SilenceClock | None = None
        self._suspended = 0
        self._reported: set[int] = set()

    def heard(self, rank: int) -> None:
        if self._clock is not None:
            self._clock.heard(rank)

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Judge no rank in the block (ranks are renumbered in it); afterwards every
        rank's silence counts from its end."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1
            if self._clock is not None:
                self._clock.restart()
            self._reported.clear()

    async def run(
        self,
        ranks: Callable[[], Sequence[MessageSender]],
        on_silent: Callable[[int, float], None],
    ) -> None:
        """For the engine's lifetime: beat to `ranks()` (each rank's input, by number);
        call `on_silent(rank, seconds)` once for a rank silent past the timeout."""
        clock = self._clock = SilenceClock(self._interval)
        beat = m.FrontEndAlive()
        async with anyio.create_task_group() as tasks:
            beats = _Beats(tasks)
            while True:
                now = await clock.tick()
                senders = list(ranks())
                for sender in senders:
                    beats.send(sender, beat)
                if now is None or self._suspended:
                    continue
                for rank in range(len(senders)):
                    silent = clock.silent_for(rank, now)
                    if silent >= self._timeout and rank not in self._reported:
                        self._reported.add(rank)
                        on_silent(rank, silent)


class FrontEndWatch:
    """A rank's side (rule 5): beats to the front end and, on a headless rank, ends the
    rank when the front end goes silent (`lost` then says so)."""

    def __init__(self, *, interval: float, timeout: float, judges: bool) -> None:
        self._interval = interval
        self._timeout = timeout
        self._judges = judges
        self._clock: SilenceClock | None = None
        self.lost = False

    def heard(self) -> None:
        """The front end sent something."""
        if self._clock is not None:
            self._clock.heard(_FRONT_END)

    async def run(
        self, outputs: Sink, rank: Callable[[], int], member: int, serving: anyio.CancelScope
    ) -> None:
        """Beat on `outputs` as rank `rank()` (it changes when a shrink renumbers the
        ranks), member `member`; when the front end is silent past the timeout, cancel
        `serving`."""
        clock = self._clock = SilenceClock(self._interval)
        async with anyio.create_task_group() as tasks:
            beats = _Beats(tasks)
            while True:
                now = await clock.tick()
                beats.send(outputs, m.RankAlive(rank=rank(), member=member))
                if not self._judges or now is None:
                    continue
                silent = clock.silent_for(_FRONT_END, now)
                if silent >= self._timeout:
                    logger.error(
                        "rank %d (pid %d): the front end sent nothing for %.1f s "
                        "(heartbeat_timeout %g s: it is gone, stopped or unreachable); "
                        "exiting with code %d, restart this rank to join a new front end",
                        rank(),
                        os.getpid(),
                        silent,
                        self._timeout,
                        FRONT_END_LOST_EXIT,
                    )
                    self.lost = True
                    _leave_after(_EXIT_GRACE_S)
                    serving.cancel()  # this task's beats in flight too
                    return


class _Beats:
    """Sends beats without waiting for them: each is a task of its own, and a channel
    whose last beat has not left yet (its peer stopped reading) gets no new one."""

    def __init__(self, tasks: anyio.abc.TaskGroup) -> None:
        self._tasks = tasks
        self._waiting: set[Sink] = set()

    def send(self, channel: Sink, beat: object) -> None:
        if channel not in self._waiting:
            self._waiting.add(channel)
            self._tasks.start_soon(self._send, channel, beat)

    async def _send(self, channel: Sink, beat: object) -> None:
        try:
            # A rank that a scale or a shrink just removed has its input closed; a rank's
            # output closes as it leaves.
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                await channel.send(beat)
        finally:
            self._waiting.discard(channel)


def _leave_after(seconds: float) -> None:
    """Exit with FRONT_END_LOST_EXIT in `seconds` if the orderly exit has not happened
    by then (nobody is left to wait for)."""
    timer = threading.Timer(seconds, os._exit, args=(FRONT_END_LOST_EXIT,))
    timer.daemon = True
    timer.start()
