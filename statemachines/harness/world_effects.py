"""A rank's modelled effects in the world (``rank_loop.RankEffects`` over ``toy``)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..rank import (
    NotifyStartWave,
    NotifyWaveComplete,
    PauseMode,
    StartVote,
)
from .invariants import Violation
from .network import COORDINATOR, DUPLICATOR
from .toy import ToyRequest

if TYPE_CHECKING:
    from .world import World


class RankEffects:
    """The modelled effects of rank ``r`` (``rank_loop.RankEffects``)."""

    def __init__(self, world: World, r: int) -> None:
        self.world = world
        self.r = r

    def add_request(self, request_id: str, payload: object) -> None:
        steps, stalls = payload  # type: ignore[misc]
        toy = self.world.toys[self.r]
        request = ToyRequest(id=int(request_id), remaining=steps, stalls=stalls)
        self.world.toys[self.r] = replace(toy, requests=(*toy.requests, request))

    def abort_requests(self, request_ids: tuple[str, ...]) -> None:
        self._finish(frozenset(int(i) for i in request_ids))

    def stop_requests(self, request_ids: tuple[str, ...]) -> None:
        self._finish(frozenset(int(i) for i in request_ids))

    def _finish(self, ids: frozenset[int]) -> None:
        world = self.world
        toy = world.toys[self.r]
        held = frozenset(q.id for q in toy.requests) & ids
        kept = tuple(q for q in toy.requests if q.id not in ids)
        world.toys[self.r] = replace(toy, requests=kept)
        world.end_requests(held)

    def pause_scheduler(self, mode: PauseMode) -> None:
        if mode is PauseMode.ABORT:
            self._finish(frozenset(q.id for q in self.world.toys[self.r].requests))
        self.world.toys[self.r] = replace(self.world.toys[self.r], scheduler_pause=mode)

    def resume_scheduler(self) -> None:
        self.world.toys[self.r] = replace(self.world.toys[self.r], scheduler_pause=None)

    def reset_prefix_cache(self) -> None:
        pass

    def start_vote(self, vote: StartVote) -> None:
        self.world.start_vote(self.r, vote)

    def notify_coordinator(self, message: NotifyStartWave | NotifyWaveComplete) -> None:
        network = self.world.network
        # A local half of the coordinator-wave property (``por`` rule 7b): a rank
        # announces only a wave it is in, and completes only one it left.
        own = self.world.loops[self.r].machine.wave
        ahead = message.wave > own if isinstance(message, NotifyStartWave) else message.wave >= own
        if ahead:
            raise Violation("coordinator_wave", f"rank {self.r} in wave {own} sends {message}")
        if isinstance(message, NotifyStartWave):
            network.send(self.r, COORDINATOR, ("start_wave", self.r, message.wave))
            return
        network.send(self.r, COORDINATOR, ("wave_complete", message.wave))
        if self.world.config.duplicate_wave_complete:
            network.send(DUPLICATOR, COORDINATOR, ("wave_complete", message.wave))

    def announce_held(self, request_ids: tuple[str, ...], reason: str) -> None:
        held = frozenset(int(i) for i in request_ids)
        self.world.client = replace(self.world.client, held=self.world.client.held | held)

    def report(self) -> object:
        return None

    def reply(self, call_id: int, *, error: str | None = None, result: object = None) -> None:
        self.world.answered(self.r, call_id, error)
