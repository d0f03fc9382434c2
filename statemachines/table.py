"""Transitions as data: the small base every protocol machine in this package shares.

Theory of operation:

1. A machine's whole mutable state is one frozen dataclass with a ``phase`` field.
2. ``TRANSITIONS`` maps ``(phase, event type)`` to a ``Transition``: the name of the
   handler method and the phases it may lead to (the diagrams are drawn from these).
3. ``handle(event)`` looks the pair up; a missing pair raises ``ProtocolError``.
4. A handler is a pure function of (state, event): it returns the new state and the
   actions, or raises. Only ``handle`` commits, after the handler returned, so a refused
   event leaves the machine exactly as it was.
5. Handlers are looked up by name, so a subclass can override one rule (the tests build
   deliberately broken variants this way).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Generic, TypeVar

from .errors import ProtocolError

StateT = TypeVar("StateT")


@dataclass(frozen=True, slots=True, kw_only=True)
class Transition:
    """One row of a transition table."""

    handler: str
    targets: tuple[Enum, ...]


class TableMachine(Generic[StateT]):
    """A machine driven by a ``TRANSITIONS`` table; subclasses supply state and handlers."""

    TRANSITIONS: ClassVar[Mapping[tuple[Enum, type], Transition]]
    _state: StateT

    def handle(self, event: object) -> tuple[Any, ...]:
        """Feed one event; return the actions the caller must perform, in order."""
        state = self._state
        phase = state.phase  # type: ignore[attr-defined]
        transition = self.TRANSITIONS.get((phase, type(event)))
        if transition is None:
            raise ProtocolError(type(self).__name__, phase.name, event)
        new_state, actions = getattr(self, transition.handler)(state, event)
        self._state = new_state
        return actions

    def snapshot(self) -> StateT:
        """The full state, immutable: equal snapshots mean identical machines."""
        return self._state

    def copy(self) -> TableMachine[StateT]:
        """An independent machine in the same state (the state itself is immutable)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin

    def restore(self, snapshot: StateT) -> None:
        """Put the machine back into a state previously returned by ``snapshot``."""
        self._state = snapshot

    def refuse(self, state: StateT, event: object, reason: str) -> ProtocolError:
        """The error for an event this state cannot take (the caller raises it)."""
        return ProtocolError(type(self).__name__, state.phase.name, event, reason)  # type: ignore[attr-defined]
