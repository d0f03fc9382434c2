"""The sampler: greedy, truncation, seeding, penalties, min_tokens and logprobs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wavecore.engine.executors.batch import SequenceChunk
from wavecore.engine.sampling import truncation
from wavecore.engine.sampling.logits_processing import (
    apply_output_penalties,
    apply_repetition_penalty,
)
from wavecore.engine.sampling.sampler import Sampler
from wavecore.engine.sampling.truncation import apply_min_p, apply_top_k_top_p
from wavecore.engine.sampling_params import SamplingParams

EOS = 0


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """These tensors are tiny: handing them to a second OpenMP thread costs more than it
    saves, and on a busy two-core machine it makes this module several times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def chunk(
    params: SamplingParams,
    *,
    request_id: str = "r",
    prompt: Sequence[int] = (1, 2),
    outputs: Sequence[int] = (),
) -> SequenceChunk:
    history = [*prompt, *outputs]
    return SequenceChunk(
        request_id=request_id,
        token_ids=history[-1:],
        start_pos=len(history) - 1,
        block_table=(0,),
        sample=True,
        sampling=params,
        all_token_ids=history,
        prompt_len=len(prompt),
    )


def distinct_logits(draw: st.DrawFn, rows: int, vocab: int) -> torch.Tensor:
    """Logits without ties, so 'the k most likely' is well defined."""
    values = []
    for _ in range(rows):
        order = draw(st.permutations(range(vocab)))
        scale = draw(st.floats(0.05, 3.0))
        values.append([scale * rank for rank in order])
    return torch.tensor(values, dtype=torch.float32)


@st.composite
def logits_batches(draw: st.DrawFn) -> torch.Tensor:
    rows = draw(st.integers(1, 6))
    vocab = draw(st.integers(2, 40))
    return distinct_logits(draw, rows, vocab)


@given(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=50),
        elements=st.floats(-50, 50, width=32),
    ),
    st.booleans(),
)
def test_greedy_is_argmax(values: np.ndarray, with_logprobs: bool) -> None:
    logits = torch.from_numpy(values)
    params = SamplingParams(temperature=0.0, logprobs=3 if with_logprobs else None)
    chunks = [chunk(params, request_id=str(i)) for i in range(logits.shape[0])]
    sampled = Sampler(eos_token_id=None).sample(logits, chunks)
    assert [s.token_id for s in sampled] == logits.argmax(dim=1).tolist()
    assert [s.request_id for s in sampled] == [c.request_id for c in chunks]


@given(logits_batches(), st.data())
def test_top_k_never_picks_a_token_outside_the_k_most_likely(
    logits: torch.Tensor, data: st.DataObject
) -> None:
    vocab = logits.shape[1]
    ks = [data.draw(st.integers(1, vocab)) for _ in range(logits.shape[0])]
    chunks = [chunk(SamplingParams(top_k=k, temperature=2.0)) for k in ks]
    sampler = Sampler(eos_token_id=None, seed=data.draw(st.integers(0, 1000)))
    for _ in range(5):
        for row, token in enumerate(s.token_id for s in sampler.sample(logits, chunks)):
            rank = int((logits[row] > logits[row, token]).sum())
            assert rank < ks[row]


@given(logits_batches(), st.data())
def test_top_p_never_picks_a_token_outside_the_nucleus(
    logits: torch.Tensor, data: st.DataObject
) -> None:
    ps = [data.draw(st.floats(0.01, 1.0)) for _ in range(logits.shape[0])]
    chunks = [chunk(SamplingParams(top_p=p)) for p in ps]
    sampler = Sampler(eos_token_id=None, seed=data.draw(st.integers(0, 1000)))
    probs = logits.double().softmax(dim=1)
    for _ in range(5):
        for row, token in enumerate(s.token_id for s in sampler.sample(logits, chunks)):
            mass_above = float(probs[row][probs[row] > probs[row, token]].sum())
            # The nucleus is the smallest prefix reaching p: a member has less than p above it.
            assert mass_above < ps[row] + 1e-5


@given(logits_batches(), st.data())
def test_min_p_never_picks_an_improbable_token(logits: torch.Tensor, data: st.DataObject) -> None:
    ratios = [data.draw(st.floats(0.0, 1.0)) for _ in range(logits.shape[0])]
    chunks = [chunk(SamplingParams(min_p=r, temperature=1.5)) for r in ratios]
    sampler = Sampler(eos_token_id=None, seed=data.draw(st.integers(0, 1000)))
    probs = (logits.double() / 1.5).softmax(dim=1)
    for _ in range(5):
        for row, token in enumerate(s.token_id for s in sampler.sample(logits, chunks)):
            assert probs[row, token] >= ratios[row] * probs[row].max() - 1e-6


@given(logits_batches(), st.data())
def test_mixed_top_k_and_top_p_rows_respect_both(logits: torch.Tensor, data: st.DataObject) -> None:
    vocab = logits.shape[1]
    ks = [data.draw(st.integers(0, vocab)) for _ in range(logits.shape[0])]
    ps = [data.draw(st.sampled_from([1.0, 0.3, 0.7, 0.95])) for _ in range(logits.shape[0])]
    chunks = [chunk(SamplingParams(top_k=k, top_p=p)) for k, p in zip(ks, ps, strict=True)]
    sampler = Sampler(eos_token_id=None, seed=data.draw(st.integers(0, 1000)))
    for _ in range(5):
        for row, token in enumerate(s.token_id for s in sampler.sample(logits, chunks)):
            k = ks[row] or vocab
            ranked = logits[row].double().argsort(descending=True)[:k]
            assert token in ranked.tolist()
            # Top-p applies to the distribution renormalised over the top-k survivors.
            kept = logits[row].double()[ranked].softmax(dim=0)
            mass_above = float(kept[kept > kept[ranked.tolist().index(token)]].sum())
            assert mass_above < ps[row] + 1e-5


def test_truncation_leaves_rows_without_filters_whole() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 9.0]])
    out = apply_top_k_top_p(logits, [2, 0, 0], [1.0, 1.0, 0.5])
    inf = float("-inf")
    assert out.tolist() == [[4.0, 3.0, inf, inf], [1.0, 2.0, 3.0, 4.0], [inf, inf, inf, 9.0]]
    assert apply_top_k_top_p(logits, [0, 4, 0], [1.0, 1.0, 1.0]) is logits
    assert apply_min_p(logits, [0.0, 0.0, 0.0]) is logits


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_a_partial_ranking_keeps_what_a_full_sort_keeps(
    monkeypatch: pytest.MonkeyPatch, scale: float
) -> None:
    """Top-p rows without a top-k first rank `_NUCLEUS_GUESS` tokens: the same tokens
    survive as with a sort of the whole vocabulary, whether the nucleus lies among them
    (peaked rows) or not (flat rows, which then sort)."""
    generator = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(8, 49_152, generator=generator) * scale
    # A row whose 100 likeliest tokens hold about 91% and a long flat tail the rest:
    # its nucleus at p = 0.9 lies among the ranked, but only just.
    logits[7] = 0.0
    logits[7, :100] = 8.5 + 0.1 * torch.randn(100, generator=generator)
    top_k = [0, 0, 40, 0, 2000, 0, 0, 0]
    top_p = [0.9, 0.5, 0.9, 1.0, 0.95, 0.99, 0.3, 0.8]
    partial = apply_top_k_top_p(logits, top_k, top_p)
    monkeypatch.setattr(truncation, "_NUCLEUS_GUESS", logits.shape[1])
    full = apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(partial.isinf(), full.isinf())
    assert torch.equal(partial[~partial.isinf()], logits[~partial.isinf()])


def test_combined_filters_leave_only_the_top_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0]])
    params = SamplingParams(top_k=2, top_p=0.3, seed=7)
    sampler = Sampler(eos_token_id=None)
    assert {
        sampler.sample(logits, [chunk(params, outputs=[1] * n)])[0].token_id for n in range(30)
    } == {1}


def test_seeded_request_ignores_its_batch_companions() -> None:
    torch.manual_seed(0)
    vocab = 64
    target = torch.randn(vocab)
    params = SamplingParams(seed=1234, temperature=1.3, top_p=0.95)

    def draw_alone(position: int) -> int:
        logits = target.unsqueeze(0)
        chunks = [chunk(params, outputs=[5] * position)]
        return Sampler(eos_token_id=None, seed=1).sample(logits, chunks)[0].token_id

    def draw_in_company(position: int, companions: int, slot: int) -> int:
        rows = [torch.randn(vocab) for _ in range(companions)]
        rows.insert(slot, target)
        others = [
            chunk(SamplingParams(seed=None if i % 2 else i, top_k=5), request_id=f"o{i}")
            for i in range(companions)
        ]
        others.insert(slot, chunk(params, request_id="target", outputs=[5] * position))
        sampled = Sampler(eos_token_id=None, seed=99).sample(torch.stack(rows), others)
        return sampled[slot].token_id

    alone = [draw_alone(p) for p in range(40)]
    for companions, slot in [(1, 0), (1, 1), (4, 2), (7, 7)]:
        assert [draw_in_company(p, companions, slot) for p in range(40)] == alone
    # The position feeds the randomness: 40 draws from a spread-out distribution differ.
    assert len(set(alone)) > 5


def test_same_seed_different_positions_and_seeds_give_different_streams() -> None:
    logits = torch.zeros(1, 1000)
    sampler = Sampler(eos_token_id=None)
    stream_a = [
        sampler.sample(logits, [chunk(SamplingParams(seed=1), outputs=[3] * n)])[0].token_id
        for n in range(20)
    ]
    stream_b = [
        sampler.sample(logits, [chunk(SamplingParams(seed=2), outputs=[3] * n)])[0].token_id
        for n in range(20)
    ]
    assert stream_a != stream_b
    assert len(set(stream_a)) > 15


def test_unseeded_requests_follow_the_sampler_seed() -> None:
    logits = torch.zeros(8, 100)
    chunks = [chunk(SamplingParams(), request_id=str(i)) for i in range(8)]
    first = [s.token_id for s in Sampler(eos_token_id=None, seed=5).sample(logits, chunks)]
    second = [s.token_id for s in Sampler(eos_token_id=None, seed=5).sample(logits, chunks)]
    assert first == second
    assert len(set(first)) > 1


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = 4000
    temperature = 0.7
    # Logits chosen so that softmax(logits / temperature) == probs.
    logits = (probs.log() * temperature).expand(draws, 4).contiguous()
    chunks = [
        chunk(SamplingParams(temperature=temperature), request_id=str(i)) for i in range(draws)
    ]
    counts = Counter(s.token_id for s in Sampler(eos_token_id=None, seed=3).sample(logits, chunks))
    assert set(counts) == {0, 1, 2, 3}
    for token, p in enumerate(probs.tolist()):
        # Five standard deviations: generous, and the seed makes it deterministic anyway.
        assert abs(counts[token] / draws - p) < 5 * (p * (1 - p) / draws) ** 0.5


def test_seeded_draws_follow_the_distribution_across_seeds() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    draws = 2000
    logits = probs.log().expand(draws, 4).contiguous()
    chunks = [chunk(SamplingParams(seed=i), request_id=str(i)) for i in range(draws)]
    counts = Counter(s.token_id for s in Sampler(eos_token_id=None).sample(logits, chunks))
    for token, p in enumerate(probs.tolist()):
        assert abs(counts[token] / draws - p) < 5 * (p * (1 - p) / draws) ** 0.5


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0], [2.0, -2.0, 2.0, -2.0, 1.0]])
    chunks = [
        chunk(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], outputs=[1]),
        chunk(SamplingParams(), prompt=[0, 1], outputs=[4]),
    ]
    apply_repetition_penalty(logits, chunks)
    assert logits.tolist() == [[1.0, -4.0, 2.0, -2.0, 1.0], [2.0, -2.0, 2.0, -2.0, 1.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(2, 5)
    chunks = [
        chunk(
            SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
            prompt=[4, 4, 4],
            outputs=[1, 2, 2, 2],
        ),
        chunk(SamplingParams(frequency_penalty=-1.0), prompt=[1], outputs=[3, 3]),
    ]
    apply_output_penalties(logits, chunks)
    assert logits.tolist() == [[0.0, -0.75, -1.25, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0, 0.0]]


def test_penalties_reach_the_returned_logprobs() -> None:
    logits = torch.tensor([[1.0, -1.0, 0.5, 2.0]])
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=1.5,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        logprobs=4,
    )
    sampled = Sampler(eos_token_id=None).sample(
        logits, [chunk(params, prompt=[0, 1], outputs=[3, 3])]
    )[0]
    expected = torch.tensor([[1.0 / 1.5, -1.5, 0.5, 2.0 / 1.5 - 0.3 - 0.4]]).log_softmax(dim=1)[0]
    got = dict(sampled.top_logprobs)
    assert got == pytest.approx({t: v for t, v in enumerate(expected.tolist())}, abs=1e-6)
    assert sampled.token_id == int(expected.argmax())


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    sampler = Sampler(eos_token_id=EOS)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(1,))

    def pick(params: SamplingParams, outputs: int) -> int:
        return sampler.sample(logits, [chunk(params, outputs=[3] * outputs)])[0].token_id

    assert pick(params, 0) == 2
    assert pick(params, 1) == 2
    assert pick(params, 2) == EOS
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert pick(ignoring, 0) == EOS  # with ignore_eos, EOS is an ordinary token
    # Random rows are masked too, even where EOS would otherwise be near certain.
    likely_eos = torch.tensor([[20.0, 0.0, 0.0, 0.0]])
    for seed in range(20):
        random = SamplingParams(min_tokens=3, seed=seed)
        picks = [
            sampler.sample(likely_eos, [chunk(random, outputs=[3] * n)])[0].token_id
            for n in range(4)
        ]
        assert EOS not in picks[:3]
        assert picks[3] == EOS


def test_logprobs_match_log_softmax_after_temperature() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 30)
    temperatures = [0.0, 0.5, 2.0]
    counts = [0, 5, 20]
    chunks = [
        chunk(SamplingParams(temperature=t, logprobs=n, seed=4, top_k=3), request_id=str(i))
        for i, (t, n) in enumerate(zip(temperatures, counts, strict=True))
    ]
    sampled = Sampler(eos_token_id=None).sample(logits, chunks)
    for row, (token, t, n) in enumerate(zip(sampled, temperatures, counts, strict=True)):
        reference = (logits[row] / (t or 1.0)).log_softmax(dim=0)
        assert token.logprob == pytest.approx(float(reference[token.token_id]), abs=1e-6)
        assert len(token.top_logprobs) == n
        ranked = sorted(range(30), key=lambda i: -float(reference[i]))[:n]
        assert [tok for tok, _ in token.top_logprobs] == ranked
        for tok, value in token.top_logprobs:
            assert value == pytest.approx(float(reference[tok]), abs=1e-6)


def test_requests_without_logprobs_get_none_in_a_mixed_batch() -> None:
    logits = torch.randn(2, 10)
    chunks = [
        chunk(SamplingParams(logprobs=2), request_id="a"),
        chunk(SamplingParams(), request_id="b"),
    ]
    with_lp, without = Sampler(eos_token_id=None, seed=0).sample(logits, chunks)
    assert with_lp.logprob is not None and len(with_lp.top_logprobs) == 2
    assert without.logprob is None and without.top_logprobs == ()


def test_the_callers_logits_are_left_untouched() -> None:
    logits = torch.randn(2, 10)
    before = logits.clone()
    chunks = [
        chunk(
            SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, min_tokens=3), outputs=[0]
        ),
        chunk(SamplingParams(temperature=0.0, frequency_penalty=1.0), outputs=[1, 1]),
    ]
    Sampler(eos_token_id=EOS).sample(logits, chunks)
    assert torch.equal(logits, before)


def test_empty_batch_returns_nothing() -> None:
    assert Sampler(eos_token_id=None).sample(torch.empty(0, 10), []) == ()


@pytest.mark.parametrize(
    ("logits", "chunks", "message"),
    [
        (torch.zeros(2, 4), [chunk(SamplingParams())], "2 rows but 1 chunks"),
        (torch.zeros(4), [chunk(SamplingParams())], "2-D floating"),
        (torch.zeros(1, 4, dtype=torch.long), [chunk(SamplingParams())], "2-D floating"),
        (
            torch.zeros(1, 4),
            [chunk(SamplingParams(repetition_penalty=1.2), request_id="bad", outputs=[9])],
            "'bad' has token id 9",
        ),
        (
            torch.zeros(1, 4),
            [chunk(SamplingParams(presence_penalty=1.0), request_id="neg", outputs=[-1])],
            "'neg' has token id -1",
        ),
    ],
)
def test_bad_inputs_raise_a_clear_error(
    logits: torch.Tensor, chunks: list[SequenceChunk], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Sampler(eos_token_id=None).sample(logits, chunks)


def test_non_sampling_chunk_is_rejected() -> None:
    bad = SequenceChunk(
        request_id="p",
        token_ids=(1,),
        start_pos=0,
        block_table=(0,),
        sample=False,
        sampling=SamplingParams(),
        all_token_ids=(1,),
        prompt_len=1,
    )
    with pytest.raises(ValueError, match="'p' has sample=False"):
        Sampler(eos_token_id=None).sample(torch.zeros(1, 4), [bad])


def test_negative_eos_id_is_rejected() -> None:
    with pytest.raises(ValueError, match="eos_token_id"):
        Sampler(eos_token_id=-1)
