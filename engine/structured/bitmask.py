"""The step's grammar bitmask: for each sampling row of a structured-output request, the
tokens its grammar allows next, one bit per token (llguidance's packed int32 layout:
token t is bit t % 32 of word t // 32). Computed on the event loop while the forward
runs on the model thread; numpy only, so the scheduler's side imports no torch."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np

from wavecore.engine.executors.batch import GrammarBitmask
from wavecore.engine.structured.compiler import RequestGrammar

# Matchers fill their rows in parallel on llguidance's own threads (outside the GIL).
_EXECUTOR = llguidance.LLExecutor()


def words_for(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def compute_bitmask(
    rows: Sequence[tuple[int, RequestGrammar]], vocab_size: int
) -> GrammarBitmask | None:
    """The bitmask of these (sampling row, grammar) pairs, or None when there are none.

    A grammar without a usable matcher (in error: the request ends at its update) gets
    an all-allowed row, so its sample stays well defined."""
    if not rows:
        return None
    words = np.full((len(rows), words_for(vocab_size)), -1, dtype=np.int32)
    live = [
        (grammar.matcher, index)
        for index, (_, grammar) in enumerate(rows)
        if grammar.matcher is not None and not grammar.matcher.is_error()
    ]
    if live:
        llguidance.numpy.fill_next_token_bitmask_par(_EXECUTOR, live, words)
    return GrammarBitmask(rows=tuple(row for row, _ in rows), words=words)
