"""`wavecore serve` usage errors: one line on stderr and exit status 2, before any
engine starts."""

from __future__ import annotations

import socket

import pytest

from wavecore.engine.cli.main import main


def test_a_port_in_use_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--executor", "null", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
        (["--max-waiting", "-1"], "--max-waiting must be >= 0"),
        (["--shutdown-timeout", "-2"], "--shutdown-timeout must be >= 0"),
        (["--api-key", ""], "--api-key must not be empty"),
        (["--max-num-seqs", "0"], "max_num_seqs must be a positive int"),
        (["--max-inflight", "0"], "--max-inflight must be >= 1, got 0"),
        (["--max-inflight-per-client", "0"], "--max-inflight-per-client must be >= 1"),
        (["--max-queued-per-client", "-1"], "--max-queued-per-client must be >= 0"),
        (["--null-step-ms", "-5"], "null_step_seconds must be a finite number >= 0"),
    ],
)
def test_bad_flags_are_named(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--executor", "null", *flags]) == 2
    assert message in capsys.readouterr().err
