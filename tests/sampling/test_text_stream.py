"""TextStream: detokenization and stop strings together, fed token by token."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st
from wavecore.engine.sampling.byte_tokenizer import EOS_TOKEN_ID, ByteTokenizer
from wavecore.engine.sampling.text_stream import TextStream

# Multi-byte characters, so stop strings and UTF-8 boundaries interact.
ALPHABET = "aé€🎉"


def first_stop_cut(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stop if text[:end].endswith(s)]
        if ending_here:
            return text[: end - max(len(s) for s in ending_here)], True
    return text, False


@given(
    st.text(ALPHABET, max_size=20),
    st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=2).map(tuple),
)
@example("aa€🎉a", ("🎉",))
@example("aé", ("é",))
def test_streamed_text_is_the_full_text_cut_at_the_first_stop(
    text: str, stop: tuple[str, ...]
) -> None:
    tokenizer = ByteTokenizer()
    stream = TextStream(tokenizer, stop, prompt_ids=tokenizer.encode("prompt "))
    streamed = ""
    stopped = False
    expected, expect_stop = first_stop_cut(text, stop)
    for token in [*tokenizer.encode(text), EOS_TOKEN_ID]:
        delta = stream.add([token])
        streamed += delta.text
        assert expected.startswith(streamed)
        if delta.stopped:
            stopped = True
            break
    if not stopped:
        final = stream.finish()
        streamed += final.text
        stopped = final.stopped
    assert (streamed, stopped) == (expected, expect_stop)


def test_finish_releases_an_incomplete_tail_and_held_stop_prefix() -> None:
    stream = TextStream(ByteTokenizer(), ("ab",))
    assert stream.add([ord("x"), ord("a")]).text == "x"
    # The incomplete character is not text yet, so "a" may still begin "ab".
    assert stream.add(list("€".encode())[:2]).text == ""
    finish = stream.finish()
    assert (finish.text, finish.stopped) == ("a\ufffd", False)
    assert stream.add([ord("z")]).text == ""


def test_nothing_after_a_stop() -> None:
    stream = TextStream(ByteTokenizer(), ("!",))
    delta = stream.add(list(b"hi! there"))
    assert (delta.text, delta.stopped) == ("hi", True)
    assert stream.add(list(b"more")).text == ""
    assert stream.finish().text == ""
