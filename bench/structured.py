"""Structured output: the grammar engines on this model's vocabulary, and what a JSON
schema costs the engine end to end.

Part 1, grammar engines (llguidance, which wavecore uses, and xgrammar, upstream's
default, when it is installed): on SmolLM2's 49,152-token vocabulary, the time to
build the tokenizer information, to compile a typical schema (first and cached), and
to compute one token mask, per token of a valid output (batch 1) and for 32 matchers
at once.

Part 2, end to end (one rank in this process, the real model, greedy): 32 concurrent
chat requests with a JSON schema, then the same 32 prompts unconstrained with each
request's `max_tokens` set to its constrained output's length (`ignore_eos`), so both
runs produce the same number of tokens: the throughput ratio is the cost of structured
output. The bitmask is timed where the engine computes it (on the event loop, while the
forward runs), against the forward's own time; also at batch 1.

Usage: python bench/structured.py [--quick] [--skip-engine]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
from machine import describe, on_a_thread_of_its_own

from wavecore.engine.api import open_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.sampling.tokenizer import Tokenizer
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.structured.bitmask import compute_bitmask
from wavecore.engine.structured.compiler import GrammarCompiler
from wavecore.engine.structured.grammars import GrammarVocabulary
from wavecore.engine.structured_outputs import StructuredOutputs

RESULTS = Path(__file__).resolve().parent / "results" / "structured.json"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string"}},
            "required": ["city"],
        },
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "hobbies", "member"],
    "additionalProperties": False,
}
VALID = (
    '{"name": "Ada Lovelace", "age": 36, "hobbies": ["maths", "poetry"], '
    '"address": {"city": "London"}, "member": true}'
)
ASKS = [
    "Describe a fictional person as JSON.",
    "Invent a character for a novel and give their details as JSON.",
    "Give me a JSON record of a made-up club member.",
    "Create a JSON profile of a retired sailor.",
]


def grammar_engines(quick: bool) -> list[dict[str, Any]]:
    tokenizer = Tokenizer.from_gguf()
    ids = tokenizer.encode(VALID, add_special_tokens=False)
    rows = [_llguidance(tokenizer, ids, quick)]
    try:
        rows.append(_xgrammar(tokenizer, ids, quick))
    except ImportError:
        rows.append({"engine": "xgrammar", "note": "not installed"})
    return rows


def _llguidance(tokenizer: Tokenizer, ids: list[int], quick: bool) -> dict[str, Any]:
    import llguidance.numpy
    import numpy as np

    started = time.perf_counter()
    vocabulary = GrammarVocabulary(tokenizer, tokenizer.vocab_size)
    build = time.perf_counter() - started
    spec = StructuredOutputs(json=SCHEMA)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    GrammarVocabulary._cache[tokenizer] = vocabulary  # the one just timed
    started = time.perf_counter()
    grammar = compiler.start(spec)
    while grammar.compiling:
        grammar.poll()
    compile_first = time.perf_counter() - started
    started = time.perf_counter()
    cached = compiler.start(spec)
    compile_cached = time.perf_counter() - started
    masks = []
    for token in ids:
        started = time.perf_counter()
        compute_bitmask([(0, cached, [])], tokenizer.vocab_size)
        masks.append(time.perf_counter() - started)
        cached.accept(token)
    batch = [compiler.start(spec) for _ in range(32)]
    for grammar_ in batch:  # mid-object, where the masks are largest
        for token in ids[:8]:
            grammar_.accept(token)
    batch_times = []
    for _ in range(5 if quick else 30):
        started = time.perf_counter()
        compute_bitmask([(row, one, []) for row, one in enumerate(batch)], tokenizer.vocab_size)
        batch_times.append(time.perf_counter() - started)
    compiler.close()
    del llguidance, np
    return {
        "engine": "llguidance",
        "tokenizer_build_s": build,
        "compile_first_ms": compile_first * 1e3,
        "compile_cached_ms": compile_cached * 1e3,
        "mask_ms_per_token": statistics.median(masks) * 1e3,
        "mask_ms_32": statistics.median(batch_times) * 1e3,
        "runtime_dependencies": "none",
    }


def _xgrammar(tokenizer: Tokenizer, ids: list[int], quick: bool) -> dict[str, Any]:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(
        hf, vocab_size=tokenizer.vocab_size, stop_token_ids=[tokenizer.eos_token_id]
    )
    build = time.perf_counter() - started
    compiler = xgrammar.GrammarCompiler(info, max_threads=2)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_first = time.perf_counter() - started
    started = time.perf_counter()
    compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_cached = time.perf_counter() - started
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(32, tokenizer.vocab_size)
    masks = []
    for token in ids:
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        masks.append(time.perf_counter() - started)
        matcher.accept_token(token)
    batch = [xgrammar.GrammarMatcher(compiled) for _ in range(32)]
    for one in batch:
        for token in ids[:8]:
            one.accept_token(token)
    batch_times = []
    for _ in range(5 if quick else 30):
        started = time.perf_counter()
        for row, one in enumerate(batch):
            one.fill_next_token_bitmask(bitmask, row)
        batch_times.append(time.perf_counter() - started)
    return {
        "engine": "xgrammar",
        "tokenizer_build_s": build,
        "compile_first_ms": compile_first * 1e3,
        "compile_cached_ms": compile_cached * 1e3,
        "mask_ms_per_token": statistics.median(masks) * 1e3,
        "mask_ms_32": statistics.median(batch_times) * 1e3,
        "runtime_dependencies": "transformers, triton, pydantic, apache-tvm-ffi",
    }


class _StepTimes:
    """Wraps the core so each step's forward and bitmask are timed where they run."""

    def __init__(self, core: EngineCore) -> None:
        self.forward: list[float] = []
        self.mask: list[float] = []
        executor = core.executor
        execute_model = executor.execute_model
        fill = core.fill_bitmask

        def timed_forward(batch: Any) -> Any:
            started = time.perf_counter()
            result = execute_model(batch)
            self.forward.append(time.perf_counter() - started)
            return result

        def timed_fill(step: Any, slot: Any) -> None:
            started = time.perf_counter()
            fill(step, slot)
            self.mask.append(time.perf_counter() - started)

        executor.execute_model = timed_forward  # type: ignore[method-assign]
        core.fill_bitmask = timed_fill  # type: ignore[method-assign]


async def _run(
    engine: Any, prompts: list[str], params: list[SamplingParams]
) -> tuple[float, list[int]]:
    lengths = [0] * len(prompts)
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for index, (prompt, param) in enumerate(zip(prompts, params, strict=True)):

            async def one(index: int = index, prompt: str = prompt, param: SamplingParams = param):
                chat = [{"role": "user", "content": prompt}]
                async for delta in engine.generate(chat, param):
                    lengths[index] += len(delta.token_ids)

            tg.start_soon(one)
    return time.perf_counter() - started, lengths


async def end_to_end(quick: bool) -> dict[str, Any]:
    spec = StructuredOutputs(json=SCHEMA)
    results: dict[str, Any] = {}
    config = EngineConfig(dtype="float32", max_num_seqs=64)
    async with open_engine(config) as engine:
        core = engine.core_client.core  # type: ignore[attr-defined]
        times = _StepTimes(core)
        for batch in (1, 8) if quick else (1, 32):
            prompts = [ASKS[i % len(ASKS)] + f" (#{i})" for i in range(batch)]
            constrained = [
                SamplingParams(temperature=0, max_tokens=160, structured_outputs=spec)
            ] * batch
            await _run(engine, prompts[:1], constrained[:1])  # compiles, warms up
            times.forward.clear()
            times.mask.clear()
            wall_c, lengths = await _run(engine, prompts, constrained)
            forward_c, masks = list(times.forward), list(times.mask)
            times.forward.clear()
            plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
            wall_p, plain_lengths = await _run(engine, prompts, plain)
            forward_p = list(times.forward)
            tokens = sum(lengths)
            results[f"batch_{batch}"] = {
                "tokens": tokens,
                "constrained_tokens_per_s": tokens / wall_c,
                "unconstrained_tokens_per_s": sum(plain_lengths) / wall_p,
                "throughput_ratio": (tokens / wall_c) / (sum(plain_lengths) / wall_p),
                "mask_ms_median": statistics.median(masks) * 1e3 if masks else 0.0,
                "forward_ms_median_constrained": statistics.median(forward_c) * 1e3,
                "forward_ms_median_unconstrained": statistics.median(forward_p) * 1e3,
                "step_ms_constrained": wall_c / max(1, len(forward_c)) * 1e3,
                "step_ms_unconstrained": wall_p / max(1, len(forward_p)) * 1e3,
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, batch 8")
    parser.add_argument("--skip-engine", action="store_true", help="only the grammar engines")
    args = parser.parse_args()
    machine = describe()
    # On a thread that ends with it: the engine of the end-to-end part then runs as in a
    # process of its own (`on_a_thread_of_its_own` says why).
    engines = on_a_thread_of_its_own(grammar_engines, args.quick)
    print(f"Grammar engines on SmolLM2's vocabulary ({machine['cpu']}, {machine['cpus']} CPUs)")
    print(f"{'engine':<11} {'tokenizer s':>11} {'compile ms':>10} {'cached ms':>9} "
          f"{'mask ms/token':>13} {'mask ms x32':>11}  run-time deps")  # fmt: skip
    for row in engines:
        if "note" in row:
            print(f"{row['engine']:<11} {row['note']}")
            continue
        print(
            f"{row['engine']:<11} {row['tokenizer_build_s']:>11.2f} {row['compile_first_ms']:>10.2f} "
            f"{row['compile_cached_ms']:>9.3f} {row['mask_ms_per_token']:>13.3f} "
            f"{row['mask_ms_32']:>11.3f}  {row['runtime_dependencies']}"
        )
    result: dict[str, Any] = {"machine": machine, "grammar_engines": engines}
    if not args.skip_engine:
        runs = anyio.run(end_to_end, args.quick)
        result["end_to_end"] = runs
        print("\nEnd to end, one rank, greedy, a JSON schema against the same tokens unconstrained")
        print(f"{'batch':>5} {'tokens':>6} {'json tok/s':>10} {'plain tok/s':>11} {'ratio':>6} "
              f"{'mask ms':>7} {'forward ms':>10} {'step ms json/plain':>18}")  # fmt: skip
        for name, run in runs.items():
            print(
                f"{name.removeprefix('batch_'):>5} {run['tokens']:>6} "
                f"{run['constrained_tokens_per_s']:>10.1f} {run['unconstrained_tokens_per_s']:>11.1f} "
                f"{run['throughput_ratio']:>6.3f} {run['mask_ms_median']:>7.3f} "
                f"{run['forward_ms_median_constrained']:>10.1f} "
                f"{run['step_ms_constrained']:>8.1f} / {run['step_ms_unconstrained']:.1f}"
            )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
