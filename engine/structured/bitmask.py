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
    rows: Sequence[tuple[int, RequestGrammar, list[int]]], vocab_size: int
) -> GrammarBitmask | None:
    """The bitmask of these (first sampling row, grammar, drafts) triples, or None when
    there are none. A grammar with k speculative drafts fills k + 1 rows from its first:
    the tokens allowed next, then after each draft in turn (the matcher is left as it
    was). A grammar without a usable matcher (in error: the request ends at its update)
    gets all-allowed rows, so its samples stay well defined."""
    if not rows:
        return None
    indices = [first + offset for first, _, drafts in rows for offset in range(len(drafts) + 1)]
    words = np.full((len(indices), words_for(vocab_size)), -1, dtype=np.int32)
    plain: list[tuple[llguidance.LLMatcher, int]] = []
    drafted: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
    position = 0
    for _, grammar, drafts in rows:
        matcher = grammar.matcher
        if matcher is not None and not matcher.is_error():
            if drafts:
                drafted.append((matcher, position, drafts))
            else:
                plain.append((matcher, position))
        position += len(drafts) + 1
    if plain:
        llguidance.numpy.fill_next_token_bitmask_par(_EXECUTOR, plain, words)
    if drafted:
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(_EXECUTOR, drafted, words)
    return GrammarBitmask(rows=tuple(indices), words=words)
