"""Malformed frames: refused by the codec, logged once per channel, then only counted.

Every receiving channel of the DP engine passes one of these as `on_invalid`, so a
stray or hostile sender can never kill a receiver task, and cannot flood the log. A
well-formed message that has no business on a channel (or that the receiving state
machine refuses as impossible) is dropped the same way, through `unexpected`.
"""

from __future__ import annotations

import logging

from wavecore.channels import DecodeError

logger = logging.getLogger("wavecore.engine.dp")


class InvalidFrameLog:
    def __init__(self, channel: str) -> None:
        self.channel = channel
        self.count = 0

    def __call__(self, error: DecodeError | str) -> None:
        self.count += 1
        if self.count == 1:
            logger.warning(
                "%s: dropped a malformed frame (%s); later ones are counted, not logged",
                self.channel,
                error,
            )

    def unexpected(self, message: object, reason: str = "not expected here") -> None:
        self(f"{type(message).__name__}: {reason}")
