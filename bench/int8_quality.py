"""How much each rounding path changes the model's predictions, against float32, same run.

Teacher-forced top-1 agreement over the fixed texts of `engine/model/quality.py` and
perplexity of its fixed story, for a float32 executor of the model and one per
candidate, with each one's load time and whether it meets the accuracy budget of the
default path (`weights="auto"`: agreement >= 97%, perplexity within 2%):
- int8: `weights="int8"` (fbgemm, `engine/model/int8_linear.py`);
- woq: the default path's weight-only kernel forced for every class (the GGUF's
  4-bit blocks as stored, 8 bits per channel for its 8-bit ones, bfloat16 activations);
- woq-vnni: the same weights with activations rounded to int8 per group of 32 (the
  "woq-vnni" kernel, CPUs with AVX-512 VNNI), forced for every class;
- bf16 projections: the default path's "onednn-bf16" kernel forced for every class
  (bfloat16 weights, float32 activations), on CPUs with native bfloat16 only;
- bfloat16 model: `dtype="bfloat16"` (everything in bfloat16), likewise.
Prints a table, writes bench/results/int8_quality.json (the int8 figures at the top
level, every candidate under "candidates"). `--model` takes any model spec (a GGUF
file or a Hugging Face directory).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from wavecore.engine.model import ModelExecutor, load_executor
from wavecore.engine.model.kernel_choice import cpu_name
from wavecore.engine.model.kernel_plan import FORCE_ENV
from wavecore.engine.model.linear import can_pack_bf16
from wavecore.engine.model.quality import byte_ids, compare
from wavecore.engine.model.vnni_linear import can_pack_vnni
from wavecore.engine.model.weight_format import WeightFormat
from wavecore.engine.model.woq_linear import GROUP, can_pack_woq
from wavecore.engine.sampling.errors import TokenizerLoadError
from wavecore.engine.sampling.tokenizer import Tokenizer

RESULTS = Path(__file__).resolve().parent / "results"


def timed_load(
    model: str | None, weights: WeightFormat, dtype: str = "float32", forced: str | None = None
) -> tuple[ModelExecutor, float]:
    start = time.perf_counter()
    previous = os.environ.pop(FORCE_ENV, None)
    if forced is not None:
        os.environ[FORCE_ENV] = forced
    try:
        executor = load_executor(
            model,
            device="cpu",
            kv_cache_memory=32 * 2**20,
            weights=weights,
            dtype=dtype,  # type: ignore[arg-type]
        )
    finally:
        os.environ.pop(FORCE_ENV, None)
        if previous is not None:
            os.environ[FORCE_ENV] = previous
    return executor, time.perf_counter() - start


def candidates() -> dict[str, dict[str, Any]]:
    """The rounding paths this CPU runs at speed, as `timed_load` arguments."""
    found: dict[str, dict[str, Any]] = {"int8": {"weights": "int8", "dtype": "auto"}}
    if can_pack_woq(torch.device("cpu"), torch.float32, GROUP, 16):
        # The GGUF's 4-bit blocks (8 bits for its 8-bit ones), bfloat16 activations.
        found["woq"] = {"weights": "auto", "dtype": "auto", "forced": "woq"}
    if can_pack_vnni(torch.device("cpu"), torch.float32, GROUP, 16):
        # The same weights, activations rounded to int8 per group of 32 (AVX-512 VNNI).
        found["woq-vnni"] = {"weights": "auto", "dtype": "auto", "forced": "woq-vnni"}
    if can_pack_bf16(torch.device("cpu"), torch.float32):
        found["bf16 projections"] = {"weights": "auto", "dtype": "auto", "forced": "onednn-bf16"}
        found["bfloat16 model"] = {"weights": "float32", "dtype": "bfloat16"}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: SmolLM2)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "int8_quality.json")
    args = parser.parse_args()

    reference, reference_load = timed_load(args.model, "float32")
    try:
        tokenize = Tokenizer.from_source(reference.source).encode
    except TokenizerLoadError:  # the tiny test models have none

        def tokenize(text: str) -> list[int]:
            return byte_ids(text, reference.config.vocab_size)

    def encode(text: str) -> list[int]:
        # A text longer than the model's context is scored as far as it fits.
        return tokenize(text)[: reference.max_model_len]

    rows: dict[str, dict[str, Any]] = {}
    reports = {}
    for name, how in candidates().items():
        candidate, load = timed_load(args.model, **how)
        report = compare(reference.score, candidate.score, encode)
        candidate.close()
        reports[name] = report
        rows[name] = {
            "agreement": report.agreement,
            "perplexity": report.candidate_perplexity,
            "perplexity_change": report.perplexity_change,
            "within_budget": report.within_budget,
            "load_s": load,
        }
    report = reports["int8"]

    print(
        f"{cpu_name()}; model {reference.source.path.name}; "
        f"{report.positions} teacher-forced positions"
    )
    print(
        f"{'path':<17} {'load s':>7} {'top-1 agreement':>16} {'perplexity':>11} "
        f"{'change':>8}  budget (>= 97%, within 2%)"
    )
    print(
        f"{'float32':<17} {reference_load:>7.1f} {'(reference)':>16} "
        f"{report.reference_perplexity:>11.3f}"
    )
    for name, row in rows.items():
        print(
            f"{name:<17} {row['load_s']:>7.1f} {row['agreement']:>16.1%} "
            f"{row['perplexity']:>11.3f} {row['perplexity_change']:>+8.2%}  "
            f"{'met' if row['within_budget'] else 'missed'}"
        )

    results = {
        "benchmark": "int8_quality",
        "model": str(reference.source.path),
        "positions": report.positions,
        "agreeing": report.agreeing,
        "agreement": report.agreement,
        "float32_perplexity": report.reference_perplexity,
        "int8_perplexity": report.candidate_perplexity,
        "perplexity_change": report.perplexity_change,
        "float32_load_s": reference_load,
        "int8_load_s": rows["int8"]["load_s"],
        "cpu": cpu_name(),
        "candidates": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output}")
    reference.close()


if __name__ == "__main__":
    main()
