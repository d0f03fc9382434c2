"""Speculative decoding leaves the sampling distribution as it is.

A toy model over four tokens (the next token follows the last one's cycle with
probability 0.55, each other with 0.15) is sampled at temperature 1 by the real
sampler, N requests with speculation and N without. Prompt lookup drafts the cycle,
and so does the toy's own greedy draft model (its argmax is the cycle): right about
half the time, so drafts are accepted and rejected at every position. The
frequencies of each token at each output position must agree.

The bound: by Hoeffding's inequality each of the 2 x 5 x 4 frequencies is within
t = 0.05 of its probability except with probability 2 exp(-2 N t^2) (N = 2000:
9.1e-5), so all of them are, except with probability 0.004 at most, and then two
runs differ by at most 2t in every cell. A verifier that accepted every draft would
push the cycle token's frequency from 0.55 towards 1. The runs use fixed seeds: the
test is deterministic on a machine.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from wavecore.engine.config import EngineConfig
from wavecore.engine.core.engine_core import EngineCore
from wavecore.engine.executors.batch import (
    GrammarBitmask,
    ModelBatch,
    ModelOutput,
    accepted_drafts,
    sampling_rows,
)
from wavecore.engine.executors.null_executor import NullExecutor
from wavecore.engine.request import EngineRequest
from wavecore.engine.sampling.byte_tokenizer import ByteTokenizer
from wavecore.engine.sampling.sampler import Sampler
from wavecore.engine.sampling_params import SamplingParams

TOKENIZER = ByteTokenizer()
REQUESTS = 2000
OUTPUT = 5
BOUND = 2 * 0.05
CYCLE = 0.55


class ToyModel(NullExecutor):
    """The null executor's bookkeeping with a real sampler over toy logits."""

    def __init__(self) -> None:
        super().__init__(
            num_kv_blocks=8192,
            block_size=16,
            max_model_len=64,
            vocab_size=TOKENIZER.vocab_size,
            eos_token_id=TOKENIZER.eos_token_id,
        )
        self._sampler = Sampler(TOKENIZER.eos_token_id, seed=1234)
        other = (1 - CYCLE) / 3
        table = torch.full((4, TOKENIZER.vocab_size), float("-inf"))
        for last in range(4):
            table[last, :4] = torch.tensor(
                [CYCLE if token == (last + 1) % 4 else other for token in range(4)]
            ).log()
        self._table = table

    def sample_tokens(self, forward: object, bitmask: GrammarBitmask | None) -> ModelOutput:
        assert isinstance(forward, ModelBatch)
        rows = sampling_rows(forward.chunks)
        if not rows:
            return ModelOutput(sampled=())
        logits = self._table[[row.all_token_ids[-1] % 4 for row in rows]]
        sampled = self._sampler.sample(logits, rows)
        return ModelOutput(sampled=sampled, draft_token_ids=self._greedy_drafts(forward, sampled))

    @staticmethod
    def _greedy_drafts(forward: ModelBatch, sampled: tuple) -> dict[str, tuple[int, ...]]:
        """What a greedy draft model of the toy proposes: the cycle after the last
        token a chunk emits."""
        drafts, row = {}, 0
        for chunk in forward.chunks:
            if not chunk.sample:
                continue
            samples = sampled[row : row + chunk.num_samples]
            row += chunk.num_samples
            if chunk.num_lookahead_tokens:
                verified = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens :]
                last = samples[accepted_drafts(verified, samples)].token_id
                count = chunk.num_lookahead_tokens
                drafts[chunk.request_id] = tuple((last + i) % 4 for i in range(1, count + 1))
        return drafts


def frequencies(method: str | None) -> list[Counter[int]]:
    spec = {"speculative_method": method, "num_speculative_tokens": 4} if method else {}
    core = EngineCore(
        executor=ToyModel(),
        tokenizer=TOKENIZER,
        config=EngineConfig(
            executor="null", max_num_seqs=256, speculative_token_budget=1 << 16, **spec
        ),
        eos_token_id=TOKENIZER.eos_token_id,
    )
    params = SamplingParams(temperature=1.0, max_tokens=OUTPUT, ignore_eos=True)
    for number in range(REQUESTS):
        core.add_request(
            EngineRequest(
                request_id=str(number), prompt_token_ids=(0, 1, 2, 3, 0, 1, 2, 3, 0), params=params
            )
        )
    outputs: dict[str, list[int]] = {}
    while core.has_unfinished():
        for update in core.step():
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    if method:
        counts = core.scheduler.spec_counts
        assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    return [Counter(output[position] for output in outputs.values()) for position in range(OUTPUT)]


@pytest.fixture(scope="module")
def plain() -> list[Counter[int]]:
    return frequencies(None)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_every_position_keeps_its_distribution(plain: list[Counter[int]], method: str) -> None:
    speculating = frequencies(method)
    for position in range(OUTPUT):
        for token in range(4):
            difference = abs(plain[position][token] - speculating[position][token]) / REQUESTS
            assert difference <= BOUND, (position, token, plain[position], speculating[position])
    # The toy model is what it says: after the prompt's last 0, its cycle goes on with 1.
    assert abs(plain[0][1] / REQUESTS - CYCLE) <= BOUND / 2
