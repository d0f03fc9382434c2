"""`ModelExecutor`: the engine's `Executor` backed by a real Llama-family model.

Construction resolves the model, dequantizes its weights onto the device (and, with
`weights="int8"`, quantizes the projections to int8; with `weights="auto"`, the
default, holds each projection in the forms this machine's plan runs fastest within
the accuracy budget, `auto_weights.py`; `weight_format.py`), sizes the
paged KV cache from a memory budget and precomputes the rotary table. Each
`execute` plans the batch (checking it first), runs one forward pass for all its
chunks, and hands the sampling rows' logits to the `Sampler`.

Sleep levels: 1 moves the weights to CPU memory and frees the KV cache; 2 frees both,
and waking reloads the weights from the model file.

With `enable_lora`, LoRA adapters (`add_lora`, `remove_lora`, `pin_lora`) are kept in a
`LoRAStore` beside the weights, not in them: a weight update keeps them (they apply to
the new base), and a sleep of either level keeps their host copies (`lora.adapters`).

Every method runs on the engine's model thread; `torch.inference_mode` is entered per
call because it is thread-local.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from wavecore.engine.errors import (
    LoRAError,
    UnknownLoRAError,
    WeightUpdateError,
    WeightUpdateRefusedError,
)
from wavecore.engine.executors.batch import (
    EXECUTOR_TAGS,
    ExecutorMemory,
    GrammarBitmask,
    ModelBatch,
    ModelOutput,
    SampledToken,
    SequenceChunk,
    sampling_rows,
)
from wavecore.engine.executors.errors import ExecutorAsleepError, ExecutorClosedError
from wavecore.engine.executors.rpc import remote_callable
from wavecore.engine.executors.weight_specs import check_update
from wavecore.engine.lora.compute import LoRARows, MixedDecodes
from wavecore.engine.lora.native import native_kernel, step_owner
from wavecore.engine.lora.request import LoRARequest
from wavecore.engine.lora.store import LoRAStore
from wavecore.engine.model import native_attention
from wavecore.engine.model.batch_plan import CacheGeometry, ForwardPlan, plan_forward
from wavecore.engine.model.compiled_decode import INT8_NOT_COMPILED, CompiledDecode
from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.dtypes import (
    DeviceSpec,
    DTypeSpec,
    dtype_name,
    pick_device,
    pick_dtype,
    pick_kv_cache_dtype,
)
from wavecore.engine.model.errors import InvalidBatchError
from wavecore.engine.model.kernel_choice import ROUNDING_KERNELS, KernelChoice, choose_kernels
from wavecore.engine.model.kv_cache import PagedKVCache, blocks_for_budget, bytes_per_block
from wavecore.engine.model.linear import can_pack_bf16
from wavecore.engine.model.llama import LlamaModel
from wavecore.engine.model.resolve import resolve_model_source
from wavecore.engine.model.rope import RotaryTable
from wavecore.engine.model.source import ModelSource
from wavecore.engine.model.weight_format import WeightFormat, check_weight_format
from wavecore.engine.model.weight_update import stage_weights, weight_shapes
from wavecore.engine.model.weights import ModelWeights
from wavecore.engine.sampling.grammar_mask import apply_grammar_bitmask
from wavecore.engine.sampling_params import SamplingParams

DEFAULT_KV_CACHE_MEMORY = 512 * 2**20


class Drafter(Protocol):
    """A draft model beside this executor (`draft_model.DraftModel`): it follows each
    sampled step, and proposes what the step's chunks ask for."""

    def follow(
        self, chunks: Sequence[SequenceChunk], sampled: Sequence[SampledToken]
    ) -> dict[str, tuple[int, ...]]: ...

    def memory(self) -> ExecutorMemory: ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: frozenset[str]) -> None: ...

    def reset_kv_cache(self) -> None: ...

    def close(self) -> None: ...


class TokenSampler(Protocol):
    def sample(
        self, logits: torch.Tensor, chunks: Sequence[SequenceChunk]
    ) -> tuple[SampledToken, ...]: ...


def _use_all_cores() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cores and torch.get_num_threads() < cores:
        torch.set_num_threads(cores)


@dataclasses.dataclass(frozen=True, slots=True)
class Forward:
    """A forward pass's batch and its sampling rows' logits, waiting to be sampled."""

    batch: ModelBatch
    logits: torch.Tensor


class ModelExecutor:
    def __init__(
        self,
        source: ModelSource,
        *,
        device: DeviceSpec = "auto",
        kv_cache_memory: int | float = DEFAULT_KV_CACHE_MEMORY,
        block_size: int = 16,
        max_model_len: int | None = None,
        sampler: TokenSampler | None = None,
        seed: int = 0,
        weights: WeightFormat = "auto",
        dtype: DTypeSpec = "auto",
        kv_cache_dtype: DTypeSpec = "auto",
        enable_lora: bool = False,
        max_loras: int = 4,
        max_lora_rank: int = 64,
        compile_decode: bool = False,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self._source = source
        self._device = pick_device(device)
        self._dtype = pick_dtype(self._device, dtype)
        self._weights = check_weight_format(weights, self._device, dtype)
        if self._weights == "int8" and self._dtype != torch.float32:
            raise ValueError(
                f"weights='int8' computes in float32; dtype {dtype!r} cannot go with it"
            )
        if self._weights == "int8" and compile_decode:
            raise ValueError(INT8_NOT_COMPILED)
        # The KV cache takes its own dtype (`dtypes.pick_kv_cache_dtype`): bfloat16 for
        # "auto" beside a plan that rounds to it, which is known only once the plan is.
        kv_if_rounding = pick_kv_cache_dtype(
            kv_cache_dtype,
            compute=self._dtype,
            rounds_to_bf16=self._weights == "auto" and can_pack_bf16(self._device, self._dtype),
        )
        kv_otherwise = pick_kv_cache_dtype(
            kv_cache_dtype, compute=self._dtype, rounds_to_bf16=False
        )
        if self._device.type == "cpu":
            _use_all_cores()
        config = source.config
        # Which kernel each projection product runs on this machine (measured once per
        # machine and cached; `kernel_choice.py`). "auto" judges its rounding kernels
        # on the loaded weights, so it chooses in `_load_weights`.
        self._kernel_choice: KernelChoice | None = None
        if self._weights != "auto":
            self._kernel_choice = choose_kernels(
                config, device=self._device, dtype=self._dtype, weights=self._weights
            )
        self._block_size = block_size
        # Bad sizes are refused before the slow load, against the wider of the caches.
        widest = max(kv_if_rounding, kv_otherwise, key=lambda t: t.itemsize)
        blocks_for_budget(
            kv_cache_memory, bytes_per_block(config, block_size, widest), self._device
        )
        limit = config.context_length
        if max_model_len is not None:
            if (
                isinstance(max_model_len, bool)
                or not isinstance(max_model_len, int)
                or max_model_len < 1
            ):
                raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
            if max_model_len > limit:
                raise ValueError(
                    f"max_model_len {max_model_len} exceeds the model's context length {limit}"
                )
            limit = max_model_len

        weights = self._load_weights(self._device, kv_if_rounding)
        rounds = any(self.kernels.plan.uses(kernel) for kernel in ROUNDING_KERNELS)
        self._kv_dtype = kv_if_rounding if rounds else kv_otherwise
        self._num_blocks = blocks_for_budget(
            kv_cache_memory, bytes_per_block(config, block_size, self._kv_dtype), self._device
        )
        # A sequence longer than the whole cache could never be scheduled.
        self._max_model_len = min(limit, self._num_blocks * block_size)
        self._rotary = RotaryTable(
            config,
            self._max_model_len,
            rope_freqs=weights.rope_freqs,
            device=self._device,
            dtype=self._dtype,
        )
        self._model: LlamaModel | None = LlamaModel(config, weights, self._rotary)
        self._offloaded: ModelWeights | None = None
        self._cache: PagedKVCache | None = self._new_cache()
        if sampler is None:
            from wavecore.engine.sampling.sampler import Sampler

            sampler = Sampler(source.eos_token_id, seed=seed)
        self._sampler = sampler
        self._loras: LoRAStore | None = None
        self._lora_path = ""
        if enable_lora:
            # The deltas' weights round as the base's do: bfloat16 beside a plan that
            # rounds to it (half the bytes), float32 where the base is exact.
            native, self._lora_path = native_kernel(
                config,
                self._device,
                self._dtype,
                weight_dtype=torch.bfloat16 if rounds else torch.float32,
            )
            self._loras = LoRAStore(
                config,
                max_loras=max_loras,
                max_lora_rank=max_lora_rank,
                device=self._device,
                dtype=self._dtype,
                native=native,
            )
        self._draft: Drafter | None = None
        self._closed = False
        # A plan of "auto" weights may run int8 for batch 1 on some CPU: that step then
        # stays eager, and `path_report` says why.
        self._compile_skipped = compile_decode and self.kernels.plan.decode == "fbgemm"
        self._compiled = CompiledDecode() if compile_decode and not self._compile_skipped else None
        if self._compiled is not None:
            model, cache = self._ready()
            # On a decode at the scratch block, so that no request waits for it; its plan
            # built as `compute_logits` builds one (inference tensors), or the guards on
            # the per-step inputs would differ and the first step compile again.
            with torch.inference_mode():
                self._compiled.compile_now(model, self._scratch_plan(decode=True), cache)

    @property
    def draft(self) -> Drafter | None:
        """The draft model attached (`attach_draft`), if any."""
        return self._draft

    def attach_draft(self, draft: Drafter) -> None:
        """Speculative decoding with a draft model: `draft` follows every step after its
        sampling and proposes (`draft_model.py`); it sleeps and wakes with this
        executor and is closed with it."""
        self._draft = draft

    # -- what the engine reads --------------------------------------------------------

    @property
    def source(self) -> ModelSource:
        """The resolved model: GGUF metadata for the tokenizer, EOS id, chat template."""
        return self._source

    @property
    def config(self) -> ModelConfig:
        return self._source.config

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype (`dtypes.pick_kv_cache_dtype`)."""
        return self._kv_dtype

    @property
    def weights(self) -> WeightFormat:
        """How the projections are stored: "float32" (the model's dtype), "int8", or
        "auto" (per shape class, as `kernels` says)."""
        return self._weights

    @property
    def kernels(self) -> KernelChoice:
        """The CPU and the projection kernel chosen per shape class (`kernel_plan.py`)."""
        if self._kernel_choice is None:
            raise RuntimeError("the kernels are chosen when the weights load")
        return self._kernel_choice

    def path_report(self) -> dict[str, str]:
        """Which path runs, for `stats()`: the CPU, each shape class's kernel (the
        decode's "(compiled)" with `compile_decode`), where the plan came from, the KV
        cache's dtype, and with a bfloat16 cache on the CPU what runs decode attention
        (`native_attention.py`; a float32 cache always runs torch's)."""
        report = self.kernels.report()
        if self._compiled is not None:
            report["decode"] += " (compiled)"
        elif self._compile_skipped:
            report["decode"] += " (not compiled: int8 products break the graph)"
        report["kv_cache"] = dtype_name(self._kv_dtype)
        if self._kv_dtype == torch.bfloat16 and self._device.type == "cpu":
            report["attention"] = native_attention.kernel_report()
        if self._lora_path:
            report["lora"] = self._lora_path
        return report

    @property
    def compiles_decode(self) -> bool:
        """Whether one-decode steps run through the compiled graph (`compile_decode`)."""
        return self._compiled is not None

    @property
    def streamed_weight_bytes(self) -> int:
        """Bytes of weights one batch-1 decode step reads (`ModelWeights.streamed_bytes`)."""
        return self.model_weights.streamed_bytes

    @property
    def model_weights(self) -> ModelWeights:
        """The weights as the forward pass holds them (for inspection and benchmarks)."""
        model, _ = self._ready()
        return model.weights

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_kv_blocks(self) -> int:
        return self._num_blocks

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    # -- running ----------------------------------------------------------------------

    def execute(self, batch: ModelBatch) -> ModelOutput:
        return self.sample_tokens(self.execute_model(batch), None)

    def execute_model(self, batch: ModelBatch) -> Forward:
        """The forward pass (upstream's `execute_model`); sampling is `sample_tokens`."""
        return Forward(batch=batch, logits=self.compute_logits(batch))

    def sample_tokens(self, forward: object, bitmask: GrammarBitmask | None) -> ModelOutput:
        """Sample the forward's rows, each structured row among what its grammar allows;
        the logprobs are then those of the constrained distribution."""
        if not isinstance(forward, Forward):
            raise TypeError(f"sample_tokens takes what execute_model returned, got {forward!r}")
        sampling = sampling_rows(forward.batch.chunks)
        sampled: tuple[SampledToken, ...] = ()
        if sampling:
            logits = forward.logits
            with torch.inference_mode():
                if bitmask is not None:
                    apply_grammar_bitmask(logits, bitmask)  # the logits are this step's own
                sampled = tuple(self._sampler.sample(logits, sampling))
        if self._draft is None:
            return ModelOutput(sampled=sampled)
        drafts = self._draft.follow(forward.batch.chunks, sampled)
        return ModelOutput(sampled=sampled, draft_token_ids=drafts)

    def compute_logits(self, batch: ModelBatch) -> torch.Tensor:
        """One forward pass; float32 logits `[sampling rows, vocab]` in batch order."""
        model, cache = self._ready()
        geometry = CacheGeometry(
            block_size=self._block_size,
            num_blocks=self._num_blocks,
            max_model_len=self._max_model_len,
            vocab_size=self.config.vocab_size,
        )
        with torch.inference_mode():
            plan = plan_forward(batch.chunks, geometry, self._device)
            if plan.num_tokens == 0:
                return torch.empty(0, self.config.vocab_size)
            if self._compiled is not None and CompiledDecode.handles(plan):
                return self._compiled(model, plan, cache)
            if not plan.lora_runs and not plan.lora_mixed:
                return model.forward(plan, cache)
            return model.forward(plan, cache, self._lora_rows(plan))

    def _lora_rows(self, plan: ForwardPlan) -> LoRARows:
        """The step's adapters made resident, with their rows; an adapter this executor
        does not hold refuses the batch before the forward writes anything."""
        names = plan.lora_names
        if self._loras is None:
            raise InvalidBatchError(
                f"the batch names LoRA adapter(s) {names}, but LoRA is not enabled"
            )
        try:
            active = self._loras.activate(names)
        except (LoRAError, UnknownLoRAError) as error:
            raise InvalidBatchError(str(error)) from None
        if self._loras.native is not None:
            owner = step_owner(
                plan.num_tokens, names, plan.lora_runs, plan.lora_mixed, plan.lora_owner
            )
            return LoRARows((), native=self._loras.native_rows(names, owner))
        mixed = None
        if plan.lora_mixed and plan.lora_owner is not None:
            mixed = MixedDecodes(self._loras.stacked(plan.lora_mixed), plan.lora_owner)
        return LoRARows(
            tuple((active[name], start, end) for name, start, end in plan.lora_runs), mixed
        )

    # -- LoRA adapters (on the model thread, between steps) ----------------------------

    @property
    def lora_enabled(self) -> bool:
        return self._loras is not None

    def add_lora(self, request: LoRARequest) -> None:
        """Read, check and keep the adapter (`LoRAError` naming what is wrong)."""
        self._lora_store().add(request)

    def remove_lora(self, name: str) -> None:
        self._lora_store().remove(name)

    def pin_lora(self, name: str) -> None:
        self._lora_store().pin(name)

    @property
    def pinned_loras(self) -> frozenset[str]:
        return self._loras.pinned if self._loras is not None else frozenset()

    @remote_callable
    def list_loras(self) -> list[str]:
        return self._lora_store().names() if self._loras is not None else []

    @remote_callable
    def resident_loras(self) -> dict[str, Any]:
        """The adapters on the device (least recently used first), the pinned ones, and
        how many times an adapter was swapped in."""
        store = self._lora_store()
        return {"resident": store.resident, "pinned": sorted(store.pinned), "swaps": store.swaps}

    def _lora_store(self) -> LoRAStore:
        self._check_open()
        if self._loras is None:
            raise LoRAError("LoRA is not enabled: start the engine with enable_lora=True")
        return self._loras

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 logits `[len, vocab]` at every position of one sequence, prefilled
        alone in one pass (teacher forcing, for quality measurements). It writes the
        sequence's KV into the first blocks of the cache: call it only on an executor
        that no engine is running."""
        tokens = list(token_ids)
        if not tokens:
            raise ValueError("score needs at least one token")
        model, cache = self._ready()
        chunk = SequenceChunk(
            request_id="wavecore-score",
            token_ids=tuple(tokens),
            start_pos=0,
            block_table=tuple(range(-(-len(tokens) // self._block_size))),
            sample=True,
            sampling=SamplingParams(),
            all_token_ids=tuple(tokens),
            prompt_len=len(tokens),
        )
        geometry = CacheGeometry(
            block_size=self._block_size,
            num_blocks=self._num_blocks,
            max_model_len=self._max_model_len,
            vocab_size=self.config.vocab_size,
        )
        with torch.inference_mode():
            plan = plan_forward((chunk,), geometry, self._device)
            every_row = torch.arange(len(tokens), device=self._device)
            return model.forward(dataclasses.replace(plan, sample_rows=every_row), cache)

    def execute_dummy(self) -> None:
        model, cache = self._ready()
        with torch.inference_mode():
            model.forward(self._scratch_plan(decode=False), cache)

    def _scratch_plan(self, *, decode: bool) -> ForwardPlan:
        """One token in the scratch block, which only the executor's own passes may name
        (the dummy pass; with `decode`, the sampled decode at position 1 of the compile
        at load)."""
        _, cache = self._ready()
        geometry = CacheGeometry(
            block_size=self._block_size,
            num_blocks=self._num_blocks + 1,  # admits the scratch block
            max_model_len=self._block_size,
            vocab_size=self.config.vocab_size,
        )
        start = 1 if decode else 0
        chunk = SequenceChunk(
            request_id="wavecore-scratch",
            token_ids=(0,),
            start_pos=start,
            block_table=(cache.scratch_block,),
            sample=decode,
            sampling=SamplingParams(),
            all_token_ids=(0,) * (start + 1),
            prompt_len=1,
        )
        return plan_forward((chunk,), geometry, self._device)

    # -- memory -----------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self._check_open()
        self._cache = None
        if self._model is not None:
            if level == 1 and self._device.type != "cpu":
                self._offloaded = self._model.weights.to(torch.device("cpu"))
            elif level == 1:
                self._offloaded = self._model.weights  # already in CPU memory
            self._model = None
        if level == 2:
            self._offloaded = None
        if self._draft is not None:
            self._draft.sleep(level)
        if self._loras is not None:
            self._loras.evict_all()  # the host copies stay: swapped in again when used
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: frozenset[str]) -> None:
        self._check_open()
        unknown = set(tags) - EXECUTOR_TAGS
        if unknown:
            raise ValueError(
                f"unknown wake_up tags {sorted(unknown)}; known: {sorted(EXECUTOR_TAGS)}"
            )
        if "weights" in tags and self._model is None:
            if self._offloaded is not None:
                weights = self._offloaded.to(self._device)
            else:
                # The plan is known by now: nothing is judged again.
                weights = self._load_weights(self._device, self._kv_dtype)
            self._offloaded = None
            self._model = LlamaModel(self.config, weights, self._rotary)
        if "kv_cache" in tags and self._cache is None:
            self._cache = self._new_cache()
        if self._draft is not None:
            self._draft.wake_up(tags)

    def memory(self) -> ExecutorMemory:
        """This executor's bytes, a draft model's included."""
        memory = ExecutorMemory(
            weights=self._model.weights.num_bytes if self._model is not None else 0,
            offloaded_weights=self._offloaded.num_bytes if self._offloaded is not None else 0,
            kv_cache=self._cache.num_bytes if self._cache is not None else 0,
        )
        if self._draft is None:
            return memory
        draft = self._draft.memory()
        return ExecutorMemory(
            weights=memory.weights + draft.weights,
            offloaded_weights=memory.offloaded_weights + draft.offloaded_weights,
            kv_cache=memory.kv_cache + draft.kv_cache,
        )

    def reset_kv_cache(self) -> None:
        self._check_open()
        if self._cache is not None:
            self._cache.clear()
        if self._draft is not None:
            self._draft.reset_kv_cache()

    # -- weight updates (`executors.weight_specs.UpdatableExecutor`) ---------------------

    @remote_callable
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The canonical tensors an update may name, with their shapes."""
        return weight_shapes(self.config)

    def stage_weights(
        self, tensors: Mapping[str, torch.Tensor], *, partial: bool, origin: str
    ) -> ModelWeights:
        """Check `tensors` and build the weights they make, beside the current ones."""
        self._check_open()
        if self._model is None:
            raise WeightUpdateRefusedError(
                "the weights are asleep: call wake_up(['weights']) before update_weights"
            )
        check_update(tensors, self.weight_shapes(), partial=partial, origin=origin)
        with torch.inference_mode():
            return stage_weights(
                self._model.weights,
                self.config,
                tensors,
                device=self._device,
                dtype=self._dtype,
            )

    def save_weights(
        self, directory: str, *, max_shard_size: int, weight_version: str | None
    ) -> None:
        """Write the served weights as a Hugging Face directory (`weight_export`)."""
        from pathlib import Path

        from wavecore.engine.model.weight_export import served_tensors, write_model_directory

        self._check_open()
        if self._model is None:
            raise WeightUpdateRefusedError(
                "the weights are asleep: call wake_up(['weights']) before save_weights"
            )
        weights = self._model.weights
        if weights.rope_freqs is not None:
            raise WeightUpdateError(
                f"save_weights: {self._source.path} scales rope by a rope_freqs tensor, "
                "which a Hugging Face directory cannot hold"
            )
        with torch.inference_mode():
            tensors = served_tensors(weights, self.config, device=self._device, dtype=self._dtype)
        write_model_directory(
            Path(directory),
            tensors,
            self._source,
            max_shard_size=max_shard_size,
            weight_version=weight_version,
        )

    def commit_weights(self, staged: object) -> None:
        if not isinstance(staged, ModelWeights):
            raise TypeError(f"commit_weights takes what stage_weights built, got {staged!r}")
        self._model = LlamaModel(self.config, staged, self._rotary)

    def close(self) -> None:
        if self._draft is not None:
            self._draft.close()
        self._model = None
        self._offloaded = None
        self._cache = None
        self._closed = True

    # -- internals --------------------------------------------------------------------

    def _load_weights(self, device: torch.device, judged_kv: torch.dtype) -> ModelWeights:
        """The weights in the forms their plan runs; "auto" judges its rounding kernels
        beside a KV cache of `judged_kv`, the dtype the cache takes if they are chosen."""
        if self._weights == "auto":
            return self._load_auto_weights(judged_kv)
        weights = ModelWeights.build(
            self.config,
            self._source.load_tensors(),
            origin=self._source.path,
            device=device,
            dtype=self._dtype,
            # int8 weights are quantized from the default float layout.
            kernels=self.kernels.plan if self._weights == "float32" else None,
        )
        if self._weights == "int8":
            from wavecore.engine.model.int8_weights import quantize_weights

            weights = quantize_weights(weights, self.config, self._encoder())
        return weights

    def _load_auto_weights(self, judged_kv: torch.dtype) -> ModelWeights:
        from wavecore.engine.model.auto_weights import AutoWeights
        from wavecore.engine.model.linear import BLAS
        from wavecore.engine.model.quality import byte_ids

        reference = ModelWeights.build(
            self.config,
            self._source.load_tensors(),
            origin=self._source.path,
            device=self._device,
            dtype=self._dtype,
            kernels=BLAS,
        )
        encoder = self._encoder()
        vocab = self.config.vocab_size
        auto = AutoWeights(
            reference,
            self.config,
            encoder or (lambda text: byte_ids(text, vocab)),
            encoder,
            kv_cache_dtype=judged_kv,
        )
        if self._kernel_choice is None:
            self._kernel_choice = choose_kernels(
                self.config,
                device=self._device,
                dtype=self._dtype,
                weights="auto",
                quality=auto.quality,
                model_key=_model_key(self._source.path),
                kv_cache_dtype=judged_kv,
            )
        with torch.inference_mode():
            return auto.build(self._kernel_choice.plan)

    def _encoder(self) -> Callable[[str], list[int]] | None:
        """The model's tokenizer's encode, or None for a model without a usable one
        (int8 calibration and quality checks then run on the text's bytes)."""
        from wavecore.engine.sampling.errors import TokenizerLoadError
        from wavecore.engine.sampling.tokenizer import Tokenizer

        try:
            return Tokenizer.from_source(self._source).encode
        except TokenizerLoadError:
            return None

    def _new_cache(self) -> PagedKVCache:
        return PagedKVCache(
            self.config,
            num_blocks=self._num_blocks,
            block_size=self._block_size,
            device=self._device,
            dtype=self._kv_dtype,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise ExecutorClosedError("the model executor is closed")

    def _ready(self) -> tuple[LlamaModel, PagedKVCache]:
        self._check_open()
        if self._model is None or self._cache is None:
            missing = [
                n for n, v in (("weights", self._model), ("kv_cache", self._cache)) if v is None
            ]
            raise ExecutorAsleepError(
                f"the model executor is asleep ({', '.join(missing)} released); call wake_up first"
            )
        return self._model, self._cache


def _model_key(path: Path) -> str:
    """Names the model in the kernel cache's key for "auto" (its accuracy budget is
    judged on these weights): the file's name and size, or a directory's and its files'."""
    try:
        if path.is_dir():
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        else:
            size = path.stat().st_size
    except OSError:
        size = -1
    return f"{path.name} {size} bytes"


def load_executor(
    model: str | os.PathLike[str] | None = None,
    *,
    device: DeviceSpec = "auto",
    kv_cache_memory: int | float = DEFAULT_KV_CACHE_MEMORY,
    block_size: int = 16,
    max_model_len: int | None = None,
    sampler: TokenSampler | None = None,
    seed: int = 0,
    weights: WeightFormat = "auto",
    dtype: DTypeSpec = "auto",
    kv_cache_dtype: DTypeSpec = "auto",
    enable_lora: bool = False,
    max_loras: int = 4,
    max_lora_rank: int = 64,
    compile_decode: bool = False,
) -> ModelExecutor:
    """Resolve `model` (None: the default SmolLM2 GGUF) and build its executor;
    `weights="int8"` quantizes its projections at load (CPU only); `dtype` is the
    compute dtype ("auto": float32 on the CPU, bfloat16 or float16 on a GPU). Both
    "auto" (the defaults) on the CPU: each shape class runs the fastest of float32,
    bfloat16 (CPUs with AMX or AVX-512 BF16) and int8 within the accuracy budget,
    measured on first load and cached (`kernel_choice.py`), the KV cache then in
    bfloat16 where that plan rounds to it (`kv_cache_dtype`, `kv_cache.py`).
    `compile_decode` runs batch-1 decodes through a compiled graph
    (`compiled_decode.py`), compiled here."""
    return ModelExecutor(
        resolve_model_source(model),
        device=device,
        kv_cache_memory=kv_cache_memory,
        block_size=block_size,
        max_model_len=max_model_len,
        sampler=sampler,
        seed=seed,
        weights=weights,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        enable_lora=enable_lora,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        compile_decode=compile_decode,
    )
