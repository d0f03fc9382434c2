"""bench/serve.py runs end to end (tiny sizes, null executor) and writes its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.soak  # bench smoke runs are in `make soak` (make test's time budget)
def test_serve_benchmark_quick_run_writes_json_and_plot(tmp_path: Path) -> None:
    output = tmp_path / "serve.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serve.py"), "--quick", "--output", str(output)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    result = json.loads(output.read_text())
    assert [row["rate"] for row in result["rows"]] == [20.0, 80.0]
    assert all(row["failures"] == 0 for row in result["rows"])
    assert all(row["output_tokens_per_s"] > 0 for row in result["rows"])
    assert output.with_suffix(".png").stat().st_size > 0


@pytest.mark.soak  # bench smoke runs are in `make soak` (make test's time budget)
def test_fairness_benchmark_quick_run_writes_json(tmp_path: Path) -> None:
    output = tmp_path / "fairness.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fairness.py"), "--quick", "--output", str(output)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    result = json.loads(output.read_text())
    assert [row["admission"] for row in result["rows"]] == [
        "fair (defaults)",
        "first come, first served",
    ]
    assert all(row["idle_p50_ms"] > 0 and row["heavy_tokens_per_s"] > 0 for row in result["rows"])
    assert result["machine"]["cpu"]
