"""Our GGUF tokenizer against transformers' reading of the same file.

transformers is the reference: it builds its tokenizer from the GGUF independently
(its own metadata reader and converter). Loading it takes about ten seconds, so it is
loaded once for the module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from wavecore.engine.sampling.tokenizer import Tokenizer

pytestmark = pytest.mark.model

TEXTS = [
    "Hello, world!",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\nand more",
    "Numbers: 1234567890 3.14159 -42 1e10",
    "naïve café résumé Ærøskøbing",
    "日本語のテキストと中文文本",
    "Русский текст и ελληνικά",
    "emoji 🎉🚀 and a family 👨‍👩‍👧‍👦 and flags 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special inside<|endoftext|>text <repo_name>x<file_sep>y",
    "<|im_start|> spaced <|im_end|>",
    "code: def f(x):\n    return x ** 2  # square\n",
    "it's they're we've I'm you'll he'd",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "a" * 300,
    "The quick brown fox jumps over the lazy dog. " * 5,
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語 🎨"},
    ],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def reference(smollm_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name
    )


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches(
    smollm_tokenizer: Tokenizer, reference: Any, add_special_tokens: bool
) -> None:
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=add_special_tokens)
        assert smollm_tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected, (
            text
        )


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches(
    smollm_tokenizer: Tokenizer, reference: Any, skip_special_tokens: bool
) -> None:
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=False)
        expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
        assert smollm_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected


def test_special_ids_and_vocabulary_size_match(smollm_tokenizer: Tokenizer, reference: Any) -> None:
    assert smollm_tokenizer.eos_token_id == reference.eos_token_id
    assert smollm_tokenizer.bos_token_id == reference.bos_token_id
    assert smollm_tokenizer.vocab_size == len(reference)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches(
    smollm_tokenizer: Tokenizer, reference: Any, add_generation_prompt: bool
) -> None:
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        got = smollm_tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt
        )
        assert got == expected


def test_hf_directory_round_trip(reference: Any, tmp_path: Path) -> None:
    reference.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.eos_token_id == reference.eos_token_id
    for text in TEXTS:
        assert loaded.encode(text) == reference.encode(text)
    for messages in CONVERSATIONS:
        assert loaded.apply_chat_template(messages) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
