"""Values no honest rank or coordinator sends, refused before the front end acts on them.

The codec already guarantees each message's shape (types, field counts; `StepOutputs`
checks its own columns add up). What it cannot know is the engine's own sizes: a token
id outside the vocabulary, an unknown finish reason, a negative count, a load report for
more or fewer ranks than serve, a member id never handed out. Each check returns why a
message is refused, or None; the caller drops a refused message through its
`InvalidFrameLog`, so a hostile frame never reaches a detokenizer or a table index.
"""

from __future__ import annotations

from typing import Any

from wavecore.engine import messages as m
from wavecore.statemachines import FinishReason

_FINISH_REASONS = frozenset(reason.value for reason in FinishReason)


def _token_problem(token_ids: Any, vocab_size: int) -> str | None:
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = next(token for token in token_ids if not 0 <= token < vocab_size)
        return f"token id {bad} is outside the vocabulary of {vocab_size}"
    return None


def step_outputs_problem(message: m.StepOutputs, vocab_size: int) -> str | None:
    """Why these outputs cannot be from a rank of this engine, or None."""
    if any(count < 0 for count in message.token_counts):
        return "a negative token count"
    problem = _token_problem(message.token_ids, vocab_size)
    if problem is not None:
        return problem
    unknown = set(message.finished.values()) - _FINISH_REASONS
    if unknown:
        return f"unknown finish reason(s) {sorted(unknown)!r}"
    for entry in message.logprobs:
        for token, _logprob, top in entry.entries:
            problem = _token_problem([token, *(alternative for alternative, _ in top)], vocab_size)
            if problem is not None:
                return problem
    return None


def member_problem(member: int, issued: int) -> str | None:
    """Why a message naming this member id (`RankAssignment.member`) is refused, when
    `issued` ids were handed out so far (0, 1, ...)."""
    if not 0 <= member < issued:
        return f"member {member} is no rank of this engine"
    return None


def state_problem(state: m.CoordinatorState) -> str | None:
    """Why a coordinator publication is refused: its columns must agree and be sane."""
    if not len(state.waiting) == len(state.running) == len(state.kv_usage) >= 1:
        return (
            f"load columns of {len(state.waiting)}, {len(state.running)} and "
            f"{len(state.kv_usage)} ranks"
        )
    if state.wave < 0 or min(state.waiting) < 0 or min(state.running) < 0:
        return "a negative wave or count"
    if not all(0.0 <= usage <= 1.0 for usage in state.kv_usage):
        return "a KV-cache usage outside [0, 1]"
    return None
