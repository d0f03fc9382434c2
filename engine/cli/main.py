"""The `wavecore` command line: `wavecore generate` runs prompts through an engine."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

import anyio
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from wavecore.engine.cli.demo_prompts import DEMO_PROMPTS
from wavecore.engine.cli.latency import RequestTimer, RunSummary
from wavecore.engine.config import EngineConfig
from wavecore.engine.interface import Engine
from wavecore.engine.sampling_params import SamplingParams

_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
# About 10-30 us of spinning on a current x86 core: longer than the Python between two
# ops of a step, far shorter than libgomp's default (see `bound_openmp_spinning`).
OPENMP_SPIN_COUNT = 30_000


class UsageError(Exception):
    """A command-line input problem, reported as one line and exit status 2."""


@dataclass(slots=True, kw_only=True)
class PromptJob:
    """One prompt of a run, and what came back for it."""

    prompt: str | list[dict[str, str]]
    params: SamplingParams
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    timer: RequestTimer | None = None

    def result(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": len(self.token_ids),
        }


def _sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    chosen = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": tuple(args.stop or ()),
    }
    return {name: value for name, value in chosen.items() if value is not None}


def _parse_prompt_line(line: str, where: str, defaults: dict[str, Any], chat: bool) -> PromptJob:
    """A line is plain text, or a JSON object with `prompt` or `messages` and sampling fields."""
    if not line.lstrip().startswith("{"):
        return PromptJob(prompt=_as_chat(line, chat), params=SamplingParams(**defaults))
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise UsageError(f"{where}: not valid JSON ({error.msg})") from None
    unknown = set(record) - _SAMPLING_FIELDS - {"prompt", "messages"}
    if unknown:
        raise UsageError(f"{where}: unknown field(s) {sorted(unknown)}")
    if ("prompt" in record) == ("messages" in record):
        raise UsageError(f"{where}: give exactly one of 'prompt' or 'messages'")
    overrides = {k: v for k, v in record.items() if k in _SAMPLING_FIELDS}
    try:
        params = SamplingParams(**{**defaults, **overrides})
    except (TypeError, ValueError) as error:
        raise UsageError(f"{where}: {error}") from None
    if "messages" in record:
        return PromptJob(prompt=record["messages"], params=params)
    return PromptJob(prompt=_as_chat(record["prompt"], chat), params=params)


def _as_chat(text: str, chat: bool) -> str | list[dict[str, str]]:
    return [{"role": "user", "content": text}] if chat else text


def load_jobs(args: argparse.Namespace, stdin: TextIO) -> list[PromptJob]:
    defaults = _sampling_from_args(args)
    try:
        SamplingParams(**defaults)
    except ValueError as error:
        raise UsageError(str(error)) from None
    jobs: list[PromptJob] = []
    if args.demo:
        jobs += [_parse_prompt_line(p, "demo", defaults, True) for p in DEMO_PROMPTS]
    for text in args.prompt or ():
        jobs.append(PromptJob(prompt=_as_chat(text, args.chat), params=SamplingParams(**defaults)))
    if args.prompts_file is not None:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise UsageError(f"--prompts-file {path}: no such file")
        lines = path.read_text(encoding="utf-8").splitlines()
        jobs += [
            _parse_prompt_line(line, f"{path}:{number}", defaults, args.chat)
            for number, line in enumerate(lines, 1)
            if line.strip()
        ]
    if not jobs and not stdin.isatty():
        jobs += [
            _parse_prompt_line(line.rstrip("\r\n"), f"stdin:{number}", defaults, args.chat)
            for number, line in enumerate(stdin, 1)
            if line.strip()
        ]
    if not jobs:
        raise UsageError("no prompts: give --prompt, --prompts-file, --demo, or lines on stdin")
    return jobs


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    memory: int | float = args.kv_cache_memory
    try:
        return EngineConfig(
            model=args.model,
            executor=args.executor,
            device=args.device,
            kv_cache_memory=memory,
            max_num_seqs=args.max_num_seqs,
            dp_size=args.dp,
            dp_mode=args.dp_mode,
            # Ranks started elsewhere connect over tcp; the transport is not hashed.
            transport="tcp" if getattr(args, "dp_master", None) else "ipc",
        )
    except ValueError as error:
        raise UsageError(str(error)) from None


async def _run_job(engine: Engine, job: PromptJob, on_text: Callable[[str], None]) -> None:
    job.timer = RequestTimer()
    async for delta in engine.generate(job.prompt, job.params):
        job.timer.tokens_arrived(len(delta.token_ids))
        job.text += delta.text
        job.token_ids += delta.token_ids
        job.prompt_tokens = delta.usage.prompt_tokens
        job.finish_reason = delta.finish_reason
        on_text(delta.text)


async def run_generate(
    args: argparse.Namespace,
    console: Console,
    jobs: list[PromptJob],
    rank_counts: list[int] | None = None,
) -> RunSummary:
    """Run the jobs; with data parallelism, `rank_counts` receives requests per rank."""
    config = _engine_config(args)
    loading = console.status("loading the engine...")
    loading.start()
    async with _open_engine(args, config) as engine:
        loading.stop()
        start = time.perf_counter()
        scale_at = _check_scale_at(args)
        if len(jobs) == 1 and args.output is None and scale_at is None:

            def echo(text: str) -> None:
                console.print(text, end="", markup=False, highlight=False)

            await _run_job(engine, jobs[0], echo)
            console.print()
        else:
            with Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            ) as progress:
                task = progress.add_task("generating", total=len(jobs))
                done = [0]

                async def scale(size: int) -> None:
                    await engine.scale(size)
                    console.print(f"scaled to {size} data-parallel ranks")

                async def run_one(job: PromptJob) -> None:
                    await _run_job(engine, job, lambda _text: None)
                    progress.advance(task)
                    done[0] += 1
                    if scale_at is not None and done[0] == scale_at[0]:
                        tg.start_soon(scale, scale_at[1])

                async with anyio.create_task_group() as tg:
                    for job in jobs:
                        tg.start_soon(run_one, job)
        seconds = time.perf_counter() - start
        if rank_counts is not None:
            rank_counts.extend((await engine.stats()).requests_per_rank)
    return RunSummary.of(
        [job.timer for job in jobs if job.timer is not None],
        prompt_tokens=sum(job.prompt_tokens for job in jobs),
        output_tokens=sum(len(job.token_ids) for job in jobs),
        seconds=seconds,
    )


def _check_scale_at(args: argparse.Namespace) -> tuple[int, int] | None:
    """`--scale-at REQS:SIZE`: after REQS requests finished, scale to SIZE ranks."""
    scale_at: tuple[int, int] | None = args.scale_at
    if scale_at is None:
        return None
    if args.dp < 2 or args.dp_master is not None:
        raise UsageError("--scale-at needs a local data-parallel engine (--dp 2 or more)")
    return scale_at


def _scale_at(text: str) -> tuple[int, int]:
    requests, colon, size = text.partition(":")
    if not colon or not requests.isdigit() or not size.isdigit() or int(size) < 1:
        raise argparse.ArgumentTypeError(
            f"--scale-at takes REQS:SIZE (finished requests, new rank count >= 1), got {text!r}"
        )
    return int(requests), int(size)


def _open_engine(
    args: argparse.Namespace, config: EngineConfig
) -> AbstractAsyncContextManager[Engine]:
    from wavecore.engine.api import open_dp_engine, open_engine

    if args.dp_master is None:
        return open_engine(config)
    local = args.dp_local_ranks if args.dp_local_ranks is not None else args.dp
    return open_dp_engine(config, master=args.dp_master, local_ranks=range(local))


def cmd_rank(args: argparse.Namespace) -> int:
    """Run one headless rank that joins the front end at `--master`; ends with it."""
    from wavecore.engine.core.engine_core import EngineCore
    from wavecore.engine.dp.rank_process import rank_main

    if not 0 <= args.dp_rank < args.dp:
        raise UsageError(f"--dp-rank {args.dp_rank} is outside --dp-size {args.dp}")
    rank_main(f"tcp://{args.master}", args.dp_rank, _engine_config(args), EngineCore.from_config)
    return 0


def summary_table(summary: RunSummary, rank_counts: Sequence[int] = ()) -> Table:
    table = Table(title="summary", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    ms = 1000.0
    rows = [
        ("requests", f"{summary.requests}"),
        ("prompt tokens", f"{summary.prompt_tokens}"),
        ("output tokens", f"{summary.output_tokens}"),
        ("wall time", f"{summary.seconds:.2f} s"),
        ("output tokens/s", f"{summary.output_tokens_per_s:.1f}"),
        ("requests/s", f"{summary.requests_per_s:.2f}"),
        (
            "time to first token p50 / p99",
            f"{summary.ttft_p50 * ms:.0f} / {summary.ttft_p99 * ms:.0f} ms",
        ),
        (
            "inter-token latency p50 / p99",
            f"{summary.itl_p50 * ms:.1f} / {summary.itl_p99 * ms:.1f} ms",
        ),
    ]
    if len(rank_counts) > 1:
        rows.append(("requests per DP rank", " / ".join(map(str, rank_counts))))
    for what, value in rows:
        table.add_row(what, value)
    return table


def _write_results(jobs: Sequence[PromptJob], output: str) -> None:
    with open(output, "w", encoding="utf-8") as sink:
        for job in jobs:
            sink.write(json.dumps(job.result(), ensure_ascii=False) + "\n")


def cmd_generate(args: argparse.Namespace, console: Console) -> int:
    jobs = load_jobs(args, sys.stdin)
    rank_counts: list[int] = []
    summary = anyio.run(run_generate, args, console, jobs, rank_counts, backend=args.backend)
    if args.output is not None:
        _write_results(jobs, args.output)
        console.print(f"wrote {len(jobs)} results to {args.output}")
    elif len(jobs) > 1:
        for number, job in enumerate(jobs, 1):
            question = job.prompt if isinstance(job.prompt, str) else job.prompt[-1]["content"]
            console.rule(f"[bold]{number}. {question}", align="left")
            console.print(job.text.strip(), markup=False, highlight=False)
            console.print(f"[dim]({len(job.token_ids)} tokens, {job.finish_reason})")
    console.print(summary_table(summary, rank_counts))
    return 0


def _memory(text: str) -> int | float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    return value if 0 < value <= 1 else int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wavecore", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="run prompts through an engine")
    source = gen.add_argument_group("prompts")
    source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    source.add_argument(
        "--prompts-file", help="one prompt per line, or JSONL with per-prompt fields"
    )
    source.add_argument("--demo", action="store_true", help="the built-in set of 16 chat prompts")
    source.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--output", help="write results as JSONL, one object per prompt, in order")
    engine = gen.add_argument_group("engine")
    engine.add_argument(
        "--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M)"
    )
    engine.add_argument("--executor", choices=["model", "null"], default="model")
    engine.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument(
        "--kv-cache-memory",
        type=_memory,
        default=512 * 2**20,
        help="bytes, or a fraction in (0, 1]",
    )
    engine.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    engine.add_argument("--dp", type=int, default=1, help="data-parallel ranks (processes)")
    engine.add_argument("--dp-mode", choices=["lockstep", "independent"], default="lockstep")
    engine.add_argument(
        "--scale-at",
        type=_scale_at,
        metavar="REQS:SIZE",
        help="after REQS requests finished, scale to SIZE data-parallel ranks",
    )
    engine.add_argument(
        "--dp-master",
        metavar="HOST:PORT",
        help="listen here for ranks started elsewhere with `wavecore rank` (tcp)",
    )
    engine.add_argument(
        "--dp-local-ranks", type=int, help="with --dp-master: how many ranks start here"
    )
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int)
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--seed", type=int)
    sampling.add_argument("--stop", action="append", help="a stop string (repeatable)")
    rank = commands.add_parser("rank", help="run one headless data-parallel rank")
    rank.add_argument("--dp-rank", type=int, required=True)
    rank.add_argument("--dp-size", dest="dp", type=int, required=True)
    rank.add_argument("--master", required=True, metavar="HOST:PORT", help="the front end")
    rank.add_argument("--dp-mode", choices=["lockstep", "independent"], default="lockstep")
    rank.add_argument("--model")
    rank.add_argument("--executor", choices=["model", "null"], default="model")
    rank.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    rank.add_argument("--max-num-seqs", type=int, default=64)
    rank.add_argument("--kv-cache-memory", type=_memory, default=512 * 2**20)
    return parser


def bound_openmp_spinning() -> None:
    """Let OpenMP workers spin only briefly between parallel regions, unless the user chose.

    A decode step is hundreds of small ops. Idle workers that spin long (libgomp's
    default) steal the cores the next op needs when the machine is loaded; workers
    that sleep at once (OMP_WAIT_POLICY=PASSIVE) pay a wake-up per op. A bounded spin
    covers the few microseconds of Python between ops and then sleeps. Measured on 2
    cores with SmolLM2-135M, context 128 (bench/model.py, tokens/s at batch 1 / 64):
    quiet machine, default 29 / 277, PASSIVE 20 / 215, GOMP_SPINCOUNT=30000 31 / 288;
    two busy processes alongside, default 17 / 157, PASSIVE 15 / 149, bounded 18 / 191.
    OpenMP reads this once, when torch loads it, so it is set where the process starts,
    before anything imports torch; a library import must not change the environment.
    """
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", str(OPENMP_SPIN_COUNT))


def main(argv: Sequence[str] | None = None) -> int:
    bound_openmp_spinning()
    args = build_parser().parse_args(argv)
    console = Console(stderr=False)
    if args.command == "generate" and args.demo:
        # The demo is greedy and answers briefly unless told otherwise.
        args.chat = True
        args.temperature = 0.0 if args.temperature is None else args.temperature
        args.max_tokens = 96 if args.max_tokens is None else args.max_tokens
    try:
        if args.command == "rank":
            return cmd_rank(args)
        return cmd_generate(args, console)
    except UsageError as error:
        console.print(f"[red]wavecore {args.command}: {error}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
