"""bench/generate.py runs end to end (tiny sizes, null executor) and writes its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.soak  # bench smoke runs are in `make soak` (make test's time budget)
def test_generate_benchmark_quick_run_writes_json_and_plot(tmp_path: Path) -> None:
    output = tmp_path / "generate.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "generate.py"),
            "--quick",
            "--executor",
            "null",
            "--output",
            str(output),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    result = json.loads(output.read_text())
    assert {row["concurrency"] for row in result["rows"]} == {1, 4}
    assert all(row["output_tokens"] == row["requests"] * 8 for row in result["rows"])
    assert output.with_suffix(".png").stat().st_size > 0
