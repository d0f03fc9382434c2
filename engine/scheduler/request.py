"""The scheduler's record of one request: its tokens, KV blocks and lifecycle."""

from __future__ import annotations

from typing import Protocol

from wavecore.engine.sampling_params import SamplingParams
from wavecore.statemachines.request import RequestMachine, RequestState

from .speculative import Backoff


class Grammar(Protocol):
    """What the scheduler asks of a request's grammar (`engine.structured.compiler`)."""

    @property
    def ready(self) -> bool:
        """Compiled: the request may be admitted."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance past an output token; False if the grammar forbids it."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more."""
        ...

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of these tokens, in order, the grammar would accept now."""
        ...

    def forced_tokens(self) -> list[int]:
        """The tokens of the text the grammar forces next (none where it allows a
        choice)."""
        ...


class Request:
    """Mutable bookkeeping for one request, owned by the scheduler.

    `token_ids` is the prompt followed by the outputs; chunks share this list, never a
    copy. `num_computed_tokens` counts the tokens whose KV is in `block_table` (or is
    being computed by the step in flight). `block_hashes` chains the prefix-cache hashes
    of the table's full, computed blocks. A stop is decided by `stop_token_ids` (EOS
    included unless ignored) once the request reaches `min_len` tokens, and a request
    finishes for length at `max_len` tokens. `grammar` (structured output) is opaque
    here: a `Grammar`, whose matcher accepts each output token in `update`. `lora`
    names the request's LoRA adapter (None: the base model); `prefix_root` starts its
    prefix-cache hash chain, so that it shares blocks only with requests of its adapter.
    With a draft model, `draft_token_ids` are the executor's proposals for the tokens
    after `token_ids` (set by each update that samples it, so they always follow the
    current tokens), `drafts_coming` says its last sampling chunk asked for them, and
    the draft model's KV for it is valid below `draft_computed` (it sits out steps in
    which no request may draft, and catches up in the next one it runs).
    """

    __slots__ = (
        "backoff",
        "block_hashes",
        "block_table",
        "draft_computed",
        "draft_token_ids",
        "drafts_coming",
        "grammar",
        "lora",
        "machine",
        "max_len",
        "min_len",
        "num_computed_tokens",
        "prefix_root",
        "prompt_len",
        "request_id",
        "sampling",
        "stop_token_ids",
        "token_ids",
    )

    def __init__(
        self,
        *,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos_token_id: int | None,
        max_sequence_len: int,
        grammar: Grammar | None = None,
        lora: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora = lora
        self.prefix_root = 0 if lora is None else hash(("lora", lora))
        self.grammar = grammar
        self.backoff = Backoff()
        self.sampling = sampling
        self.token_ids = list(prompt_token_ids)
        self.prompt_len = len(self.token_ids)
        self.machine = RequestMachine()
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_computed_tokens = 0
        self.draft_token_ids: list[int] = []
        self.drafts_coming = False
        self.draft_computed = 0
        stops = set(sampling.stop_token_ids)
        if eos_token_id is not None and not sampling.ignore_eos:
            stops.add(eos_token_id)
        self.stop_token_ids = frozenset(stops)
        self.min_len = self.prompt_len + sampling.min_tokens
        self.max_len = min(self.prompt_len + sampling.max_tokens, max_sequence_len)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.machine.state}, "
            f"tokens={len(self.token_ids)}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)})"
        )

    @property
    def state(self) -> RequestState:
        return self.machine.state
