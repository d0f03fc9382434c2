"""Smoke tests: `bench/model.py --quick`, `bench/decode_anatomy.py --quick` and
`bench/int4_candidate.py` run end to end (on a tiny model, an HF directory, where they
take one) and write JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "model.py"


def run_bench(script: str, output: Path, *args: str) -> tuple[str, dict[str, Any]]:
    """Run `bench/<script>` with `args` and `--output output`: its stdout and JSON."""
    completed = subprocess.run(
        [sys.executable, str(BENCH.with_name(script)), *args, "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout, json.loads(output.read_text())


@pytest.mark.soak  # bench smoke runs are in `make soak` (make test's time budget)
def test_quick_bench_writes_results(tiny_hf_dir: Path, tmp_path: Path) -> None:
    stdout, results = run_bench(
        "model.py", tmp_path / "model.json", "--quick", "--model", str(tiny_hf_dir)
    )
    assert "wavecore tok/s" in stdout and "int8 tok/s" in stdout
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
    assert "default path (weights=auto) kernels" in stdout
    if results["kernels"]["origin"] != "fixed":  # a CPU with oneDNN: a choice to show
        rows = {row["kernels"]: row for row in results["kernels_batch1"]}
        assert set(rows) == {"chosen", "forced blas", "forced onednn"}
        assert rows["forced blas"]["plan"]["decode"] == "blas"
        assert all(row["batch1_tok_s"] > 0 for row in rows.values())
    assert results["transformers_generate_batch1_tok_s"] > 0
    # llama.cpp runs only where installed, and only on a GGUF: never on this model.
    assert results["llamacpp"] is None and "llama.cpp: " in stdout
    assert all(row["llamacpp_tok_s"] is None for row in results["decode"])


@pytest.mark.soak
def test_the_decode_anatomy_bench_writes_results(tiny_hf_dir: Path, tmp_path: Path) -> None:
    stdout, results = run_bench(
        "decode_anatomy.py", tmp_path / "anatomy.json", "--quick", "--model", str(tiny_hf_dir)
    )
    assert "part of a batch-1 step" in stdout
    median = results["median_seconds"]
    assert median["step"] > 0 and median["forward"] > 0 and median["products"] > 0
    assert median["glue (forward - products)"] == median["forward"] - median["products"]
    assert "llama.cpp step" not in median  # never on an HF directory
    assert results["streamed_weight_bytes"] > 0 and results["roof_seconds"] > 0


@pytest.mark.soak
def test_the_int4_candidate_bench_writes_results(tmp_path: Path) -> None:
    _, results = run_bench("int4_candidate.py", tmp_path / "int4.json", "--rounds", "2")
    rows = results["rows"]
    assert [row["shape"] for row in rows] == ["qkv", "o", "gate_up", "down", "lm_head"]
    for row in rows:
        assert row["int4_us"] > 0 and row["int4_max_error"] < 1e-3
