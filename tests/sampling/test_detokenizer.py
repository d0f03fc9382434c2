"""IncrementalDetokenizer: the deltas add up to the full decode, and are valid text."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from wavecore.engine.sampling.byte_tokenizer import EOS_TOKEN_ID, ByteTokenizer
from wavecore.engine.sampling.detokenizer import Decoder, IncrementalDetokenizer
from wavecore.engine.sampling.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


def stream(
    tokenizer: Decoder,
    ids: list[int],
    group_sizes: list[int],
    *,
    prompt: list[int] | None = None,
    skip_special_tokens: bool = True,
) -> list[str]:
    """The deltas for `ids` fed in groups of the given sizes (cycled), then the flush."""
    detokenizer = IncrementalDetokenizer(
        tokenizer, prompt or (), skip_special_tokens=skip_special_tokens
    )
    deltas = []
    position = 0
    sizes = group_sizes or [1]
    step = 0
    while position < len(ids):
        size = sizes[step % len(sizes)]
        deltas.append(detokenizer.add(ids[position : position + size]))
        position += size
        step += 1
    deltas.append(detokenizer.flush())
    return deltas


group_sizes = st.lists(st.integers(1, 4), max_size=5)


@given(st.lists(st.integers(0, EOS_TOKEN_ID), max_size=60), group_sizes, st.booleans())
@example([0xE2], [1], True)
@example([0xE2, 0x82, 0x41, 0xF0, 0x9F, 0x8E, 0x89], [1], True)
def test_byte_stream_deltas_add_up_to_the_full_decode(
    ids: list[int], sizes: list[int], skip: bool
) -> None:
    tokenizer = ByteTokenizer()
    deltas = stream(tokenizer, ids, sizes, skip_special_tokens=skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


@given(st.text(max_size=40), group_sizes)
def test_valid_text_streams_without_replacement_characters(text: str, sizes: list[int]) -> None:
    tokenizer = ByteTokenizer()
    deltas = stream(tokenizer, tokenizer.encode(text), sizes)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in delta for delta in deltas)


def test_a_multibyte_character_is_held_until_complete() -> None:
    detokenizer = IncrementalDetokenizer(ByteTokenizer())
    euro = list("€".encode())
    assert detokenizer.add(euro[:1]) == ""
    assert detokenizer.add(euro[1:2]) == ""
    assert detokenizer.add([*euro[2:], ord("!")]) == "€!"


def test_a_character_straddling_the_prompt_goes_to_the_output() -> None:
    euro = list("€".encode())
    detokenizer = IncrementalDetokenizer(ByteTokenizer(), [ord("a"), *euro[:2]])
    assert detokenizer.add(euro[2:]) == "€"
    assert detokenizer.add([ord("b")]) == "b"


def test_decoder_context_comes_from_the_prompt_and_earlier_tokens() -> None:
    # A SentencePiece-style decoder drops the word marker's space at the very start of
    # a decode, so decoding each token alone would glue the words together.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = Tokenizer(backend, bos_token_id=None, eos_token_id=None, chat_template=None)
    assert tokenizer.decode([2]) == "world"
    assert "".join(stream(tokenizer, [1, 2, 3, 2], [1])) == "Hello world! world"
    assert "".join(stream(tokenizer, [2, 3], [1], prompt=[1])) == " world!"


@pytest.mark.model
@given(st.lists(st.integers(0, 49151), max_size=40), group_sizes, st.booleans())
def test_gguf_token_stream_deltas_add_up_to_the_full_decode(
    smollm_tokenizer: Tokenizer, ids: list[int], sizes: list[int], skip: bool
) -> None:
    deltas = stream(smollm_tokenizer, ids, sizes, skip_special_tokens=skip)
    assert "".join(deltas) == smollm_tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.model
@given(st.text(max_size=60), st.text(max_size=20), group_sizes)
@example("naïve café — 日本語 🎉👨‍👩‍👧 ok", "Prompt: ", [1])
def test_gguf_text_streams_back_exactly(
    smollm_tokenizer: Tokenizer, text: str, prompt: str, sizes: list[int]
) -> None:
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = smollm_tokenizer.encode(prompt, add_special_tokens=False)
    deltas = stream(smollm_tokenizer, ids, sizes, prompt=prompt_ids)
    full = smollm_tokenizer.decode(ids)
    assert "".join(deltas) == full
    # Characters the vocabulary lacks bytes for (rare planes) do not survive encoding.
    if REPLACEMENT not in full:
        assert not any(REPLACEMENT in delta for delta in deltas)
