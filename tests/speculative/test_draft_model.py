"""Speculative decoding with a draft model (`engine/model/draft_model.py`) on tiny random
Llamas of a byte vocabulary: greedy outputs are plain decoding's with the target as
its own draft (every draft accepted) and with a degraded copy (some rejected), through
preemption, the prefix cache and a sleep; and a draft that cannot draft for the target
is refused at load, named."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_byte_model import write_tiny_model

from wavecore.engine.cli.main import main
from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.model.draft_model import DraftModelError
from wavecore.engine.request import EngineRequest
from wavecore.engine.sampling.byte_tokenizer import EOS_TOKEN_ID
from wavecore.engine.sampling_params import SamplingParams

BASE = EngineConfig(
    device="cpu",
    dtype="float32",
    weights="float32",
    kv_cache_memory=2**20,
    block_size=4,
    max_model_len=256,
)
PROMPTS = [bytes([65 + i]) * (3 + 2 * i) + b"xyz" for i in range(6)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("draft-models")
    target = write_tiny_model(root / "target")
    # The target with noise on every weight: it agrees with the target most of the time.
    degraded = root / "degraded"
    shutil.copytree(target, degraded)
    generator = torch.Generator().manual_seed(7)
    state = load_file(degraded / "model.safetensors")
    state = {
        name: tensor + 0.15 * tensor.std() * torch.randn(tensor.shape, generator=generator)
        for name, tensor in state.items()
    }
    save_file(state, str(degraded / "model.safetensors"))
    return {
        "target": str(target),
        "degraded": str(degraded),
        "other-vocabulary": str(write_tiny_model(root / "wide", vocab=300)),
        "short-context": str(write_tiny_model(root / "short", context=64)),
    }


def engine(models: dict[str, str], draft: str | None, **config: object) -> EngineCore:
    spec = (
        {"speculative_method": "draft_model", "draft_model": models[draft]}
        if draft is not None
        else {}
    )
    settings = {"model": models["target"], **spec, "num_speculative_tokens": 4, **config}
    return EngineCore.from_config(dataclasses.replace(BASE, **settings))


def run(core: EngineCore, prompts: list[bytes]) -> list[list[int]]:
    """Greedy outputs of 40, 36, ... tokens: the running requests thin out."""
    for number, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=40 - 4 * number, ignore_eos=True)
        core.add_request(
            EngineRequest(request_id=str(number), prompt_token_ids=tuple(prompt), params=params)
        )
    outputs: dict[str, list[int]] = {}
    while core.has_unfinished():
        for update in core.step():
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    return [outputs[str(number)] for number in range(len(prompts))]


@pytest.fixture(scope="module")
def plain(models: dict[str, str]) -> Iterator[list[list[int]]]:
    core = engine(models, None)
    yield run(core, PROMPTS)
    core.close()


@pytest.mark.parametrize(
    "config",
    # 40 blocks of 4 tokens (2,048 bytes each) where the six requests grow to 84.
    [
        {},
        {"kv_cache_memory": 40 * 2048},
        {"async_scheduling": True},
        # Prompts in chunks that sample nothing: the draft follows those too.
        {"max_num_batched_tokens": 8, "speculative_token_budget": 8},
        # No drafts while more than 3 requests run: the draft sits those steps out,
        # then catches up on the requests left.
        {"speculative_token_budget": 4},
        {"speculative_token_budget": 4, "async_scheduling": True},
    ],
    ids=["roomy", "preempting", "batch-queue", "chunked-prefill", "catch-up", "catch-up-queue"],
)
def test_the_target_as_its_own_draft_is_always_right(
    models: dict[str, str], plain: list[list[int]], config: dict
) -> None:
    core = engine(models, "target", **config)
    assert run(core, PROMPTS) == plain
    counts = core.scheduler.spec_counts
    assert counts.num_drafts > 0
    assert counts.num_accepted_tokens == counts.num_draft_tokens
    core.close()


def test_the_draft_sits_out_steps_where_no_request_may_draft(
    models: dict[str, str], plain: list[list[int]]
) -> None:
    """With room for drafts while at most 3 requests run (the step's running requests
    before it admits any), the draft model runs in no step that starts with more (at
    large batches it costs nothing), and catches up after."""
    core = engine(models, "target", speculative_token_budget=4)
    scheduler, draft = core.scheduler, core.executor.draft.executor
    running_before: list[int] = []
    running_at_draft: list[int] = []
    schedule, compute_logits = scheduler.schedule, draft.compute_logits

    def noted_schedule(*args: object) -> object:
        running_before.append(scheduler.num_running)
        return schedule(*args)

    def counted(batch: object) -> object:
        running_at_draft.append(running_before[-1])
        return compute_logits(batch)

    scheduler.schedule, draft.compute_logits = noted_schedule, counted
    assert run(core, PROMPTS) == plain
    assert running_at_draft and max(running_at_draft) <= 3 < max(running_before)
    counts = core.scheduler.spec_counts
    assert counts.num_accepted_tokens == counts.num_draft_tokens > 0
    core.close()


def test_a_degraded_draft_is_partly_right_and_changes_no_token(
    models: dict[str, str], plain: list[list[int]]
) -> None:
    core = engine(models, "degraded")
    assert run(core, PROMPTS) == plain
    counts = core.scheduler.spec_counts
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    # The same prompts again: their blocks come from the prefix cache, the draft's KV
    # with them.
    assert run(core, PROMPTS) == plain
    assert core.scheduler.block_manager.prefix_cache_hits > 0
    core.close()


def test_the_draft_sleeps_and_wakes_with_the_target(
    models: dict[str, str], plain: list[list[int]]
) -> None:
    core = engine(models, "target")
    alone = engine(models, None)
    with_draft, without = core.executor.memory(), alone.executor.memory()
    assert with_draft.weights == 2 * without.weights
    assert with_draft.kv_cache == 2 * without.kv_cache
    alone.close()
    core.executor.sleep(2)
    assert core.executor.memory().kv_cache == 0
    core.executor.wake_up(frozenset({"weights", "kv_cache"}))
    core.scheduler.reset_prefix_cache()
    assert run(core, PROMPTS) == plain
    counts = core.scheduler.spec_counts
    assert counts.num_accepted_tokens == counts.num_draft_tokens > 0
    core.close()


@pytest.mark.parametrize(
    ("draft", "message"),
    [
        ("other-vocabulary", "vocabulary of 300 tokens, the target 257"),
        ("short-context", "context of 64 tokens, below the target's max_model_len 256"),
    ],
)
def test_a_draft_that_cannot_draft_for_the_target_is_refused_by_name(
    models: dict[str, str], draft: str, message: str
) -> None:
    with pytest.raises(DraftModelError, match=message):
        engine(models, draft)


def test_a_missing_draft_is_named(models: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(DraftModelError, match="cannot be loaded"):
        engine({**models, "gone": str(tmp_path / "gone")}, "gone")


def test_the_cli_drafts_with_a_draft_model(
    models: dict[str, str], plain: list[list[int]], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`wavecore generate --speculative-method draft_model --draft-model PATH`: the
    plain greedy tokens; a draft of another vocabulary is one line naming it."""
    output = tmp_path / "out.jsonl"
    common = [
        "generate",
        *("--model", models["target"], "--weights", "float32", "--dtype", "float32"),
        *("--device", "cpu", "--kv-cache-memory", str(2**20), "--max-tokens", "40"),
        *("--temperature", "0", "--speculative-method", "draft_model"),
    ]
    argv = [*common, "--draft-model", models["degraded"], "--prompt", PROMPTS[0].decode()]
    assert main([*argv, "--output", str(output)]) == 0
    (row,) = [json.loads(line) for line in output.read_text().splitlines()]
    expected = plain[0]
    if EOS_TOKEN_ID in expected:  # the CLI stops at EOS, the reference ran past it
        expected = expected[: expected.index(EOS_TOKEN_ID) + 1]
    assert row["token_ids"] == expected
    argv = [*common, "--draft-model", models["other-vocabulary"], "--prompt", "hi"]
    assert main(argv) != 0
    assert "vocabulary of 300 tokens" in capsys.readouterr().err
