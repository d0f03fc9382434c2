"""The `wavecore` command line: `wavecore generate` runs prompts through an engine,
`wavecore serve` serves one over HTTP (OpenAI-compatible).

Every failure is one line on stderr (`--debug` adds the traceback); exit codes: 0 done,
1 a prompt failed or the engine died, 2 a usage error (nothing started), 3 a headless
rank whose front end fell silent, 4 any other failure (a model that does not load, an
output that cannot be written), 130 interrupted (Ctrl-C; finished results are kept).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import anyio
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from wavecore.engine.cli.latency import RequestTimer, RunSummary
from wavecore.engine.cli.prompts import PromptJob, UsageError, load_inputs
from wavecore.engine.cli.results import ResultLog, open_output, print_error
from wavecore.engine.config import DTYPE_NAMES, EngineConfig
from wavecore.engine.errors import EngineDeadError, InvalidRequestError
from wavecore.engine.interface import Engine
from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.serve.command import add_serve_parser, cmd_serve

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_ERROR = 4
EXIT_INTERRUPTED = 130

# About 10-30 us of spinning on a current x86 core: longer than the Python between two
# ops of a step, far shorter than libgomp's default (see `bound_openmp_spinning`).
OPENMP_SPIN_COUNT = 30_000


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    memory: int | float = args.kv_cache_memory
    backend = getattr(args, "dp_backend", "mp")  # `wavecore rank` has no backend flag
    try:
        return EngineConfig(
            model=args.model,
            executor=args.executor,
            # A benchmark knob `wavecore rank` does not take.
            null_step_seconds=getattr(args, "null_step_ms", 0.0) / 1000,
            device=args.device,
            weights=args.weights,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            compile_decode=args.compile_decode,
            kv_cache_memory=memory,
            max_num_seqs=args.max_num_seqs,
            dp_size=args.dp,
            dp_mode=args.dp_mode,
            on_rank_failure=args.on_rank_failure,
            async_scheduling=args.async_scheduling,
            speculative_method=args.speculative_method,
            num_speculative_tokens=args.num_speculative_tokens,
            prompt_lookup_min=args.prompt_lookup_min,
            prompt_lookup_max=args.prompt_lookup_max,
            draft_model=args.draft_model,
            draft_weights=args.draft_weights,
            heartbeat_interval=args.heartbeat_interval,
            heartbeat_timeout=args.heartbeat_timeout,
            restart_ranks=getattr(args, "restart_ranks", False),
            channel_key_file=args.channel_key_file,
            tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key,
            tls_ca_file=args.tls_ca,
            tls_server_name=args.tls_server_name,
            log_iteration_details=args.log_iteration_details,
            enable_lora=args.enable_lora or bool(getattr(args, "lora_modules", None)),
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            lora_modules=tuple(getattr(args, "lora_modules", None) or ()),
            dp_backend=backend,
            ray_address=getattr(args, "ray_address", None),
            # Ranks started elsewhere (by hand, or by Ray), and a headless rank itself
            # (`--master`), connect over tcp; the transport is not hashed.
            transport="tcp"
            if getattr(args, "dp_master", None) or backend == "ray" or getattr(args, "master", None)
            else "ipc",
        )
    except ValueError as error:
        raise UsageError(str(error)) from None


async def _run_job(engine: Engine, job: PromptJob, on_text: Callable[[str], None]) -> None:
    job.timer = RequestTimer()
    async for delta in engine.generate(job.prompt, job.params, lora=job.lora):
        job.timer.tokens_arrived(len(delta.token_ids))
        job.text += delta.text
        job.token_ids += delta.token_ids
        job.prompt_tokens = delta.usage.prompt_tokens
        job.finish_reason = delta.finish_reason
        on_text(delta.text)


class _Run:
    """The jobs of one run on one engine, each logged the moment it ends.

    A prompt the engine refuses fails alone, or with `fail_fast` stops the run; an engine
    death stops the run. Both are caught inside the job's own task: raised there, they
    would leave the task group as an exception group and end the run with a traceback.
    """

    def __init__(self, engine: Engine, log: ResultLog, *, fail_fast: bool) -> None:
        self.engine = engine
        self.log = log
        self.fail_fast = fail_fast
        self.scope = anyio.CancelScope()
        self.dead: EngineDeadError | None = None

    async def run(self, job: PromptJob, on_text: Callable[[str], None]) -> bool:
        """Whether the job finished."""
        if self.scope.cancel_called:
            # Cancellation reaches a task at its first await; one that had not started
            # when the run stopped must not begin its request (or log its failure).
            return False
        try:
            await _run_job(self.engine, job, on_text)
        except InvalidRequestError as error:
            self.log.failed(job.index, job.where, str(error))
            if self.fail_fast:
                self.scope.cancel()
            return False
        except EngineDeadError as error:
            self.died(error)
            return False
        job.finished = True
        self.log.succeeded(job)
        return True

    def died(self, error: EngineDeadError) -> None:
        self.dead = error
        self.scope.cancel()

    async def scale(self, size: int, out: Console) -> None:
        try:
            await self.engine.scale(size)
        except EngineDeadError as error:
            self.died(error)
            return
        out.print(f"scaled to {size} data-parallel ranks")

    async def rank_view(self) -> tuple[list[int], dict[str, str]]:
        """Requests per rank, and the first rank's kernel plan (what path ran)."""
        if self.dead is not None:
            return [], {}
        try:
            stats = await self.engine.stats()
        except EngineDeadError as error:
            self.died(error)
            return [], {}
        kernels = stats.ranks[0].kernels if stats.ranks else {}
        return list(stats.requests_per_rank), dict(kernels)


@dataclass(frozen=True, slots=True)
class RunOutcome:
    summary: RunSummary
    rank_counts: list[int]
    dead: EngineDeadError | None
    kernels: dict[str, str] = field(default_factory=dict)


def _streams_one(args: argparse.Namespace, jobs: Sequence[PromptJob]) -> bool:
    """One prompt, with nowhere else to go, streams its text to the terminal."""
    return len(jobs) == 1 and args.output is None and args.scale_at is None


async def run_generate(
    args: argparse.Namespace,
    config: EngineConfig,
    out: Console,
    err: Console,
    jobs: list[PromptJob],
    log: ResultLog,
) -> RunOutcome:
    """Run the jobs, each logged in `log` as it ends; an engine death ends the run."""
    scale_at: tuple[int, int] | None = args.scale_at
    loading = err.status("loading the engine...")
    loading.start()
    async with _open_engine(args, config) as engine:
        loading.stop()
        run = _Run(engine, log, fail_fast=args.fail_fast)
        start = time.perf_counter()
        with run.scope:
            if _streams_one(args, jobs):
                await _stream_one(run, jobs[0], out)
            else:
                await _run_all(run, jobs, scale_at, out, err)
        seconds = time.perf_counter() - start
        rank_counts, kernels = await run.rank_view()
    finished = [job for job in jobs if job.finished]
    summary = RunSummary.of(
        [job.timer for job in finished if job.timer is not None],
        prompt_tokens=sum(job.prompt_tokens for job in finished),
        output_tokens=sum(len(job.token_ids) for job in finished),
        seconds=seconds,
    )
    return RunOutcome(summary=summary, rank_counts=rank_counts, dead=run.dead, kernels=kernels)


async def _stream_one(run: _Run, job: PromptJob, out: Console) -> None:
    def echo(text: str) -> None:
        out.print(text, end="", markup=False, highlight=False)

    await run.run(job, echo)
    if job.text:
        out.print()


async def _run_all(
    run: _Run,
    jobs: Sequence[PromptJob],
    scale_at: tuple[int, int] | None,
    out: Console,
    err: Console,
) -> None:
    """Every job at once under a progress bar (on stderr, with the error lines, so they
    do not tear it); after `scale_at[0]` finished, scale to `scale_at[1]` ranks."""
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        # Where nobody watches (a log, a pipe) a bar is noise: rich would leave a blank line.
        disable=not err.is_interactive,
    ) as progress:
        task = progress.add_task("generating", total=len(jobs))
        finished = 0

        async def run_one(job: PromptJob) -> None:
            nonlocal finished
            if await run.run(job, lambda _text: None):
                finished += 1
                if scale_at is not None and finished == scale_at[0]:
                    tg.start_soon(run.scale, scale_at[1], out)
            progress.advance(task)

        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(run_one, job)


def check_capacity(args: argparse.Namespace, config: EngineConfig) -> None:
    """`--dp` above what this machine can hold is refused before any process starts, as
    `scale` refuses it (`engine/dp/capacity.py`); on Ray the cluster's placement decides."""
    if config.dp_size < 2 or getattr(args, "dp_master", None) is not None:
        return
    if config.dp_backend == "ray":
        return
    from wavecore.engine.dp.capacity import dp_capacity

    capacity = dp_capacity(config)
    if config.dp_size > capacity.max_dp_size:
        raise UsageError(
            f"--dp {config.dp_size} refused: at most {capacity.max_dp_size} ranks "
            f"({capacity.reason})"
        )


def _check_scale_at(args: argparse.Namespace) -> None:
    """`--scale-at REQS:SIZE` (after REQS requests finished, scale to SIZE ranks) needs
    ranks this process started."""
    if args.scale_at is not None and (args.dp < 2 or args.dp_master is not None):
        raise UsageError("--scale-at needs a local data-parallel engine (--dp 2 or more)")


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
    """Run one headless rank that joins the front end at `--master`; ends the process
    with it (exit code 3 when the front end went silent for --heartbeat-timeout)."""
    from wavecore.engine.core.engine_core import EngineCore
    from wavecore.engine.dp.channel_key import engine_channel_key
    from wavecore.engine.dp.rank_process import rank_main

    if not 0 <= args.dp_rank < args.dp:
        raise UsageError(f"--dp-rank {args.dp_rank} is outside --dp-size {args.dp}")
    config = _engine_config(args)
    try:
        key = engine_channel_key(config, headless=True)
    except ValueError as error:
        raise UsageError(str(error)) from None
    rank_main(f"tcp://{args.master}", args.dp_rank, config, EngineCore.from_config, key)


def summary_table(
    summary: RunSummary, rank_counts: Sequence[int] = (), kernels: Mapping[str, str] | None = None
) -> Table:
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
    if kernels:
        # Which path ran: the projection kernel per shape class (`kernel_plan.py`).
        classes = ("decode", "small", "large", "prefill")
        plan = ", ".join(f"{c} {kernels[c]}" for c in classes if c in kernels)
        rows.append(("kernels", f"{plan} ({kernels.get('origin', '?')})"))
        if "kv_cache" in kernels:
            rows.append(("KV cache", kernels["kv_cache"]))
        if "attention" in kernels:  # a bfloat16 cache: the C kernel or torch's
            rows.append(("decode attention", kernels["attention"]))
        if "lora" in kernels:  # with --enable-lora: which path runs the adapters' deltas
            rows.append(("LoRA deltas", kernels["lora"]))
    for what, value in rows:
        table.add_row(what, value)
    return table


def cmd_generate(args: argparse.Namespace, out: Console, err: Console) -> int:
    """0 when every prompt finished, 1 when any failed or the engine died."""
    # Every usage error before anything is written.
    config = _engine_config(args)
    _check_scale_at(args)
    inputs = load_inputs(args, sys.stdin)
    check_capacity(args, config)
    with open_output(args.output) as sink:
        log = ResultLog(sink, err)
        for bad in inputs.rejected:
            log.failed(bad.index, bad.where, bad.message)
            if args.fail_fast:
                return 1
        if not inputs.jobs:
            return 1
        for job in inputs.jobs:
            job.lora = args.lora
        try:
            outcome = anyio.run(
                run_generate, args, config, out, err, inputs.jobs, log, backend=args.backend
            )
        except KeyboardInterrupt:
            return _interrupted(args, out, err, inputs.jobs, log)
    if outcome.dead is not None:
        print_error(err, "generate", _death_line(outcome.dead, log, len(inputs), args.output))
    if args.output is not None:
        written = f"wrote {log.finished} results and {log.failures} errors to {args.output}"
        out.print(written, highlight=False)
    elif not _streams_one(args, inputs.jobs):
        _print_results(out, inputs.jobs)
    out.print(summary_table(outcome.summary, outcome.rank_counts, outcome.kernels))
    return 1 if log.failures or outcome.dead is not None else 0


def _interrupted(
    args: argparse.Namespace,
    out: Console,
    err: Console,
    jobs: Sequence[PromptJob],
    log: ResultLog,
) -> int:
    """Ctrl-C: what finished is kept (in --output already, else printed), in one line."""
    finished = sum(1 for job in jobs if job.finished)
    if args.output is not None:
        kept = f"; their results are in {args.output}"
    else:
        _print_results(out, jobs)
        kept = ""
    print_error(err, "generate", f"interrupted: {finished} of {len(jobs)} prompts finished{kept}")
    return EXIT_INTERRUPTED


def _death_line(error: EngineDeadError, log: ResultLog, prompts: int, output: str | None) -> str:
    kept = f"; their results are in {output}" if output is not None else ""
    return f"the engine died ({error}): {log.finished} of {prompts} prompts finished{kept}"


def _print_results(out: Console, jobs: Sequence[PromptJob]) -> None:
    """Each finished job under its input number; a failed one was reported on stderr."""
    for job in jobs:
        if not job.finished:
            continue
        question = job.prompt if isinstance(job.prompt, str) else job.prompt[-1]["content"]
        out.rule(f"[bold]{job.index + 1}. {escape(question)}", align="left")
        out.print(job.text.strip(), markup=False, highlight=False)
        out.print(f"[dim]({len(job.token_ids)} tokens, {job.finish_reason})")


def _memory(text: str) -> int | float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    return value if 0 < value <= 1 else int(value)


def _lora_module(text: str) -> LoRARequest:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    try:
        return LoRARequest(name, path)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_rank_behaviour_flags(group: argparse._ActionsContainer) -> None:
    """Flags every rank of a group must share (a headless rank takes them too)."""
    group.add_argument(
        "--on-rank-failure",
        choices=["fail", "shrink"],
        default="fail",
        help="shrink: a lost rank's requests end with an error, the others serve on",
    )
    group.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule the next step while the model runs the current one",
    )
    group.add_argument(
        "--speculative-method",
        choices=["ngram", "draft_model"],
        help="speculative decoding: 'ngram' drafts from the request's own earlier tokens, "
        "'draft_model' from --draft-model",
    )
    group.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K")
    group.add_argument(
        "--draft-model",
        metavar="PATH",
        help="a smaller model with the same tokenizer (GGUF file or Hugging Face directory) "
        "that drafts for --speculative-method draft_model",
    )
    group.add_argument(
        "--draft-weights",
        choices=["auto", "float32", "int8"],
        default="auto",
        help="how the draft model's projections are held (as --weights)",
    )
    group.add_argument("--prompt-lookup-min", type=int, default=2, metavar="N")
    group.add_argument("--prompt-lookup-max", type=int, default=4, metavar="N")
    group.add_argument(
        "--channel-key-file",
        metavar="FILE",
        help="the key (hex) every channel between front end, coordinator and ranks is "
        "signed with: the same file on every machine (or $WAVECORE_CHANNEL_KEY); "
        "needed where ranks start elsewhere",
    )
    group.add_argument(
        "--tls-cert", metavar="PEM", help="this process's certificate: tcp channels use TLS"
    )
    group.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    group.add_argument(
        "--tls-ca", metavar="PEM", help="the CA every peer's certificate must come from"
    )
    group.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name every listener's certificate carries (default: the host dialed)",
    )
    group.add_argument(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often the front end and each rank send each other a heartbeat",
    )
    group.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="a rank silent this long is lost; a headless rank whose front end is silent "
        "this long exits (code 3)",
    )
    group.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (PEFT's format) beside the base model",
    )
    group.add_argument(
        "--max-loras",
        type=int,
        default=4,
        metavar="N",
        help="at most N distinct adapters among a rank's running requests (device slots)",
    )
    group.add_argument(
        "--max-lora-rank", type=int, default=64, metavar="R", help="the largest adapter rank"
    )
    group.add_argument(
        "--log-iteration-details",
        action="store_true",
        help="record every forward of every rank (requests, tokens, time, dummy): "
        "logged at debug level, histograms in /metrics",
    )


def _add_engine_flags(command: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The engine flags `generate` and `serve` share, in a group the caller may extend."""
    command.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    engine = command.add_argument_group("engine")
    engine.add_argument(
        "--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M)"
    )
    engine.add_argument("--executor", choices=["model", "null"], default="model")
    engine.add_argument(
        "--null-step-ms",
        type=float,
        default=0.0,
        help="with --executor null: every step lasts this long, as a device's would",
    )
    engine.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    engine.add_argument(
        "--weights",
        choices=["auto", "float32", "int8"],
        default="auto",
        help="auto (with --dtype auto, on the CPU): per batch size the fastest of float32, "
        "bfloat16 and int8 within the accuracy budget, measured once per machine; "
        "float32: exact; int8: quantized projections",
    )
    engine.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default="auto",
        help="compute dtype (auto: float32 on the CPU, bfloat16 or float16 on a GPU)",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        choices=DTYPE_NAMES,
        default="auto",
        help="the KV cache's dtype (auto: bfloat16 where the auto weights' kernels round to "
        "it, on a CPU with native bfloat16; else the compute dtype)",
    )
    engine.add_argument(
        "--compile-decode",
        action="store_true",
        help="batch-1 decodes through a torch.compile'd graph (~1.3x on a CPU; compiles "
        "at load, needs a C++ compiler)",
    )
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument(
        "--kv-cache-memory",
        type=_memory,
        default=512 * 2**20,
        help="bytes, or a fraction in (0, 1]",
    )
    engine.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        metavar="NAME=PATH",
        help="LoRA adapters to load on every rank at start (implies --enable-lora)",
    )
    engine.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    engine.add_argument("--dp", type=int, default=1, help="data-parallel ranks (processes)")
    engine.add_argument("--dp-mode", choices=["lockstep", "independent"], default="lockstep")
    engine.add_argument(
        "--restart-ranks",
        action="store_true",
        help="with --on-rank-failure shrink: start replacements for lost ranks (here, or "
        "anywhere in the Ray cluster with --dp-backend ray)",
    )
    engine.add_argument(
        "--dp-backend",
        choices=["mp", "ray"],
        default="mp",
        help="who starts the ranks: mp (processes on this machine) or ray (actors anywhere "
        "in a Ray cluster; pip install wavecore[ray])",
    )
    engine.add_argument(
        "--ray-address",
        metavar="HOST:PORT",
        help="with --dp-backend ray: the cluster to join (default: Ray's, e.g. RAY_ADDRESS)",
    )
    _add_rank_behaviour_flags(engine)
    return engine


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wavecore", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of failures")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="run prompts through an engine")
    source = gen.add_argument_group("prompts")
    source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    source.add_argument(
        "--prompts-file", help="one prompt per line, or JSONL with per-prompt fields"
    )
    source.add_argument("--demo", action="store_true", help="the built-in set of 16 chat prompts")
    source.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument(
        "--output",
        help="write each result to this JSONL file as soon as it finishes (flushed), so a run "
        'that stops early keeps what it finished. Lines come in finishing order; "index" is '
        "the prompt's position in the input (from 0): sort by it for input order. A failed "
        'prompt\'s line is {"index": N, "error": "..."}',
    )
    gen.add_argument(
        "--fail-fast",
        action="store_true",
        help="stop at the first prompt that fails, instead of recording its error and "
        "running the others",
    )
    engine = _add_engine_flags(gen)
    engine.add_argument(
        "--lora", metavar="NAME", help="run every prompt under this adapter of --lora-modules"
    )
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
    structured = sampling.add_mutually_exclusive_group()
    structured.add_argument(
        "--json-schema", metavar="FILE", help="outputs match the JSON schema in FILE"
    )
    structured.add_argument("--regex", metavar="R", help="outputs match the regex R")
    structured.add_argument("--choice", metavar="A,B,C", help="each output is one of these")
    add_serve_parser(commands, _add_engine_flags)
    rank = commands.add_parser("rank", help="run one headless data-parallel rank")
    rank.add_argument("--dp-rank", type=int, required=True)
    rank.add_argument("--dp-size", dest="dp", type=int, required=True)
    rank.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    rank.add_argument("--master", required=True, metavar="HOST:PORT", help="the front end")
    rank.add_argument("--dp-mode", choices=["lockstep", "independent"], default="lockstep")
    _add_rank_behaviour_flags(rank)
    rank.add_argument("--model")
    rank.add_argument("--executor", choices=["model", "null"], default="model")
    rank.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    rank.add_argument("--weights", choices=["auto", "float32", "int8"], default="auto")
    rank.add_argument("--compile-decode", action="store_true")
    rank.add_argument("--dtype", choices=DTYPE_NAMES, default="auto")
    rank.add_argument("--kv-cache-dtype", choices=DTYPE_NAMES, default="auto")
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
    out = Console()
    err = Console(stderr=True)
    if args.command == "generate" and args.demo:
        # The demo is greedy and answers briefly unless told otherwise.
        args.chat = True
        args.temperature = 0.0 if args.temperature is None else args.temperature
        args.max_tokens = 96 if args.max_tokens is None else args.max_tokens
    try:
        if args.command == "rank":
            return cmd_rank(args)
        if args.command == "serve":
            config = _engine_config(args)
            check_capacity(args, config)
            return cmd_serve(args, config)
        return cmd_generate(args, out, err)
    except UsageError as error:
        print_error(err, args.command, str(error))
        return EXIT_USAGE
    except KeyboardInterrupt:
        if args.debug:
            raise
        print_error(err, args.command, "interrupted")
        return EXIT_INTERRUPTED
    except Exception as error:
        if args.debug:
            raise
        print_error(err, args.command, f"{failure_line(error)} (--debug shows the traceback)")
        return EXIT_ERROR


def failure_line(error: BaseException) -> str:
    """An exception as one line: a group with a single cause as that cause, an OSError
    as its file and reason, any other as its message (its type when it has none)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    if isinstance(error, OSError) and error.strerror:
        where = f"{error.filename}: " if error.filename else ""
        return f"{where}{error.strerror}"
    text = " ".join(str(error).split())
    return text or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
