"""Request JSON into what the engine takes: prompts and one validated `SamplingParams`.

Every field is checked for its type here and for its range by `SamplingParams` itself;
either way a bad field is a 400 naming it (`param`). Fields an OpenAI client may send
that wavecore cannot honour are refused by name rather than silently ignored; fields
nobody here knows (client extensions) are ignored, as upstream servers do.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from wavecore.engine.request import Prompt
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.serve.errors import APIError, bad_field
from wavecore.engine.structured_outputs import KINDS, StructuredOutputs

CallKind = Literal["completion", "chat"]

# SamplingParams' own fields that a request sets under the same name.
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_INT_FIELDS = ("top_k", "seed", "min_tokens")
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})
# A value other than these (None or the harmless default) asks for something wavecore
# does not do; the request is refused instead of answered differently.
_UNSUPPORTED: Mapping[str, tuple[object, ...]] = {
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}
_MAX_N = 128
_FIELD_OF_ERROR = re.compile(r"SamplingParams\.(\w+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationCall:
    """One parsed `/v1/completions` or `/v1/chat/completions` request.

    `prompts` holds one prompt per choice group (a completion may batch prompts; a chat
    has one). `max_tokens` None (chat only) means "up to the end of the context".
    """

    kind: CallKind
    prompts: tuple[Prompt, ...]
    params: SamplingParams
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: bool
    # The body field that asked for structured output ("response_format" or
    # "structured_outputs"), named by a 400 when its grammar does not compile.
    structured_field: str | None = None
    # The LoRA adapter the `model` field named (None: the base model).
    lora: str | None = None
    # OpenAI's end-user name: who the call counts against, when authenticated.
    user: str | None = None


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise APIError(
            400, f"the request body is not valid JSON: {error}", code="invalid_json"
        ) from None
    if not isinstance(value, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(value).__name__}")
    return value


def parse_call(
    kind: CallKind, body: Mapping[str, Any], model_name: str, loras: Collection[str] = ()
) -> GenerationCall:
    lora = _model_or_lora(body, model_name, loras)
    _check_unsupported(body)
    user = _optional_str(body, "user")
    stream = _bool(body, "stream", default=False)
    include_usage = _stream_options(body, stream)
    if kind == "completion":
        prompts = _completion_prompts(body)
        max_tokens = _int(body, "max_tokens", low=1)
        max_tokens = 16 if max_tokens is None else max_tokens  # OpenAI's default
        logprobs = _int(body, "logprobs", low=0)
        echo = _bool(body, "echo", default=False)
        if echo and logprobs is not None:
            raise bad_field("echo", "echo with logprobs would need prompt logprobs, not supported")
        wanted_logprobs = logprobs
    else:
        prompts = (_messages(body),)
        max_tokens = _int(body, "max_completion_tokens", low=1)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", low=1)
        echo = False
        wanted_logprobs = _chat_logprobs(body)
    n = _int(body, "n", low=1, high=_MAX_N)
    params = _sampling_params(kind, body, max_tokens, wanted_logprobs)
    structured_field, spec = _structured_outputs(body)
    if spec is not None:
        params = dataclasses.replace(params, structured_outputs=spec)
    return GenerationCall(
        kind=kind,
        prompts=prompts,
        params=params,
        max_tokens=max_tokens,
        n=1 if n is None else n,
        stream=stream,
        include_usage=include_usage,
        echo=echo,
        logprobs=wanted_logprobs is not None,
        structured_field=structured_field,
        lora=lora,
        user=user,
    )


def _model_or_lora(body: Mapping[str, Any], model_name: str, loras: Collection[str]) -> str | None:
    """The LoRA adapter the `model` field names, None for the base model."""
    model = body.get("model")
    if model is None or model == model_name:
        return None
    if isinstance(model, str) and model in loras:
        return model
    served = ", ".join(repr(name) for name in (model_name, *sorted(loras)))
    raise APIError(
        400,
        f"the model {model!r} does not exist; this server serves {served}",
        param="model",
        code="model_not_found",
    )


def _check_unsupported(body: Mapping[str, Any]) -> None:
    for name, harmless in _UNSUPPORTED.items():
        if name in body and body[name] not in harmless:
            raise APIError(
                400, f"{name}: not supported by wavecore", param=name, code="unsupported"
            )


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_field("stream_options", "only allowed when stream is true")
    if not isinstance(options, dict):
        raise bad_field("stream_options", "must be an object")
    return _bool(options, "include_usage", default=False, where="stream_options.include_usage")


def _completion_prompts(body: Mapping[str, Any]) -> tuple[Prompt, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, str) for item in prompt):
            return tuple(prompt)
        if all(_is_token(item) for item in prompt):
            return (list(prompt),)
        if all(isinstance(item, list) and all(_is_token(t) for t in item) for item in prompt):
            return tuple(list(item) for item in prompt)
    raise bad_field(
        "prompt",
        "must be a string, a non-empty list of strings, a list of token ids or a list of "
        "lists of token ids",
    )


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "must be a non-empty list of messages")
    return [_message(number, message) for number, message in enumerate(messages)]


def _message(number: int, message: object) -> dict[str, str]:
    where = f"messages[{number}]"
    if not isinstance(message, dict):
        raise bad_field(where, "must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in _CHAT_ROLES:
        raise bad_field(f"{where}.role", f"must be one of {sorted(_CHAT_ROLES)}, got {role!r}")
    # The chat templates of small models know "system", not OpenAI's newer "developer".
    role = "system" if role == "developer" else role
    return {"role": role, "content": _content(f"{where}.content", message.get("content"))}


def _content(where: str, content: object) -> str:
    """String content, or a list of text parts joined (the only part type a text model
    can read)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for number, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_field(f"{where}[{number}]", "only parts of type 'text' are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_field(f"{where}[{number}].text", "must be a string")
            texts.append(text)
        return "".join(texts)
    raise bad_field(where, "must be a string or a list of text parts")


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    wanted = _bool(body, "logprobs", default=False)
    top = _int(body, "top_logprobs", low=0)
    if top is not None and not wanted:
        raise bad_field("top_logprobs", "needs logprobs set to true")
    return (top or 0) if wanted else None


def _sampling_params(
    kind: CallKind, body: Mapping[str, Any], max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    chosen: dict[str, Any] = {"logprobs": logprobs}
    if max_tokens is not None:
        chosen["max_tokens"] = max_tokens
    for name in _FLOAT_FIELDS:
        value = _number(body, name)
        if value is not None:
            chosen[name] = value
    for name in _INT_FIELDS:
        value = _int(body, name, low=None)
        if value is not None:
            chosen[name] = value
    if chosen.get("top_k") == -1:
        chosen["top_k"] = 0  # upstream's spelling of "no top-k"
    chosen["stop"] = _stop(body)
    chosen["ignore_eos"] = _bool(body, "ignore_eos", default=False)
    token_ids = body.get("stop_token_ids")
    if token_ids is not None:
        if not isinstance(token_ids, list) or not all(_is_token(t) for t in token_ids):
            raise bad_field("stop_token_ids", "must be a list of token ids")
        chosen["stop_token_ids"] = tuple(token_ids)
    try:
        return SamplingParams(**chosen)
    except ValueError as error:
        raise _named(kind, str(error)) from None


def _named(kind: CallKind, message: str) -> APIError:
    """SamplingParams' error names its own field; the request's may be spelled otherwise."""
    found = _FIELD_OF_ERROR.search(message)
    field = found.group(1) if found else "params"
    if kind == "chat" and field == "logprobs":
        field = "top_logprobs"
    if kind == "chat" and field == "max_tokens":
        field = "max_completion_tokens"
    return bad_field(field, message.replace("SamplingParams.", ""))


def _structured_outputs(body: Mapping[str, Any]) -> tuple[str | None, StructuredOutputs | None]:
    """OpenAI's `response_format` or upstream's `structured_outputs`, at most one; a bad
    one is a 400 naming the field (whether it compiles is asked on generate)."""
    response_format = body.get("response_format")
    if response_format in (None, {"type": "text"}):
        response_format = None
    fields = body.get("structured_outputs")
    if response_format is not None and fields is not None:
        raise bad_field("structured_outputs", "cannot be combined with response_format")
    if response_format is not None:
        return "response_format", _response_format(response_format)
    if fields is None:
        return None, None
    if not isinstance(fields, dict):
        raise bad_field("structured_outputs", f"must be an object with one of {', '.join(KINDS)}")
    unknown = sorted(set(fields) - set(KINDS))
    if unknown:
        raise bad_field("structured_outputs", f"unknown fields {unknown}; known: {list(KINDS)}")
    chosen = {name: value for name, value in fields.items() if value is not None}
    if "json_object" in chosen and not isinstance(chosen["json_object"], bool):
        raise bad_field("structured_outputs.json_object", "must be a boolean")
    return "structured_outputs", _spec("structured_outputs", chosen)


def _response_format(value: object) -> StructuredOutputs:
    if not isinstance(value, dict):
        raise bad_field("response_format", "must be an object with a 'type'")
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise bad_field(
            "response_format.type",
            f"must be 'text', 'json_object' or 'json_schema', got {json.dumps(kind)}",
        )
    described = value.get("json_schema")
    if not isinstance(described, dict):
        raise bad_field("response_format.json_schema", "must be an object with a 'schema'")
    if not isinstance(described.get("name", ""), str):
        raise bad_field("response_format.json_schema.name", "must be a string")
    if not isinstance(described.get("strict", False), bool | None):
        raise bad_field("response_format.json_schema.strict", "must be a boolean")
    schema = described.get("schema")
    if not isinstance(schema, dict | bool):
        raise bad_field("response_format.json_schema.schema", "must be a JSON schema (an object)")
    return _spec("response_format.json_schema.schema", {"json": schema})


def _spec(field: str, chosen: dict[str, Any]) -> StructuredOutputs:
    try:
        return StructuredOutputs(**chosen)
    except (TypeError, ValueError) as error:
        raise bad_field(field, str(error).replace("StructuredOutputs.", "")) from None


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_field("stop", "must be a non-empty string or a list of non-empty strings")
    return tuple(stop)


def _bool(body: Mapping[str, Any], name: str, *, default: bool, where: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_field(where or name, f"must be a boolean, got {json.dumps(value)}")
    return value


def _int(
    body: Mapping[str, Any], name: str, *, low: int | None, high: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_token(value):
        raise bad_field(name, f"must be an integer, got {json.dumps(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad_field(name, f"must be {bound}, got {value}")
    return value


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_field(name, f"must be a number, got {json.dumps(value)}")
    return float(value)


def _optional_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_field(name, f"must be a string, got {json.dumps(value)}")
    return value
