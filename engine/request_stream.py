"""One request's outputs on their way from the engine loop to the task consuming them.

The loop must never wait for a slow consumer, and memory must not grow with the
number of steps a consumer falls behind. So a stream holds at most one pending delta:
a new delta that arrives before the consumer took the previous one is merged into it
(texts and token ids concatenated, the latest usage and finish reason kept).
"""

from __future__ import annotations

from dataclasses import replace

import anyio

from wavecore.engine.outputs import CompletionDelta


def merge_deltas(older: CompletionDelta, newer: CompletionDelta) -> CompletionDelta:
    return replace(
        newer,
        text=older.text + newer.text,
        token_ids=older.token_ids + newer.token_ids,
        logprobs=older.logprobs + newer.logprobs,
    )


class RequestStream:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._pending: CompletionDelta | None = None
        self._error: BaseException | None = None
        self._ready = anyio.Event()

    def put(self, delta: CompletionDelta) -> None:
        self._pending = delta if self._pending is None else merge_deltas(self._pending, delta)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with `error`, raised to the consumer after any pending output."""
        self._error = error
        self._ready.set()

    async def get(self) -> CompletionDelta:
        await self._ready.wait()
        if self._pending is not None:
            delta, self._pending = self._pending, None
            self._ready = anyio.Event()
            if self._error is not None:
                self._ready.set()
            return delta
        assert self._error is not None  # the event is only set with a delta or an error
        raise self._error
