"""Structured output in one rank's core (null executor: a deterministic "model" that
takes the first token its mask allows): every kind's output matches its spec; grammars
compile off the loop without holding anyone back; a failed or slow compile ends its
request alone; unconstrained neighbours, preemption and recompute change nothing."""

from __future__ import annotations

import threading

import pytest
from structured_helpers import NULL_SPECS, SPECS, null_core, request, run_to_end, text

from wavecore.engine.structured import grammars
from wavecore.engine.structured.compiler import GrammarCompiler
from wavecore.engine.structured_outputs import StructuredOutputs

PROMPTS = ("the first prompt", "a second one", "and a third, longer than the others")


@pytest.mark.parametrize("kind", list(NULL_SPECS))
def test_every_output_matches_its_spec(kind: str) -> None:
    spec, matches = NULL_SPECS[kind]
    core = null_core()
    for number, prompt in enumerate(PROMPTS):
        core.add_request(request(f"r{number}", prompt, max_tokens=200, structured_outputs=spec))
    results = run_to_end(core)
    for tokens, reason, error in results.values():
        assert (reason, error) == ("stop", None)
        assert matches(text(tokens)), text(tokens)


def test_unconstrained_neighbours_get_what_they_get_alone() -> None:
    alone = null_core()
    alone.add_request(request("plain", "no constraint here", max_tokens=40))
    mixed = null_core()
    mixed.add_request(request("plain", "no constraint here", max_tokens=40))
    for kind, (spec, _) in NULL_SPECS.items():
        mixed.add_request(request(kind, "constrained", max_tokens=200, structured_outputs=spec))
    assert run_to_end(mixed)["plain"] == run_to_end(alone)["plain"]


def test_preemption_and_recompute_keep_the_matcher_where_the_tokens_are() -> None:
    """A KV pool so small that requests are preempted and recomputed: the outputs are
    those of a roomy pool (a matcher left ahead or behind would change them)."""
    spec, matches = SPECS["json"]

    def outputs(**config: object) -> tuple[dict, int]:
        core = null_core(**config)
        preempted = 0
        preempt = core.scheduler._preempt

        def counting(victim: object) -> None:
            nonlocal preempted
            preempted += 1
            preempt(victim)

        core.scheduler._preempt = counting  # type: ignore[method-assign]
        for number in range(6):
            prompt = f"prompt {number} " * 3
            core.add_request(request(f"r{number}", prompt, max_tokens=80, structured_outputs=spec))
        return run_to_end(core), preempted

    roomy, _ = outputs()
    tight, preempted = outputs(kv_cache_memory=16 * 16 * 2**10, block_size=8)
    assert preempted > 0
    assert tight == roomy
    assert all(reason == "stop" and matches(text(tokens)) for tokens, reason, _ in tight.values())


class GatedVocabulary:
    """Patches `GrammarVocabulary.matcher` so compiles wait for `gate` (or fail)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, error: Exception | None = None):
        self.gate = threading.Event()
        self.error = error
        real = grammars.GrammarVocabulary.matcher

        def matcher(vocabulary: grammars.GrammarVocabulary, spec: StructuredOutputs):
            self.gate.wait(30)
            if self.error is not None:
                raise self.error
            return real(vocabulary, spec)

        monkeypatch.setattr(grammars.GrammarVocabulary, "matcher", matcher)


def test_a_compiling_grammar_holds_back_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    gated = GatedVocabulary(monkeypatch)
    core = null_core()
    core.add_request(
        request("json", "first in line", max_tokens=100, structured_outputs=SPECS["json"][0])
    )
    core.add_request(request("plain", "behind it", max_tokens=5))
    finished: dict[str, str] = {}
    for _ in range(10):
        for update in core.step():
            if update.finish_reason is not None:
                finished[update.request_id] = str(update.finish_reason)
    assert finished == {"plain": "length"}  # served while the grammar compiles
    assert core.grammars_compiling()
    gated.gate.set()
    results = run_to_end(core)
    assert results["json"][1] == "stop" and SPECS["json"][1](text(results["json"][0]))


def test_a_failed_compile_ends_its_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    gated = GatedVocabulary(
        monkeypatch, error=grammars.GrammarError("structured_outputs.regex: boom")
    )
    gated.gate.set()
    core = null_core()
    core.add_request(request("bad", "doomed", max_tokens=10, structured_outputs=SPECS["regex"][0]))
    core.add_request(request("plain", "fine", max_tokens=10))
    results = run_to_end(core)
    assert results["bad"] == ([], "error", "structured_outputs.regex: boom")
    assert results["plain"][1] == "length" and len(results["plain"][0]) == 10


def test_a_compile_past_its_timeout_ends_its_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    gated = GatedVocabulary(monkeypatch)
    core = null_core()
    core.grammars = GrammarCompiler(core.tokenizer, core.tokenizer.vocab_size, timeout=0.0)
    core.add_request(
        request("slow", "never ready", max_tokens=10, structured_outputs=SPECS["json"][0])
    )
    core.add_request(request("plain", "fine", max_tokens=10))
    try:
        results = run_to_end(core)
    finally:
        gated.gate.set()
        core.close()
    assert results["slow"][1] == "error"
    assert "did not compile within the compile timeout" in (results["slow"][2] or "")
    assert results["plain"][1] == "length"


def test_a_spec_compiled_once_is_served_from_the_cache() -> None:
    core = null_core()
    spec = SPECS["choice"][0]
    first = core.grammars.start(spec)
    while first.compiling:
        first.poll()
    again = core.grammars.start(StructuredOutputs(choice=list(spec.choice or ())))
    assert again.ready and core.grammars.compiles == 1
    assert again.matcher is not first.matcher  # each request advances its own


def test_a_token_the_grammar_forbids_ends_the_request_with_an_error() -> None:
    """A sampler that ignored the mask (a bug, or a broken executor) is caught at the
    update: the forbidden token is not output and the request alone ends with ERROR."""
    core = null_core()
    core.add_request(
        request("r", "x", max_tokens=10, structured_outputs=StructuredOutputs(choice=["zzzz"]))
    )
    core.add_request(request("plain", "fine", max_tokens=10))
    executor = core.executor
    unmasked = executor.sample_tokens
    executor.sample_tokens = lambda forward, bitmask: unmasked(forward, None)  # type: ignore[method-assign]
    results = run_to_end(core)
    tokens, reason, error = results["r"]
    assert reason == "error" and "breaks its grammar" in (error or "")
    assert "zzzz".startswith(text(tokens))
    assert results["plain"][1] == "length"
