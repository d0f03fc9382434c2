"""Speculative decoding's parts: prompt-lookup proposals, the back-off, the settings
(each bad one its own error), and the scheduler with the null executor: the same
tokens as plain decoding whatever is drafted (by prompt lookup, or by the executor as
a draft model would, `num_lookahead_tokens`), with the KV of rejected drafts never
read (`track_kv`) nor cached, serially and with two steps in flight."""

from __future__ import annotations

from typing import Any

import pytest

from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.executors.null_executor import NullExecutor
from wavecore.engine.request import EngineRequest
from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer
from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.scheduler.speculative import Backoff, NgramProposer, SpeculativeConfig
from wavecore.engine.structured_outputs import StructuredOutputs

TOKENIZER = ByteTokenizer()


def proposer(low: int = 2, high: int = 4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(prompt_lookup_min=low, prompt_lookup_max=high))


def test_the_longest_suffix_found_earlier_proposes_what_followed_its_latest_occurrence() -> None:
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert proposer().propose(tokens, 3) == [7, 8, 5]  # "1 2 3" last seen before 7 8 5
    assert proposer().propose(tokens, 1) == [7]
    assert proposer().propose([4, 5, 6, 7], 3) == []  # nothing repeats
    # A 4-gram wins over a 2-gram that occurs later.
    tokens = [5, 6, 7, 8, 1, 0, 7, 8, 2, 5, 6, 7, 8]
    assert proposer().propose(tokens, 2) == [1, 0]
    assert proposer(low=2, high=2).propose(tokens, 2) == [2, 5]


def test_a_repeating_run_drafts_k_tokens_from_an_occurrence_that_k_tokens_follow() -> None:
    """The latest occurrences of a run's suffix lie too near its end to be followed by
    k tokens; the latest that is followed by k is taken, else the earliest."""
    run = [3, 4, 5, 0, 0, 0, 0, 0, 0, 0]
    assert proposer().propose(run, 3) == [0, 0, 0]
    # Occurrences of "9 0 0 0" with three tokens after them: the latest is taken.
    tokens = [9, 0, 0, 0, 1, 2, 3, 9, 0, 0, 0, 4, 5, 6, 9, 0, 0, 0]
    assert proposer().propose(tokens, 3) == [4, 5, 6]
    # No occurrence is followed by five: the earliest gives the most.
    assert proposer(low=2, high=2).propose([1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2]


def test_matches_inside_a_token_are_not_matches() -> None:
    """Token ids are packed as 4 bytes; a byte pattern found across a token boundary
    must not count."""
    tokens = [0x01000000, 0x02, 0x0100, 0x0200, 0x01, 0x02]
    # The suffix [1, 2] appears nowhere earlier at a token boundary.
    assert proposer().propose(tokens, 2) == []


def test_back_off_after_two_empty_verifications_and_reset_on_acceptance() -> None:
    backoff = Backoff()
    backoff.verified(0)
    assert backoff.may_draft()
    backoff.verified(0)
    assert [backoff.may_draft() for _ in range(3)] == [False, False, True]
    backoff.verified(0)
    assert [backoff.may_draft() for _ in range(5)] == [False] * 4 + [True]
    backoff.verified(2)
    backoff.verified(0)
    assert backoff.may_draft()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"speculative_method": "medusa"}, "speculative_method must be one of"),
        ({"speculative_method": "draft_model", "executor": "model"}, "needs draft_model"),
        ({"speculative_method": "ngram", "draft_model": "d.gguf"}, "used only with"),
        ({"draft_model": "d.gguf"}, "used only with"),
        ({"speculative_method": "draft_model", "draft_weights": "int4"}, "draft_weights"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"speculative_method": "ngram", "prompt_lookup_min": 5}, "must not exceed"),
        ({"speculative_method": "ngram", "prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({"speculative_method": "ngram", "speculative_token_budget": 1}, "token_budget"),
    ],
)
def test_each_bad_setting_is_refused_with_its_own_error(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=rf"EngineConfig\..*{message}"):
        EngineConfig(**{"executor": "null", **fields})


def core(speculative: bool | str, **config: Any) -> EngineCore:
    """A null-executor core; `speculative` True for prompt lookup, or a method name."""
    executor = NullExecutor(
        num_kv_blocks=config.pop("num_kv_blocks", 512),
        block_size=4,
        max_model_len=512,
        vocab_size=TOKENIZER.vocab_size,
        eos_token_id=TOKENIZER.eos_token_id,
        eos_at_output=config.pop("eos_at_output", None),
        track_kv=True,
        repeat_period=6,
    )
    method = "ngram" if speculative is True else speculative
    spec = {"speculative_method": method, "num_speculative_tokens": 5} if method else {}
    return EngineCore(
        executor=executor,
        tokenizer=TOKENIZER,
        config=EngineConfig(executor="null", **spec, **config),
        eos_token_id=TOKENIZER.eos_token_id,
    )


def add_all(core: EngineCore, requests: dict[str, tuple[str, SamplingParams]]) -> None:
    for request_id, (prompt, params) in requests.items():
        core.add_request(
            EngineRequest(
                request_id=request_id,
                prompt_token_ids=tuple(TOKENIZER.encode(prompt)),
                params=params,
            )
        )


def run(core: EngineCore, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    add_all(core, requests)
    out: dict[str, Any] = {}
    while core.has_unfinished():
        for update in core.step():
            tokens, _ = out.get(update.request_id, ((), None))
            out[update.request_id] = (tokens + update.new_token_ids, update.finish_reason)
    return out


class SpoilingProposer:
    """Prompt lookup whose every other proposal has one draft changed, at a position
    that moves from call to call."""

    def __init__(self, inner: NgramProposer) -> None:
        self._inner = inner
        self._calls = 0

    def propose(self, tokens: list[int], count: int) -> list[int]:
        drafts = self._inner.propose(tokens, count)
        self._calls += 1
        if drafts and self._calls % 2:
            position = (self._calls // 2) % len(drafts)
            drafts[position] = (drafts[position] + 1) % 256
        return drafts


# Prompts that repeat, so drafts are found; the null executor's outputs repeat too
# (its next token depends on the last token and the position only).
REQUESTS = {
    f"r{i}": (("abcd" * (i + 2)) + "xy" * i, SamplingParams(max_tokens=30 + i, ignore_eos=True))
    for i in range(8)
} | {
    "min": ("abab" * 5, SamplingParams(max_tokens=20, min_tokens=10)),
    "stop-token": ("cdcd" * 6, SamplingParams(max_tokens=40, stop_token_ids=(ord("d"),))),
}


CONFIGS = {
    "roomy": {},
    "preempting": {"num_kv_blocks": 40},  # preemption and recompute
    "no-prefix-cache": {"enable_prefix_caching": False},
    "eos": {"eos_at_output": 7},  # EOS inside an accepted run ends it there
    "small-budget": {"max_num_batched_tokens": 7},  # drafts cut to the token budget
    "async": {"async_scheduling": True},  # two steps in flight (`run_pipelined`)
    "async-tight": {"async_scheduling": True, "num_kv_blocks": 40},
}
CASES = [("ngram", name) for name in CONFIGS if not name.startswith("async")] + [
    ("draft_model", name) for name in CONFIGS
]


@pytest.mark.parametrize(("method", "name"), CASES, ids=["-".join(case) for case in CASES])
def test_speculation_changes_no_token_and_reads_no_rejected_kv(method: str, name: str) -> None:
    """Whatever is drafted: prompt lookup's drafts, with one of them spoiled every
    other proposal (the cycling executor's own outputs are always predicted right), or
    the executor's own as a draft model's, asked one step ahead with blocks for their
    lookahead (the null executor's are wrong at one position in five,
    `DRAFT_MISS_PERIOD`): drafts are rejected at every position too."""
    config = CONFIGS[name]
    plain = run(core(False, **dict(config)), REQUESTS)
    speculating = core(method, **dict(config), speculative_token_budget=4096)
    if method == "ngram":
        speculating.scheduler._proposer = SpoilingProposer(speculating.scheduler._proposer)
    runner = run_pipelined if config.get("async_scheduling") else run
    assert runner(speculating, REQUESTS) == plain
    counts = speculating.scheduler.spec_counts
    assert counts.num_drafts > 0 and 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    assert sum(counts.accepted_per_position) == counts.num_accepted_tokens
    # Nothing is leaked: every block is back, free or cached.
    assert speculating.scheduler.block_manager.usage == 0.0


def test_drafts_stay_within_the_token_budget() -> None:
    """A step adds drafts only while its decodes leave room under the budget: none while
    ten requests run, some once few are left."""
    speculating = core(True, speculative_token_budget=4)
    add_all(speculating, REQUESTS)
    drafted_by_running: dict[int, int] = {}
    while speculating.has_unfinished():
        running = speculating.scheduler.num_running
        step = speculating.schedule()
        assert step is not None
        drafted = sum(chunk.num_draft_tokens for chunk in step.batch.chunks)
        assert drafted <= max(0, 4 - running)
        drafted_by_running[running] = drafted_by_running.get(running, 0) + drafted
        speculating.update(step, speculating.execute(step))
    assert drafted_by_running[len(REQUESTS)] == 0
    assert sum(drafted_by_running.values()) > 0


def test_under_async_scheduling_a_request_verifying_drafts_sits_out_the_step_ahead() -> None:
    """Two steps in flight (the batch queue): a request that drafts leaves the step
    scheduled while its sample is unknown, verifies drafts in the next, and sits out
    the one scheduled while those are in flight; the tokens are plain decoding's."""
    request = {"r": ("abcd" * 4, SamplingParams(max_tokens=40, ignore_eos=True))}
    engine = core(True, async_scheduling=True)
    scheduler, executor = engine.scheduler, engine.executor
    add_all(engine, request)
    pending = [scheduler.schedule()]  # the prefill, which samples
    drafts_per_step, tokens = [], []
    while pending:
        step = pending[0]
        output = executor.execute(step.batch)
        if scheduler.has_work():  # the step ahead, scheduled before this one's update
            ahead = scheduler.schedule()
            drafts_per_step.append([c.num_draft_tokens for c in ahead.batch.chunks])
            if not ahead.is_empty:
                ahead.resolve_placeholders(output)
                pending.append(ahead)
        pending.pop(0)
        for update in scheduler.update(step, output):
            tokens += update.new_token_ids
        if not pending and scheduler.has_work():
            pending.append(scheduler.schedule())
            drafts_per_step.append([c.num_draft_tokens for c in pending[0].batch.chunks])
    assert tokens == list(run(core(False), request)["r"][0])
    verifying = [i for i, shape in enumerate(drafts_per_step) if shape and shape[0] > 0]
    assert len(verifying) >= 2, drafts_per_step
    for i in verifying:  # the step scheduled while its drafts were in flight is empty
        assert i + 1 == len(drafts_per_step) or drafts_per_step[i + 1] == []


def run_pipelined(engine: EngineCore, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    """`run` with two steps in flight, as the batch queue runs them: each step is
    scheduled before the previous one's update, its placeholders filled from it."""
    add_all(engine, requests)
    scheduler, executor = engine.scheduler, engine.executor
    out: dict[str, Any] = {}
    pending = [scheduler.schedule()]
    while pending:
        step = pending[0]
        output = executor.execute(step.batch)
        if scheduler.has_work():
            ahead = scheduler.schedule()
            if not ahead.is_empty:
                ahead.resolve_placeholders(output)
                pending.append(ahead)
        pending.pop(0)
        for update in scheduler.update(step, output):
            tokens, _ = out.get(update.request_id, ((), None))
            out[update.request_id] = (tokens + update.new_token_ids, update.finish_reason)
        if not pending and scheduler.has_work():
            pending.append(scheduler.schedule())
    return out


def test_a_draft_model_is_asked_one_step_ahead_within_free_blocks() -> None:
    """Each sampling chunk asks for k drafts while blocks are plentiful, fewer (never
    by preempting) when they are not, and a decode verifies what came back."""
    engine = core("draft_model", speculative_token_budget=4096)
    add_all(engine, {"r": ("abcd" * 4, SamplingParams(max_tokens=30, ignore_eos=True))})
    step = engine.schedule()
    assert [c.num_lookahead_tokens for c in step.batch.chunks] == [5]
    engine.update(step, output := engine.execute(step))
    assert len(output.draft_token_ids["r"]) == 5
    step = engine.schedule()
    assert [c.num_draft_tokens for c in step.batch.chunks] == [5]
    engine.update(step, engine.execute(step))

    tight = core("draft_model", num_kv_blocks=6, speculative_token_budget=4096)
    add_all(tight, {"a": ("abcdabcd", SamplingParams(max_tokens=4, ignore_eos=True))})
    step = tight.schedule()  # 8 prompt tokens: 2 blocks of 4; 4 free, 1 kept per request
    assert step.num_preempted == 0
    (chunk,) = step.batch.chunks
    assert chunk.num_lookahead_tokens == 3  # cut by max_tokens: 4 outputs, 3 after the first

    # 3 blocks: the prompt takes 2, and the last free one is kept for the request's
    # own next token: no lookahead, and no preemption for one.
    scarce = core("draft_model", num_kv_blocks=3, speculative_token_budget=4096)
    add_all(scarce, {"a": ("abcdabcd", SamplingParams(max_tokens=3, ignore_eos=True))})
    step = scarce.schedule()
    assert [c.num_lookahead_tokens for c in step.batch.chunks] == [0]
    assert scarce.scheduler.block_manager.num_free_blocks == 1


def test_text_a_grammar_forces_is_drafted_and_accepted_whole() -> None:
    """Once "a" or "b" is chosen, the regex forces the rest of its pair and the
    "-wavecore-" after it: those bytes are drafted (one byte, one token, and the only
    token allowed: each is accepted), and the outputs are plain decoding's."""
    spec = StructuredOutputs(regex="((ab|ba)-wavecore-){3}")
    requests = {"r": ("qqq", SamplingParams(max_tokens=60, structured_outputs=spec))}
    speculating = core(True)
    assert run(speculating, requests) == run(core(False), requests)
    counts = speculating.scheduler.spec_counts
    # Each of the three pairs' second byte and the 10 forced bytes after it, in
    # drafts of up to k = 5.
    assert counts.num_draft_tokens >= 3 * 10
    assert counts.num_accepted_tokens == counts.num_draft_tokens


class ForcingGrammar:
    """A grammar that forces `forced` next and allows anything."""

    ready = True

    def __init__(self, forced: list[int]) -> None:
        self._forced = forced

    def accept(self, token_id: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False

    def valid_prefix(self, token_ids: list[int]) -> int:
        return len(token_ids)

    def forced_tokens(self) -> list[int]:
        return list(self._forced)


def test_prompt_lookup_continues_after_the_forced_text() -> None:
    engine = core(True)
    add_all(engine, {"r": ("abcdefgab", SamplingParams(max_tokens=20))})
    request = engine.scheduler._requests["r"]
    request.grammar = ForcingGrammar(list(b"cd"))
    # "ab" + the forced "cd" ends in "abcd", found at the start, followed by "efg".
    assert engine.scheduler._lookup(request, 5) == list(b"cdefg")
    assert engine.scheduler._lookup(request, 1) == list(b"c")
