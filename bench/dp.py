"""Data-parallel engine throughput and pause latency, with the null executor (and,
with `--executor model`, the real model at dp 2).

Workload: `--requests` requests of `--max-tokens` tokens each, all submitted at once,
through the full DP path (client tokenizing and detokenizing, nng channels, rank
processes, coordinator), at dp_size 1, 2 and 4, in lockstep and independent mode. The
null executor costs no compute, so the figures measure the engine's own overhead:
requests per second, and streamed tokens per second as the caller receives them.

Peers, measured in the same run: lockstep against independent at the same dp_size
(target >= 0.9x), and each dp_size against dp_size 1 of the same mode.

Pause latency, per mode: the time from `pause()` to its return, and the forwards (real
or dummy) the ranks ran between receiving the pause and completing it (each rank counts
its own). Lockstep ranks share one step counter, so the rank the pause reached last
counted the fewest: that minimum is the count after the pause reached every rank
(target: 2), the maximum the count after it reached the first. In lockstep mode every
rank starts a non-blocking all-reduce of its pause vote at each step and reads it at
the next, so a pause that reached every rank is agreed one forward later and holds
after at most two.

With `--iteration-details`, instead: the cost of `log_iteration_details`. Two lockstep
engines per dp_size (1, 2), one with the details off and one with them on, open side by
side; throughput runs alternate between them (`--repeats` each), and the table gives
the median streamed tokens/s of each and their ratio (results/dp_iteration_details.json).
On a shared, loaded machine those differ by more from run to run than the details
cost, so the same run also times what they add per step, in this process: recording
a step of `--max-num-seqs` decodes, the codec round trip of its `StepOutputs` with
and without them, and the front end's count (medians of alternating rounds).

With `--dp-backend ray`, instead: the Ray launcher against the local one, in the same
run on a local Ray cluster of this machine's cores (its head node; ranks are actors in
placement groups): for each launcher, alternating `--repeats` times, lockstep dp 2 with
`on_rank_failure="shrink"`: the start-up time (entering `open_dp_engine`), the streamed
tokens/s (target: Ray >= 0.9x the local launcher), and the time from rank 1's death
(`ray.kill` of its actor, SIGKILL of its process) to the engine serving at dp 1: the
shrink done, and a request on the survivor finished (results/dp_ray.json). The local
launcher runs over ipc (its default) and over tcp (Ray's transport), so that the
launcher's cost and the transport's show apart. Each measured run also records where
the machine's CPU time went meanwhile (`bench/cpu_seconds.py`): the front end, the
ranks, the coordinator, this process's other descendants (Ray's raylet, GCS, agents and
idle workers), the rest of the machine (other users' load) and idle, with the load
average: on a small shared machine the throughput ratio means little without them.
The summary adds the medians of the undisturbed runs (the rest of the machine used
under 0.1 CPU s), and `--quiet-wait S` waits up to S seconds before each engine for
the machine to fall quiet (under 10% busy), so that more runs are. With `--executor
model` the same comparison runs the real model (the default path) in each rank, as a
served engine would (results/dp_ray_model.json): the launchers' throughput where the
model, not the engine's overhead, takes the time.

Usage: python bench/dp.py [--quick] [--executor null|model] [--requests N] [--max-tokens N]
       [--iteration-details [--repeats N]]
       [--dp-backend ray [--repeats N] [--quiet-wait S]] [--output PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
from cpu_seconds import CPUSeconds, wait_until_quiet  # bench/cpu_seconds.py, beside this script
from machine import describe  # bench/machine.py, beside this script

from wavecore.engine.api import Engine, open_dp_engine
from wavecore.engine.config import EngineConfig
from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines.rank_events import PauseMode

RESULTS = Path(__file__).resolve().parent / "results" / "dp.json"
TARGET_TOKENS_PER_S_DP2 = 50_000
TARGET_LOCKSTEP_RATIO = 0.9
TARGET_PAUSE_FORWARDS = 2
TARGET_RAY_VS_LOCAL = 0.9


def _config(dp_size: int, mode: str, args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        executor=args.executor,
        dp_size=dp_size,
        dp_mode=mode,  # type: ignore[arg-type]
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(2048, args.max_num_seqs * 16),
        # The real model's cache: enough for its requests, not a GiB per rank.
        kv_cache_memory=2**30 if args.executor == "null" else 256 * 2**20,
        startup_timeout=120.0,
    )


async def _throughput(engine: Engine, requests: int, max_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    received = 0

    async def run(number: int) -> None:
        nonlocal received
        async for delta in engine.generate(f"request {number} " * 4, params):
            received += len(delta.token_ids)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for number in range(requests):
            tg.start_soon(run, number)
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "requests_per_s": requests / elapsed,
        "tokens_per_s": received / elapsed,
        "tokens": received,
    }


async def _pause_latency(engine: Engine, mode: PauseMode, repeats: int) -> dict[str, float]:
    """Median milliseconds and most forwards any rank ran from a pause's arrival to its
    reply. KEEP and ABORT pause with a long request running on every rank; WAIT pauses
    an idle engine, since with requests running it waits for them to finish, which is
    their length, not the protocol's cost."""
    params = SamplingParams(max_tokens=1_000_000, ignore_eos=True)
    millis: list[float] = []
    after_first: list[int] = []
    after_last: list[int] = []
    for _ in range(repeats):
        async with anyio.create_task_group() as tg:
            if mode is not PauseMode.WAIT:
                for rank in range(engine.dp_size):
                    tg.start_soon(_drain, engine.generate("pause me", params, dp_rank=rank))
                while (await engine.stats()).num_running < engine.dp_size:
                    pass
            start = time.perf_counter()
            # The protocol's latency alone: no prefix-cache reset after the pause.
            await engine.pause(mode, clear_cache=False)
            millis.append((time.perf_counter() - start) * 1000)
            stats = await engine.stats()
            counts = [r.counters.last_pause_forwards for r in stats.ranks]
            after_first.append(max(counts))
            after_last.append(min(counts))
            if mode is PauseMode.KEEP:
                await engine.pause(PauseMode.ABORT)
            await engine.resume()
    return {
        "pause_ms": statistics.median(millis),
        "pause_forwards": max(after_last),
        "pause_forwards_after_first": max(after_first),
    }


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


async def _measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for dp_size in args.dp_sizes:
        for mode in ("independent", "lockstep"):
            config = _config(dp_size, mode, args)
            async with open_dp_engine(config) as engine:
                await _throughput(engine, max(2, args.requests // 8), 4)  # warm-up
                row: dict[str, Any] = {"dp_size": dp_size, "mode": mode}
                row.update(await _throughput(engine, args.requests, args.max_tokens))
                for pause_mode in PauseMode:
                    latency = await _pause_latency(engine, pause_mode, args.pause_repeats)
                    row.update({f"{key}_{pause_mode.value}": v for key, v in latency.items()})
            rows.append(row)
            print(f"  measured dp_size={dp_size} {mode}", flush=True)
    return rows


async def _measure_details(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for dp_size in args.dp_sizes:
        config = _config(dp_size, "lockstep", args)
        async with (
            open_dp_engine(config) as off,
            open_dp_engine(dataclasses.replace(config, log_iteration_details=True)) as on,
        ):
            for engine in (off, on):
                await _throughput(engine, max(2, args.requests // 8), 4)  # warm-up
            figures: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(args.repeats):
                for name, engine in (("off", off), ("on", on)):
                    run = await _throughput(engine, args.requests, args.max_tokens)
                    figures[name].append(run["tokens_per_s"])
            steps = sum(rank.steps + rank.dummy_steps for rank in (await on.stats()).iterations)
        row = {
            "dp_size": dp_size,
            "mode": "lockstep",
            "tokens_per_s_off": statistics.median(figures["off"]),
            "tokens_per_s_on": statistics.median(figures["on"]),
            "runs_off": figures["off"],
            "runs_on": figures["on"],
            "forwards_recorded": steps,
        }
        row["on_vs_off"] = row["tokens_per_s_on"] / row["tokens_per_s_off"]
        rows.append(row)
        print(f"  measured dp_size={dp_size} with and without iteration details", flush=True)
    return rows


def _per_step_cost(max_num_seqs: int, rounds: int = 7, calls: int = 2000) -> dict[str, float]:
    """Microseconds that iteration details add to one step (see the module docstring)."""
    from wavecore.channels import Codec
    from wavecore.engine import messages as m
    from wavecore.engine.core.engine_core import EngineCore
    from wavecore.engine.core.iteration_details import IterationRecorder
    from wavecore.engine.frontend.iteration_stats import IterationStats
    from wavecore.engine.request import EngineRequest

    config = EngineConfig(
        executor="null",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(2048, max_num_seqs * 16),
        kv_cache_memory=2**30,
    )
    core = EngineCore.from_config(config)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for number in range(max_num_seqs):
        prompt = tuple(f"request {number} ".encode() * 4)
        core.add_request(
            EngineRequest(request_id=str(number), prompt_token_ids=prompt, params=params)
        )
    while True:  # until a step where every request decodes
        step = core.schedule()
        assert step is not None
        if all(chunk.start_pos >= chunk.prompt_len for chunk in step.batch.chunks):
            break
        core.update(step, core.execute(step))
    recorded: list[Any] = []
    recorder = IterationRecorder(recorded.append)
    recorder.step(step, 0.001)
    ids = tuple(chunk.request_id for chunk in step.batch.chunks)
    columns = {"rank": 0, "request_ids": ids, "token_counts": (1,) * len(ids)}
    plain = m.StepOutputs(**columns, token_ids=tuple(range(len(ids))), finished={})
    detailed = m.StepOutputs(
        **columns, token_ids=tuple(range(len(ids))), finished={}, iterations=(recorded[0],)
    )
    codec, counts = Codec(), IterationStats()

    def timed(work: Any) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            work()
        return (time.perf_counter() - start) / calls * 1e6

    figures: dict[str, list[float]] = {"record": [], "off": [], "on": [], "count": []}
    for _ in range(rounds):
        figures["record"].append(timed(lambda: recorder.step(step, 0.001)))
        figures["off"].append(timed(lambda: codec.decode(codec.encode(plain))))
        figures["on"].append(timed(lambda: codec.decode(codec.encode(detailed))))
        figures["count"].append(timed(lambda: counts.add(0, recorded[:1])))
    median = {name: statistics.median(values) for name, values in figures.items()}
    return {
        "requests_per_step": len(ids),
        "record_us": median["record"],
        "codec_off_us": median["off"],
        "codec_on_us": median["on"],
        "front_end_us": median["count"],
        "added_us": median["record"] + median["on"] - median["off"] + median["count"],
    }


def _print_details_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'dp':>3} {'mode':<10} {'off tokens/s':>13} {'on tokens/s':>12} {'on/off':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['dp_size']:>3} {row['mode']:<10} {row['tokens_per_s_off']:>13.0f} "
            f"{row['tokens_per_s_on']:>12.0f} {row['on_vs_off']:>6.3f}x"
        )


def _details_main(args: argparse.Namespace) -> None:
    args.dp_sizes = (1, 2)
    if args.quick:
        args.dp_sizes, args.requests, args.max_tokens, args.repeats = (2,), 8, 8, 1
    rows = anyio.run(_measure_details, args)
    _print_details_table(rows)
    per_step = _per_step_cost(args.max_num_seqs)
    print(
        f"per step of {per_step['requests_per_step']} decodes: recording "
        f"{per_step['record_us']:.1f} us, codec round trip {per_step['codec_off_us']:.1f} us "
        f"off / {per_step['codec_on_us']:.1f} us on, front end {per_step['front_end_us']:.1f} "
        f"us; added {per_step['added_us']:.1f} us"
    )
    output = args.output or RESULTS.with_name("dp_iteration_details.json")
    result = {
        "benchmark": "dp_iteration_details",
        "quick": args.quick,
        "executor": args.executor,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "machine": describe(),
        "rows": rows,
        "per_step": per_step,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")


async def _measure_backends(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    import ray

    from wavecore.engine.dp.client import DPClient
    from wavecore.engine.frontend.engine import FrontEnd

    launchers = {"mp ipc": ("mp", "ipc"), "mp tcp": ("mp", "tcp"), "ray": ("ray", "tcp")}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in launchers}
    for _ in range(args.repeats):
        for name, (backend, transport) in launchers.items():
            config = dataclasses.replace(
                _config(2, "lockstep", args),
                transport=transport,  # type: ignore[arg-type]
                dp_backend=backend,  # type: ignore[arg-type]
                on_rank_failure="shrink",
            )
            quiet = True
            if args.quiet_wait > 0:
                quiet = await anyio.to_thread.run_sync(
                    lambda: wait_until_quiet(busy_below=0.1, timeout_s=args.quiet_wait)
                )
            start = time.perf_counter()
            async with open_dp_engine(config) as engine:
                row = {"startup_s": time.perf_counter() - start, "found_quiet": quiet}
                await _throughput(engine, max(2, args.requests // 8), 4)  # warm-up
                assert isinstance(engine, FrontEnd) and isinstance(engine.core_client, DPClient)
                client = engine.core_client
                processes = client.wiring.processes
                cpu = CPUSeconds(
                    {
                        "front end": [os.getpid()],
                        "ranks": [p.pid for n, p in processes.items() if n.startswith("rank")],
                        "coordinator": [processes["coordinator"].pid],
                    }
                )
                cpu.start()
                row.update(await _throughput(engine, args.requests, args.max_tokens))
                row.update({f"cpu_s {group}": s for group, s in cpu.stop().items()})
                row["load_1min"] = os.getloadavg()[0]
                shrunk = client.shrunk
                rank = client.wiring.processes["rank 1"]
                killed = time.perf_counter()
                if backend == "ray":
                    ray.kill(rank.actor)  # type: ignore[attr-defined]
                else:
                    os.kill(rank.pid, signal.SIGKILL)  # type: ignore[arg-type]
                await shrunk.wait()
                row["death_to_shrunk_s"] = time.perf_counter() - killed
                await _drain(engine.generate("after", SamplingParams(max_tokens=4)))
                row["death_to_served_s"] = time.perf_counter() - killed
            runs[name].append(row)
            print(f"  measured {name}", flush=True)
    return runs


def _backends_main(args: argparse.Namespace) -> None:
    import ray

    if args.quick:
        args.requests, args.max_tokens, args.repeats = 8, 8, 1
    ray.init(
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        object_store_memory=100 * 2**20,
        logging_level="WARNING",
        log_to_driver=False,
    )
    try:
        runs = anyio.run(_measure_backends, args)
    finally:
        ray.shutdown()
    keys = ("startup_s", "tokens_per_s", "death_to_shrunk_s", "death_to_served_s", "load_1min")
    cpu_keys = [key for key in runs["ray"][0] if key.startswith("cpu_s ")]
    medians = {
        backend: {key: statistics.median(run[key] for run in rows) for key in (*keys, *cpu_keys)}
        for backend, rows in runs.items()
    }
    ratios = {
        name: medians["ray"]["tokens_per_s"] / medians[name]["tokens_per_s"]
        for name in ("mp ipc", "mp tcp")
    }
    # The runs that no other user's work disturbed (under a tenth of a CPU second).
    quiet_runs = {
        backend: [run["tokens_per_s"] for run in rows if run["cpu_s rest of the machine"] < 0.1]
        for backend, rows in runs.items()
    }
    quiet_medians = {
        backend: statistics.median(figures) if figures else None
        for backend, figures in quiet_runs.items()
    }
    header = f"{'backend':<8} {'start s':>8} {'tokens/s':>10} {'death->shrunk s':>16} {'death->served s':>16}"
    load = statistics.median(run["load_1min"] for rows in runs.values() for run in rows)
    print(
        f"lockstep dp 2, {args.executor} executor, medians of {args.repeats} "
        f"(CPU: {describe()['cpu']}, "
        f"load average {load:.2f} at the measured runs, median)"
    )
    print(header)
    print("-" * len(header))
    for backend, figures in medians.items():
        print(
            f"{backend:<8} {figures['startup_s']:>8.2f} {figures['tokens_per_s']:>10.0f} "
            f"{figures['death_to_shrunk_s']:>16.3f} {figures['death_to_served_s']:>16.3f}"
        )
    print(
        f"ray / mp tokens/s: {ratios['mp ipc']:.2f}x against ipc, {ratios['mp tcp']:.2f}x "
        f"against tcp (target >= {TARGET_RAY_VS_LOCAL}x)"
    )
    print(
        "undisturbed runs only (rest of the machine < 0.1 CPU s): "
        + ", ".join(
            f"{backend} {len(quiet_runs[backend])} runs, "
            + (f"{figure:.0f} tokens/s" if figure is not None else "none")
            for backend, figure in quiet_medians.items()
        )
    )
    print(f"CPU seconds during the measured run (medians; all {describe()['cpus']} CPUs):")
    names = [key.removeprefix("cpu_s ") for key in cpu_keys]
    print(f"{'backend':<8} " + " ".join(f"{name:>{max(8, len(name))}}" for name in names))
    for backend, figures in medians.items():
        print(
            f"{backend:<8} "
            + " ".join(
                f"{figures[key]:>{max(8, len(name))}.2f}"
                for key, name in zip(cpu_keys, names, strict=True)
            )
        )
    name = "dp_ray.json" if args.executor == "null" else "dp_ray_model.json"
    output = args.output or RESULTS.with_name(name)
    result = {
        "benchmark": "dp_ray",
        "quick": args.quick,
        "executor": args.executor,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "target_ray_vs_mp": TARGET_RAY_VS_LOCAL,
        "ray_vs_mp_tokens_per_s": ratios,
        "quiet_wait_s": args.quiet_wait,
        "undisturbed_tokens_per_s": quiet_medians,
        "ray_version": ray.__version__,
        "machine": describe(),
        "medians": medians,
        "runs": runs,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    by_key = {(row["dp_size"], row["mode"]): row for row in rows}
    for row in rows:
        independent = by_key[(row["dp_size"], "independent")]
        row["vs_independent"] = row["tokens_per_s"] / independent["tokens_per_s"]
        base = by_key.get((min(r["dp_size"] for r in rows), row["mode"]))
        row["vs_smallest_dp"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None


def _print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'dp':>3} {'mode':<12} {'req/s':>9} {'tokens/s':>10} {'vs indep':>9} "
        f"{'vs dp min':>9}" + "".join(f" {m.value + ' ms, fwd (1st)':>21}" for m in PauseMode)
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['dp_size']:>3} {row['mode']:<12} {row['requests_per_s']:>9.0f} "
            f"{row['tokens_per_s']:>10.0f} {row['vs_independent']:>8.2f}x "
            f"{row['vs_smallest_dp']:>8.2f}x"
            + "".join(
                f" {row[f'pause_ms_{m.value}']:>12.1f} {row[f'pause_forwards_{m.value}']:>3}"
                f" ({row[f'pause_forwards_after_first_{m.value}']})"
                for m in PauseMode
            )
        )


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for mode in ("independent", "lockstep"):
        chosen = [row for row in rows if row["mode"] == mode]
        axes.plot(
            [row["dp_size"] for row in chosen],
            [row["tokens_per_s"] for row in chosen],
            marker="o",
            label=mode,
        )
    axes.axhline(TARGET_TOKENS_PER_S_DP2, linestyle=":", color="grey", label="dp 2 target")
    axes.set_xlabel("dp_size")
    axes.set_ylabel("streamed tokens / s")
    axes.set_title("wavecore DP throughput, null executor")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--executor",
        choices=["null", "model"],
        default="null",
        help="model: the real model at dp 2, 16 requests of 32 tokens (results/dp_model.json)",
    )
    parser.add_argument(
        "--iteration-details",
        action="store_true",
        help="measure log_iteration_details on against off instead (same run)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="with --iteration-details or --dp-backend ray"
    )
    parser.add_argument(
        "--dp-backend",
        choices=["mp", "ray"],
        default="mp",
        help="ray: the Ray launcher against the local one instead (results/dp_ray.json)",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        metavar="S",
        help="with --dp-backend ray: before each engine, wait up to S seconds for the "
        "machine's CPUs to be under 10%% busy (a shared machine's other users)",
    )
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.iteration_details:
        _details_main(args)
        return
    if args.dp_backend == "ray":
        _backends_main(args)
        return
    args.dp_sizes = (1, 2, 4)
    args.pause_repeats = 5
    if args.executor == "model":
        args.dp_sizes, args.requests, args.max_tokens, args.pause_repeats = (2,), 16, 32, 3
        args.max_num_seqs = 16
    if args.output is None:
        args.output = RESULTS.with_name("dp_model.json") if args.executor == "model" else RESULTS
    if args.quick:
        args.dp_sizes, args.requests, args.max_tokens, args.pause_repeats = (2,), 8, 8, 1
    rows = anyio.run(_measure, args)
    _add_ratios(rows)
    _print_table(rows)
    result = {
        "benchmark": "dp",
        "quick": args.quick,
        "executor": args.executor,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "targets": {
            "tokens_per_s_dp2": TARGET_TOKENS_PER_S_DP2,
            "lockstep_vs_independent": TARGET_LOCKSTEP_RATIO,
            "pause_forwards": TARGET_PAUSE_FORWARDS,
        },
        "machine": describe(),
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    _plot(rows, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
