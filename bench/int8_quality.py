"""How much weights="int8" changes the model's predictions, against float32, same run.

Teacher-forced top-1 agreement over the fixed texts of `engine/model/quality.py` and
perplexity of its fixed story, for float32 and int8 executors of the same model,
with each one's load time. Prints a table, writes bench/results/int8_quality.json.
`--model` takes any model spec (a GGUF file or a Hugging Face directory).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from wavecore.engine.model import ModelExecutor, load_executor
from wavecore.engine.model.quality import byte_ids, compare
from wavecore.engine.model.weight_format import WeightFormat
from wavecore.engine.sampling.errors import TokenizerLoadError
from wavecore.engine.sampling.tokenizer import Tokenizer

RESULTS = Path(__file__).resolve().parent / "results"


def timed_load(model: str | None, weights: WeightFormat) -> tuple[ModelExecutor, float]:
    start = time.perf_counter()
    executor = load_executor(model, device="cpu", kv_cache_memory=32 * 2**20, weights=weights)
    return executor, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: SmolLM2)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "int8_quality.json")
    args = parser.parse_args()

    reference, reference_load = timed_load(args.model, "float32")
    candidate, candidate_load = timed_load(args.model, "int8")
    try:
        tokenize = Tokenizer.from_source(reference.source).encode
    except TokenizerLoadError:  # the tiny test models have none

        def tokenize(text: str) -> list[int]:
            return byte_ids(text, reference.config.vocab_size)

    def encode(text: str) -> list[int]:
        # A text longer than the model's context is scored as far as it fits.
        return tokenize(text)[: reference.max_model_len]

    report = compare(reference.score, candidate.score, encode)

    print(f"model {reference.source.path.name}; {report.positions} teacher-forced positions")
    print(f"{'weights':>8} {'load s':>7} {'top-1 agreement':>16} {'perplexity':>11}")
    print(
        f"{'float32':>8} {reference_load:>7.1f} {'(reference)':>16} "
        f"{report.reference_perplexity:>11.3f}"
    )
    print(
        f"{'int8':>8} {candidate_load:>7.1f} {report.agreement:>16.1%} "
        f"{report.candidate_perplexity:>11.3f}"
    )
    print(f"int8 perplexity change: {report.perplexity_change:+.2%}")

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
        "int8_load_s": candidate_load,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output}")
    reference.close()
    candidate.close()


if __name__ == "__main__":
    main()
