"""`wavecore serve --dp 2`: the same API over two rank processes, metrics per rank, and
no process left behind after SIGTERM. (One server: rank processes take seconds to
start; an engine's death is tested in process, in test_serve_app.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pynng
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


def listening_path(pid: int, name: str) -> str:
    """The ipc socket file `pid` listens on whose name is `name` (from its descriptors'
    inodes, looked up in the kernel's table of unix sockets)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = str(fd.readlink()) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and fields[7].endswith(f"/{name}"):
            return fields[7]
    raise AssertionError(f"process {pid} listens on no socket named {name!r}")


def test_a_hostile_frame_is_dropped_counted_and_served_past(dp_server: ServerProcess) -> None:
    # An empty frame once killed the server (pynng raised a bare RuntimeError).
    path = listening_path(dp_server.process.pid, "outputs")
    with pynng.Push0(dial=f"ipc://{path}", send_timeout=10_000) as stranger:
        for frame in (b"", b"\xff", b""):
            stranger.send(frame)
    with dp_server.client() as http:
        deadline = time.monotonic() + EXIT_GUARD
        while True:  # the frames arrive on another connection than the scrape's answers
            families = text_string_to_metric_families(http.get("/metrics").text)
            dropped = {
                sample.labels["channel"]: sample.value
                for family in families
                if family.name == "wavecore:dropped_frames"
                for sample in family.samples
                if sample.name.endswith("_total")
            }
            if dropped.get("client outputs", 0) >= 3:
                break
            assert time.monotonic() < deadline, dropped
        whole = http.post("/v1/completions", json={"prompt": "dp", "max_tokens": 5})
        assert whole.json()["choices"][0]["finish_reason"] == "length"


def test_sigterm_leaves_no_process_behind(dp_server: ServerProcess) -> None:
    processes = children(dp_server.process.pid)
    assert len(processes) >= 3  # two ranks and the coordinator
    status, err = dp_server.terminate()
    assert status == 0, err
    wait_gone(processes)
