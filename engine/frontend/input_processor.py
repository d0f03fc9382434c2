"""Turns what a caller passes to `generate` into a validated `EngineRequest`.

Every check happens here, on the caller's own call, so a bad request raises there and
never reaches the engine loop or disturbs the requests already in flight. A structured
output spec is compiled once to see that it compiles (in a worker thread: a large
grammar takes a while); specs found good are remembered.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import anyio.to_thread

from wavecore.engine.errors import EmptyPromptError, InvalidRequestError, PromptTooLongError
from wavecore.engine.request import EngineRequest, Prompt, PromptTokenizer
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.structured.grammars import GrammarError, check_spec
from wavecore.engine.structured_outputs import StructuredOutputs

# Specs known to compile, remembered so a repeated schema costs nothing.
_CHECKED_SPECS = 1024


class InputProcessor:
    def __init__(self, tokenizer: PromptTokenizer, *, max_model_len: int) -> None:
        self._tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._checked: OrderedDict[tuple[str, str], None] = OrderedDict()

    async def check_structured_outputs(self, spec: StructuredOutputs) -> None:
        """Raise `InvalidRequestError` naming the field unless `spec` compiles."""
        if not isinstance(spec, StructuredOutputs):
            raise InvalidRequestError(
                f"structured_outputs must be a StructuredOutputs, got {type(spec).__name__}"
            )
        key = spec.key
        if key in self._checked:
            self._checked.move_to_end(key)
        else:
            try:
                await anyio.to_thread.run_sync(check_spec, spec)
            except GrammarError as error:
                raise InvalidRequestError(str(error)) from None
            self._checked[key] = None
            if len(self._checked) > _CHECKED_SPECS:
                self._checked.popitem(last=False)

    def prepare(self, request_id: str, prompt: Prompt, params: SamplingParams) -> EngineRequest:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params must be a SamplingParams, got {type(params).__name__}"
            )
        token_ids = self._tokenize(prompt)
        if not token_ids:
            raise EmptyPromptError(f"request {request_id!r}: the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"request {request_id!r}: the prompt has {len(token_ids)} tokens, but the "
                f"model's context is {self.max_model_len} tokens (at least one must be left "
                f"for the output)"
            )
        return EngineRequest(request_id=request_id, prompt_token_ids=token_ids, params=params)

    def _tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        if isinstance(prompt, str):
            return tuple(self._tokenizer.encode(prompt)) if prompt else ()
        if not isinstance(prompt, Sequence):
            raise InvalidRequestError(
                f"a prompt is text, a list of chat messages or a list of token ids, "
                f"got {type(prompt).__name__}"
            )
        if all(isinstance(item, Mapping) for item in prompt) and prompt:
            return tuple(self._tokenize_chat(prompt))  # type: ignore[arg-type]
        return self._check_token_ids(prompt)

    def _tokenize_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        for number, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise InvalidRequestError(
                    f"chat message {number} needs string 'role' and 'content', got {dict(message)!r}"
                )
        text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # The template already wrote the special tokens it wants.
        return self._tokenizer.encode(text, add_special_tokens=False)

    def _check_token_ids(self, prompt: Sequence[object]) -> tuple[int, ...]:
        vocab = self._tokenizer.vocab_size
        for position, token in enumerate(prompt):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise InvalidRequestError(
                    f"prompt token {position} is {token!r}; token ids are ints in [0, {vocab})"
                )
        return tuple(prompt)  # type: ignore[arg-type]
