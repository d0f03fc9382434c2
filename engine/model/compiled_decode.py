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
   compiled path (`handles`); every other step runs eager, unchanged. The compiled
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
   processes faster); the executor runs it at load (`ModelExecutor._compile_decode`),
   so no request waits for it. It needs a C++ compiler: without one, loading fails
   and says so.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.fx.experimental._config as fx_config

from wavecore.engine.model.attention import AttentionPlan, DecodeAttention
from wavecore.engine.model.batch_plan import ForwardPlan
from wavecore.engine.model.kv_cache import PagedKVCache
from wavecore.engine.model.llama import LlamaModel

_MIN_TABLE = 2  # rule 2


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
        token_start=0, num_tokens=1, block_tables=table, context_len=context, mask=None
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


class CompiledDecode:
    def __init__(self) -> None:
        self._compiled = torch.compile(_one_decode, dynamic=True)
        # The model and cache last marked static (weakly: a new object may take a freed
        # one's id, and an unmarked one would compile a second, dynamic-weight graph).
        self._marked: tuple[weakref.ref[LlamaModel], weakref.ref[PagedKVCache]] | None = None

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
