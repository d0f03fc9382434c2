"""Bounded HTTP work, over real sockets: a call's engine requests (prompts x n), its stop
strings, the nesting of its JSON, text that is not valid Unicode in any field, and a body
that stalls are each refused with a specific status naming the field; the server serves
on, and a stalled or vanished client costs no traceback."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from serve_helpers import EXIT_GUARD, NULL_FLAGS, ServerProcess, error_of, serve

from wavecore.engine.serve.limits import MAX_JSON_DEPTH, MAX_STOP_CHARS, MAX_STOP_STRINGS

LIMIT_FLAGS = (*NULL_FLAGS, "--max-requests-per-call", "8", "--body-timeout", "1")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serve(*LIMIT_FLAGS)


def completion(**fields: object) -> dict[str, object]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (completion(prompt=["p"] * 3, n=3), "n", "3 prompt(s) x n=3 is 9 generations"),
        (completion(prompt=["p"] * 9), "prompt", "at most 8 per call"),
        (completion(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), "stop", "at most"),
        (completion(stop=["x" * (MAX_STOP_CHARS + 1)]), "stop", "characters in all"),
    ],
)
def test_work_beyond_the_limits_is_a_400_naming_the_field(
    server: ServerProcess, body: dict[str, object], param: str, words: str
) -> None:
    with server.client() as http:
        error = error_of(http.post("/v1/completions", json=body), 400)
        assert error["param"] == param
        assert words in str(error["message"])
        # Within the limits, the same call is served.
        fine = http.post("/v1/completions", json=completion(prompt=["p"] * 2, n=4))
        assert [c["finish_reason"] for c in fine.json()["choices"]] == ["length"] * 8


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"prompt": "a\\ud800", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": "a", "stop": ["ok", "\\udc00"]}', "stop[1]"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages[0].content",
        ),
        ("/v1/completions", '{"prompt": "a", "user": "\\ud800"}', "user"),
    ],
)
def test_a_lone_surrogate_in_any_field_is_a_400_naming_it(
    server: ServerProcess, path: str, body: str, param: str
) -> None:
    with server.client() as http:
        response = http.post(path, content=body, headers={"content-type": "application/json"})
        error = error_of(response, 400)
        assert error["param"] == param
        assert "lone surrogate" in str(error["message"])


def test_deep_nesting_is_a_400_not_a_recursion_error(server: ServerProcess) -> None:
    deep = '{"prompt": "a", "user": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with server.client() as http:
        response = http.post(
            "/v1/completions", content=deep, headers={"content-type": "application/json"}
        )
        error = error_of(response, 400)
        assert f"deeper than {MAX_JSON_DEPTH} levels" in str(error["message"])
        # Brackets inside strings are text, not nesting.
        text = json.dumps(completion(prompt="[" * 1000))
        fine = http.post("/v1/completions", content=text)
        assert fine.status_code == 200, fine.text


def _raw_connection(server: ServerProcess) -> socket.socket:
    address = urlsplit(server.url)
    connection = socket.create_connection((address.hostname, address.port), timeout=EXIT_GUARD)
    return connection


def test_a_stalled_body_is_a_408_and_its_connection_closes(server: ServerProcess) -> None:
    with _raw_connection(server) as connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n" + b'{"prompt": '
        )
        answer = b""
        while chunk := connection.recv(65536):  # until the server closes it
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"did not arrive within 1 s" in answer
    with server.client() as http:
        assert http.post("/v1/completions", json=completion()).status_code == 200


def test_clients_that_vanish_mid_body_cost_no_traceback(server: ServerProcess) -> None:
    for _ in range(3):
        with _raw_connection(server) as connection:
            connection.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"
            )
    with server.client() as http:
        assert http.post("/v1/completions", json=completion()).status_code == 200
    status, err = server.terminate()
    assert status == 0, err
    assert "Traceback" not in err, err
