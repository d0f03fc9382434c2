"""A tiny random Llama written as a Hugging Face directory with a byte vocabulary (byte
b is token b, EOS 256: the `ByteTokenizer`'s ids), so an engine runs it by path with
its own tokenizer: shared by the tests of LoRA and of draft models."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from wavecore.engine.sampling.byte_tokenizer import EOS_TOKEN_ID

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
VOCAB = EOS_TOKEN_ID + 1
HEAD_DIM = HIDDEN // HEADS
SHAPES = {  # PEFT's target -> (in, out) of the base projection
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "v_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (HIDDEN, INTER),
    "up_proj": (HIDDEN, INTER),
    "down_proj": (INTER, HIDDEN),
}


def write_tiny_model(
    directory: Path, seed: int = 0, *, vocab: int = VOCAB, context: int = 512
) -> Path:
    """The model of `seed`; `vocab` and `context` change its vocabulary size (its
    tokenizer stays the byte one) and context length."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    state = {
        "model.embed_tokens.weight": rand(vocab, HIDDEN, scale=1.0),
        "model.norm.weight": 1 + rand(HIDDEN, scale=0.1),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = 1 + rand(HIDDEN, scale=0.1)
        state[p + "post_attention_layernorm.weight"] = 1 + rand(HIDDEN, scale=0.1)
        for target, (fan_in, fan_out) in SHAPES.items():
            block = "self_attn" if target[0] in "qkvo" else "mlp"
            state[f"{p}{block}.{target}.weight"] = rand(fan_out, fan_in, scale=0.3)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    save_file(state, str(directory / "model.safetensors"))
    write_byte_tokenizer(directory)
    return directory


def write_byte_tokenizer(directory: Path) -> None:
    """A `tokenizer.json` whose ids are the `ByteTokenizer`'s (byte b is token b, EOS
    256), for the front end of a DP engine, which reads the model's own tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|eos|>", special=True)])
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))
