"""`wavecore generate --lora-modules NAME=PATH --lora NAME`: the prompts run under the
adapter (its greedy tokens, as a bare executor computes them alone)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lora_helpers import greedy_alone, write_adapter, write_tiny_model

from wavecore.engine.cli.main import main
from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.model.executor import ModelExecutor
from wavecore.engine.model.resolve import resolve_model_source
from wavecore.engine.sampling.byte_tokenizer import EOS_TOKEN_ID

PROMPT = "Once upon a time, "
TOKENS = 8


def test_the_cli_runs_its_prompts_under_an_adapter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, adapter = write_tiny_model(tmp_path / "model"), write_adapter(tmp_path / "A", seed=1)
    executor = ModelExecutor(
        resolve_model_source(model),
        device="cpu",
        dtype="float32",
        weights="float32",
        kv_cache_memory=2**20,
        enable_lora=True,
    )
    executor.add_lora(LoRARequest("A", str(adapter)))
    expected = greedy_alone(executor, list(PROMPT.encode()), TOKENS, "A")
    assert expected != greedy_alone(executor, list(PROMPT.encode()), TOKENS, None)
    executor.close()
    if EOS_TOKEN_ID in expected:  # the CLI stops at EOS, the reference ran past it
        expected = expected[: expected.index(EOS_TOKEN_ID) + 1]
    output = tmp_path / "out.jsonl"
    argv = [
        "generate",
        *("--model", str(model), "--weights", "float32", "--dtype", "float32"),
        *("--device", "cpu", "--kv-cache-memory", str(2**20), "--max-tokens", str(TOKENS)),
        *("--lora-modules", f"A={adapter}", "--lora", "A", "--temperature", "0"),
        *("--prompt", PROMPT, "--output", str(output)),
    ]
    assert main(argv) == 0
    (row,) = [json.loads(line) for line in output.read_text().splitlines()]
    assert row["token_ids"] == expected
    # The summary says which path ran the deltas (the kernel, or torch's products).
    assert "LoRA deltas" in capsys.readouterr().out
