"""`wavecore generate --dp 2`, `wavecore rank` (a headless rank joining a front end on
loopback) and `bench/dp.py --quick` run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from dp_helpers import collect, expected_tokens, wiring_of

from wavecore.channels import ChannelKey
from wavecore.engine.cli.main import main
from wavecore.engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


def test_generate_with_dp_2_reports_requests_per_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "out.jsonl"
    prompts = ["alpha", "beta", "gamma", "delta"]
    argv = ["generate", "--dp", "2", "--dp-mode", "independent", "--executor", "null"]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    argv += ["--max-tokens", "4", "--output", str(output)]
    assert main(argv) == 0
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    results = sorted(lines, key=lambda row: row["index"])  # written as they finish
    assert [r["token_ids"] for r in results] == [expected_tokens(p, 4) for p in prompts]
    assert "requests per DP rank" in capsys.readouterr().out


def test_generate_refuses_a_bad_dp_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--dp", "0", "--executor", "null", "--prompt", "x"]) == 2
    assert "dp_size" in capsys.readouterr().err


@pytest.mark.soak  # bench smoke runs are in `make soak` (make test's time budget)
def test_dp_benchmark_quick_run_writes_json_and_plot(tmp_path: Path) -> None:
    output = tmp_path / "dp.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dp.py"), "--quick", "--output", str(output)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    result = json.loads(output.read_text())
    assert {(row["dp_size"], row["mode"]) for row in result["rows"]} == {
        (2, "independent"),
        (2, "lockstep"),
    }
    assert all(row["tokens"] == result["requests"] * result["max_tokens"] for row in result["rows"])
    for row in result["rows"]:
        assert {f"pause_forwards_{mode}" for mode in ("abort", "wait", "keep")} <= row.keys()
    assert result["machine"]["cpu"]
    assert output.with_suffix(".png").stat().st_size > 0


@pytest.mark.anyio
async def test_a_headless_rank_joins_the_front_end_over_tcp(tmp_path: Path) -> None:
    """Both sides read the engine's channel key from the same file."""
    from wavecore.engine.api import open_dp_engine
    from wavecore.engine.sampling_params import SamplingParams

    key_file = tmp_path / "channel.key"
    key_file.write_text(ChannelKey.generate().hex())
    config = EngineConfig(
        executor="null",
        dp_size=2,
        dp_mode="lockstep",
        transport="tcp",
        channel_key_file=str(key_file),
    )
    joined: list[subprocess.Popen[bytes]] = []

    def start_rank(address: str) -> None:
        master = address.removeprefix("tcp://")
        argv = ["rank", "--dp-rank", "1", "--dp-size", "2", "--master", master]
        argv += ["--executor", "null", "--dp-mode", "lockstep"]
        argv += ["--channel-key-file", str(key_file)]
        code = f"import sys; from wavecore.engine.cli.main import main; sys.exit(main({argv!r}))"
        joined.append(subprocess.Popen([sys.executable, "-c", code]))

    try:
        with anyio.fail_after(120):
            async with open_dp_engine(
                config, master="127.0.0.1:0", local_ranks=[0], on_listening=start_rank
            ) as engine:
                assert list(wiring_of(engine).processes) == ["coordinator", "rank 0"]
                for rank in (0, 1):
                    prompt = f"headless {rank}"
                    deltas = await collect(
                        engine, prompt, SamplingParams(max_tokens=5), dp_rank=rank
                    )
                    assert [t for d in deltas for t in d.token_ids] == expected_tokens(prompt, 5)
        assert joined[0].wait(timeout=30) == 0  # the headless rank left with the front end
    finally:
        for process in joined:
            if process.poll() is None:
                process.kill()
                process.wait()
