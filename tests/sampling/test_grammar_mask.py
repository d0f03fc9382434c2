"""The CPU form of `apply_grammar_bitmask` (numpy) forbids exactly what the torch form does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wavecore.engine.executors.batch import GrammarBitmask
from wavecore.engine.sampling import grammar_mask


@pytest.mark.parametrize("rows", [(4, 0, 2), (1, 2, 3)])  # scattered, and a range
@pytest.mark.parametrize("vocab", [100, 128, 200])  # packed width 128: cut, exact, short
def test_numpy_form_equals_torch_form(vocab: int, rows: tuple[int, ...]) -> None:
    rng = np.random.default_rng(vocab)
    words = rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    words[1] = -1  # every token allowed
    words[2, 0] = -(2**31)  # only token 31 of the first word (the sign bit)
    bitmask = GrammarBitmask(rows=rows, words=words)
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    # Values a broken forward may give: each stays where allowed, becomes -inf where not.
    logits[:, 5], logits[:, 6], logits[:, 7] = float("inf"), float("nan"), -0.0
    expected = logits.clone()
    grammar_mask._apply_with_torch(expected, bitmask)
    grammar_mask.apply_grammar_bitmask(logits, bitmask)
    assert torch.equal(logits.nan_to_num(nan=1.0), expected.nan_to_num(nan=1.0))
    assert torch.equal(logits.signbit(), expected.signbit())
    unlisted = [row for row in range(5) if row not in rows]
    assert not logits[unlisted, :5].isinf().any()  # unlisted rows untouched
