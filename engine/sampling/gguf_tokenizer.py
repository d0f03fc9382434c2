"""Building a byte-level BPE `tokenizers.Tokenizer` from GGUF tokenizer metadata.

llama.cpp stores a `tokenizer.ggml.model == "gpt2"` tokenizer as: the vocabulary
(`tokens`, id = index), the ranked `merges` ("left right"), and `token_type`, where
CONTROL tokens (3) become special added tokens (matched whole in text, dropped by
`skip_special_tokens`) and USER_DEFINED ones (4) plain added tokens. Byte-level BPE
spells every byte as one printable character (GPT-2's byte alphabet, below), so a
vocabulary entry outside that alphabet is respelled from its UTF-8 bytes. Text is
split before BPE by the regex that `tokenizer.ggml.pre` names; unknown names get
GPT-2's, as transformers does. A BOS (and EOS) is added by a post-processor when the
file's `add_bos_token` (`add_eos_token`) says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from wavecore.engine.model.gguf_format import MetadataValue
from wavecore.engine.sampling.errors import TokenizerLoadError

_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` values whose split differs from GPT-2's built-in one.
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-character map: printable Latin-1 bytes stand for themselves,
    the other 68 bytes take the characters from U+0100 upwards, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    alphabet = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in alphabet:
            alphabet[byte] = chr(256 + extra)
            extra += 1
    return alphabet


def _spell(token: str, characters: frozenset[str]) -> str:
    if set(token) <= characters:
        return token
    alphabet = byte_alphabet()
    return "".join(alphabet[byte] for byte in token.encode("utf-8"))


@dataclass(frozen=True, slots=True, kw_only=True)
class GGUFTokenizer:
    """What a GGUF file says about its tokenizer."""

    backend: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    special_tokens: dict[str, str]  # "bos_token", "eos_token", ... -> token text
    chat_template: str | None


def build_gguf_tokenizer(metadata: Mapping[str, MetadataValue], path: Path) -> GGUFTokenizer:
    """The tokenizer that `metadata`, read from the file at `path`, describes."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerLoadError(
            f"{path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is supported"
        )
    tokens = _metadata_list(metadata, "tokenizer.ggml.tokens", path)
    merges = _metadata_list(metadata, "tokenizer.ggml.merges", path)
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not isinstance(token_types, list) or len(token_types) != len(tokens):
        raise TokenizerLoadError(f"{path}: tokenizer.ggml.token_type does not match tokens")

    characters = frozenset(byte_alphabet().values())
    spelled = [_spell(token, characters) for token in tokens]
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise TokenizerLoadError(f"{path}: malformed merge {merge!r}")
        pairs.append((parts[0], parts[1]))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=pairs)
    )
    backend.pre_tokenizer = _pre_tokenizer(
        str(metadata.get("tokenizer.ggml.pre", "")),
        add_prefix_space=bool(metadata.get("tokenizer.ggml.add_space_prefix", False)),
    )
    backend.decoder = decoders.ByteLevel()
    _add_marked_tokens(backend, tokens, spelled, token_types)

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not isinstance(value, int) or not 0 <= value < len(tokens):
            raise TokenizerLoadError(f"{path}: tokenizer.ggml.{key} = {value!r} is no token")
        return value

    bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
    pad, unk = token_id("padding_token_id"), token_id("unknown_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        backend.post_processor = _bos_eos_processor(
            (tokens[bos], bos) if add_bos and bos is not None else None,
            (tokens[eos], eos) if add_eos and eos is not None else None,
        )
    names = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    special = {name: tokens[i] for name, i in names.items() if i is not None}
    template = metadata.get("tokenizer.chat_template")
    return GGUFTokenizer(
        backend=backend,
        bos_token_id=bos,
        eos_token_id=eos,
        special_tokens=special,
        chat_template=template if isinstance(template, str) else None,
    )


def _pre_tokenizer(name: str, *, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    split = _PRE_TOKENIZER_SPLITS.get(name)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ]
    )


def _add_marked_tokens(
    backend: tokenizers.Tokenizer,
    tokens: list[str],
    spelled: list[str],
    token_types: list[int],
) -> None:
    """CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens.

    A token outside the byte alphabet was respelled, so its literal text is not in the
    vocabulary; adding it would grow the vocabulary past the model's, so it is skipped.
    """
    marked = [
        (token, token_type)
        for token, spelling, token_type in zip(tokens, spelled, token_types, strict=True)
        if token_type in (_CONTROL, _USER_DEFINED) and token == spelling
    ]
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in marked if kind == _CONTROL]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in marked
            if kind == _USER_DEFINED
        ]
    )


def _metadata_list(metadata: Mapping[str, object], key: str, path: Path) -> list[str]:
    value = metadata.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TokenizerLoadError(f"{path}: {key} is missing or not a list of strings")
    return value


def _bos_eos_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    before = [bos[0]] if bos else []
    after = [eos[0]] if eos else []
    return processors.TemplateProcessing(
        single=[*before, "$A", *after],
        pair=[*before, "$A", *after, *before, "$B", *after],
        special_tokens=[t for t in (bos, eos) if t is not None],
    )
