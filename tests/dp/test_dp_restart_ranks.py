"""Restarting lost ranks (issue 15, `EngineConfig(restart_ranks=True)`, `--restart-ranks`):
after a shrink the engine scales back to its size with replacement ranks started here,
through the same scale up a caller's `scale` performs; a restart that cannot happen
leaves the engine serving at the smaller size, saying why. Null-executor ranks."""

from __future__ import annotations

import os
import signal

import anyio
import pytest
from dp_helpers import (
    HANG_GUARD,
    check_rank_1_lost,
    client_of,
    collect,
    expected_tokens,
    load_then,
    null_config,
    tokens_of,
    wiring_of,
)

from wavecore.engine.api import open_dp_engine
from wavecore.engine.cli.main import UsageError, _engine_config, build_parser
from wavecore.engine.config import EngineConfig
from wavecore.engine.frontend.engine import FrontEnd
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio


def test_restart_ranks_needs_the_shrink_policy() -> None:
    with pytest.raises(ValueError, match="restart_ranks needs on_rank_failure='shrink'"):
        EngineConfig(restart_ranks=True)
    with pytest.raises(ValueError, match="restart_ranks must be a bool"):
        EngineConfig(on_rank_failure="shrink", restart_ranks=1)  # type: ignore[arg-type]
    flags = ["generate", "--on-rank-failure", "shrink", "--restart-ranks"]
    assert _engine_config(build_parser().parse_args(flags)).restart_ranks
    with pytest.raises(UsageError, match="restart_ranks needs"):
        _engine_config(build_parser().parse_args(["generate", "--restart-ranks"]))


@pytest.mark.parametrize("dp_mode", ["lockstep", "independent"])
async def test_a_killed_rank_is_replaced_and_the_engine_serves_at_its_size(dp_mode: str) -> None:
    config = null_config(dp_mode=dp_mode, on_rank_failure="shrink", restart_ranks=True)
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config) as engine:
            client = client_of(engine)
            restarted = client.restarted
            killed = wiring_of(engine).processes["rank 1"]
            deltas = await load_then(engine, range(2), lambda: os.kill(killed.pid, signal.SIGKILL))
            check_rank_1_lost(deltas, "rank 1 lost (rank 1 died (killed by SIGKILL))")
            await restarted.wait()
            assert client.restarts == ["restarted to 2 ranks"]
            assert engine.dp_size == 2
            replacement = wiring_of(engine).processes["rank 1"]
            assert replacement is not killed and replacement.is_alive()
            for rank in range(2):
                prompt = f"after the restart {rank}"
                params = SamplingParams(max_tokens=8)
                after = await collect(engine, prompt, params, dp_rank=rank)
                assert tokens_of(after) == expected_tokens(prompt, 8)


async def test_a_restart_the_engine_refuses_leaves_it_serving_smaller() -> None:
    """After `update_weights` a new rank would load the model file instead of the
    weights the ranks serve: the scale refuses, so the restart does not happen."""
    config = null_config(dp_mode="independent", on_rank_failure="shrink", restart_ranks=True)
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config) as engine:
            client = client_of(engine)
            restarted = client.restarted
            assert isinstance(engine, FrontEnd)
            engine._weights.updated = True  # what a weight update leaves behind
            pid = wiring_of(engine).processes["rank 1"].pid
            deltas = await load_then(engine, range(2), lambda: os.kill(pid, signal.SIGKILL))
            check_rank_1_lost(deltas, "rank 1 lost (rank 1 died (killed by SIGKILL))")
            await restarted.wait()
            assert client.restarts[0].startswith("no restart to 2 ranks: the ranks serve weights")
            assert engine.dp_size == 1
            after = await collect(engine, "after", SamplingParams(max_tokens=8))
            assert tokens_of(after) == expected_tokens("after", 8)
