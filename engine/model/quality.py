"""How far a weight format's predictions drift from float32's, on fixed text.

Two measures, both teacher-forced (every position sees the true preceding tokens, so
one early disagreement does not derail the rest):
- top-1 agreement: the fraction of positions where both formats predict the same
  next token, over `AGREEMENT_TEXTS` and `PERPLEXITY_TEXT`;
- perplexity of `PERPLEXITY_TEXT` under each format.

The texts are fixed here (written for this purpose, varied in kind: prose, a
recipe, code, numbers, dialogue) so that figures compare across runs and machines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

AGREEMENT_TEXTS: tuple[str, ...] = (
    "The capital of France is Paris. It lies on the Seine, and its best known "
    "landmark, the Eiffel Tower, was built for the world's fair of 1889.",
    "To make a simple tomato sauce, warm two spoons of olive oil in a pan, add a "
    "chopped onion and cook it slowly until soft. Then add the tomatoes, a pinch of "
    "salt and a few leaves of basil, and let it simmer for twenty minutes.",
    'def square(number):\n    """Return the square of a number."""\n    return '
    "number * number\n\n\nprint(square(7))\n",
    "The planets of the solar system, in order from the Sun, are Mercury, Venus, "
    "Earth, Mars, Jupiter, Saturn, Uranus and Neptune.",
    "Q: What is 17 multiplied by 3?\nA: 17 multiplied by 3 is 51.\nQ: And 12 times 12?\n"
    "A: 12 times 12 is 144.",
    "Plants make their food by photosynthesis: their leaves take in light, water and "
    "carbon dioxide and turn them into sugar, giving off oxygen as they do.",
    "Weather is what the air is doing today: rain, wind, sunshine. Climate is the "
    "pattern of weather in a place over many years.",
    "Sleep matters because the body repairs itself and the brain sorts the day's "
    "memories while we rest; without it, attention and mood suffer.",
)

PERPLEXITY_TEXT = (
    "Once upon a time there was a little girl who lived in a village near the forest. "
    "Whenever she went out, she wore a red riding cloak, so everyone in the village "
    "called her Little Red Riding Hood. One morning her mother asked her to take a "
    "basket of bread and butter to her grandmother, who was ill and lived on the other "
    "side of the wood. On the way she met a wolf, who asked her where she was going. "
    "She told him, and the wolf ran ahead by a shorter path to the grandmother's house. "
    "When the girl arrived, she found the wolf in her grandmother's bed, wearing her "
    'grandmother\'s nightcap. "What big eyes you have," she said. "All the better to '
    'see you with, my dear," said the wolf. Just then a woodcutter passing by heard '
    "the noise, came in, and chased the wolf away, and the grandmother, who had hidden "
    "in the cupboard, came out safe and sound."
)


def byte_ids(text: str, vocab_size: int) -> list[int]:
    """`text`'s UTF-8 bytes folded into the vocabulary: token ids for a model that has
    no usable tokenizer (the tiny test models), varied enough to exercise every layer."""
    return [byte % vocab_size for byte in text.encode()]


# The accuracy budget a rounding kernel must meet to run by default (`weights="auto"`,
# `kernel_choice.py`): top-1 agreement with float32 and perplexity within 2% of its.
MIN_AGREEMENT = 0.97
MAX_PERPLEXITY_CHANGE = 0.02

Scorer = Callable[[Sequence[int]], torch.Tensor]  # token ids -> logits [len, vocab]


@dataclass(frozen=True, slots=True, kw_only=True)
class QualityReport:
    positions: int  # teacher-forced positions compared, over every text
    agreeing: int
    reference_perplexity: float
    candidate_perplexity: float

    @property
    def agreement(self) -> float:
        return self.agreeing / self.positions

    @property
    def perplexity_change(self) -> float:
        """Relative change of the candidate's perplexity against the reference's."""
        return self.candidate_perplexity / self.reference_perplexity - 1

    @property
    def within_budget(self) -> bool:
        return (
            self.agreement >= MIN_AGREEMENT and abs(self.perplexity_change) <= MAX_PERPLEXITY_CHANGE
        )


def perplexity(logits: torch.Tensor, token_ids: Sequence[int]) -> float:
    """exp of the mean negative log-likelihood of each token given those before it;
    `logits[i]` predicts `token_ids[i + 1]`."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    targets = torch.tensor(token_ids[1:], dtype=torch.long)
    log_probs = torch.log_softmax(logits[:-1].to(torch.float32), dim=-1)
    nll = -log_probs.gather(1, targets[:, None]).mean()
    return math.exp(float(nll))


def compare(
    reference: Scorer, candidate: Scorer, encode: Callable[[str], list[int]]
) -> QualityReport:
    """Score the fixed texts with both formats; see the module docstring."""
    positions = agreeing = 0
    for text in AGREEMENT_TEXTS:
        tokens = encode(text)
        same = reference(tokens).argmax(-1) == candidate(tokens).argmax(-1)
        positions += len(tokens)
        agreeing += int(same.sum())
    tokens = encode(PERPLEXITY_TEXT)
    reference_logits, candidate_logits = reference(tokens), candidate(tokens)
    same = reference_logits.argmax(-1) == candidate_logits.argmax(-1)
    return QualityReport(
        positions=positions + len(tokens),
        agreeing=agreeing + int(same.sum()),
        reference_perplexity=perplexity(reference_logits, tokens),
        candidate_perplexity=perplexity(candidate_logits, tokens),
    )
