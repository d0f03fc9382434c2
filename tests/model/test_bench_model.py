"""Smoke test: `bench/model.py --quick` runs end to end on a tiny model (an HF directory) and writes JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "model.py"


@pytest.mark.soak  # bench smoke runs are in `make soak` (make test's time budget)
def test_quick_bench_writes_results(tiny_hf_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "model.json"
    completed = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--quick",
            "--model",
            str(tiny_hf_dir),
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "wavecore tok/s" in completed.stdout and "int8 tok/s" in completed.stdout
    results = json.loads(output.read_text())
    assert [row["batch"] for row in results["decode"]] == [1, 4]
    assert results["matmul_gflops"] > 0 and results["stream_gbps"] > 0
    assert results["wavecore_batch1_bandwidth_fraction"] > 0
    for row in results["decode"]:
        assert row["wavecore_tok_s"] > 0 and row["transformers_forward_tok_s"] > 0
        assert row["wavecore_roof_fraction"] > 0
        assert row["int8_tok_s"] > 0 and row["int8_vs_float32"] > 0
        assert row["auto_tok_s"] > 0 and row["auto_vs_float32"] > 0
    assert 0 < results["int8_weight_bytes_per_token"] < results["weight_bytes_per_token"]
    assert results["cpu_model"] and results["kernels"]["cpu"] == results["cpu_model"]
    assert results["int8_kernels"]["decode"] == "fbgemm"
    assert results["auto_kernels"]["decode"] and results["auto_weights_bytes"] > 0
    assert "default path (weights=auto) kernels" in completed.stdout
    if results["kernels"]["origin"] != "fixed":  # a CPU with oneDNN: a choice to show
        rows = {row["kernels"]: row for row in results["kernels_batch1"]}
        assert set(rows) == {"chosen", "forced blas", "forced onednn"}
        assert rows["forced blas"]["plan"]["decode"] == "blas"
        assert all(row["batch1_tok_s"] > 0 for row in rows.values())
    assert results["transformers_generate_batch1_tok_s"] > 0
    # llama.cpp runs only where installed, and only on a GGUF: never on this model.
    assert results["llamacpp"] is None and "llama.cpp: " in completed.stdout


@pytest.mark.soak
def test_the_int4_candidate_bench_writes_results(tmp_path: Path) -> None:
    output = tmp_path / "int4.json"
    completed = subprocess.run(
        [
            sys.executable,
            str(BENCH.with_name("int4_candidate.py")),
            "--rounds",
            "2",
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = json.loads(output.read_text())["rows"]
    assert [row["shape"] for row in rows] == ["qkv", "o", "gate_up", "down", "lm_head"]
    for row in rows:
        assert row["int4_us"] > 0 and row["int4_max_error"] < 1e-3
