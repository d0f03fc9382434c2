"""Rendering a model's Jinja chat template into a prompt string.

Chat templates ship inside model files (GGUF metadata `tokenizer.chat_template`, or
`tokenizer_config.json` / `chat_template.jinja` next to a `tokenizer.json`) and are
written for the Hugging Face convention: a Jinja environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `raise_exception(message)` global, a
`strftime_now(format)` global and a `tojson` filter that keeps non-ASCII text as is.
The template sees `messages`, `add_generation_prompt` and the special-token strings
(`bos_token`, `eos_token`, ...). Templates come from files we did not write, so they
run in Jinja's immutable sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is missing, malformed, or refused the conversation."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.filters["tojson"] = _tojson
    return environment


class ChatTemplate:
    """A compiled chat template and the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template does not compile: {error}") from error
        self._special_tokens = dict(special_tokens)
        self.source = source

    def render(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        try:
            return self._template.render(
                messages=[dict(message) for message in messages],
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template failed: {error}") from error
