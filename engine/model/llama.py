"""The Llama-family forward pass over a flattened, mixed batch.

All tokens of a pass (decodes and prefill chunks of many sequences) run through each
layer together as one `[tokens, hidden]` matrix; only attention looks at sequence
boundaries, through the `ForwardPlan`. The final norm and the LM head run only for the
rows that sample, which for a long prefill is one row instead of thousands.

Arithmetic follows Hugging Face's Llama in order and precision (norms in float32,
rotary in the half-split layout) so float32 logits agree to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wavecore.engine.lora.compute import LoRARows, add_lora
from wavecore.engine.model import native_norm
from wavecore.engine.model.attention import paged_attention
from wavecore.engine.model.batch_plan import ForwardPlan
from wavecore.engine.model.config import ModelConfig
from wavecore.engine.model.kv_cache import PagedKVCache
from wavecore.engine.model.rope import RotaryTable
from wavecore.engine.model.weights import ModelWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if native_norm.usable(x, weight):
        return torch.ops.wavecore.rms_norm(x, weight, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    # Reduced precision: normalize in float32, scale in the model's dtype, as HF does.
    normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: ModelWeights, rotary: RotaryTable) -> None:
        self.config = config
        self.weights = weights
        self.rotary = rotary
        self.scale = config.head_dim**-0.5

    def forward(
        self, plan: ForwardPlan, cache: PagedKVCache, lora: LoRARows | None = None
    ) -> torch.Tensor:
        """Run every token of `plan`, fill the cache, return float32 logits of sampling rows.
        `lora` adds each adapter's deltas to its rows' products (`lora.compute`)."""
        config, weights = self.config, self.weights
        tokens = plan.num_tokens
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = config.q_size, config.kv_size
        inter = config.intermediate_size
        eps = config.rms_norm_eps

        hidden = weights.embed.index_select(0, plan.token_ids)
        cos, sin = self.rotary.lookup(plan.positions)
        for index, layer in enumerate(weights.layers):
            x = rms_norm(hidden, layer.attn_norm, eps)
            qkv = layer.qkv(x)
            if lora is not None:
                add_lora(qkv, x, lora, index, "qkv")
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            # q and k heads rotate together: one rotary call per layer.
            qk = self.rotary.apply(
                qkv[:, : q_size + kv_size].view(tokens, heads + kv_heads, head_dim), cos, sin
            )
            queries, keys = qk[:, :heads], qk[:, heads:]
            values = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
            cache.write(index, plan.slot_mapping, keys, values)
            attended = paged_attention(
                queries, cache.keys[index], cache.values[index], plan.attention, self.scale
            )
            # Residual adds fused into the product: one op instead of two.
            attended = attended.view(tokens, q_size)
            hidden = layer.o.add_to(hidden, attended)
            if lora is not None:
                add_lora(hidden, attended, lora, index, "o")

            x = rms_norm(hidden, layer.ffn_norm, eps)
            gate_up = layer.gate_up(x)
            if lora is not None:
                add_lora(gate_up, x, lora, index, "gate_up")
            gate = gate_up[:, :inter]
            F.silu(gate, inplace=True)
            gate *= gate_up[:, inter:]
            hidden = layer.down.add_to(hidden, gate)
            if lora is not None:
                add_lora(hidden, gate, lora, index, "down")

        last = rms_norm(hidden.index_select(0, plan.sample_rows), weights.final_norm, eps)
        return weights.lm_head(last).to(torch.float32)
