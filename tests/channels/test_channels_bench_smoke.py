"""The channels benchmark runs end to end with --quick and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "channels.py"


def test_benchmark_quick_run_writes_results(tmp_path: Path) -> None:
    output = tmp_path / "channels.json"
    completed = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    results = json.loads(output.read_text())["results"]
    assert set(results) == {"wavecore+cbor2", "wavecore signed", "zmq+msgpack", "zmq+msgspec"}
    assert all(value > 0 for row in results.values() for value in row.values())
    assert "ours/zmq+msgpack" in completed.stdout and "signed/unsigned" in completed.stdout
