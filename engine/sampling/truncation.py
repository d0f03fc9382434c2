"""Top-k, top-p (nucleus) and min-p truncation of temperature-scaled logits.

Each function takes `[m, vocab]` logits and one parameter per row, and returns new
logits with the excluded tokens set to `-inf`; rows whose parameter disables the
filter come back unchanged. Top-k and top-p share one descending sort: a token's rank
decides top-k (rank >= k is out), and the probability mass ranked strictly above it
decides top-p (out once that mass already reaches p), so the most likely token always
survives. The exclusion mask is built in sorted order and scattered back to vocabulary
order. Only as many of the most likely tokens as the filters can keep are ranked (a partial
top-k instead of a full sort when every top-p row also has a top-k). Min-p keeps tokens whose probability is at least `min_p` times the largest one;
the ratio is unchanged by renormalisation, so its order relative to the others does
not matter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    vocab_size = logits.shape[1]
    k_per_row = [k if 0 < k < vocab_size else vocab_size for k in top_k]
    use_top_k = any(k < vocab_size for k in k_per_row)
    use_top_p = any(p < 1.0 for p in top_p)
    if not (use_top_k or use_top_p):
        return logits
    device = logits.device
    # Only the `ranked` most likely tokens are ranked: enough for every row's top-k, and
    # for top-p too when each top-p row also has a top-k (a partial top-k is far cheaper
    # than sorting the vocabulary). A row without top-k keeps every unranked token.
    full_sort = any(p < 1.0 and k == vocab_size for k, p in zip(k_per_row, top_p, strict=True))
    ranked = vocab_size if full_sort else max(k for k in k_per_row if k < vocab_size)
    if ranked == vocab_size:
        sorted_logits, order = logits.sort(dim=1, descending=True)
    else:
        sorted_logits, order = logits.topk(ranked, dim=1)
    k = torch.tensor(k_per_row, device=device).unsqueeze(1)
    excluded = torch.arange(ranked, device=device).unsqueeze(0) >= k
    if use_top_p:
        probs = sorted_logits.masked_fill(excluded, float("-inf")).softmax(dim=1)
        mass_above = probs.cumsum(dim=1) - probs
        p = torch.tensor(top_p, dtype=probs.dtype, device=device).unsqueeze(1)
        # Rows with p == 1 are left alone: rounding in the cumulative sum could
        # otherwise cut the far tail.
        excluded |= (mass_above >= p) & (p < 1.0)
    unranked_excluded = (k < vocab_size).expand(-1, vocab_size)
    in_vocab_order = unranked_excluded.clone().scatter_(1, order, excluded)
    return logits.masked_fill(in_vocab_order, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    if not any(p > 0.0 for p in min_p):
        return logits
    probs = logits.softmax(dim=1)
    ratio = torch.tensor(min_p, dtype=probs.dtype, device=logits.device).unsqueeze(1)
    threshold = probs.amax(dim=1, keepdim=True) * ratio
    return logits.masked_fill(probs < threshold, float("-inf"))
