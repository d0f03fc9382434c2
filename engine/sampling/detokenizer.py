"""Streaming token ids out as text, one clean delta at a time.

Decoding one token at a time is wrong twice over: a token may hold only part of a
multi-byte UTF-8 character (decoded alone it is U+FFFD), and some decoders read
context (a SentencePiece word-start marker turns into a space only after another
word). So the detokenizer keeps a short window of ids, split at `read_offset`: in
front, the ids of the previous delta (the prefix, kept as context); behind, the ids
not yet emitted. Each step decodes the prefix and the whole window; the new text is
what the second decode adds to the first. If it ends in U+FFFD, the last character
is still incomplete and nothing is emitted; the ids wait for the next step.
Otherwise the delta is emitted and the window slides: the ids just emitted become
the prefix and older ones are dropped, so each step costs a few tokens' decoding.

The offset only moves at clean character boundaries, so the concatenated deltas equal
the decode of the whole sequence. The window starts with a few prompt tokens when a
prompt is given, for context. If those end inside a character that the first output
tokens complete, the completed character belongs to the output: the delta then starts
where the two decodes first differ. `flush` releases whatever is held (with U+FFFD for
a truly incomplete tail) when the sequence ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Enough context for any decoder we know of to see the previous word.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _common_prefix_length(first: str, second: str) -> int:
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return length


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The window: ids already emitted (kept as context), then ids not yet emitted.
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """The text that `token_ids` complete, or "" while a character is incomplete."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Everything still held back; call once, when the sequence has ended."""
        return self._emit(final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _emit(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        emitted = self._decode(self._ids[: self._read_offset])
        current = self._decode(self._ids)
        if current.endswith(_REPLACEMENT) and not final:
            return ""
        start = (
            len(emitted) if current.startswith(emitted) else _common_prefix_length(emitted, current)
        )
        # The ids just emitted become the context; older ones are never decoded again.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return current[start:]
