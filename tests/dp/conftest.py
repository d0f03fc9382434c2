"""DP tests share engines per module (spawning ranks costs seconds), so the backend is
module-scoped here: asyncio by default; `test_dp_trio.py` runs a subset on trio."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"
