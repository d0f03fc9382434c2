"""Applying a step's grammar bitmask to its logits (torch side of `engine.structured`).

On the CPU the bits are unpacked by numpy (`np.unpackbits`, one pass over the words)
and each forbidden logit's bits are set to -inf's in place, through numpy's view of the
tensor as int32 (two bitwise passes): 3.0 ms for 32 rows of SmolLM2's 49,152 tokens on
the 2 vCPU Xeon, 0.05 for one, where the torch form (a shift, a mask and a compare per
bit on int32 tensors, then `masked_fill`) took 7.2 and 0.18. Other devices, and logits
whose rows are not contiguous, keep the torch form.
"""

from __future__ import annotations

import numpy as np
import torch

from wavecore.engine.executors.batch import GrammarBitmask

_BITS = torch.arange(32, dtype=torch.int32)
# -inf's float32 bits, as an int32.
_NEGATIVE_INFINITY = np.float32(-np.inf).view(np.int32)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: GrammarBitmask) -> None:
    """Set to -inf, in place, the logits of every token a listed row's grammar forbids."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1:
        _apply_on_cpu(logits.detach().numpy(), bitmask)
    else:
        _apply_with_torch(logits, bitmask)


def _apply_with_torch(logits: torch.Tensor, bitmask: GrammarBitmask) -> None:
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


def _apply_on_cpu(logits: np.ndarray, bitmask: GrammarBitmask) -> None:
    # Bit t % 32 of word t // 32 is bit t % 8 of the word's byte (t % 32) // 8 in
    # little-endian order: unpacked little-endian, bit t lands at column t.
    words = np.ascontiguousarray(bitmask.words, dtype="<i4")
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    vocab = logits.shape[1]
    width = min(vocab, allowed.shape[1])
    # -1 (all bits) where forbidden, 0 where allowed; past the grammar's vocabulary,
    # forbidden. A forbidden logit's bits become exactly -inf's, whatever it held.
    forbidden = np.full((len(bitmask.rows), vocab), -1, dtype=np.int32)
    np.subtract(allowed[:, :width], 1, out=forbidden[:, :width], dtype=np.int32)
    rows = list(bitmask.rows)
    first = rows[0] if rows else 0
    contiguous = rows == list(range(first, first + len(rows)))
    target = logits[first : first + len(rows)] if contiguous else logits[rows]
    bits = target.view(np.int32)
    np.bitwise_and(bits, ~forbidden, out=bits)
    np.bitwise_or(bits, forbidden & _NEGATIVE_INFINITY, out=bits)
    if not contiguous:
        logits[rows] = target
