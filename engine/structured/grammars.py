"""From a `StructuredOutputs` spec to a grammar the engine can match tokens against.

The grammar engine is llguidance (the Rust library behind llama.cpp's and upstream's
`guidance` backend): it has no run-time dependency (xgrammar, upstream's default, pulls
in transformers, triton and pydantic), builds a matcher for a typical schema in about a
millisecond on this project's CPUs and computes a 49k-token mask in tens of
microseconds; `bench/structured.py` measures both engines side by side.

Every kind becomes one llguidance grammar text:
- `json`: the schema through llguidance's JSON compiler, with `", "` and `": "` as the
  only separators and no other whitespace: outputs stay as short as the schema allows
  (free whitespace lets a small model emit newlines without end), and parse as
  `json.dumps` would write them.
- `json_object`: the schema `{"type": "object"}`.
- `regex`: as given (Rust regex syntax, anchored at both ends).
- `choice`: a Lark rule of one literal per option.
- `grammar`: Lark as llguidance reads it, or GBNF (recognized by its `::=`),
  translated to Lark.

`check_spec` compiles a spec without a vocabulary and raises `GrammarError` naming the
field with the compiler's message; `GrammarVocabulary` wraps a tokenizer's vocabulary
for matchers (built once per tokenizer: about 0.7 s for a 49k BPE vocabulary).
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import llguidance
import tokenizers
from llguidance.gbnf_to_lark import gbnf_to_lark

from wavecore.engine.structured_outputs import StructuredOutputs

_JSON_OPTIONS: Any = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """A spec does not compile; the message names the field and the compiler's reason."""


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar for `spec` (not yet checked)."""
    kind = spec.kind
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=_JSON_OPTIONS
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            options = " | ".join(json.dumps(option) for option in spec.choice or ())
            return llguidance.LLMatcher.grammar_from_lark(f"start: {options}\n")
        text = spec.grammar or ""
        lark = gbnf_to_lark(text) if "::=" in text else text
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except Exception as error:  # llguidance's own parse errors (ValueError, RuntimeError)
        raise GrammarError(f"structured_outputs.{kind}: {_first_lines(error)}") from None


def check_spec(spec: StructuredOutputs) -> None:
    """Raise `GrammarError` unless `spec` compiles (no vocabulary needed: cheap)."""
    message = llguidance.LLMatcher.validate_grammar(grammar_text(spec), None)
    if message:
        raise GrammarError(f"structured_outputs.{spec.kind}: {_first_lines(message)}")


def _first_lines(error: object, limit: int = 6) -> str:
    """The compiler's message on one line (it spans several, with carets)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines[:limit])


class GrammarVocabulary:
    """A tokenizer's vocabulary as llguidance reads it, for `vocab_size` logit columns.

    Built once per tokenizer object and shared (`for_tokenizer`): a tokenizer with a
    Hugging Face `backend` is handed over whole (added and special tokens included);
    one that lists its tokens' bytes (`token_bytes`, the byte tokenizer) is read token
    by token.
    """

    _cache: weakref.WeakKeyDictionary[object, GrammarVocabulary] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        eos = tokenizer.eos_token_id
        backend = getattr(tokenizer, "backend", None)
        if isinstance(backend, tokenizers.Tokenizer):
            self.ll_tokenizer = llguidance.LLTokenizer(
                backend.to_str(), n_vocab=vocab_size, eos_token=eos
            )
        elif hasattr(tokenizer, "token_bytes"):
            self.ll_tokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_TokenTable(tokenizer))
            )
        else:
            raise GrammarError(
                f"structured outputs need a tokenizer with a known vocabulary; "
                f"{type(tokenizer).__name__} has none"
            )
        self.vocab_size = vocab_size

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int) -> GrammarVocabulary:
        with cls._lock:
            vocabulary = cls._cache.get(tokenizer)
            if vocabulary is None or vocabulary.vocab_size != vocab_size:
                vocabulary = cls(tokenizer, vocab_size)
                cls._cache[tokenizer] = vocabulary
            return vocabulary

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher for `spec` (slow for large grammars: call it off the loop)."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(
                f"structured_outputs.{spec.kind}: {_first_lines(matcher.get_error())}"
            )
        return matcher


class _TokenTable:
    """What llguidance's `TokenizerWrapper` reads of a tokenizer that lists its tokens."""

    def __init__(self, tokenizer: Any) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = tokenizer.token_bytes
        self.special_token_ids = [tokenizer.eos_token_id]
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)
