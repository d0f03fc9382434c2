"""`dp_backend="ray"` settings (issue 31): validated with specific errors, reachable from
the command line, and, without Ray installed, a clear error naming the extra to
install. No cluster is started here (test_dp_ray.py has one)."""

from __future__ import annotations

import sys

import pytest

from wavecore.engine.api import open_engine
from wavecore.engine.cli.main import _engine_config, build_parser
from wavecore.engine.config import EngineConfig
from wavecore.engine.errors import BackendUnavailableError


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"dp_backend": "k8s"}, "dp_backend must be 'mp' or 'ray', got 'k8s'"),
        ({"dp_backend": "ray"}, "dp_backend='ray' needs transport='tcp'"),
        ({"ray_address": "head:6379"}, "ray_address is an address string for dp_backend='ray'"),
        (
            {"dp_backend": "ray", "transport": "tcp", "ray_address": 6379},
            "ray_address is an address string",
        ),
    ],
)
def test_bad_ray_settings_are_refused_by_name(settings: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        EngineConfig(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_ray_flags_reach_the_engine_configuration_over_tcp(command: str) -> None:
    args = build_parser().parse_args(
        [command, "--dp", "4", "--dp-backend", "ray", "--ray-address", "head:6379"]
    )
    config = _engine_config(args)
    assert (config.dp_backend, config.ray_address, config.transport) == ("ray", "head:6379", "tcp")
    default = _engine_config(build_parser().parse_args([command]))
    assert (default.dp_backend, default.ray_address, default.transport) == ("mp", None, "ipc")


@pytest.mark.anyio
async def test_without_ray_asking_for_it_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    config = EngineConfig(executor="null", dp_backend="ray", transport="tcp")
    with pytest.raises(BackendUnavailableError, match=r"pip install wavecore\[ray\]"):
        async with open_engine(config):
            pass
