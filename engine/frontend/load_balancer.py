"""Which rank gets the next request.

Score per rank (lowest wins): `max(client_count * inflight_here, waiting + running)`,
plus, when requests wait there, a KV-pressure penalty `waiting * 6 * max(0, kv - 0.5)`.
`waiting`, `running` and `kv` come from the coordinator (possibly stale); `inflight_here`
is what this client itself has sent and not yet seen finish. Ties go to the first rank
at or after a start index that rotates with every pick, and a pick bumps that rank's
local waiting count at once, so a burst spreads over the ranks before the coordinator's
next statistics arrive.
"""

from __future__ import annotations

from collections.abc import Sequence


class LoadBalancer:
    def __init__(self, dp_size: int, *, client_count: int = 1) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.dp_size = dp_size
        self.client_count = client_count
        self.waiting = [0] * dp_size
        self.running = [0] * dp_size
        self.kv_usage = [0.0] * dp_size
        self.inflight = [0] * dp_size
        self._start = 0

    def score(self, rank: int) -> float:
        waiting = self.waiting[rank]
        load = max(self.client_count * self.inflight[rank], waiting + self.running[rank])
        penalty = waiting * 6 * max(0.0, self.kv_usage[rank] - 0.5) if waiting else 0.0
        return load + penalty

    def pick(self) -> int:
        order = [(self._start + offset) % self.dp_size for offset in range(self.dp_size)]
        rank = min(order, key=self.score)  # min keeps the first of equal scores
        self._start = (self._start + 1) % self.dp_size
        self.assigned(rank)
        self.waiting[rank] += 1
        return rank

    def assigned(self, rank: int) -> None:
        """A request went to `rank` (picked here, or chosen by the caller)."""
        self.inflight[rank] += 1

    def finished(self, rank: int) -> None:
        self.inflight[rank] = max(0, self.inflight[rank] - 1)

    def update(
        self, waiting: Sequence[int], running: Sequence[int], kv_usage: Sequence[float]
    ) -> None:
        """The coordinator's latest figures replace the local guesses."""
        if not len(waiting) == len(running) == len(kv_usage) == self.dp_size:
            raise ValueError(f"load figures for {len(waiting)} ranks, expected {self.dp_size}")
        self.waiting = list(waiting)
        self.running = list(running)
        self.kv_usage = list(kv_usage)
