"""The batch queue (`EngineConfig(async_scheduling=True)`) against the step-time bound.

Workload: C requests (64 and 256) of a 16-token prompt and `--tokens` output tokens
each (ignore_eos, greedy), all sent at once to one rank: the real driver
(`RankRunner` over its `RankLoop`, the scheduler, the model thread) with an output
sink that only counts, so the figure is the rank's own Python (scheduling, updates,
outputs), not a front end's. The executor is the null executor with
`step_seconds=T`: every forward sleeps T seconds, releasing the GIL as a GPU's forward
would. The step-time bound is C / T tokens per second (every forward yields one token
per running request); the run also needs a prefill step or two, which the bound
ignores. The serial loop pays its Python between forwards; the batch queue overlaps
it with the next forward. "model busy" is the share of the wall time spent inside the
forwards as they really took (a loaded machine oversleeps T): the bound measured
against the forwards' real durations. Each figure is the best of `--repeats` runs
(serial and queue alternating), the run least disturbed by other work.

`--speculative ngram|draft_model` measures the batch queue with speculative decoding:
concurrencies 1 and 8 (drafts are added only while a step holds at most 16 tokens),
k = 4, the null executor's outputs cycling (`repeat_period`) so prompt lookup finds
drafts, and drafting as a draft model does for "draft_model" (some drafts wrong on
purpose). A request that drafts verifies in one forward and sits out the step ahead
under the queue (batch queue rule 7), so the table adds tokens per forward; the bound
stays one token per request per forward, which speculation can exceed.

Usage: python bench/batch_queue.py [--quick] [--step-ms T] [--tokens N]
       [--speculative ngram|draft_model]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path
from typing import Any

import anyio
from machine import describe

from wavecore.engine import messages as m
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.core.model_thread import ModelThread
from wavecore.engine.core.rank_runner import RankRunner, Shutdown
from wavecore.engine.executors.null_executor import NullExecutor
from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer
from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines import RankMachine

RESULTS = Path(__file__).resolve().parent / "results" / "batch_queue.json"
TARGET_OF_BOUND = 0.95
PROMPT_TOKENS = 16


SPECULATIVE_TOKENS = 4
REPEAT_PERIOD = 5


def _build(
    concurrency: int, tokens: int, step_seconds: float, queue: bool, speculative: str | None
) -> EngineCore:
    tokenizer = ByteTokenizer()
    block_size = 16
    # (one block more each: a draft model's lookahead may reach past the last token)
    blocks = concurrency * (-(-(PROMPT_TOKENS + tokens + 1) // block_size) + 1)
    executor = NullExecutor(
        num_kv_blocks=blocks,
        block_size=block_size,
        max_model_len=PROMPT_TOKENS + tokens + 1,
        vocab_size=tokenizer.vocab_size,
        eos_token_id=tokenizer.eos_token_id,
        step_seconds=step_seconds,
        repeat_period=REPEAT_PERIOD if speculative else None,
    )
    spec = (
        {"speculative_method": speculative, "num_speculative_tokens": SPECULATIVE_TOKENS}
        if speculative
        else {}
    )
    config = EngineConfig(
        executor="null",
        max_num_seqs=concurrency,
        max_num_batched_tokens=max(2048, concurrency * PROMPT_TOKENS),
        async_scheduling=queue,
        **spec,
    )
    return EngineCore(
        executor=executor, tokenizer=tokenizer, config=config, eos_token_id=tokenizer.eos_token_id
    )


class _Counter:
    """The rank's output sink: counts tokens and finished requests."""

    def __init__(self, expected: int) -> None:
        self.tokens = 0
        self.finished = 0
        self._expected = expected
        self.all_finished = anyio.Event()

    async def send(self, item: Any) -> None:
        if isinstance(item, m.StepOutputs):
            self.tokens += len(item.token_ids)
            self.finished += len(item.finished)
            if self.finished == self._expected:
                self.all_finished.set()

    async def flush(self) -> None:
        pass


async def _measure(
    concurrency: int, tokens: int, step_seconds: float, queue: bool, speculative: str | None
) -> dict:
    core = _build(concurrency, tokens, step_seconds, queue, speculative)
    # Time inside the forwards as they really took (a loaded machine oversleeps).
    # (The forward is `execute_model`, where the null executor sleeps its step time.)
    busy = [0.0]
    forward = core.executor.execute_model

    def timed_forward(batch: Any) -> Any:
        begun = time.perf_counter()
        try:
            return forward(batch)
        finally:
            busy[0] += time.perf_counter() - begun

    core.executor.execute_model = timed_forward  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    counter = _Counter(concurrency)
    to_rank, inbox = anyio.create_memory_object_stream[Any](math.inf)
    with ModelThread() as thread:
        runner = RankRunner(
            core=core,
            machine=RankMachine(0, 1, lockstep=False),
            model_thread=thread,
            group=None,
            outputs=counter,
            coordinator=None,
            on_invalid=print,
        )
        async with to_rank, inbox, anyio.create_task_group() as tg:
            tg.start_soon(runner.run, inbox)
            started = time.perf_counter()
            for index in range(concurrency):
                prompt = tuple(32 + (index * 7 + offset) % 90 for offset in range(PROMPT_TOKENS))
                await to_rank.send(
                    m.AddRequest(
                        request_id=f"r{index}", prompt_token_ids=prompt, params=params, wave=0
                    )
                )
            await counter.all_finished.wait()
            elapsed = time.perf_counter() - started
            await to_rank.send(Shutdown())
    if counter.tokens != concurrency * tokens:
        raise RuntimeError(f"expected {concurrency * tokens} tokens, got {counter.tokens}")
    throughput = counter.tokens / elapsed
    bound = concurrency / step_seconds
    return {
        "concurrency": concurrency,
        "mode": "queue" if queue else "serial",
        "tokens_per_s": throughput,
        "bound_tokens_per_s": bound,
        "of_bound": throughput / bound,
        "model_busy": busy[0] / elapsed,
        "forwards": runner.counts["real_steps"],
        "tokens_per_forward": counter.tokens / max(1, runner.counts["real_steps"]),
        "seconds": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the fixed forward time")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--speculative", choices=["ngram", "draft_model"])
    args = parser.parse_args()
    if args.output is None:
        name = f"batch_queue_{args.speculative}.json" if args.speculative else RESULTS.name
        args.output = RESULTS.with_name(name)
    # As a rank process does once it has loaded (engine/dp/rank_process.py): without it,
    # full collections of the whole heap stall the loop about 100 ms each.
    gc.collect()
    gc.freeze()
    concurrencies = (1, 8) if args.speculative else (64, 256)
    if args.quick:
        concurrencies, args.tokens, args.repeats = (8,), 8, 1
    step_seconds = args.step_ms / 1000
    rows = []
    for concurrency in concurrencies:
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.repeats):
            for queue in (False, True):
                runs[queue].append(
                    anyio.run(
                        _measure, concurrency, args.tokens, step_seconds, queue, args.speculative
                    )
                )
        rows += [max(runs[queue], key=lambda row: row["tokens_per_s"]) for queue in (False, True)]
    machine = describe()
    speculating = f", speculative {args.speculative} k={SPECULATIVE_TOKENS}" * bool(
        args.speculative
    )
    print(
        f"batch queue vs serial loop, null executor with a {args.step_ms:g} ms forward "
        f"(GIL released){speculating}, {args.tokens} output tokens per request, on "
        f"{machine['cpu']} ({machine['cpus']} CPUs)"
    )
    print(
        f"{'C':>4} {'mode':<7} {'tokens/s':>9} {'bound':>8} {'of bound':>9} "
        f"{'model busy':>11} {'forwards':>9} {'tok/forward':>11}"
    )
    for row in rows:
        print(
            f"{row['concurrency']:>4} {row['mode']:<7} {row['tokens_per_s']:>9.0f} "
            f"{row['bound_tokens_per_s']:>8.0f} {row['of_bound']:>9.3f} "
            f"{row['model_busy']:>11.3f} {row['forwards']:>9} {row['tokens_per_forward']:>11.2f}"
        )
    speedups = {
        str(c): next(r for r in rows if r["concurrency"] == c and r["mode"] == "queue")[
            "tokens_per_s"
        ]
        / next(r for r in rows if r["concurrency"] == c and r["mode"] == "serial")["tokens_per_s"]
        for c in concurrencies
    }
    for concurrency, speedup in speedups.items():
        print(
            f"C={concurrency}: queue / serial = {speedup:.2f}x (target of bound {TARGET_OF_BOUND})"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "benchmark": "batch_queue",
                "machine": machine,
                "speculative": args.speculative,
                "quick": args.quick,
                "step_ms": args.step_ms,
                "output_tokens": args.tokens,
                "repeats": args.repeats,
                "prompt_tokens": PROMPT_TOKENS,
                "rows": rows,
                "queue_over_serial": speedups,
                "target_of_bound": TARGET_OF_BOUND,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
