"""Reading the prompts of a `wavecore generate` run, before any engine starts.

Every input is read in full first, so a prompt that cannot be read (bytes that are not
UTF-8, bad JSON, a field of the wrong type, bad sampling fields) is known before a
model loads. Such a prompt becomes a `Rejected` entry naming its place (`file:line`);
the others become `PromptJob`s. Both keep their position in the input (`index`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

from wavecore.engine.cli.demo_prompts import DEMO_PROMPTS
from wavecore.engine.cli.latency import RequestTimer
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.structured.grammars import check_spec
from wavecore.engine.structured_outputs import StructuredOutputs

_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}

CliPrompt = str | list[dict[str, str]]


class UsageError(Exception):
    """A command-line input problem, reported as one line and exit status 2."""


class BadPromptError(Exception):
    """One prompt of the input cannot be run; the message says why, not where."""


@dataclass(slots=True, kw_only=True)
class PromptJob:
    """One prompt of a run, and what came back for it."""

    index: int
    where: str
    prompt: CliPrompt
    params: SamplingParams
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    timer: RequestTimer | None = None
    finished: bool = False
    # The LoRA adapter it runs under (`--lora`), None for the base model.
    lora: str | None = None

    def result(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": len(self.token_ids),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejected:
    """A prompt of the input that could not be read."""

    index: int
    where: str
    message: str


@dataclass(slots=True)
class Inputs:
    """Every prompt of a run in input order: `index` counts jobs and rejections alike."""

    jobs: list[PromptJob] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.jobs) + len(self.rejected)

    def add(self, where: str, prompt: CliPrompt, params: SamplingParams) -> None:
        self.jobs.append(PromptJob(index=len(self), where=where, prompt=prompt, params=params))

    def reject(self, where: str, message: str) -> None:
        self.rejected.append(Rejected(index=len(self), where=where, message=message))


def load_inputs(args: argparse.Namespace, stdin: TextIO) -> Inputs:
    """The run's prompts: `--demo`, then `--prompt`s, then `--prompts-file`; stdin only
    when none of those gave one."""
    defaults = _default_sampling(args)
    inputs = Inputs()
    if args.demo:
        for number, text in enumerate(DEMO_PROMPTS, 1):
            inputs.add(f"demo {number}", _as_chat(text, True), SamplingParams(**defaults))
    for number, text in enumerate(args.prompt or (), 1):
        # A --prompt is taken literally, even when it looks like JSON.
        inputs.add(f"--prompt {number}", _as_chat(text, args.chat), SamplingParams(**defaults))
    if args.prompts_file is not None:
        path = Path(args.prompts_file)
        _add_lines(inputs, str(path), _file_bytes(path), defaults, args.chat)
    if not len(inputs) and not stdin.isatty():
        _add_lines(inputs, "stdin", _stdin_bytes(stdin), defaults, args.chat)
    if not len(inputs):
        raise UsageError("no prompts: give --prompt, --prompts-file, --demo, or lines on stdin")
    return inputs


def _default_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags given; bad ones are a usage error, since every prompt has them."""
    chosen = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": tuple(args.stop or ()),
    }
    defaults = {name: value for name, value in chosen.items() if value is not None}
    try:
        structured = _structured_flags(args)
        if structured is not None:
            defaults["structured_outputs"] = structured
        SamplingParams(**defaults)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return defaults


def _structured_flags(args: argparse.Namespace) -> StructuredOutputs | None:
    """`--json-schema FILE`, `--regex R` or `--choice A,B,C` (argparse allows one),
    compiled here so that a bad one stops the run before a model loads."""
    if args.json_schema is not None:
        path = Path(args.json_schema)
        try:
            spec = StructuredOutputs(json=path.read_text())
        except OSError as error:
            raise UsageError(f"--json-schema {path}: {error.strerror}") from None
    elif args.regex is not None:
        spec = StructuredOutputs(regex=args.regex)
    elif args.choice is not None:
        spec = StructuredOutputs(choice=[option for option in args.choice.split(",") if option])
    else:
        return None
    check_spec(spec)
    return spec


def _file_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise UsageError(f"--prompts-file {path}: no such file")
    try:
        return path.read_bytes()
    except OSError as error:
        raise UsageError(f"--prompts-file {path}: {error.strerror}") from None


def _stdin_bytes(stdin: TextIO) -> bytes:
    # The bytes, not the text: a line that is not UTF-8 is then rejected alone instead
    # of the decoder failing the whole stream.
    binary = getattr(stdin, "buffer", None)
    return binary.read() if binary is not None else stdin.read().encode()


def _add_lines(
    inputs: Inputs, name: str, data: bytes, defaults: dict[str, Any], chat: bool
) -> None:
    """One prompt per non-blank line, each named `name:line`."""
    for number, raw in enumerate(data.splitlines(), 1):
        where = f"{name}:{number}"
        try:
            parsed = _parse_line(raw, defaults, chat)
        except BadPromptError as error:
            inputs.reject(where, str(error))
            continue
        if parsed is not None:
            inputs.add(where, *parsed)


def _parse_line(
    raw: bytes, defaults: dict[str, Any], chat: bool
) -> tuple[CliPrompt, SamplingParams] | None:
    """A line is plain text, or a JSON object with `prompt` or `messages` and sampling
    fields; None for a blank line."""
    line = _decode(raw)
    if not line.strip():
        return None
    if not line.lstrip().startswith("{"):
        return _as_chat(line, chat), SamplingParams(**defaults)
    record = _json_object(line)
    unknown = set(record) - _SAMPLING_FIELDS - {"prompt", "messages"}
    if unknown:
        raise BadPromptError(f"unknown field(s) {sorted(unknown)}")
    if ("prompt" in record) == ("messages" in record):
        raise BadPromptError("give exactly one of 'prompt' or 'messages'")
    params = _line_sampling(record, defaults)
    if "messages" in record:
        return _messages(record["messages"]), params
    return _as_chat(_text(record["prompt"]), chat), params


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadPromptError(
            f"not valid UTF-8 (byte {error.start + 1} of the line is 0x{raw[error.start]:02x})"
        ) from None


def _json_object(line: str) -> dict[str, Any]:
    """The object on a line that starts with `{` (so, when it parses, an object)."""
    try:
        record: dict[str, Any] = json.loads(line)
    except json.JSONDecodeError as error:
        raise BadPromptError(f"not valid JSON ({error.msg} at column {error.colno})") from None
    return record


def _line_sampling(record: dict[str, Any], defaults: dict[str, Any]) -> SamplingParams:
    """The line's sampling fields over the flags'; its `structured_outputs` is an object
    with one of upstream's kinds (`{"regex": "..."}`), compiled here."""
    overrides = {k: v for k, v in record.items() if k in _SAMPLING_FIELDS}
    try:
        structured = overrides.get("structured_outputs")
        if isinstance(structured, dict):
            overrides["structured_outputs"] = StructuredOutputs(**structured)
            check_spec(overrides["structured_outputs"])
        return SamplingParams(**{**defaults, **overrides})
    except (TypeError, ValueError) as error:
        raise BadPromptError(str(error)) from None


def _text(prompt: object) -> str:
    if not isinstance(prompt, str):
        raise BadPromptError(f"prompt must be a string, got {_shown(prompt)}")
    return prompt


def _messages(messages: object) -> list[dict[str, str]]:
    if (
        not isinstance(messages, list)
        or not messages
        or not all(_is_message(message) for message in messages)
    ):
        raise BadPromptError(
            "messages must be a non-empty list of objects with string 'role' and 'content', "
            f"got {_shown(messages)}"
        )
    return messages


def _is_message(message: object) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


def _shown(value: object) -> str:
    """A value as it was written in the JSON line."""
    return json.dumps(value, ensure_ascii=False)


def _as_chat(text: str, chat: bool) -> CliPrompt:
    return [{"role": "user", "content": text}] if chat else text
