"""Servers for the tests: `wavecore serve` in a subprocess on a free port, one per test
module (starting one costs a second or two)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serve_helpers import NULL_FLAGS, ServerProcess, serve


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The null engine without the admin API."""
    yield from serve(*NULL_FLAGS)


@pytest.fixture(scope="module")
def admin_server() -> Iterator[ServerProcess]:
    """The null engine with the admin API, shedding load past 2 waiting requests."""
    yield from serve(*NULL_FLAGS, "--enable-admin-api", "--max-waiting", "2")


@pytest.fixture
def anyio_backend() -> str:
    """Clients run on asyncio (the server's backend is its `--backend` flag):
    `openai`'s AsyncStream leaves an async generator unclosed after `[DONE]`, which
    trio reports as a ResourceWarning, an error in this suite."""
    return "asyncio"
