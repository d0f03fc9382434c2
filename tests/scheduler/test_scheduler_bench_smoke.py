"""The scheduler benchmark runs end to end at tiny sizes and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_scheduler_quick(tmp_path: Path) -> None:
    output = tmp_path / "scheduler.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scheduler.py"), "--quick", "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "wavecore step total" in result.stdout
    report = json.loads(output.read_text())
    assert report["quick"] is True and report["requests"] == 32
    phases = report["us_per_request_step"]
    assert set(phases) == {"schedule", "execute", "update", "total"}
    assert all(value > 0 for value in phases.values())
