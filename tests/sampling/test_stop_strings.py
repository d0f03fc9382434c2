"""StopChecker: cuts at the first completed stop string and never streams part of one."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from wavecore.engine.sampling.stop_strings import StopChecker, StopStreamClosedError

ALPHABET = "abcx"


def reference_cut(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """The text before the stop string that completes first (longest on a tie)."""
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stop if text[:end].endswith(s)]
        if ending_here:
            return text[: end - max(len(s) for s in ending_here)], True
    return text, False


@given(
    # Short deltas, so that stop strings often straddle them.
    st.lists(st.text(ALPHABET, max_size=3), max_size=15),
    st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3).map(tuple),
)
@example(["xa", "b"], ("ab",))
@example(["abcd"], ("abcd", "bc"))
@example(["a", "bc", "d"], ("abcd", "bc"))
@settings(max_examples=300)  # cheap, and the interesting cases are rare
def test_streamed_text_is_the_text_before_the_first_stop(
    deltas: list[str], stop: tuple[str, ...]
) -> None:
    expected, expect_stop = reference_cut("".join(deltas), stop)
    checker = StopChecker(stop)
    longest = max(len(s) for s in stop)
    streamed = ""
    stopped = False
    for delta in deltas:
        scan = checker.feed(delta)
        streamed += scan.text
        # Never taken back, never beyond the cut, and only a short tail is held.
        assert expected.startswith(streamed)
        assert len(checker.held) <= longest - 1
        if scan.stopped:
            stopped = True
            break
    if not stopped:
        streamed += checker.flush()
    assert (streamed, stopped) == (expected, expect_stop)
    assert not any(s in streamed for s in stop)


def test_stop_string_split_across_deltas_is_never_streamed() -> None:
    checker = StopChecker(("</end>",))
    assert checker.feed("Hello </").text == "Hello "
    assert checker.held == "</"
    assert checker.feed("e").text == ""
    scan = checker.feed("nd> trailing")
    assert scan.stopped and scan.text == ""


def test_a_held_tail_that_does_not_become_a_stop_is_released() -> None:
    checker = StopChecker(("STOP",))
    assert checker.feed("ST").text == ""
    assert checker.feed("ART").text == "START"
    assert checker.feed("S").text == ""
    assert checker.flush() == "S"


def test_without_stop_strings_everything_passes_through() -> None:
    checker = StopChecker(())
    assert checker.feed("abc").text == "abc"
    assert checker.flush() == ""


def test_feeding_after_the_end_is_an_error() -> None:
    checker = StopChecker(("x",))
    assert checker.feed("axb").stopped
    with pytest.raises(StopStreamClosedError):
        checker.feed("more")


@pytest.mark.parametrize("stop", [("",), "abc", ("ok", 3)])
def test_bad_stop_strings_are_rejected(stop: object) -> None:
    with pytest.raises(ValueError, match="non-empty strings"):
        StopChecker(stop)  # type: ignore[arg-type]
