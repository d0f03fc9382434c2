"""Structured output over HTTP, through the official `openai` client: OpenAI's
`response_format` (json_schema, json_object) and upstream's `structured_outputs` body
field, whole and streamed; every bad one a 400 naming its field; /metrics counts them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from serve_helpers import ServerProcess

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Who are you?"}]


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_a_chat_with_a_json_schema_answers_json_that_validates(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=100,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_json_object_mode_starts_an_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=12,
        response_format={"type": "json_object"},
    )
    assert (reply.choices[0].message.content or "").startswith("{")


def test_structured_outputs_choice_and_regex_whole_and_streamed(client: openai.OpenAI) -> None:
    choices = ["north", "south", "east", "west"]
    reply = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Which way?",
        max_tokens=20,
        n=3,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(
        choice.text in choices and choice.finish_reason == "stop" for choice in reply.choices
    )
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="A date:",
        max_tokens=20,
        stream=True,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    )
    text = "".join(chunk.choices[0].text for chunk in stream)
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", text)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frob"}},
                }
            },
            "response_format",
            "structured_outputs.json: .*frob",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "must be 'text'"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
        (
            {"structured_outputs": {"regex": "(open"}},
            "structured_outputs",
            "structured_outputs.regex",
        ),
        ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs", "grammar"),
        (
            {"structured_outputs": {"choice": []}},
            "structured_outputs",
            "choice must be a non-empty",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"structured_outputs": {"xml": "a"}}, "structured_outputs", "unknown fields"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "cannot be combined",
        ),
    ],
)
def test_a_bad_spec_is_a_400_naming_its_field(
    client: openai.OpenAI, body: dict, param: str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=5,
            extra_body=body,
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param
    assert re.search(message, str(error["message"])), error["message"]


def test_metrics_count_structured_requests_by_kind(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="x",
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["a", "b"]}},
    )
    text = httpx.get(f"{server.url}/metrics").text
    counted = re.search(
        r'wavecore:structured_output_requests_total\{.*kind="choice".*\} (\S+)', text
    )
    assert counted and float(counted.group(1)) >= 1
    assert "wavecore:grammar_compile_seconds_total" in text
