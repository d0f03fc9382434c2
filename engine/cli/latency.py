"""Per-request timing of a generation run, and the summary figures of many."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(slots=True)
class RequestTimer:
    """Time to first token, and the gap before each later token."""

    start: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    token_gaps: list[float] = field(default_factory=list)

    def tokens_arrived(self, count: int) -> None:
        if count == 0:
            return
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
            count -= 1
        elif self.last_token_at is not None:
            # Tokens that arrive together share the gap since the previous delta.
            self.token_gaps.extend([(now - self.last_token_at) / count] * count)
            count = 0
        if count:
            self.token_gaps.extend([0.0] * count)
        self.last_token_at = now

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.start


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSummary:
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else math.nan

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else math.nan

    @classmethod
    def of(
        cls, timers: list[RequestTimer], *, prompt_tokens: int, output_tokens: int, seconds: float
    ) -> RunSummary:
        ttfts = [t.ttft for t in timers if t.ttft is not None]
        gaps = [gap for t in timers for gap in t.token_gaps]
        return cls(
            requests=len(timers),
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            seconds=seconds,
            ttft_p50=percentile(ttfts, 50),
            ttft_p99=percentile(ttfts, 99),
            itl_p50=percentile(gaps, 50),
            itl_p99=percentile(gaps, 99),
        )
