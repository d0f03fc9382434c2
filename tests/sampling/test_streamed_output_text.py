"""Detokenizer and stop strings chained, as the output processor chains them."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import example, given
from hypothesis import strategies as st

from wavecore.engine.sampling.byte_tokenizer import EOS_TOKEN_ID, ByteTokenizer
from wavecore.engine.sampling.detokenizer import IncrementalDetokenizer
from wavecore.engine.sampling.stop_strings import StopChecker

# Multi-byte characters, so stop strings and UTF-8 boundaries interact.
ALPHABET = "aé€🎉"


def first_stop_cut(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stop if text[:end].endswith(s)]
        if ending_here:
            return text[: end - max(len(s) for s in ending_here)], True
    return text, False


def stream_text(
    token_groups: Sequence[Sequence[int]], stop: tuple[str, ...], prompt: Sequence[int]
) -> tuple[list[str], bool]:
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), prompt)
    checker = StopChecker(stop)
    deltas = []
    for group in token_groups:
        scan = checker.feed(detokenizer.add(group))
        deltas.append(scan.text)
        if scan.stopped:
            return deltas, True
    scan = checker.feed(detokenizer.flush())
    deltas.append(scan.text)
    if not scan.stopped:
        deltas.append(checker.flush())
    return deltas, scan.stopped


@given(
    st.text(ALPHABET, max_size=20),
    st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=2).map(tuple),
    st.integers(1, 3),
)
@example("aa€🎉a", ("🎉",), 1)
@example("aé", ("é",), 1)
def test_streamed_text_is_the_full_text_cut_at_the_first_stop(
    text: str, stop: tuple[str, ...], group: int
) -> None:
    tokenizer = ByteTokenizer()
    ids = [*tokenizer.encode(text), EOS_TOKEN_ID]
    groups = [ids[i : i + group] for i in range(0, len(ids), group)]
    deltas, stopped = stream_text(groups, stop, tokenizer.encode("prompt "))
    assert ("".join(deltas), stopped) == first_stop_cut(text, stop)
    expected = first_stop_cut(text, stop)[0]
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert expected.startswith(streamed)
        assert "\ufffd" not in delta


def test_an_incomplete_character_keeps_a_stop_prefix_held() -> None:
    # "a" may begin "ab" until the next character is known, and the half of "€" is
    # not a character yet, so nothing is released until the stream ends.
    deltas, stopped = stream_text([[ord("x"), ord("a")], list("€".encode())[:2]], ("ab",), ())
    assert (deltas, stopped) == (["x", "", "a\ufffd", ""], False)
