"""The one error every state machine raises for an event it cannot take."""

from __future__ import annotations


class ProtocolError(Exception):
    """An event arrived that the machine's current state does not allow.

    The machine is left exactly as it was before the event. The message names the
    machine, its state and the event, in the form "RankMachine can't handle event
    StepDone(...) in state IDLE".
    """

    def __init__(self, machine: str, state: object, event: object, reason: str = "") -> None:
        self.machine = machine
        self.state = state
        self.event = event
        detail = f": {reason}" if reason else ""
        super().__init__(f"{machine} can't handle event {event!r} in state {state}{detail}")


class LockstepDriftError(ProtocolError):
    """Ranks met in one all-reduce with different step counters or waves.

    Raised instead of letting the next collective hang: drift means the ranks issued
    different numbers of forwards since their last sync, which a later all-reduce turns
    into a silent hang.
    """


class ReconfigurationActiveError(ProtocolError):
    """A second reconfiguration was requested while one is still in progress."""
