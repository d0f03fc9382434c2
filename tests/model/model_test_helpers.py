"""Helpers of the model tests: a greedy stand-in sampler and tiny random models.

Tiny Llama/Qwen2 models are written as GGUF files and Hugging Face directories with
the same weights, so each loader can be checked against the other and against
transformers. The GGUF writer applies the q/k row permutation exactly as
llama.cpp's converter describes it, independently of the runtime's inverse.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from wavecore.engine.executors.batch import Executor, ModelBatch, SampledToken, SequenceChunk
from wavecore.engine.model import load_executor
from wavecore.engine.model.config import ModelConfig
from wavecore.engine.sampling_params import SamplingParams

# A model config small enough to build weights for in a test (kernel choice, auto path).
KERNEL_TEST_CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    context_length=512,
    tie_word_embeddings=True,
    qkv_bias=False,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class TinySpec:
    architecture: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    context_length: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def bias(self) -> bool:
        return self.architecture == "qwen2"


def random_state_dict(spec: TinySpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face names and layouts. Scales chosen so logits are far from uniform."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    state = {
        "model.embed_tokens.weight": rand(spec.vocab_size, h, scale=1.0),
        "model.norm.weight": 1 + rand(h, scale=0.1),
    }
    if not spec.tie_word_embeddings:
        state["lm_head.weight"] = rand(spec.vocab_size, h, scale=0.3)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = 1 + rand(h, scale=0.1)
        state[p + "post_attention_layernorm.weight"] = 1 + rand(h, scale=0.1)
        state[p + "self_attn.q_proj.weight"] = rand(h, h, scale=0.3)
        state[p + "self_attn.k_proj.weight"] = rand(kv, h, scale=0.3)
        state[p + "self_attn.v_proj.weight"] = rand(kv, h, scale=0.3)
        state[p + "self_attn.o_proj.weight"] = rand(h, h, scale=0.1)
        state[p + "mlp.gate_proj.weight"] = rand(spec.intermediate_size, h, scale=0.2)
        state[p + "mlp.up_proj.weight"] = rand(spec.intermediate_size, h, scale=0.2)
        state[p + "mlp.down_proj.weight"] = rand(h, spec.intermediate_size, scale=0.1)
        if spec.bias:
            state[p + "self_attn.q_proj.bias"] = rand(h, scale=0.2)
            state[p + "self_attn.k_proj.bias"] = rand(kv, scale=0.2)
            state[p + "self_attn.v_proj.bias"] = rand(kv, scale=0.2)
    return state


def write_hf_directory(directory: Path, spec: TinySpec, state: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [
            "LlamaForCausalLM" if spec.architecture == "llama" else "Qwen2ForCausalLM"
        ],
        "model_type": spec.architecture,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.context_length,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    return directory


def converter_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's convert script: rows of each head go from halves to interleaved pairs.
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    index, _, rest = hf_name.removeprefix("model.layers.").partition(".")
    return f"blk.{index}.{_GGUF_LAYER_NAMES[rest]}"


def write_gguf(
    path: Path,
    spec: TinySpec,
    state: dict[str, torch.Tensor],
    *,
    quant: gguf.GGMLQuantizationType | None = None,
    architecture: str | None = None,
    skip: frozenset[str] = frozenset(),
    raw_blocks: Mapping[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
) -> Path:
    """Write `state` as GGUF; 2-D weights other than the embedding in `quant` if given.

    `raw_blocks` maps GGUF tensor names to already-quantized bytes `[rows, row_bytes]`
    written as they are, in the file's layout, instead of `state`'s tensor: for types
    `gguf.quants` can read but not write.
    """
    raw_blocks = raw_blocks or {}
    arch = architecture or spec.architecture
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(spec.num_layers)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    for hf, tensor in state.items():
        name = gguf_name(hf)
        if name in skip:
            continue
        if name in raw_blocks:
            blocks, kind = raw_blocks[name]
            writer.add_tensor(name, blocks, raw_dtype=kind)
            continue
        array = tensor.numpy().astype(np.float32)
        if spec.architecture == "llama" and name.endswith("attn_q.weight"):
            array = converter_permute(array, spec.num_heads)
        elif spec.architecture == "llama" and name.endswith("attn_k.weight"):
            array = converter_permute(array, spec.num_kv_heads)
        if quant is not None and array.ndim == 2 and name != "token_embd.weight":
            writer.add_tensor(name, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class ArgmaxSampler:
    """Greedy sampling alone, so executor tests do not depend on the sampler's features."""

    def sample(
        self, logits: torch.Tensor, chunks: Sequence[SequenceChunk]
    ) -> tuple[SampledToken, ...]:
        tokens = logits.argmax(dim=1).tolist()
        return tuple(
            SampledToken(request_id=c.request_id, token_id=t)
            for c, t in zip(chunks, tokens, strict=True)
        )


@dataclass(slots=True, kw_only=True)
class GreedyRequest:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    block_table: list[int]
    computed: int = 0
    output: list[int] = field(default_factory=list)
    lora: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class GreedyRunner:
    """A minimal scheduler for tests: block allocation, chunked prefill, greedy decoding.

    Blocks are handed out in a shuffled order, so block tables are never contiguous.
    """

    def __init__(self, executor: Executor, *, seed: int = 0) -> None:
        self.executor = executor
        self.free = list(range(executor.num_kv_blocks))
        random.Random(seed).shuffle(self.free)
        self.count = 0

    def add(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        share_prefix_of: GreedyRequest | None = None,
        shared_blocks: int = 0,
        lora: str | None = None,
    ) -> GreedyRequest:
        """A request; with `share_prefix_of`, its first `shared_blocks` blocks are that one's."""
        size = self.executor.block_size
        blocks = -(-(len(prompt) + max_new_tokens) // size)
        shared = share_prefix_of.block_table[:shared_blocks] if share_prefix_of else []
        table = shared + [self.free.pop() for _ in range(blocks - len(shared))]
        self.count += 1
        return GreedyRequest(
            request_id=f"req-{self.count}",
            prompt=list(prompt),
            max_new_tokens=max_new_tokens,
            block_table=table,
            computed=len(shared) * size,
            lora=lora,
        )

    def run(self, requests: Sequence[GreedyRequest], *, chunk_size: int | None = None) -> None:
        """Step all `requests` together, one batch per step, until each is done."""
        while active := [r for r in requests if not r.done]:
            chunks = []
            for request in active:
                tokens = request.tokens
                remaining = len(tokens) - request.computed
                take = remaining if chunk_size is None else min(chunk_size, remaining)
                chunks.append(
                    SequenceChunk(
                        request_id=request.request_id,
                        token_ids=tokens[request.computed : request.computed + take],
                        start_pos=request.computed,
                        block_table=request.block_table,
                        sample=request.computed + take == len(tokens),
                        sampling=SamplingParams(temperature=0.0, max_tokens=request.max_new_tokens),
                        all_token_ids=tokens,
                        prompt_len=len(request.prompt),
                        lora=request.lora,
                    )
                )
                request.computed += take
            output = self.executor.execute(ModelBatch(chunks=tuple(chunks)))
            by_id = {r.request_id: r for r in active}
            for sampled in output.sampled:
                by_id[sampled.request_id].output.append(sampled.token_id)


def greedy_alone(executor: Executor, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    runner = GreedyRunner(executor)
    request = runner.add(prompt, max_new_tokens)
    runner.run([request])
    return request.output


def prefill_logits(model_path: Path, prompt: list[int]) -> torch.Tensor:
    """Last-position logits of one prefill of `prompt`, on the CPU."""
    executor = load_executor(
        str(model_path), device="cpu", kv_cache_memory=2**20, sampler=ArgmaxSampler()
    )
    chunk = SequenceChunk(
        request_id="r",
        token_ids=prompt,
        start_pos=0,
        block_table=list(range(-(-len(prompt) // executor.block_size))),
        sample=True,
        sampling=SamplingParams(temperature=0),
        all_token_ids=prompt,
        prompt_len=len(prompt),
    )
    logits = executor.compute_logits(ModelBatch(chunks=(chunk,)))
    executor.close()
    return logits[0]


def attention_chunks(
    shapes: Sequence[tuple[int, int]], free_blocks: list[int], block_size: int
) -> list[SequenceChunk]:
    """One chunk per `(start_pos, num_tokens)` in `shapes` (a decode when one token),
    each in blocks popped from `free_blocks`: an attention test's pass."""
    chunks = []
    for index, (start, count) in enumerate(shapes):
        table = [free_blocks.pop() for _ in range(-(-(start + count) // block_size))]
        chunks.append(
            SequenceChunk(
                request_id=f"r{index}",
                token_ids=[0] * count,
                start_pos=start,
                block_table=table,
                sample=True,
                sampling=SamplingParams(),
                all_token_ids=[0] * (start + count),
                prompt_len=start + count,
            )
        )
    return chunks
