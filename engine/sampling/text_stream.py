"""One request's output text: token ids in, clean text deltas out, cut at stop strings.

Chains an `IncrementalDetokenizer` (valid UTF-8 only, decoder context kept) into a
`StopChecker` (no part of a stop string is ever released). The output processor keeps
one per request: `add` for each step's new tokens, and `finish` once when the request
ends for any other reason (EOS, length, abort) to release the text still held back.
After `add` reports `stopped`, the request must be finished with reason "stop"; the
stream releases nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from wavecore.engine.sampling.detokenizer import Decoder, IncrementalDetokenizer
from wavecore.engine.sampling.stop_strings import StopChecker


@dataclass(frozen=True, slots=True, kw_only=True)
class TextDelta:
    """New text safe to show; `stopped` when a stop string ended the output."""

    text: str
    stopped: bool


class TextStream:
    def __init__(
        self,
        tokenizer: Decoder,
        stop: Sequence[str] = (),
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
        )
        self._stop = StopChecker(stop)
        self._ended = False

    def add(self, token_ids: Sequence[int]) -> TextDelta:
        if self._ended:
            return TextDelta(text="", stopped=False)
        scan = self._stop.feed(self._detokenizer.add(token_ids))
        self._ended = scan.stopped
        return TextDelta(text=scan.text, stopped=scan.stopped)

    def finish(self) -> TextDelta:
        """The rest of the text, when the request ends other than by a stop string.

        The held tail may still complete a stop string (`stopped` is then true, and the
        text ends before it)."""
        if self._ended:
            return TextDelta(text="", stopped=False)
        self._ended = True
        scan = self._stop.feed(self._detokenizer.flush())
        if scan.stopped:
            return TextDelta(text=scan.text, stopped=True)
        return TextDelta(text=scan.text + self._stop.flush(), stopped=False)
