"""The small interface between the front end and its ranks, and what a scale needs.

Two implementations: `core.inprocess` (one rank in this process, its model on a
thread; messages travel as objects on memory streams) and `dp.client` (N rank
processes and a coordinator over nng channels). Both carry the same messages
(`engine.messages`) and run the same rank loop; the front end cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Any, Protocol

from wavecore.engine.errors import EngineDeadError
from wavecore.engine.request import PromptTokenizer


class CoreClient(Protocol):
    @property
    def dp_size(self) -> int:
        """Ranks the client may route to now (a scale changes it)."""
        ...

    @property
    def lockstep(self) -> bool: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> PromptTokenizer: ...

    @property
    def has_coordinator(self) -> bool:
        """Whether a coordinator publishes the wave view (else the ranks' own counters
        are the view)."""
        ...

    @property
    def dropped_frames(self) -> dict[str, int]:
        """Frames the receiving channels in this process (and the coordinator's) dropped
        as malformed or impossible, by channel."""
        ...

    @property
    def max_chunk_bytes(self) -> int | None:
        """The largest piece of a tensor one message may carry (None: no limit, the
        message is not encoded)."""
        ...

    def rank_node(self, rank: int) -> str:
        """Where rank `rank` runs (its machine, or its node in a Ray cluster), for stats."""
        ...

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Report the death of a rank (or of what carries its messages) to ``callback``."""

    def attach(self, host: ScaleHost) -> None:
        """The front end it serves: a client that shrinks its group around a lost rank
        (`on_rank_failure="shrink"`) drives it through the shrink."""

    async def root_cause(
        self, error: EngineDeadError, *, in_collective: bool = False
    ) -> EngineDeadError:
        """The error to report for a rank's failure: a rank's failure is often a peer's
        death seen from the other side (a broken collective, `in_collective`), and the
        death comes first."""
        ...

    async def send(self, rank: int, message: Any) -> None: ...

    async def send_coordinator(self, message: Any) -> None: ...

    def outputs(self) -> AsyncIterator[Any]:
        """Every rank's messages to the front end, until the ranks are gone."""
        ...

    def coordinator_states(self) -> AsyncIterator[Any]:
        """The coordinator's publications (nothing, where there is no coordinator)."""
        ...

    async def scale(self, host: ScaleHost, new_dp_size: int, drain_timeout: float | None) -> None:
        """Change the number of ranks, driving `host` (the front end) through the scale."""
        ...


class ScaleHost(Protocol):
    """What a scale asks of the front end: its per-rank tables and calls to ranks."""

    @property
    def dp_size(self) -> int: ...

    def route_to(self, dp_size: int) -> None:
        """New requests go to ranks [0, dp_size) only."""

    def resize_tables(self, dp_size: int) -> None: ...

    def unfinished_on(self, ranks: Collection[int]) -> dict[str, int]:
        """The requests in flight on these ranks, with their rank."""
        ...

    async def request_finished(self) -> None:
        """Return once any request finishes."""

    async def abort_on(self, requests: dict[str, int]) -> None: ...

    async def prepare_ranks(self, ranks: Collection[int]) -> None:
        """New ranks, started and not serving yet: give them what every rank serves
        beyond the model file (the LoRA adapters); an error fails the scale."""

    async def call_ranks(self, ranks: Collection[int], message: Callable[[int], Any]) -> None:
        """Send these ranks the call ``message(call_id)`` and wait for every answer; the
        error names the ranks that refused."""

    async def coordinator_size(self, dp_size: int) -> None:
        """Return once the coordinator published a view of ``dp_size`` ranks."""

    def shrink_refused(self) -> str | None:
        """Why the engine cannot shrink around a lost rank now (paused, asleep, a
        reconfiguration or weight update running), else None."""
        ...

    def reconfiguring(self, active: bool) -> None:
        """A shrink starts or ends: calls that a scale refuses are refused meanwhile."""

    async def scale(self, new_dp_size: int, *, drain_timeout: float | None = None) -> None:
        """Scale as a caller would (`Engine.scale`), with the same checks."""

    async def lose_ranks(
        self, lost: Collection[int], survivors: Sequence[int], error: str, *, resend: bool
    ) -> None:
        """The ``lost`` ranks are gone: their requests with output end with finish reason
        "error" and ``error``, those with none yet go to a survivor (with ``resend``, and
        once per request; else they end so too), calls stop waiting
        for them (failing with ``error``), and the ``survivors`` become ranks
        ``0..len(survivors)-1`` in every table."""
