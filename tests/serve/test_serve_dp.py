"""`wavecore serve --dp 2`: the same API over two rank processes, metrics per rank, and
no process left behind after SIGTERM. (One server: rank processes take seconds to
start; an engine's death is tested in process, in test_serve_app.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import EXIT_GUARD, NULL_FLAGS, ServerProcess

DP_FLAGS = (*NULL_FLAGS, "--dp", "2", "--enable-admin-api", "--log-iteration-details")


def children(pid: int) -> set[int]:
    """The processes `pid` started (its rank processes and coordinator)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(child) for child in (task / "children").read_text().split())
    return found


def wait_gone(pids: set[int]) -> None:
    """Until every process in `pids` has exited (orphans are reaped by init; the
    condition lives in the kernel, so it is polled, under a hang guard)."""
    deadline = time.monotonic() + EXIT_GUARD
    while alive := {pid for pid in pids if Path(f"/proc/{pid}").exists()}:
        assert time.monotonic() < deadline, f"still running: {sorted(alive)}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def dp_server() -> Iterator[ServerProcess]:
    server = ServerProcess.start(*DP_FLAGS)
    try:
        yield server
    finally:
        server.kill()


def test_two_ranks_serve_and_report_metrics_per_rank(dp_server: ServerProcess) -> None:
    with dp_server.client() as http:
        whole = http.post("/v1/completions", json={"prompt": "dp", "max_tokens": 5, "n": 4})
        assert [c["finish_reason"] for c in whole.json()["choices"]] == ["length"] * 4
        stats = http.get("/stats").json()
        assert len(stats["ranks"]) == 2
        assert all(count > 0 for count in stats["requests_per_rank"])
        families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
        ranks = {s.labels["engine"] for s in families["wavecore:num_requests_running"].samples}
        assert ranks == {"0", "1"}
        # --log-iteration-details: each rank's forwards, as histograms per rank.
        tokens = {
            s.labels["engine"]: s.value
            for s in families["wavecore:iteration_tokens"].samples
            if s.name.endswith("_count")
        }
        times = {
            s.labels["engine"]: s.value
            for s in families["wavecore:iteration_time_seconds"].samples
            if s.name.endswith("_count")
        }
        dummies = {
            s.labels["engine"]: s.value for s in families["wavecore:iteration_dummy_steps"].samples
        }
        assert tokens.keys() == times.keys() == dummies.keys() == {"0", "1"}
        assert all(times[rank] == tokens[rank] + dummies[rank] > 0 for rank in tokens)


def test_sigterm_leaves_no_process_behind(dp_server: ServerProcess) -> None:
    processes = children(dp_server.process.pid)
    assert len(processes) >= 3  # two ranks and the coordinator
    status, err = dp_server.terminate()
    assert status == 0, err
    wait_gone(processes)
