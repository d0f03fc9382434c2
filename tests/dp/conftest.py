"""DP tests share engines per module (spawning ranks costs seconds), so the backend is
module-scoped here: asyncio by default; `test_dp_trio.py` runs a subset on trio."""

from __future__ import annotations

import pytest

from wavecore.channels import KEY_ENVIRONMENT, ChannelKey


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def shared_channel_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """The key in the environment of the front end and of the headless ranks it starts,
    as an operator gives it (`engine/dp/channel_key.py`)."""
    key = ChannelKey.generate().hex()
    monkeypatch.setenv(KEY_ENVIRONMENT, key)
    return key
