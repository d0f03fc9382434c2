"""Cutting a text stream at the first stop string, without ever streaming part of one.

Text arrives in deltas of any size, so a stop string may straddle several of them.
`StopChecker.feed` appends a delta to a small held-back buffer and looks for every
stop string in it; since the buffer never held a whole stop string before, any match
ends inside the new delta. On a match it returns the text before the stop string that
completes first (so the result does not depend on how the text was split into deltas)
and reports the stop; the stop string itself and everything after it are dropped.
Otherwise it releases all but the longest tail of the buffer that is a prefix of some
stop string (fewer than `max(len(stop))` characters), because only that tail could
still grow into a match. `flush` releases the held tail when the stream ends for
another reason (EOS, length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class StopScan:
    """What `feed` found: `text` is safe to stream; `stopped` means a stop string hit."""

    text: str
    stopped: bool


class StopStreamClosedError(RuntimeError):
    """The checker was fed after a stop string was found or after `flush`."""


class StopChecker:
    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop must be a sequence of non-empty strings")
        self._stop = tuple(stop)
        self._longest = max((len(s) for s in self._stop), default=0)
        self._held = ""
        self._closed = False

    @property
    def held(self) -> str:
        """Text held back because it may begin a stop string."""
        return self._held

    def feed(self, delta: str) -> StopScan:
        if self._closed:
            raise StopStreamClosedError("the stream already ended")
        if not self._stop:
            return StopScan(text=delta, stopped=False)
        buffer = self._held + delta
        # (end, start) of each stop string's first occurrence: the one completed first
        # wins, as if the text had arrived one character at a time; on a tie, the longer.
        hits = [(index + len(s), index) for s in self._stop if (index := buffer.find(s)) >= 0]
        if hits:
            self._closed = True
            self._held = ""
            return StopScan(text=buffer[: min(hits)[1]], stopped=True)
        keep = self._partial_match_length(buffer)
        self._held = buffer[len(buffer) - keep :]
        return StopScan(text=buffer[: len(buffer) - keep], stopped=False)

    def flush(self) -> str:
        """The held tail, released because the stream ended without a stop string."""
        if self._closed:
            return ""
        self._closed = True
        held, self._held = self._held, ""
        return held

    def _partial_match_length(self, buffer: str) -> int:
        for length in range(min(len(buffer), self._longest - 1), 0, -1):
            tail = buffer[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0
