"""One request's output on its way from the engine to the task that consumes it.

A `RequestStream` turns the token ids each step produced into text (incremental
detokenization, stop strings) and holds the result until the consumer takes it.

The engine must never wait for a slow consumer, and memory must not grow with the
number of steps a consumer falls behind, so output the consumer has not taken yet is
accumulated, not queued: the consumer's next `get()` receives everything since its
previous one as a single `CompletionDelta`. Nothing is built per step but the text.

A stop string ends the request here, next to the caller: `process` then says so, and
the caller finishes the request in the scheduler that still holds it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator

import anyio

from wavecore.engine.outputs import CompletionDelta, TokenLogprob, Usage
from wavecore.engine.request import EngineRequest
from wavecore.engine.sampling.detokenizer import Decoder, IncrementalDetokenizer
from wavecore.engine.sampling.stop_strings import StopChecker
from wavecore.engine.scheduler import RequestUpdate


class RequestStream:
    def __init__(self, request: EngineRequest, tokenizer: Decoder) -> None:
        self.request_id = request.request_id
        self.request = request  # kept to send it again if its rank is lost before output
        self.resent = False
        self._detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
        self._stops = StopChecker(request.params.stop)
        self._prompt_tokens = len(request.prompt_token_ids)
        self._want_logprobs = request.params.logprobs is not None
        self._output_tokens = 0
        self.finished = False
        # Output not yet taken by the consumer.
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._finish_reason: str | None = None
        self._error_text: str | None = None
        self._has_output = False
        self._version: str | None = None  # the weights of the output not yet taken
        self._sealed: deque[CompletionDelta] = deque()
        self._error: BaseException | None = None
        self._ready = anyio.Event()

    def process(self, update: RequestUpdate, weight_version: str | None = None) -> bool:
        """Take one step's output, produced by the weights `weight_version`. True when a
        stop string ended the request while the scheduler still runs it (the caller must
        finish it there).

        A step may bring several tokens (speculative decoding). With stop strings they
        are taken one at a time, so a stop string ends the output at the token that
        completes it, as plain decoding would, and later tokens are not output."""
        tokens = update.new_token_ids
        if len(tokens) < 2 or not self.request.params.stop:
            return self._process(update, weight_version)
        last = len(tokens) - 1
        for index, token in enumerate(tokens):
            single = RequestUpdate(
                request_id=update.request_id,
                new_token_ids=(token,),
                sampled=update.sampled[index : index + 1],
                finish_reason=update.finish_reason if index == last else None,
            )
            if self._process(single, weight_version):
                return True
            if self.finished:
                break
        return False

    def _process(self, update: RequestUpdate, weight_version: str | None) -> bool:
        if self.finished:
            return False
        if self._has_output and weight_version != self._version:
            # A delta says which weights made its tokens: output of older weights not
            # taken yet is sealed into a delta of its own.
            self._sealed.append(self._take())
        self._version = weight_version
        finish = None if update.finish_reason is None else str(update.finish_reason)
        text = self._detokenizer.add(update.new_token_ids)
        if finish is not None:
            text += self._detokenizer.flush()
        scan = self._stops.feed(text)
        text = scan.text
        if scan.stopped:
            stop_hit, finish = finish is None, "stop"
        else:
            stop_hit = False
            if finish is not None:
                text += self._stops.flush()
        self._output_tokens += len(update.new_token_ids)
        if not text and not update.new_token_ids and finish is None:
            return stop_hit
        if text:
            self._text.append(text)
        self._token_ids += update.new_token_ids
        if self._want_logprobs:
            self._logprobs += [
                TokenLogprob(token_id=s.token_id, logprob=s.logprob, top=s.top_logprobs)
                for s in update.sampled
                if s.logprob is not None
            ]
        if finish is not None:
            self._finish_reason = finish
            self.finished = True
        self._has_output = True
        self._ready.set()
        return stop_hit

    @property
    def produced_output(self) -> bool:
        """Whether any step produced output for this request yet."""
        return self._output_tokens > 0 or self.finished

    def end_with_error(self, error: str) -> None:
        """End the stream with finish reason "error" and `error`, after any output not
        taken yet (its rank was lost)."""
        if self.finished:
            return
        self._finish_reason = "error"
        self._error_text = error
        self.finished = True
        self._has_output = True
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with `error`, raised to the consumer after any pending output."""
        self._error = error
        self.finished = True
        self._ready.set()

    async def deltas(self) -> AsyncIterator[CompletionDelta]:
        """Every delta, up to the one that finishes the request."""
        while True:
            delta = await self.get()
            yield delta
            if delta.finished:
                return

    async def get(self) -> CompletionDelta:
        await self._ready.wait()
        if self._sealed:
            delta = self._sealed.popleft()
        elif self._has_output:
            delta = self._take()
        else:
            # The event is only set with output pending or an error.
            raise self._error  # type: ignore[misc]
        if self._error is None and not self._sealed and not self._has_output:
            self._ready = anyio.Event()
        return delta

    def _take(self) -> CompletionDelta:
        """The output not yet taken, as one delta; clears it."""
        delta = CompletionDelta(
            request_id=self.request_id,
            text="".join(self._text),
            token_ids=tuple(self._token_ids),
            finish_reason=self._finish_reason,
            usage=Usage(prompt_tokens=self._prompt_tokens, output_tokens=self._output_tokens),
            logprobs=tuple(self._logprobs),
            weight_version=self._version,
            error=self._error_text if self._finish_reason is not None else None,
        )
        self._text, self._token_ids, self._logprobs = [], [], []
        self._has_output = False
        return delta
