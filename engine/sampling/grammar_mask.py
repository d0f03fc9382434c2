"""Applying a step's grammar bitmask to its logits (torch side of `engine.structured`)."""

from __future__ import annotations

import torch

from wavecore.engine.executors.batch import GrammarBitmask

_BITS = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: GrammarBitmask) -> None:
    """Set to -inf, in place, the logits of every token a listed row's grammar forbids."""
    rows = torch.tensor(bitmask.rows, dtype=torch.long, device=logits.device)
    words = torch.from_numpy(bitmask.words).to(logits.device)
    bits = words.unsqueeze(-1).bitwise_right_shift(_BITS.to(logits.device)).bitwise_and(1)
    allowed = bits.reshape(len(bitmask.rows), -1).bool()
    vocab = logits.shape[1]
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:  # logit columns past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
