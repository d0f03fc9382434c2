"""Top-k, top-p (nucleus) and min-p truncation of temperature-scaled logits.

Each function takes `[m, vocab]` logits and one parameter per row, and returns new
logits with the excluded tokens set to `-inf`; rows whose parameter disables the
filter come back unchanged. Top-k and top-p share one descending sort: a token's rank
decides top-k (rank >= k is out), and the probability mass ranked strictly above it
decides top-p (out once that mass already reaches p), so the most likely token always
survives. The exclusion mask is built in sorted order and scattered back to vocabulary
order. Only as many of the most likely tokens as the filters can keep are ranked (a partial
top-k instead of a full sort when every top-p row also has a top-k). A top-p row without
a top-k first ranks its `_NUCLEUS_GUESS` most likely tokens: when they hold at least
`p` of the row's probability (its softmax over the whole vocabulary), every token
ranked below them has that much mass above it and is out, so the partial ranking
decides exactly what a sort would; otherwise the vocabulary is sorted (a sort of 32
rows of SmolLM2's 49,152 tokens took 49 ms on the 2 vCPU Xeon, the 1,024 most likely
tokens 6). Min-p keeps tokens whose probability is at least `min_p` times the largest
one; the ratio is unchanged by renormalisation, so its order relative to the others
does not matter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# How many tokens a top-p row without a top-k ranks before it sorts the vocabulary.
_NUCLEUS_GUESS = 1024


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    vocab_size = logits.shape[1]
    k_per_row = [k if 0 < k < vocab_size else vocab_size for k in top_k]
    use_top_k = any(k < vocab_size for k in k_per_row)
    use_top_p = any(p < 1.0 for p in top_p)
    if not (use_top_k or use_top_p):
        return logits
    # Only the most likely tokens are ranked: enough for every row's top-k, and for
    # top-p too when each top-p row also has a top-k (a partial top-k is far cheaper
    # than sorting the vocabulary). A row without top-k keeps every unranked token.
    most = max((k for k in k_per_row if k < vocab_size), default=0)
    # Top-p rows without a top-k: their nucleus must lie among the ranked tokens.
    nucleus_rows = [
        row
        for row, (k, p) in enumerate(zip(k_per_row, top_p, strict=True))
        if p < 1.0 and k == vocab_size
    ]
    if not nucleus_rows:
        return _truncate(logits, logits.topk(most, dim=1), k_per_row, top_p, None)
    guess = max(most, _NUCLEUS_GUESS)
    if guess < vocab_size:
        ranking = logits.topk(guess, dim=1)
        rows = torch.tensor(nucleus_rows, device=logits.device)
        # Their probabilities over the whole vocabulary, in ranked order.
        probs = logits[rows].softmax(dim=1).gather(1, ranking.indices[rows])
        p = torch.tensor([top_p[row] for row in nucleus_rows], device=logits.device)
        if bool((probs.sum(dim=1) >= p).all()):
            return _truncate(logits, ranking, k_per_row, top_p, (rows, probs))
    return _truncate(logits, logits.sort(dim=1, descending=True), k_per_row, top_p, None)


def _truncate(
    logits: torch.Tensor,
    ranking: tuple[torch.Tensor, torch.Tensor],
    k_per_row: list[int],
    top_p: Sequence[float],
    nucleus: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Top-k and top-p from `ranking` (the most likely tokens' logits and ids, in
    descending order). `nucleus`: the top-p rows without a top-k, with their
    probabilities over the whole vocabulary in ranked order, when the ranking is
    partial (each then holds its nucleus, so its unranked tokens are out)."""
    vocab_size = logits.shape[1]
    device = logits.device
    sorted_logits, order = ranking
    ranked = order.shape[1]
    k = torch.tensor(k_per_row, device=device).unsqueeze(1)
    excluded = torch.arange(ranked, device=device).unsqueeze(0) >= k
    unranked_excluded = (k < vocab_size).expand(-1, vocab_size).clone()
    if any(p < 1.0 for p in top_p):
        probs = sorted_logits.masked_fill(excluded, float("-inf")).softmax(dim=1)
        if nucleus is not None:
            rows, whole = nucleus
            probs[rows] = whole
            unranked_excluded[rows] = True
        mass_above = probs.cumsum(dim=1) - probs
        p = torch.tensor(top_p, dtype=probs.dtype, device=device).unsqueeze(1)
        # Rows with p == 1 are left alone: rounding in the cumulative sum could
        # otherwise cut the far tail.
        excluded |= (mass_above >= p) & (p < 1.0)
    in_vocab_order = unranked_excluded.scatter_(1, order, excluded)
    return logits.masked_fill(in_vocab_order, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    if not any(p > 0.0 for p in min_p):
        return logits
    probs = logits.softmax(dim=1)
    ratio = torch.tensor(min_p, dtype=probs.dtype, device=logits.device).unsqueeze(1)
    threshold = probs.amax(dim=1, keepdim=True) * ratio
    return logits.masked_fill(probs < threshold, float("-inf"))
