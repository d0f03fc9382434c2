"""A scale's calls to ranks, each bounded: a rank that does not answer is named.

Why the bound is `2 * collective_timeout`: a healthy rank answers every call a scale
makes (pause, switch, leave, resume) after at most one collective of its own (a
pause's consensus vote, the resume barrier, the new group's rendezvous) and the
forward in flight, and a rank gives up any collective after `collective_timeout` and
then answers (with an error where it failed). A rank silent for twice that is
stopped, dead, or wedged outside the protocol; the scale then goes on without it
(`on_rank_failure="shrink"`) or the engine ends naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import anyio

from wavecore.engine.errors import EngineDeadError, RankCallError
from wavecore.engine.frontend.core_client import ScaleHost


class RanksUnanswered(Exception):
    """These ranks did not answer a scale's call within its bound."""

    def __init__(self, ranks: tuple[int, ...], what: str, seconds: float) -> None:
        self.ranks = ranks
        self.what = what
        self.seconds = seconds
        names = ", ".join(f"rank {rank}" for rank in ranks)
        super().__init__(f"{names} did not answer {what} within {seconds:g} s")

    def cause(self, rank: int) -> str:
        """Why this rank is given up, in the words of a lost rank's cause."""
        return f"rank {rank} did not answer {self.what} within {self.seconds:g} s"


async def call_each(
    host: ScaleHost,
    ranks: Collection[int],
    message: Callable[[int, int], Any],
    *,
    what: str,
    seconds: float,
) -> None:
    """Call every rank (`message(rank, call_id)`, one call each, concurrently) and wait
    for all answers, at most `seconds`. Raises `RanksUnanswered` naming the silent
    ranks, else `RankCallError` with every refusal (a rank that refuses still
    answered)."""
    answered: set[int] = set()
    errors: dict[int, str] = {}
    ended: list[EngineDeadError] = []

    async def call(rank: int) -> None:
        try:
            await host.call_ranks((rank,), lambda call_id: message(rank, call_id))
        except RankCallError as error:
            errors[rank] = str(error)
        except EngineDeadError as error:
            ended.append(error)  # every call fails so: one says it
        answered.add(rank)

    with anyio.move_on_after(seconds):
        async with anyio.create_task_group() as tg:
            for rank in ranks:
                tg.start_soon(call, rank)
    if ended:
        raise ended[0]
    silent = tuple(rank for rank in ranks if rank not in answered)
    if silent:
        raise RanksUnanswered(silent, what, seconds)
    if errors:
        raise RankCallError("; ".join(errors[rank] for rank in sorted(errors)))
