"""What a caller of `generate` receives: one delta per engine step that produced text."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLogprob:
    """The sampled token's log-probability and the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionDelta:
    """New output of one request since its previous delta.

    `text` is valid UTF-8 text that will never be taken back (a possible start of a
    stop string is held until it is ruled out). `finish_reason` is set on the last
    delta only: "stop", "length" or "abort". `weight_version` names the weights that
    produced `token_ids` (set by `update_weights` / `set_weight_version`; None for the
    weights the engine loaded); a delta never mixes tokens of two versions. A request
    that was on a DP rank the engine lost (`on_rank_failure="shrink"`) ends with
    finish reason "error" and `error` naming the rank.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()
    weight_version: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
