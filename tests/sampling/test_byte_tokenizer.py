"""ByteTokenizer: one token per UTF-8 byte plus EOS, with the Tokenizer surface."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wavecore.engine.sampling.byte_tokenizer import EOS_TEXT, EOS_TOKEN_ID, ByteTokenizer


@given(st.text())
def test_text_round_trips(text: str) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_eos_is_skipped_or_spelled() -> None:
    tokenizer = ByteTokenizer()
    ids = [*tokenizer.encode("é"), EOS_TOKEN_ID, *tokenizer.encode("x")]
    assert tokenizer.decode(ids) == "éx"
    assert tokenizer.decode(ids, skip_special_tokens=False) == f"é{EOS_TEXT}x"
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.vocab_size) == (
        256,
        None,
        257,
    )


def test_incomplete_bytes_decode_to_replacement_characters() -> None:
    assert ByteTokenizer().decode([0xE2, 0x82]) == "\ufffd"


def test_out_of_vocabulary_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="token id 257 is outside"):
        ByteTokenizer().decode([1, 257])


def test_chat_template() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    tokenizer = ByteTokenizer()
    assert (
        tokenizer.apply_chat_template(messages)
        == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith("hi\n")
