"""`CompiledDecode`: the forward pass of a step that is one sequence's decode, compiled
by torch.compile (inductor), for `EngineConfig(compile_decode=True)`.

Why: a batch-1 step reads every weight once, and on a CPU the products do that at close
to the memory's rate; the rest of the step is some 1,500 small ops (norms, rotary, KV
writes, the attention's gather, the activation, dtype conversions), each dispatched
from Python with its code and data evicted from the caches by the weights streamed
between them. Inductor fuses them into a few C++ loops around the same product
kernels. Measured on the 2 vCPU Xeon of the README's figures (default path, woq
products, alternating rounds in one process): 12.4-12.6 against 15.5-15.6 ms a token.

Theory of operation:
1. Only a step of exactly one decode (one sequence, one token, no LoRA) takes the
   compiled path (`handles`); every other step runs eager, unchanged. Int8 (fbgemm)
   products are never compiled (`INT8_NOT_COMPILED`): asked for, they are refused; chosen
   by an "auto" plan for batch 1, that step stays eager. The compiled
   graph is `LlamaModel.forward` itself, traced for that shape, so the two paths cannot
   drift apart; they differ in rounding only (inductor reorders the fused ops).
2. One graph serves every context length: shapes are dynamic, and the block table is
   padded with the scratch block to at least two entries, so that a one-block table
   (a size inductor would specialize) never reaches it. Sizes are not matched to each
   other by value ("duck" sizing off), so a table as long as some weight's dimension
   compiles nothing new. Python floats (the norms' epsilon, attention's scale: the
   model's constants) are compiled in, not traced as inputs, which spared a second
   trace of the whole model (SmolLM2's compile at load 22 -> 14 s).
3. The model (weights, rotary tables) and the KV cache are arguments, each tensor
   marked static: their shapes are compiled in (the product kernels need them fixed),
   and weights or a cache of the same shapes (after a weight update or a wake-up) are
   read in place of the old ones without a new compile.
4. The first compile takes tens of seconds on 2 cores (inductor's cache makes later
   processes faster); the executor runs it at load (`compile_now`), so no request
   waits for it. It needs a C++ compiler: without one, loading fails
   and says so.
5. The model and the cache are checked once per object, not at every step. Dynamo
   would check some 1,300 guards on them before each call (every tensor's shape,
   dtype and strides, every object's type, every constant), about 0.9 ms of a 10 ms
   step on the EPYC of the README; inductor would then assert each input's size and
   stride again. Both are left out for them: when the executor hands over a model or
   a cache it has not seen (after a weight update or a wake-up), `_layout` walks them
   once, and a layout other than the graph's (a projection that became 8-bit, a pool
   of another size) gets a graph of its own, compiled for it, never the old one. The
   per-step inputs (tokens, positions, slots, block table, context) keep their guards.
   This holds because the executor never changes a model or a cache in place (beyond
   the pools' contents): an update or a wake-up builds new objects. An object with
   nothing to look into matches only itself (a new one compiles anew). Measured on that
   EPYC in alternating rounds: 1.08x the step without the guards, 1.06x more without
   the asserts.
6. The graph's wrapper, the code that calls its ~10 kernels a layer (fused loops, the
   products, attention), is C++ (inductor's `cpp_wrapper`), not Python: a step's 300-odd
   calls then cost no Python dispatch each. 1.06x again on that EPYC (8.89 -> 8.30 ms
   a step, the same tokens); a cold compile of the tests' tiny model took as long.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch._dynamo.types import GuardFilterEntry
from torch._guards import ChainedSource

from wavecore.engine.model.attention import AttentionPlan, DecodeAttention
from wavecore.engine.model.batch_plan import ForwardPlan
from wavecore.engine.model.errors import CompileDecodeError
from wavecore.engine.model.kv_cache import PagedKVCache
from wavecore.engine.model.llama import LlamaModel

_MIN_TABLE = 2  # rule 2
INT8_NOT_COMPILED = (
    "compile_decode cannot go with weights='int8': fbgemm's int8 products cannot be "
    "traced, so the graph would break at every one of them and run slower than eager "
    "(about 0.8x); use weights='auto' or 'float32', or leave compile_decode off"
)
_CHECKED_PER_OBJECT = ("model", "cache")  # rule 5: `_one_decode`'s arguments


def _one_decode(
    model: LlamaModel,
    cache: PagedKVCache,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    table: torch.Tensor,
    context: int,
) -> torch.Tensor:
    attention = DecodeAttention(
        token_start=0,
        num_tokens=1,
        block_tables=table,
        context_len=context,
        context_lens=positions + 1,
        mask=None,
    )
    plan = ForwardPlan(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slots,
        sample_rows=torch.zeros(1, dtype=torch.int64, device=token_ids.device),
        attention=AttentionPlan(decodes=(attention,), prefills=()),
    )
    return model.forward(plan, cache)


def _mark_static(value: Any, seen: set[int]) -> None:
    """Mark every tensor reachable through dataclasses, lists and tuples static."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        torch._dynamo.mark_static(value)
    elif isinstance(value, list | tuple):
        for item in value:
            _mark_static(item, seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _mark_static(getattr(value, field.name), seen)


def _layout(value: Any, tensors: dict[int, int]) -> Hashable:
    """Everything about `value` a graph traced with it depends on (rule 5): the types
    of the objects reached through fields, lists and tuples, the values of their
    scalars, and of each tensor its dtype, device, shape, strides and which earlier
    tensor it is (`tensors`: id to first-seen index), but not its contents."""
    if isinstance(value, torch.Tensor):
        alias = tensors.setdefault(id(value), len(tensors))
        return (
            torch.Tensor,
            value.dtype,
            value.device,
            tuple(value.shape),
            value.stride(),
            value.storage_offset(),
            value.requires_grad,
            alias,
        )
    if value is None or isinstance(value, str | int | torch.dtype | torch.device | enum.Enum):
        return (type(value), value)
    if isinstance(value, float):
        return (float, value.hex())  # compiled in (rule 2); hex: NaN equals itself
    if isinstance(value, list | tuple):
        return (type(value), tuple(_layout(item, tensors) for item in value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif hasattr(value, "__dict__"):
        fields = sorted(vars(value).items())
    else:
        return (type(value), id(value))  # nothing to look into: only itself matches
    return (type(value), tuple((name, _layout(item, tensors)) for name, item in fields))


def _keep_guard(entry: GuardFilterEntry) -> bool:
    """Dynamo's guards on the model and the cache go (rule 5); the others stay."""
    source = entry.orig_guard.originating_source
    while isinstance(source, ChainedSource):
        source = source.base
    return getattr(source, "local_name", None) not in _CHECKED_PER_OBJECT


def _keep_guards(entries: Sequence[GuardFilterEntry]) -> list[bool]:
    return [_keep_guard(entry) for entry in entries]


def _compile() -> Callable[..., torch.Tensor]:
    """A new compiled `_one_decode`. Dynamo keeps its graphs on the code object, and
    without guards on the model it would hand any model the graph it has: a graph for
    another layout needs a code object of its own."""
    code = _one_decode.__code__.replace()
    function = types.FunctionType(code, _one_decode.__globals__, _one_decode.__name__)
    options = {
        "guard_filter_fn": _keep_guards,
        "size_asserts": False,
        "alignment_asserts": False,
        "cpp_wrapper": True,  # rule 6
    }
    return torch.compile(function, dynamic=True, options=options)


class CompiledDecode:
    def __init__(self) -> None:
        self._compiled = _compile()
        self._layout: Hashable | None = None  # what `_compiled` serves; None: nothing yet
        # The model and cache last checked (weakly: a new object may take a freed one's
        # id, and would then be served without being looked at).
        self._marked: tuple[weakref.ref[LlamaModel], weakref.ref[PagedKVCache]] | None = None

    def compile_now(self, model: LlamaModel, plan: ForwardPlan, cache: PagedKVCache) -> None:
        """Compile the graph on `plan` (rule 4), which must be built as the steps' plans
        are (under inference mode: the guards see it); a machine that cannot compile
        fails here, saying why."""
        try:
            self(model, plan, cache)
        except Exception as error:
            raise CompileDecodeError(
                f"compile_decode: torch.compile could not compile the decode step "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                f"its CPU backend needs a working C++ compiler (g++ or clang++); load without "
                f"compile_decode"
            ) from error

    @staticmethod
    def handles(plan: ForwardPlan) -> bool:
        """Whether `plan` is one decode that samples, with no LoRA and no mask (rule 1)."""
        attention = plan.attention
        return (
            plan.num_tokens == 1
            and plan.sample_rows.shape[0] == 1
            and len(attention.decodes) == 1
            and not attention.prefills
            and attention.decodes[0].mask is None
            and not plan.lora_runs
            and not plan.lora_mixed
        )

    def __call__(self, model: LlamaModel, plan: ForwardPlan, cache: PagedKVCache) -> torch.Tensor:
        """`model.forward(plan, cache)` through the compiled graph; `handles(plan)` must hold."""
        marked = self._marked
        if marked is None or marked[0]() is not model or marked[1]() is not cache:
            # One root for the whole walk: `seen` holds ids, and a temporary root freed
            # between two walks could lend its id to the next one's, which would then be
            # skipped (the cache's pools were, once: left dynamic, every view of them
            # cost the trace seconds of symbolic shape work).
            roots = [
                model.weights,
                model.rotary.cos,
                model.rotary.signed_sin,
                cache.keys,
                cache.values,
            ]
            _mark_static(roots, set())
            layout = _layout((model, cache), {})
            if self._layout is not None and layout != self._layout:
                self._compiled = _compile()
            self._layout = layout
            self._marked = (weakref.ref(model), weakref.ref(cache))
        decode = plan.attention.decodes[0]
        table = decode.block_tables
        if table.shape[1] < _MIN_TABLE:
            scratch = torch.full(
                (1, _MIN_TABLE - table.shape[1]),
                cache.scratch_block,
                dtype=table.dtype,
                device=table.device,
            )
            table = torch.cat([table, scratch], dim=1)
        with (
            fx_config.patch(use_duck_shape=False),
            torch._dynamo.config.patch(specialize_float=True),
        ):
            return self._compiled(
                model,
                cache,
                plan.token_ids,
                plan.positions,
                plan.slot_mapping,
                table,
                decode.context_len,
            )
