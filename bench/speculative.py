"""Speculative decoding (prompt lookup, or a draft model) against plain decoding, same
model, same run.

Workloads, greedy, chat template: input-grounded ones (rewrite a code snippet with one
change; extract fields of a text into JSON, with the schema as structured output;
continue a numbered list) and open chat (no repetition to find). Each at batch 1, then
all 32 prompts of the open-chat set at once (batch 32). Plain and speculative runs
alternate (`--rounds`), on one loaded model (two cores over one executor, never at the
same time); each figure is the median of the rounds. The outputs must be identical
(greedy) but where float32 rounding decides a near-tie: the bench says whether they
were.

`--method draft_model` drafts with `--draft-model` (default: the shipped model itself,
the only one of its tokenizer here, so this measures the mechanism's cost and an
acceptance of 100%; `--draft-weights int8` drafts with its int8 copy). The speculative
engine then has an executor of its own, the draft attached.

Usage: python bench/speculative.py [--quick] [--rounds N] [--k K]
       [--method ngram|draft_model] [--draft-model PATH] [--draft-weights W]
       [--path float32|auto]   (float32, the default: exact; auto: the default path)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from machine import describe

from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.request import EngineRequest
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.structured_outputs import StructuredOutputs

RESULTS = Path(__file__).resolve().parent / "results"
CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for index in range(window, len(values)):
        total += values[index] - values[index - window]
        averages.append(total / window)
    return averages
'''
TEXT = (
    "Order 4471 was placed by Maria Keller (maria.keller@example.org) on 12 March 2026. "
    "She bought two hiking boots at 89.90 EUR each and one rain jacket at 129.00 EUR. "
    "Delivery goes to Bahnhofstrasse 12, 8001 Zurich, Switzerland, by express post."
)
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer"},
        "customer": {"type": "string"},
        "email": {"type": "string"},
        "date": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "quantity": {"type": "integer"},
                    "price": {"type": "number"},
                },
                "required": ["name", "quantity", "price"],
            },
        },
        "city": {"type": "string"},
    },
    "required": ["order_id", "customer", "email", "date", "items", "city"],
}
WORKLOADS: dict[str, tuple[str, StructuredOutputs | None]] = {
    "code edit": (
        "Rewrite this function so that it raises TypeError instead of ValueError. "
        f"Output only the code.\n\n{CODE}",
        None,
    ),
    "extract JSON": (
        f"Extract the order from this text as JSON.\n\n{TEXT}",
        StructuredOutputs(json=ORDER),
    ),
    "numbered list": (
        "Continue this list up to 20, one line each:\n1. apple\n2. banana\n3. cherry\n4. date\n",
        None,
    ),
    "open chat": ("What makes a good friend? Answer in a few sentences.", None),
}
CHAT = [
    "Why is the sky blue?",
    "Give me three tips for sleeping better.",
    "What is a prime number?",
    "Describe a sunset in two sentences.",
    "How do bees make honey?",
    "What should I pack for a weekend hike?",
    "Explain what a database index is.",
    "Write a haiku about autumn.",
]


def chat_prompt(core: EngineCore, text: str) -> tuple[int, ...]:
    rendered = core.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tuple(core.tokenizer.encode(rendered, add_special_tokens=False))


def timed(
    core: EngineCore, prompts: list[tuple[int, ...]], params: list[SamplingParams]
) -> tuple[float, list[list[int]]]:
    for number, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(
            EngineRequest(request_id=str(number), prompt_token_ids=prompt, params=param)
        )
    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()
    while core.has_unfinished():
        for update in core.step():
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    return time.perf_counter() - started, [outputs[str(n)] for n in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 64 tokens, batch 8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--k",
        type=int,
        help="num_speculative_tokens (default: 5 on the float32 path, 3 on the default path, "
        "each path's best measured: its weight-only kernel runs rows in blocks of 4, so a "
        "verification of 4 rows costs 1.3x a decode there and one of 6 rows 1.7x)",
    )
    parser.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    parser.add_argument("--draft-model", help="default: the shipped model")
    parser.add_argument("--draft-weights", choices=["auto", "float32", "int8"], default="float32")
    parser.add_argument(
        "--path",
        choices=["float32", "auto"],
        default="float32",
        help="float32 (exact: outputs comparable token for token) or the default path",
    )
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    if args.k is None:
        args.k = 5 if args.path == "float32" else 3
    max_tokens = 64 if args.quick else 200
    # Two cores over one executor share its KV cache: neither may keep a prefix cache,
    # whose blocks the other would overwrite.
    config = EngineConfig(
        device="cpu",
        dtype=args.path,
        weights=args.path,
        max_num_seqs=64,
        enable_prefix_caching=False,
    )
    plain = EngineCore.from_config(config)
    spec_config = dataclasses.replace(
        config, speculative_method="ngram", num_speculative_tokens=args.k
    )
    if args.method == "draft_model":
        draft = args.draft_model or str(plain.executor.source.path)
        speculative = EngineCore.from_config(
            dataclasses.replace(
                spec_config,
                speculative_method="draft_model",
                draft_model=draft,
                draft_weights=args.draft_weights,
            )
        )
        method = f"draft model {Path(draft).name} ({args.draft_weights})"
    else:
        speculative = EngineCore(
            executor=plain.executor,
            tokenizer=plain.tokenizer,
            config=spec_config,
            eos_token_id=plain.executor.source.eos_token_id,
        )
        method = "ngram"
    machine = describe()
    cases: dict[str, tuple[list[tuple[int, ...]], list[SamplingParams]]] = {}
    for name, (ask, spec) in WORKLOADS.items():
        param = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)
        cases[f"{name}, batch 1"] = ([chat_prompt(plain, ask)], [param])
    batch = 8 if args.quick else 32
    chats = [chat_prompt(plain, CHAT[i % len(CHAT)] + f" ({i})") for i in range(batch)]
    cases[f"open chat, batch {batch}"] = (
        chats,
        [SamplingParams(temperature=0, max_tokens=max_tokens)] * batch,
    )
    timed(plain, cases["open chat, batch 1"][0], cases["open chat, batch 1"][1])  # warm up
    rows: list[dict[str, Any]] = []
    kernels = plain.executor.kernels.plan.as_dict()
    plan_text = "/".join(kernels.values())
    print(
        f"Speculative decoding ({method}, k={args.k}) against plain, greedy, {args.path} path "
        f"(kernels {plan_text}; {machine['cpu']}, {machine['cpus']} CPUs)"
    )
    print(f"{'workload':<24} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'accepted':>8} {'per draft':>9} same")  # fmt: skip
    for name, (prompts, params) in cases.items():
        plain_times, spec_times = [], []
        counts = speculative.scheduler.spec_counts
        before = (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens)
        for _ in range(rounds):
            seconds, plain_out = timed(plain, prompts, params)
            plain_times.append(seconds)
            seconds, spec_out = timed(speculative, prompts, params)
            spec_times.append(seconds)
            identical = spec_out == plain_out
        tokens = sum(len(out) for out in plain_out)
        drafts = counts.num_drafts - before[0]
        drafted = counts.num_draft_tokens - before[1]
        accepted = counts.num_accepted_tokens - before[2]
        row = {
            "workload": name,
            "tokens": tokens,
            "plain_tokens_per_s": tokens / statistics.median(plain_times),
            "speculative_tokens_per_s": tokens / statistics.median(spec_times),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "accepted_per_draft": accepted / drafts if drafts else 0.0,
            # Greedy outputs part only where float32 rounding decides a near-tie (a
            # verified position runs in a forward of several rows, on other kernels).
            "identical": identical,
        }
        row["speedup"] = row["speculative_tokens_per_s"] / row["plain_tokens_per_s"]
        rows.append(row)
        print(
            f"{name:<24} {tokens:>6} {row['plain_tokens_per_s']:>11.1f} "
            f"{row['speculative_tokens_per_s']:>10.1f} {row['speedup']:>6.2f}x "
            f"{row['acceptance_rate']:>8.2f} {row['accepted_per_draft']:>9.2f} "
            f"{'yes' if identical else 'no'}"
        )
    stem = "speculative" if args.method == "ngram" else "speculative_draft"
    results = RESULTS / (f"{stem}.json" if args.path == "float32" else f"{stem}_{args.path}.json")
    results.parent.mkdir(exist_ok=True)
    report = {
        "machine": machine,
        "method": method,
        "k": args.k,
        "path": args.path,
        "kernels": kernels,
        "rows": rows,
    }
    results.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {results}")
    plain.close()
    if speculative.executor is not plain.executor:
        speculative.close()


if __name__ == "__main__":
    main()
