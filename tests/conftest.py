"""Suite-wide configuration: hypothesis profiles, the anyio backends under test, and a
cache directory of the suite's own."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

# `dev` keeps the edit-test loop fast; `ci` (set by .ci/run) explores more.
settings.register_profile(
    "dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every anyio test runs on both backends."""
    return request.param


@pytest.fixture(scope="session", autouse=True)
def own_cache_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Kernel plans the suite measures (`engine/model/kernel_cache.py`) go to a directory
    of its own, inherited by the rank processes it starts, never the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield
