"""Where a batch-1 decode step's time goes: the products, the rest of the forward pass,
the executor around it, against the roof for the bytes it reads and against llama.cpp.

One process, the default path (`weights="auto"`, the kernels it prints), the shipped
GGUF, one sequence of `--context` prompt tokens; in alternating rounds, each figure the
median over its round's steps, the median round reported:
- step: `ModelExecutor.execute` of one decode (plan, forward pass, sampler), timed as
  `bench/model.py` times it;
- forward: `ModelExecutor.compute_logits` of the same decode (plan and forward pass,
  no sampling);
- products: every projection's product of one row, layer by layer, and the LM head,
  through the kernels the plan runs one row on, and nothing else between them: what a
  step with these kernels cannot go below;
- llama.cpp's batch-1 step on the same GGUF (where `make bench-llamacpp` installed it);
- with `--compile-decode`, the step of an executor loaded with `compile_decode=True`
  (the same path with its one-decode steps through a torch.compile'd graph,
  `engine/model/compiled_decode.py`; its compile at load is not timed).
Derived: the glue (forward - products: norms, rotary, KV writes, attention, the
activation, and every op's dispatch) and the executor's share (step - forward); the
roof is the bytes one step reads (`streamed_weight_bytes`) over this machine's
measured streaming rate (`bench/model.py`'s vector-matrix product).

Prints a table, writes bench/results/decode_anatomy.json. `--quick` for a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import llamacpp_peer  # bench/llamacpp_peer.py, beside this script
import torch
from machine import describe  # bench/machine.py, beside this script
from model import GREEDY, make_prompts, stream_gbps, wavecore_decode

from wavecore.engine.executors.batch import ModelBatch, SequenceChunk
from wavecore.engine.model import ModelExecutor, load_executor

RESULTS = Path(__file__).resolve().parent / "results" / "decode_anatomy.json"


def median_seconds(call: Callable[[], object], steps: int) -> float:
    """The median wall time of `steps` calls, after one untimed call."""
    call()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_call(executor: ModelExecutor, prompt: list[int]) -> Callable[[], object]:
    """One decode's forward pass (after its prompt is in the cache), repeatable."""
    tokens = [*prompt, prompt[-1]]
    table = list(range(-(-len(tokens) // executor.block_size)))

    def chunk(start: int) -> SequenceChunk:
        return SequenceChunk(
            request_id="r",
            token_ids=tokens[start:],
            start_pos=start,
            block_table=table,
            sample=True,
            sampling=GREEDY,
            all_token_ids=tokens,
            prompt_len=len(prompt),
        )

    executor.compute_logits(ModelBatch(chunks=(chunk(0),)))  # the prompt, cached
    decode = ModelBatch(chunks=(chunk(len(prompt)),))
    return lambda: executor.compute_logits(decode)


def products_call(executor: ModelExecutor) -> Callable[[], None]:
    """Every projection's one-row product, layer by layer, then the LM head."""
    weights = executor.model_weights
    head, *layers = weights.projections()
    rows = {p.in_features: torch.randn(1, p.in_features) for p in (head, *layers)}

    def run() -> None:
        with torch.inference_mode():
            for projection in (*layers, head):
                projection(rows[projection.in_features])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: SmolLM2)"
    )
    parser.add_argument("--context", type=int, default=128, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--compile-decode", action="store_true", help="also a compile_decode=True executor"
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    steps, rounds = (4, 1) if args.quick else (32, args.rounds)
    context = 16 if args.quick else args.context

    executor = load_executor(args.model, seed=0)
    prompt = make_prompts(1, context, executor.config.vocab_size)[0]
    bandwidth = stream_gbps(16 if args.quick else 256, 2 if args.quick else 10)
    streamed = executor.streamed_weight_bytes
    llama = llamacpp_peer.open_peer(
        executor.source.path, torch.get_num_threads(), context + steps + 8
    )
    compiled = (
        load_executor(args.model, seed=0, compile_decode=True) if args.compile_decode else None
    )
    forward = forward_call(executor, prompt)
    products = products_call(executor)

    seconds: dict[str, list[float]] = {"step": [], "forward": [], "products": []}
    if compiled is not None:
        seconds["compiled step"] = []
    if llama is not None:
        seconds["llama.cpp step"] = []
    for _ in range(rounds):
        seconds["step"].append(1 / wavecore_decode(executor, [prompt], steps))
        executor.reset_kv_cache()
        forward = forward_call(executor, prompt)
        seconds["forward"].append(median_seconds(forward, steps))
        seconds["products"].append(median_seconds(products, steps))
        if compiled is not None:
            seconds["compiled step"].append(1 / wavecore_decode(compiled, [prompt], steps))
            compiled.reset_kv_cache()
        if llama is not None:
            seconds["llama.cpp step"].append(1 / llamacpp_peer.decode_tok_s(llama, prompt, steps))
    if llama is not None:
        llama.close()
    median = {name: statistics.median(values) for name, values in seconds.items()}
    median["glue (forward - products)"] = median["forward"] - median["products"]
    median["executor (step - forward)"] = median["step"] - median["forward"]
    roof = streamed / (bandwidth * 1e9)

    kernels = executor.path_report()
    print(
        f"{describe()['cpu']}, {torch.get_num_threads()} threads; {executor.source.path.name}, "
        f"context {context}; default path kernels: decode {kernels['decode']}; "
        f"{streamed / 1e6:.0f} MB read per step at {bandwidth:.1f} GB/s: roof "
        f"{roof * 1e3:.2f} ms ({1 / roof:.0f} tok/s)"
    )
    print(f"{'part of a batch-1 step':<28}{'ms':>8}{'tok/s':>9}{'of step':>9}{'roof/this':>11}")
    steps_named = ("step", "compiled step", "llama.cpp step")
    whole = ("forward", "products", *steps_named)
    for name, value in median.items():
        rate = f"{1 / value:>9.1f}" if name in steps_named else f"{'':>9}"
        share = f"{value / median['step']:>9.0%}" if name not in steps_named[1:] else f"{'':>9}"
        reached = f"{roof / value:>11.0%}" if name in whole else f"{'':>11}"
        print(f"{name:<28}{value * 1e3:>8.2f}{rate}{share}{reached}")
    if llama is not None:
        print(
            f"wavecore's step is {median['llama.cpp step'] / median['step']:.2f}x llama.cpp's "
            f"speed; its products alone take {median['products'] / median['llama.cpp step']:.2f}x "
            f"llama.cpp's whole step"
        )
    if llama is not None and compiled is not None:
        print(
            f"the compiled step is {median['llama.cpp step'] / median['compiled step']:.2f}x "
            f"llama.cpp's speed, {median['step'] / median['compiled step']:.2f}x the eager step's"
        )
    result = {
        "machine": describe(),
        "threads": torch.get_num_threads(),
        "context": context,
        "rounds": rounds,
        "steps_per_round": steps,
        "kernels": kernels,
        "streamed_weight_bytes": streamed,
        "stream_gbps": bandwidth,
        "roof_seconds": roof,
        "median_seconds": median,
        "seconds_per_round": seconds,
        "load_average_at_end": os.getloadavg(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
