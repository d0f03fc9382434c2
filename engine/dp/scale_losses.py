"""Ranks lost while a reconfiguration runs, and the cut they make into it.

Theory of operation:

1. A loss (`take`) names the rank's *member* id (`DPWiring.members`), not its number: a
   shrink renumbers the survivors, and a number taken before that would name another
   rank after it; a headless rank has no process here to name. The number is read from
   the wiring only when the loss is handled (`resolve`), at a point where the wiring
   and the `ScalingMachine` agree on the numbering.
2. Only members are taken: a rank of the group, not one a scale up is still starting
   (`joining`: the scale watches those itself and rolls back when one fails), and not
   one taken already (the same death is reported by the watcher and by every peer's
   broken collective).
3. A taken loss cancels the batch of actions in flight (`cut_in`) at its next
   checkpoint, so a reconfiguration never waits out a bound for a rank known gone;
   `ScalingMachine` rule 10 is valid whichever of that batch's actions were done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import anyio

from wavecore.engine.dp.launcher import DPWiring


@dataclass(frozen=True, slots=True, kw_only=True)
class Loss:
    member: int
    cause: str
    # Its requests without output go to a survivor (not when its own loop failed).
    resend: bool


class LossInbox:
    """See the module docstring."""

    def __init__(self, wiring: DPWiring) -> None:
        self._wiring = wiring
        self._pending: list[Loss] = []
        self._taken: set[int] = set()
        self._scope: anyio.CancelScope | None = None
        # Members a scale up started that are not in the group yet (rule 2).
        self.joining: set[int] = set()

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def take(self, loss: Loss) -> bool:
        """Rules 2 and 3: take a member's loss and cut into the batch in flight; False
        when it is no member's."""
        member = loss.member
        known = member in self._taken or any(p.member == member for p in self._pending)
        if known or member in self.joining or self._wiring.number_of(member) is None:
            return False
        self._pending.append(loss)
        if self._scope is not None:
            self._scope.cancel()
        return True

    @contextlib.contextmanager
    def cut_in(self) -> Iterator[anyio.CancelScope]:
        """Rule 3: the scope a batch of actions runs in (cancelled at once when a loss
        is pending already)."""
        with anyio.CancelScope() as scope:
            self._scope = scope
            if self._pending:
                scope.cancel()
            try:
                yield scope
            finally:
                self._scope = None

    def resolve(self, members: int) -> dict[int, Loss]:
        """Rule 1: the pending losses by their current numbers (members only), now
        taken for good."""
        lost: dict[int, Loss] = {}
        for loss in self._pending:
            number = self._wiring.number_of(loss.member)
            if number is not None and number < members:
                lost[number] = loss
                self._taken.add(loss.member)
        self._pending = []
        return lost

    def forget_pending(self) -> None:
        self._pending = []
