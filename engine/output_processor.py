"""Turns the token ids a step produced into the text deltas callers stream.

This runs next to the caller (in the engine process for one rank, in the client for
data parallelism): it owns each request's incremental detokenizer and stop-string
checker. A stop string ends the request here, so the caller is told to finish it in
the scheduler; its text up to the stop string is the last delta.
"""

from __future__ import annotations

from dataclasses import dataclass

from wavecore.engine.input_processor import EngineRequest
from wavecore.engine.outputs import CompletionDelta, TokenLogprob, Usage
from wavecore.engine.sampling.detokenizer import Decoder, IncrementalDetokenizer
from wavecore.engine.sampling.stop_strings import StopChecker
from wavecore.engine.scheduler import RequestUpdate


@dataclass(slots=True)
class _RequestText:
    detokenizer: IncrementalDetokenizer
    stops: StopChecker
    prompt_tokens: int
    want_logprobs: bool
    output_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self._requests: dict[str, _RequestText] = {}

    def add(self, request: EngineRequest) -> None:
        self._requests[request.request_id] = _RequestText(
            detokenizer=IncrementalDetokenizer(self._tokenizer, request.prompt_token_ids),
            stops=StopChecker(request.params.stop),
            prompt_tokens=len(request.prompt_token_ids),
            want_logprobs=request.params.logprobs is not None,
        )

    def discard(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def process(self, update: RequestUpdate) -> tuple[CompletionDelta | None, bool]:
        """The delta for `update` (None if it adds nothing), and whether a stop string
        finished a request the scheduler still holds."""
        state = self._requests.get(update.request_id)
        if state is None:
            return None, False
        finish = None if update.finish_reason is None else str(update.finish_reason)
        text = state.detokenizer.add(update.new_token_ids)
        if finish is not None:
            text += state.detokenizer.flush()
        scan = state.stops.feed(text)
        text = scan.text
        stop_hit = scan.stopped and finish is None
        if scan.stopped:
            finish = "stop"
        elif finish is not None:
            text += state.stops.flush()
        state.output_tokens += len(update.new_token_ids)
        if finish is not None:
            del self._requests[update.request_id]
        if not text and not update.new_token_ids and finish is None:
            return None, False
        logprobs = ()
        if state.want_logprobs:
            logprobs = tuple(
                TokenLogprob(token_id=s.token_id, logprob=s.logprob, top=s.top_logprobs)
                for s in update.sampled
                if s.logprob is not None
            )
        delta = CompletionDelta(
            request_id=update.request_id,
            text=text,
            token_ids=update.new_token_ids,
            finish_reason=finish,
            usage=Usage(prompt_tokens=state.prompt_tokens, output_tokens=state.output_tokens),
            logprobs=logprobs,
        )
        return delta, stop_hit
