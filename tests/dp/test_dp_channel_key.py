"""The engine's channel key (`engine/dp/channel_key.py`): headless ranks need one the
front end shares, and are refused before anything starts without it; a rank with
another key cannot join, its hello refused unread."""

from __future__ import annotations

import os

import pytest
from dp_helpers import headless_rank_is_refused

from wavecore.channels import KEY_ENVIRONMENT, ChannelKey
from wavecore.engine.api import open_dp_engine
from wavecore.engine.cli.main import main
from wavecore.engine.config import EngineConfig

pytestmark = pytest.mark.anyio
NEEDS_KEY = "headless ranks need the engine's channel key"


def _config(**changes: object) -> EngineConfig:
    return EngineConfig(executor="null", dp_size=2, transport="tcp", **changes)  # type: ignore[arg-type]


async def test_a_front_end_expecting_headless_ranks_needs_a_shared_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.delenv(KEY_ENVIRONMENT, raising=False)
    with pytest.raises(ValueError, match=NEEDS_KEY):
        async with open_dp_engine(_config(), master="127.0.0.1:0", local_ranks=[0]):
            pass
    missing = f"{tmp_path}/missing.key"
    with pytest.raises(ValueError, match=f"cannot read the channel key file {missing}"):
        async with open_dp_engine(
            _config(channel_key_file=missing), master="127.0.0.1:0", local_ranks=[0]
        ):
            pass
    monkeypatch.setenv(KEY_ENVIRONMENT, "zz")
    with pytest.raises(ValueError, match=rf"\${KEY_ENVIRONMENT} is not hexadecimal"):
        async with open_dp_engine(_config(), master="127.0.0.1:0", local_ranks=[0]):
            pass


def test_a_headless_rank_without_the_key_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(KEY_ENVIRONMENT, raising=False)
    argv = ["rank", "--dp-rank", "1", "--dp-size", "2", "--master", "127.0.0.1:1"]
    assert main([*argv, "--executor", "null"]) == 2
    err = capsys.readouterr().err
    assert NEEDS_KEY in err and len(err.strip().splitlines()) == 1


async def test_a_rank_with_another_key_cannot_join(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The front end and its local rank share one key; the headless rank has another:
    its hello is refused unread (and counted), so the startup ends naming it."""
    monkeypatch.setenv(KEY_ENVIRONMENT, ChannelKey.generate().hex())
    argv = ["rank", "--dp-rank", "1", "--dp-size", "2", "--executor", "null"]
    other = {**os.environ, KEY_ENVIRONMENT: ChannelKey.generate().hex()}
    await headless_rank_is_refused(_config(startup_timeout=4.0), argv, env=other)
    assert "client handshake: dropped a malformed frame (a frame that failed authentication" in (
        caplog.text
    )
