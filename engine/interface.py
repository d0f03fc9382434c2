"""The engine's public interface: what `open_engine` returns for every `dp_size`.

One front end (`frontend.engine.FrontEnd`) implements it over either core client: one
rank in this process, or N rank processes. Every call means the same on both, raises
the same exceptions (`wavecore.engine.errors`) and `stats()` returns one type, with one
entry per rank.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.outputs import CompletionDelta
from wavecore.engine.request import Prompt
from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines import PauseMode

PauseModeName = Literal["abort", "wait", "keep"]

# `save_weights`'s shards: Hugging Face's default `max_shard_size`, 5 GB.
DEFAULT_SHARD_SIZE = 5 * 10**9


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreStats:
    """One rank's scheduler and memory. `paused` and `asleep` say why requests wait."""

    num_waiting: int
    num_running: int
    kv_usage: float
    prefix_cache_hit_rate: float
    # Prompt tokens looked up in, and found in, the prefix cache since start.
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Bytes held now: weights where the rank computes, weights kept in host memory while
    # asleep at level 1, the KV cache (what a sleep frees, and a wake takes back).
    weights_bytes: int
    offloaded_weights_bytes: int
    kv_cache_bytes: int
    num_kv_blocks: int
    block_size: int
    paused: str | None
    asleep: tuple[str, ...]
    weight_version: str | None
    # Structured-output grammars this rank compiled (cache hits excluded), and the
    # seconds those compiles took.
    grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0
    # Speculative decoding (upstream's spec_decode counters): decodes verified with
    # drafts, draft tokens, drafts accepted, and accepted drafts by position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    # Running requests per LoRA adapter (the base model's not counted).
    lora_running: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCounters:
    """What one rank's loop did: forwards, votes read, waves, requests, the last pause's
    cost."""

    wave: int
    step_counter: int
    running: bool
    real_steps: int
    dummy_steps: int
    votes: int
    waves_started: int
    waves_completed: int
    requests_added: int
    requests_held: int
    # Forwards between the first pause call reaching this rank and its reply.
    last_pause_forwards: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStats:
    rank: int
    core: CoreStats
    counters: RankCounters
    # The rank's CPU model, and its projection kernel per shape class ("decode", "small",
    # "large", "prefill") with the plan's "origin" (`engine/model/kernel_choice.py`);
    # empty for an executor without a model.
    kernels: dict[str, str] = field(default_factory=dict)
    # Frames and messages this rank's channels dropped as malformed or impossible, by
    # channel (`engine/dp/invalid_frames.py`); empty for a rank in the front end's process.
    dropped_frames: dict[str, int] = field(default_factory=dict)
    # Where the rank runs: "<hostname> (local)" for a rank process spawned by the front
    # end, "<ip> (Ray node <id>)" for a Ray actor, "headless" for a `wavecore rank`
    # started by hand, "this process" for a single rank in the front end's process.
    node: str = ""


# The upper bounds of the histograms of `RankIterations`: milliseconds a forward took,
# tokens it ran (a last bucket, +Inf, counts the rest).
STEP_MS_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0)
STEP_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankIterations:
    """One rank's forwards as its iteration details told the front end
    (`EngineConfig.log_iteration_details`): totals, and the histograms of their time
    and tokens (`ms_buckets[i]`: forwards that took at most `STEP_MS_BUCKETS[i]` ms, not
    cumulative; the last entry counts the rest; the same for tokens). Dummy batches
    count in `dummy_steps` and the time histogram, not in the tokens'."""

    rank: int
    steps: int
    dummy_steps: int
    context_requests: int
    context_tokens: int
    generation_requests: int
    generation_tokens: int
    elapsed_ms: float
    ms_buckets: tuple[int, ...]
    tokens_buckets: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    """Every rank's figures (one entry for a single rank), the coordinator's wave view,
    and which requests wait and why. Taken after every call made before `stats()`."""

    ranks: tuple[RankStats, ...]
    wave: int
    engines_running: bool
    held: Mapping[str, str]
    requests_per_rank: tuple[int, ...]
    # Structured-output requests accepted since start, per kind ("json", "regex", ...).
    structured_requests: Mapping[str, int] = field(default_factory=dict)
    # Frames dropped as malformed or impossible, by receiving channel (front end,
    # coordinator and ranks alike): a hostile or broken peer shows here.
    dropped_frames: Mapping[str, int] = field(default_factory=dict)
    # Per rank that sent iteration details (none unless `log_iteration_details`).
    iterations: tuple[RankIterations, ...] = ()

    @property
    def num_waiting(self) -> int:
        return sum(rank.core.num_waiting for rank in self.ranks)

    @property
    def num_running(self) -> int:
        return sum(rank.core.num_running for rank in self.ranks)

    @property
    def paused(self) -> str | None:
        """The pause mode every rank holds, None if any rank is not paused."""
        modes = {rank.core.paused for rank in self.ranks}
        return modes.pop() if len(modes) == 1 else None

    @property
    def asleep(self) -> tuple[str, ...]:
        """What is asleep on any rank."""
        return tuple(sorted({tag for rank in self.ranks for tag in rank.core.asleep}))


class Engine(Protocol):
    """An LLM engine of one or more data-parallel ranks; safe to call from any task."""

    @property
    def dp_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        dp_rank: int | None = None,
        lora: str | LoRARequest | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """Stream one request's output. `prompt` is text, chat messages or token ids;
        `dp_rank` pins the request to a rank; `lora` runs it under a LoRA adapter, by
        name (`UnknownLoRAError` at once if none is loaded) or as a `LoRARequest` (loaded
        on every rank first if its name is new). Leaving the loop early aborts it."""
        ...

    async def abort(self, request_id: str) -> None:
        """Finish a request as aborted; its stream ends with finish reason "abort"."""

    async def add_lora(self, request: LoRARequest) -> None:
        """Load a LoRA adapter (PEFT's format) on every rank, all or nothing: a rank
        that refuses it (`LoRAError`, naming the rank, the file and why) leaves no rank
        holding it. Ranks started later (scale, restart) load it before they serve.
        Needs `enable_lora`; the same name and path again is a no-op."""

    async def remove_lora(self, name: str) -> None:
        """Drop an adapter from every rank; refused while requests under it are in
        flight (`LoRAError`), or for an unknown name (`UnknownLoRAError`)."""

    async def pin_lora(self, name: str) -> None:
        """Keep an adapter resident in a device slot on every rank (never swapped out
        for another); at most `max_loras` pinned."""

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters every rank holds, by name."""
        ...

    async def pause(
        self, mode: PauseMode | PauseModeName = PauseMode.KEEP, *, clear_cache: bool = True
    ) -> None:
        """Stop scheduling on every rank; return once the pause holds. ABORT finishes
        every request as aborted, WAIT lets running requests end, KEEP freezes them.
        Requests that arrive while paused wait. `clear_cache` resets the prefix cache."""

    async def resume(self) -> None:
        """Undo a pause (refused while one completes, or while asleep)."""

    async def sleep(self, level: int = 1, *, mode: PauseMode | PauseModeName = "abort") -> None:
        """Pause in `mode`, then free memory: level 0 pauses scheduling only, level 1
        offloads the weights and drops the KV cache, level 2 drops both. Kept requests
        are recomputed after `wake_up`."""

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore "weights", "kv_cache" and/or "scheduling" (all if None); scheduling
        resumes once nothing is asleep any more."""

    async def is_sleeping(self) -> bool: ...

    async def is_paused(self) -> bool: ...

    async def reset_prefix_cache(self) -> None: ...

    async def stats(self) -> EngineStats: ...

    async def scale(self, new_dp_size: int, *, drain_timeout: float | None = None) -> None:
        """Change the number of DP ranks while serving (refused by a one-rank engine
        in this process: it has no ranks to add or remove)."""

    @property
    def weight_version(self) -> str | None:
        """The version of the weights every rank serves (None: as loaded)."""
        ...

    async def update_weights(
        self,
        source: str | os.PathLike[str] | Mapping[str, Any],
        *,
        version: str | None = None,
        partial: bool = False,
    ) -> None:
        """Serve new weights: a safetensors file, a directory of them, a GGUF file, or a
        mapping of (canonical or Hugging Face) names to `torch.Tensor`s. Only while
        paused, or asleep with the weights awake (`WeightUpdateRefusedError`). All or
        nothing: every rank checks names, shapes and dtypes and builds the new weights
        before any rank switches; a failure (`WeightUpdateError`, naming the rank and
        the tensor or file) leaves every rank its old weights. `partial` allows a
        subset of the tensors. The prefix cache is reset; requests kept across the
        update are recomputed with the new weights from their next token."""

    async def set_weight_version(self, version: str | None) -> None:
        """Relabel the weights served now (reported by `stats()` and every delta)."""

    async def save_weights(
        self, directory: str | os.PathLike[str], *, max_shard_size: int = DEFAULT_SHARD_SIZE
    ) -> None:
        """Write the weights the ranks serve (after any `update_weights`) into
        `directory` (new, or without safetensors files) as a Hugging Face model:
        safetensors shards of at most `max_shard_size` bytes with their index, the
        model's `config.json` and tokenizer, and `wavecore_weights.json` with the weight
        version; `EngineConfig(model=directory)` and `update_weights(directory)` load
        it. The ranks keep serving (each pauses its steps while it writes). Refused
        while `update_weights` runs (`WeightUpdateInProgressError`) or the weights
        sleep (`WeightUpdateRefusedError`); an executor without weights (the null
        executor) or a failed write raises `WeightUpdateError`-family errors naming
        the rank."""

    async def start_profile(self, directory: str | os.PathLike[str]) -> None:
        """Start the torch profiler on every rank (CPU activity, and CUDA where a rank
        has a GPU); `stop_profile` writes the traces into `directory` (made if
        missing). `ProfilerStateError` if it already runs; no scale meanwhile."""

    async def stop_profile(self) -> list[str]:
        """Stop the profiler on every rank; each rank's Chrome trace JSON file (loadable
        in Perfetto or chrome://tracing, named by rank, member id and pid), in rank
        order. `ProfilerStateError` if it does not run."""
        ...

    async def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the upstream API's name for it)
    ) -> list[Any]:
        """Call the executor method `method` that each rank's executor marks
        `@remote_callable`, with plain-data arguments; the results in rank order.
        `CollectiveRpcError` names an unknown method, a failing rank or one that did not
        answer within `timeout` seconds."""
        ...
