"""The front end's count of the ranks' iteration details (`messages.IterationDetails`):
each is logged at debug level as it arrives and added to its rank's totals and
histograms, which `stats()` reports (`interface.RankIterations`) and `/metrics` shows."""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from wavecore.engine.interface import STEP_MS_BUCKETS, STEP_TOKENS_BUCKETS, RankIterations
from wavecore.engine.messages import IterationDetails

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class _RankTotals:
    steps: int = 0
    dummy_steps: int = 0
    context_requests: int = 0
    context_tokens: int = 0
    generation_requests: int = 0
    generation_tokens: int = 0
    elapsed_ms: float = 0.0
    ms_buckets: list[int] = field(default_factory=lambda: [0] * (len(STEP_MS_BUCKETS) + 1))
    tokens_buckets: list[int] = field(default_factory=lambda: [0] * (len(STEP_TOKENS_BUCKETS) + 1))


class IterationStats:
    def __init__(self) -> None:
        self._ranks: dict[int, _RankTotals] = {}

    def add(self, rank: int, iterations: tuple[IterationDetails, ...]) -> None:
        totals = self._ranks.get(rank)
        if totals is None:
            totals = self._ranks[rank] = _RankTotals()
        debug = _log.isEnabledFor(logging.DEBUG)
        for details in iterations:
            if debug:
                _log.debug(
                    "rank %d iteration %d: %d context requests (%d tokens), %d generation "
                    "requests (%d tokens), %.3f ms%s",
                    rank,
                    details.iteration,
                    details.context_requests,
                    details.context_tokens,
                    details.generation_requests,
                    details.generation_tokens,
                    details.elapsed_ms,
                    ", dummy" if details.dummy else "",
                )
            totals.elapsed_ms += details.elapsed_ms
            totals.ms_buckets[bisect.bisect_left(STEP_MS_BUCKETS, details.elapsed_ms)] += 1
            if details.dummy:
                totals.dummy_steps += 1
                continue
            totals.steps += 1
            totals.context_requests += details.context_requests
            totals.context_tokens += details.context_tokens
            totals.generation_requests += details.generation_requests
            totals.generation_tokens += details.generation_tokens
            tokens = details.context_tokens + details.generation_tokens
            totals.tokens_buckets[bisect.bisect_left(STEP_TOKENS_BUCKETS, tokens)] += 1

    def snapshot(self) -> tuple[RankIterations, ...]:
        return tuple(
            RankIterations(
                rank=rank,
                steps=totals.steps,
                dummy_steps=totals.dummy_steps,
                context_requests=totals.context_requests,
                context_tokens=totals.context_tokens,
                generation_requests=totals.generation_requests,
                generation_tokens=totals.generation_tokens,
                elapsed_ms=totals.elapsed_ms,
                ms_buckets=tuple(totals.ms_buckets),
                tokens_buckets=tuple(totals.tokens_buckets),
            )
            for rank, totals in sorted(self._ranks.items())
        )
