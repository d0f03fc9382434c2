"""SmolLM2-135M (the default model) against transformers loading the same GGUF.

One executor and one transformers model per session (see conftest). Prompts are
tokenized with a byte-level BPE built from the GGUF's own vocabulary and merges; any
valid token ids would do, real text just makes the greedy continuations meaningful.
"""

from __future__ import annotations

import pytest
import torch
from model_test_helpers import GreedyRunner

from wavecore.engine.executors.batch import ModelBatch, SequenceChunk
from wavecore.engine.model import ModelExecutor
from wavecore.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.model

TEXTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):\n    ",
    "List three uses of copper:",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Q: What is 12 times 12?\nA:",
    "Photosynthesis is the process by which plants " * 6,
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his daughter. Every morning they walked together to the river, and " * 4,
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(smollm_executor: ModelExecutor) -> list[list[int]]:
    from tokenizers import Tokenizer, models, pre_tokenizers

    metadata = smollm_executor.source.gguf_metadata
    vocab = {token: index for index, token in enumerate(metadata["tokenizer.ggml.tokens"])}
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    encoded = [tokenizer.encode(text).ids for text in TEXTS]
    assert len({len(ids) for ids in encoded}) == len(TEXTS)
    return encoded


def test_default_model_metadata(smollm_executor: ModelExecutor) -> None:
    source = smollm_executor.source
    config = smollm_executor.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert (
        config.vocab_size == 49152 and config.tie_word_embeddings and config.rope_theta == 100000.0
    )
    assert source.eos_token_id == 2 and source.context_length == 8192
    assert "<|im_start|>" in source.chat_template


@pytest.fixture(scope="module")
def continuations(smollm_executor: ModelExecutor, prompts) -> list[list[int]]:
    """Our greedy continuations of every prompt, decoded together, cut after EOS."""
    runner = GreedyRunner(smollm_executor)
    requests = [runner.add(p, NEW_TOKENS) for p in prompts]
    runner.run(requests)
    eos = smollm_executor.source.eos_token_id
    return [until_eos(request.output, eos) for request in requests]


@pytest.fixture(scope="module")
def reference_logits(hf_reference, prompts, continuations) -> list[torch.Tensor]:
    """transformers' logits from the last prompt position on, teacher-forced on our output.

    One forward per prompt serves both checks: row 0 is the last-position prefill
    logits (causal attention: later tokens do not change it), and the argmax of row
    `i` is transformers' greedy choice after our first `i` generated tokens.
    """
    with torch.inference_mode():
        return [
            hf_reference(torch.tensor([prompt + ours[:-1]], device=hf_reference.device)).logits[
                0, len(prompt) - 1 :
            ]
            for prompt, ours in zip(prompts, continuations, strict=True)
        ]


def test_prefill_logits_match_transformers(smollm_executor, prompts, reference_logits) -> None:
    runner = GreedyRunner(smollm_executor)
    requests = [runner.add(p, 1) for p in prompts]
    batch = ModelBatch(
        chunks=tuple(
            SequenceChunk(
                request_id=r.request_id,
                token_ids=r.prompt,
                start_pos=0,
                block_table=r.block_table,
                sample=True,
                sampling=SamplingParams(temperature=0.0),
                all_token_ids=r.prompt,
                prompt_len=len(r.prompt),
            )
            for r in requests
        )
    )
    ours = smollm_executor.compute_logits(batch)
    assert ours.shape == (len(prompts), smollm_executor.config.vocab_size)
    for row, reference in enumerate(reference_logits):
        difference = (ours[row] - reference[0]).abs().max().item()
        assert difference < 1e-3, (row, difference)


def test_greedy_continuations_match_transformers(continuations, reference_logits) -> None:
    # The continuations are identical exactly when transformers' argmax at every generated
    # position is the token we produced there (by induction on steps).
    identical = 0
    mismatches = []
    for ours, logits in zip(continuations, reference_logits, strict=True):
        reference = logits.argmax(-1).tolist()
        if reference == ours:
            identical += 1
        else:
            mismatches.append((ours, reference))
    assert identical >= 7, mismatches


def until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_greedy_output_is_batch_invariant(smollm_executor, prompts) -> None:
    subject = prompts[7]
    runner = GreedyRunner(smollm_executor, seed=1)
    alone = runner.add(subject, NEW_TOKENS // 2)
    runner.run([alone])

    # 31 companions of mixed lengths (1 to 24 tokens), so the batch mixes prefills and decodes.
    others = [p[: 1 + (5 * i) % min(len(p), 24)] for i, p in enumerate(prompts * 4)][:31]
    runner = GreedyRunner(smollm_executor, seed=2)
    batch = [runner.add(subject, NEW_TOKENS // 2)] + [
        runner.add(p, i % 8 + 1) for i, p in enumerate(others)
    ]
    runner.run(batch)
    assert batch[0].output == alone.output

    for chunk_size in (24, 64):
        runner = GreedyRunner(smollm_executor, seed=chunk_size)
        chunked = runner.add(subject, NEW_TOKENS // 2)
        runner.run([chunked, runner.add(prompts[0], 4)], chunk_size=chunk_size)
        assert chunked.output == alone.output, chunk_size

    runner = GreedyRunner(smollm_executor, seed=4)
    first = runner.add(subject, 1)
    runner.run([first])
    cached = runner.add(
        subject, NEW_TOKENS // 2, share_prefix_of=first, shared_blocks=len(subject) // 16
    )
    assert cached.computed >= 64
    runner.run([cached])
    assert cached.output == alone.output
