"""The torch profiler on every rank (`start_profile` / `stop_profile`) at dp 1 (in this
process) and dp 2 (rank processes): one Chrome trace JSON file per rank, named by
rank and member, and clear refusals when it already runs or does not."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anyio
import pytest
from dp_helpers import HANG_GUARD, collect, expected_tokens, null_config, tokens_of

from wavecore.engine.api import open_engine
from wavecore.engine.errors import ProfilerStateError, ScalingRefusedError
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("dp_size", [1, 2])
async def test_one_trace_per_rank(dp_size: int, tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    with anyio.fail_after(HANG_GUARD):
        async with open_engine(null_config(dp_size=dp_size)) as engine:
            with pytest.raises(ProfilerStateError, match="not running"):
                await engine.stop_profile()
            await engine.start_profile(traces)
            with pytest.raises(ProfilerStateError, match="already runs"):
                await engine.start_profile(traces)
            with pytest.raises(ScalingRefusedError, match="stop_profile"):
                await engine.scale(dp_size + 1)
            for rank in range(dp_size):
                deltas = await collect(
                    engine, "profiled", SamplingParams(max_tokens=4), dp_rank=rank
                )
                assert tokens_of(deltas) == expected_tokens("profiled", 4)
            written = await engine.stop_profile()
            with pytest.raises(ProfilerStateError, match="not running"):
                await engine.stop_profile()
    check_traces(written, traces, dp_size)


def check_traces(written: list[str], traces: Path, dp_size: int) -> None:
    """One trace per rank, in rank order, each a Chrome trace JSON file with events."""
    assert len(written) == dp_size
    assert sorted(Path(path) for path in written) == sorted(traces.iterdir())
    for rank, path in enumerate(written):
        name = rf"wavecore-[\d-]+-rank{rank}-member\d+-pid\d+\.trace\.json"
        assert re.fullmatch(name, Path(path).name)
        trace = json.loads(Path(path).read_text())
        assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
