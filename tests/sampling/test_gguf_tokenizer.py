"""Reading GGUF metadata and building a tokenizer from it, on small files written here.

The files are written with the `gguf` package's own writer, so the reader is checked
against an independent implementation of the format, and the tokenizer's handling of
special tokens, BOS and byte fallback is checked without loading the real model.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wavecore.engine.model.gguf_format import GGUFFormatError, read_gguf_metadata
from wavecore.engine.sampling.chat_template import ChatTemplateError
from wavecore.engine.sampling.errors import TokenizerLoadError
from wavecore.engine.sampling.gguf_tokenizer import byte_alphabet
from wavecore.engine.sampling.tokenizer import Tokenizer

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
SPECIAL = ["<s>", "</s>", "<think>"]
WORDS = ["he", "hel", "hell", "hello"]
MERGES = ["h e", "he l", "hel l", "hell o"]
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('no tools here') }}{% endif %}"
    "{{ bos_token }}[{{ m['role'] }}] {{ m['content'] | tojson }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def write_gguf(path: Path, *, model: str = "gpt2", add_bos: bool = True) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    tokens = [*SPECIAL, *byte_alphabet().values(), *WORDS]
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES)
    writer.add_token_types([CONTROL, CONTROL, USER_DEFINED] + [NORMAL] * (len(tokens) - 3))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_gguf(write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def test_reader_returns_every_value_type_as_written(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(path, "test")
    values = {
        "t.u8": (writer.add_uint8, 250),
        "t.i8": (writer.add_int8, -5),
        "t.u16": (writer.add_uint16, 65000),
        "t.i16": (writer.add_int16, -30000),
        "t.u32": (writer.add_uint32, 4_000_000_000),
        "t.i32": (writer.add_int32, -2_000_000_000),
        "t.u64": (writer.add_uint64, 2**63 + 5),
        "t.i64": (writer.add_int64, -(2**62)),
        "t.f32": (writer.add_float32, 0.5),
        "t.f64": (writer.add_float64, 1e-300),
        "t.bool": (writer.add_bool, True),
        "t.str": (writer.add_string, "héllo 🎉"),
        "t.ints": (writer.add_array, [1, -2, 3]),
        "t.floats": (writer.add_array, [0.25, -1.5]),
        "t.strs": (writer.add_array, ["a", "", "日本"]),
    }
    for key, (add, value) in values.items():
        add(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()

    metadata = read_gguf_metadata(path)
    assert metadata["general.architecture"] == "test"
    for key, (_, value) in values.items():
        assert metadata[key] == value, key
    assert read_gguf_metadata(path, {"t.str", "t.u8", "absent"}) == {
        "t.str": "héllo 🎉",
        "t.u8": 250,
    }


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a GGUF file"),
        (b"GGML" + bytes(20), "not a GGUF file"),
        (b"GGUF" + (9).to_bytes(4, "little") + bytes(16), "version 9"),
        (
            b"GGUF" + (3).to_bytes(4, "little") + bytes(8) + (1).to_bytes(8, "little"),
            "past the end",
        ),
    ],
)
def test_reader_rejects_broken_files(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFFormatError, match=message):
        read_gguf_metadata(path)


def test_special_and_added_tokens(tiny_tokenizer: Tokenizer) -> None:
    hello = 3 + 256 + WORDS.index("hello")
    assert tiny_tokenizer.encode("hello") == [0, hello]
    assert tiny_tokenizer.encode("hello", add_special_tokens=False) == [hello]
    ids = tiny_tokenizer.encode("<think>hello</s>", add_special_tokens=False)
    assert ids == [2, hello, 1]
    assert tiny_tokenizer.decode(ids) == "<think>hello"
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == "<think>hello</s>"
    assert (tiny_tokenizer.bos_token_id, tiny_tokenizer.eos_token_id) == (0, 1)
    assert tiny_tokenizer.vocab_size == 3 + 256 + len(WORDS)


def test_no_bos_when_the_file_says_so(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_gguf(write_gguf(tmp_path / "nobos.gguf", add_bos=False))
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)


@given(st.text(max_size=30))
def test_any_text_round_trips_through_the_byte_alphabet(
    tiny_tokenizer: Tokenizer, text: str
) -> None:
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    # Text that spells a special token is tokenized as that token, and skipped on decode.
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template_renders_with_helpers(tiny_tokenizer: Tokenizer) -> None:
    rendered = tiny_tokenizer.apply_chat_template([{"role": "user", "content": 'say "hi" 日本'}])
    assert rendered == '<s>[user] "say \\"hi\\" 日本"\n[assistant] '
    without = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=False
    )
    assert without == '<s>[user] "x"\n'
    with pytest.raises(ChatTemplateError, match="no tools here"):
        tiny_tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_decode_rejects_ids_outside_the_vocabulary(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match=f"token id {tiny_tokenizer.vocab_size} is outside"):
        tiny_tokenizer.decode([5, tiny_tokenizer.vocab_size])
    with pytest.raises(ValueError, match="token id -1 is outside"):
        tiny_tokenizer.decode([-1])


def test_non_byte_level_vocabularies_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="'llama'"):
        Tokenizer.from_gguf(write_gguf(tmp_path / "spm.gguf", model="llama"))


def test_hf_directory_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match=r"no tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_chat_template_runs_sandboxed(tiny_tokenizer: Tokenizer) -> None:
    from wavecore.engine.sampling.chat_template import ChatTemplate

    escape = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(ChatTemplateError):
        escape.render([{"role": "user", "content": "x"}])
    mutate = ChatTemplate("{{ messages.append(1) }}", {})
    with pytest.raises(ChatTemplateError):
        mutate.render([])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}", {})
