"""Speculative decoding's scheduler side: which draft tokens a decode carries.

Theory of operation:

1. Proposals. "ngram" (`NgramProposer`, prompt lookup): the longest suffix of a
   request's tokens, `prompt_lookup_max` down to `prompt_lookup_min` tokens long, is
   looked up in its earlier tokens (prompt and output); the up to k tokens that
   followed its latest earlier occurrence that k tokens follow are the drafts, else
   those after its earliest (in a repeating run the latest occurrences lie too near
   the end to give k tokens: "0 0" at the end of "... 0 0 0 0 0" was last seen one
   token back, and drafted one "0" a step). Nothing matches, nothing is proposed. The search runs on the tokens packed as bytes (`bytes.rfind`, C speed), a
   few microseconds for a few thousand tokens. Under structured output the text the
   grammar forces next (a JSON schema's keys and punctuation) is drafted first and
   the lookup continues after it (`Scheduler._lookup`). "draft_model": the executor proposes,
   right after it samples a step (a smaller model of the same vocabulary, greedy, on a
   KV cache of its own addressed by the same block tables: `engine/model/
   draft_model.py`). The scheduler asks for them by giving a sampling chunk
   `num_lookahead_tokens` (k, within the blocks it can add for them without
   preempting anyone) and uses what comes back in the request's next decode.
2. Verification (the executor and `Scheduler.update`): a decode with k drafts runs its
   last token and the k drafts in one forward and samples every one of the k + 1
   positions as plain decoding would there, with the drafts before it taken as the
   history (penalties, `min_tokens`, seeds, grammar). The drafts are accepted up to the
   first that differs from the token sampled before it, and that sampled token follows
   them. Each emitted token is therefore exactly the token plain decoding samples at
   its position: greedy outputs are identical, a seeded request's too, and an
   unseeded one's tokens follow exactly the target distribution (the sample at each
   position is drawn from it, whatever the draft was). This is rejection sampling
   (Leviathan et al.) for a draft that is one token with certainty, as both
   proposers' drafts are: accepting draft x with probability p(x), else drawing from
   p without x, emits exactly what drawing from p and comparing emits.
3. The KV of rejected drafts is never used: `num_computed_tokens` falls back to the
   accepted tokens, their slots are overwritten later, and only blocks of accepted
   tokens reach the prefix cache.
4. Never a loss (`Backoff`): a request whose drafts were all rejected twice in a row
   stops drafting for 2, 4, ... up to 64 of its steps; any accepted draft resets it.
   At large batches the forward is compute-bound and extra tokens cost their full
   price, so drafts are proposed only while the step's scheduled tokens stay within
   `token_budget`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
_WIDTH = array("i").itemsize
_MAX_SPECULATIVE_TOKENS = 16
_MAX_BACKOFF = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class SpeculativeConfig:
    """`method` "ngram" (prompt lookup) or "draft_model" (the executor's draft model,
    rule 1); `num_speculative_tokens` drafts per decode at most; the n-gram sizes looked up; `token_budget` caps a step's scheduled tokens
    beyond which no drafts are added (rule 4)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    token_budget: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_method must be one of {list(METHODS)} or None, got {self.method!r}"
            )
        _check_int(
            "num_speculative_tokens", self.num_speculative_tokens, 1, _MAX_SPECULATIVE_TOKENS
        )
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, 64)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        _check_int("speculative_token_budget", self.token_budget, 2, 1 << 20)

    @property
    def executor_proposes(self) -> bool:
        """Whether drafts come from the executor (a draft model) rather than the
        scheduler's own prompt lookup."""
        return self.method == "draft_model"


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")


class NgramProposer:
    """Prompt lookup (rule 1)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self._min = config.prompt_lookup_min
        self._max = config.prompt_lookup_max

    def propose(self, tokens: Sequence[int], count: int) -> list[int]:
        """Up to `count` tokens that followed an earlier occurrence of the longest
        matching suffix of `tokens` (rule 1 says which); [] when none matches."""
        length = len(tokens)
        if count < 1 or length <= self._min:
            return []
        packed = array("i", tokens).tobytes()
        width = _WIDTH
        for size in range(min(self._max, length - 1), self._min - 1, -1):
            suffix = packed[(length - size) * width :]
            # The latest occurrence that `count` tokens follow, else the earliest
            # (followed by the most), ending before the suffix itself.
            found = _aligned_rfind(packed, suffix, (length - count) * width)
            if found < 0:
                found = _aligned_find(packed, suffix, (length - 1) * width)
            if found >= 0:
                start = found // width + size
                return list(tokens[start : start + count])
        return []


def _aligned_rfind(packed: bytes, pattern: bytes, end: int) -> int:
    """The last occurrence of `pattern` within `packed[:end]` at a token boundary
    (`bytes.rfind` may land inside a token), or -1."""
    while (found := packed.rfind(pattern, 0, end)) >= 0:
        if found % _WIDTH == 0:
            return found
        end = found + len(pattern) - 1
    return -1


def _aligned_find(packed: bytes, pattern: bytes, end: int) -> int:
    """The first occurrence of `pattern` within `packed[:end]` at a token boundary, or -1."""
    start = 0
    while (found := packed.find(pattern, start, end)) >= 0:
        if found % _WIDTH == 0:
            return found
        start = found + 1
    return -1


class Backoff:
    """One request's drafting pause after rejected drafts (rule 4)."""

    __slots__ = ("misses", "wait")

    def __init__(self) -> None:
        self.misses = 0
        self.wait = 0

    def may_draft(self) -> bool:
        if self.wait:
            self.wait -= 1
            return False
        return True

    def verified(self, accepted: int) -> None:
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= 2:
            self.wait = min(_MAX_BACKOFF, 2 ** (self.misses - 1))


class SpecDecodeCounts:
    """Upstream's `spec_decode_*` counters of one scheduler: verified decodes (drafts),
    draft tokens, accepted tokens, and accepted drafts by position (0 = first draft)."""

    __slots__ = ("accepted_per_position", "num_accepted_tokens", "num_draft_tokens", "num_drafts")

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def record(self, drafts: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1
