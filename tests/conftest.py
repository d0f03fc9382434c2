"""Suite-wide configuration: hypothesis profiles and the anyio backends under test."""

from __future__ import annotations

import os

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
