"""Response bodies in OpenAI's shapes: whole completions, streamed chunks, usage and
logprobs, and the server-sent-events framing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from wavecore.engine.outputs import CompletionDelta, TokenLogprob
from wavecore.engine.serve.choices import Choice
from wavecore.engine.serve.parsing import CallKind
from wavecore.engine.serve.state import ReadyEngine

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    """What every body and chunk of one response repeats."""

    id: str
    kind: CallKind
    created: int
    model: str

    def base(self, chunk: bool) -> dict[str, Any]:
        if self.kind == "completion":
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


@dataclass(slots=True)
class ChoiceResult:
    """A choice's output so far, summed over its deltas."""

    text: str = ""
    output_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        self.output_tokens += len(delta.token_ids)
        self.prompt_tokens = delta.usage.prompt_tokens
        self.finish_reason = delta.finish_reason
        self.logprobs.extend(delta.logprobs)


def usage(choices: Sequence[Choice], results: Sequence[ChoiceResult]) -> dict[str, int]:
    """Each prompt counted once, whatever `n`; every choice's output tokens."""
    prompt = sum(len(c.prompt_token_ids) for c in choices if c.counts_prompt)
    completion = sum(result.output_tokens for result in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def whole_body(
    header: Header,
    ready: ReadyEngine,
    choices: Sequence[Choice],
    results: Sequence[ChoiceResult],
    logprobs: bool,
) -> dict[str, Any]:
    body = header.base(chunk=False)
    body["choices"] = [
        _whole_choice(header.kind, ready, choice, result, logprobs)
        for choice, result in zip(choices, results, strict=True)
    ]
    body["usage"] = usage(choices, results)
    return body


def _whole_choice(
    kind: CallKind, ready: ReadyEngine, choice: Choice, result: ChoiceResult, logprobs: bool
) -> dict[str, Any]:
    formatted = format_logprobs(kind, ready, result.logprobs) if logprobs else None
    entry: dict[str, Any] = {"index": choice.index}
    if kind == "completion":
        entry["text"] = choice.echo + result.text
    else:
        entry["message"] = {"role": "assistant", "content": result.text}
    entry["logprobs"] = formatted
    entry["finish_reason"] = result.finish_reason
    return entry


def chunk(
    header: Header,
    index: int,
    text: str,
    finish_reason: str | None,
    *,
    first: bool,
    logprobs: dict[str, Any] | None,
    include_usage: bool,
) -> dict[str, Any]:
    """One streamed piece of choice `index`; a chat's first chunk names the role."""
    body = header.base(chunk=True)
    entry: dict[str, Any] = {"index": index}
    if header.kind == "completion":
        entry["text"] = text
    else:
        entry["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    entry["logprobs"] = logprobs
    entry["finish_reason"] = finish_reason
    body["choices"] = [entry]
    if include_usage:
        body["usage"] = None  # OpenAI's shape: only the last chunk carries usage
    return body


def usage_chunk(
    header: Header, choices: Sequence[Choice], results: Sequence[ChoiceResult]
) -> dict[str, Any]:
    body = header.base(chunk=True)
    body["choices"] = []
    body["usage"] = usage(choices, results)
    return body


def format_logprobs(
    kind: CallKind, ready: ReadyEngine, entries: Sequence[TokenLogprob]
) -> dict[str, Any]:
    if kind == "chat":
        return {"content": [_chat_logprob(ready, entry) for entry in entries]}
    tokens = [ready.token_text(entry.token_id) for entry in entries]
    offsets: list[int] = []
    position = 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [
            {ready.token_text(token): logprob for token, logprob in entry.top} for entry in entries
        ],
        "text_offset": offsets,
    }


def _chat_logprob(ready: ReadyEngine, entry: TokenLogprob) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = ready.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    described = one(entry.token_id, entry.logprob)
    described["top_logprobs"] = [one(token, logprob) for token, logprob in entry.top]
    return described
