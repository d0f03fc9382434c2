"""A process's death is reported with its cause: the signal that killed it by name
("killed by SIGKILL"), never "exit code None" or "-9"; at startup, after it, and while
a scale starts new ranks."""

from __future__ import annotations

import multiprocessing
import os
import signal

import anyio
import pytest
from dp_helpers import HANG_GUARD, collect, expected_tokens, null_config, tokens_of, wiring_of

from wavecore.engine.api import open_dp_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.dp.exit_status import describe_exit
from wavecore.engine.dp.launcher import DPStartupError
from wavecore.engine.errors import EngineDeadError, ScalingFailedError
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio


def build_core_killed_in_rank_1(config: EngineConfig) -> EngineCore:
    """Rank 1's model load ends in SIGKILL, a death no Python code of its own reports
    (the launcher and the scaler name rank processes "wavecore-dp-rank<N>")."""
    if multiprocessing.current_process().name == "wavecore-dp-rank1":
        os.kill(os.getpid(), signal.SIGKILL)
    return EngineCore.from_config(config)


@pytest.mark.parametrize(
    ("exitcode", "description"),
    [
        (0, "exited with code 0"),
        (3, "exited with code 3"),
        (-signal.SIGKILL, "killed by SIGKILL"),
        (-signal.SIGTERM, "killed by SIGTERM"),
        (-200, "killed by signal 200"),
        (None, "exit status not collected"),
    ],
)
def test_an_exit_status_reads_as_its_cause(exitcode: int | None, description: str) -> None:
    assert describe_exit(exitcode) == description


async def test_a_rank_killed_while_serving_is_reported_killed_by_sigkill() -> None:
    """Independent mode: no collective in which rank 0 would notice the death first."""
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(null_config(dp_mode="independent")) as engine:
            stream = engine.generate("endless", SamplingParams(max_tokens=10**6), dp_rank=1)
            await stream.__anext__()
            os.kill(wiring_of(engine).processes["rank 1"].pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match=r"rank 1 died \(killed by SIGKILL\)"):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError, match=r"rank 1 died \(killed by SIGKILL\)"):
                await engine.stats()


async def test_a_rank_killed_during_startup_is_named_with_its_signal() -> None:
    config = null_config(dp_mode="independent")
    with (
        anyio.fail_after(HANG_GUARD),
        pytest.raises(DPStartupError, match=r"rank 1 ended during startup \(killed by SIGKILL\)"),
    ):
        async with open_dp_engine(config, build_core=build_core_killed_in_rank_1):
            pass


async def test_a_new_rank_killed_during_a_scale_is_named_with_its_signal() -> None:
    config = null_config(dp_size=1, dp_mode="independent")
    with anyio.fail_after(HANG_GUARD):
        async with open_dp_engine(config, build_core=build_core_killed_in_rank_1) as engine:
            with pytest.raises(ScalingFailedError) as failed:
                await engine.scale(2)
            message = str(failed.value)
            assert "rolled back (still 1 ranks)" in message
            assert "new rank 1 exited during startup: killed by SIGKILL" in message
            deltas = await collect(engine, "still serving", SamplingParams(max_tokens=5))
            assert tokens_of(deltas) == expected_tokens("still serving", 5)
