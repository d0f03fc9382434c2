"""Malformed frames: refused by the codec, logged at a bounded rate, always counted.

Every receiving channel of the DP engine passes one of these as `on_invalid`, so a
stray or hostile sender can never kill a receiver task, and cannot flood the log: the
first drop of a channel is logged, later ones at most once per `LOG_INTERVAL_S` (with how
many were dropped since). A well-formed message that has no business on a channel (or
that the receiving state machine refuses as impossible) is dropped the same way, through
`unexpected`. Every channel's `count` reaches the front end's `stats()` (the ranks' in
their stats, the coordinator's in its state) and `/metrics` of `wavecore serve`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from wavecore.channels import DecodeError

logger = logging.getLogger("wavecore.engine.dp")

LOG_INTERVAL_S = 10.0


class InvalidFrameLog:
    def __init__(self, channel: str) -> None:
        self.channel = channel
        self.count = 0
        self._logged_at: float | None = None
        self._logged_count = 0

    def __call__(self, error: DecodeError | str) -> None:
        self.count += 1
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < LOG_INTERVAL_S:
            return
        since = self.count - self._logged_count - 1
        self._logged_at, self._logged_count = now, self.count
        logger.warning(
            "%s: dropped a malformed frame (%s)%s; drops are logged at most every %g s",
            self.channel,
            error,
            f", and {since} more since the last report" if since else "",
            LOG_INTERVAL_S,
        )

    def unexpected(self, message: object, reason: str = "not expected here") -> None:
        self(f"{type(message).__name__}: {reason}")


def counts(logs: Iterable[InvalidFrameLog]) -> dict[str, int]:
    """Each channel's drops so far."""
    return {log.channel: log.count for log in logs}
