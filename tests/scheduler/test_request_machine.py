"""RequestMachine: every (state, event) pair is a listed transition or a ProtocolError."""

from __future__ import annotations

import dataclasses

import pytest

from wavecore.statemachines.errors import ProtocolError
from wavecore.statemachines.request import (
    Finish,
    FinishReason,
    Preempt,
    RequestMachine,
    RequestState,
    Schedule,
)

W, R, P, F = (
    RequestState.WAITING,
    RequestState.RUNNING,
    RequestState.PREEMPTED,
    RequestState.FINISHED,
)

EVENTS = [Schedule(), Preempt(), *(Finish(reason=reason) for reason in FinishReason)]

# Written out by hand from the module docstring's rules, not derived from the table.
LEGAL = {
    (W, "Schedule"): R,
    (P, "Schedule"): R,
    (R, "Preempt"): P,
    (R, "Finish(STOP)"): F,
    (R, "Finish(LENGTH)"): F,
    (R, "Finish(ABORT)"): F,
    (R, "Finish(ERROR)"): F,
    (W, "Finish(ABORT)"): F,
    (W, "Finish(ERROR)"): F,
    (P, "Finish(ABORT)"): F,
    (P, "Finish(ERROR)"): F,
}


def _label(event: object) -> str:
    if isinstance(event, Finish):
        return f"Finish({event.reason.name})"
    return type(event).__name__


def _machine_in(state: RequestState) -> RequestMachine:
    machine = RequestMachine()
    path = {
        W: [],
        R: [Schedule()],
        P: [Schedule(), Preempt()],
        F: [Finish(reason=FinishReason.ABORT)],
    }[state]
    for event in path:
        machine.handle(event)
    assert machine.state is state
    return machine


@pytest.mark.parametrize("state", list(RequestState))
@pytest.mark.parametrize("event", EVENTS, ids=_label)
def test_every_state_event_pair(state: RequestState, event: object) -> None:
    machine = _machine_in(state)
    before = (machine.state, machine.finish_reason)
    target = LEGAL.get((state, _label(event)))
    if target is None:
        with pytest.raises(ProtocolError) as caught:
            machine.handle(event)  # type: ignore[arg-type]
        assert (machine.state, machine.finish_reason) == before
        assert "RequestMachine" in str(caught.value) and str(state) in str(caught.value)
        assert caught.value.state is state and caught.value.event is event
    else:
        assert machine.handle(event) is target  # type: ignore[arg-type]
        assert machine.state is target
        if isinstance(event, Finish):
            assert machine.finish_reason is event.reason
            assert machine.is_finished


def test_a_request_can_be_preempted_and_resumed_repeatedly() -> None:
    machine = RequestMachine()
    for _ in range(3):
        machine.handle(Schedule())
        machine.handle(Preempt())
    machine.handle(Schedule())
    machine.handle(Finish(reason=FinishReason.LENGTH))
    assert machine.finish_reason is FinishReason.LENGTH


def test_finish_with_a_non_reason_is_refused_unchanged() -> None:
    machine = _machine_in(R)
    with pytest.raises(ProtocolError, match="FinishReason"):
        machine.handle(Finish(reason="stop"))  # type: ignore[arg-type]
    assert machine.state is R and machine.finish_reason is None


def test_an_unknown_event_type_is_refused() -> None:
    machine = RequestMachine()
    with pytest.raises(ProtocolError):
        machine.handle(object())  # type: ignore[arg-type]
    assert machine.state is W


def test_events_are_frozen_slotted_keyword_only() -> None:
    for cls in (Schedule, Preempt, Finish):
        params = cls.__dataclass_params__  # type: ignore[attr-defined]
        assert params.frozen
        assert hasattr(cls, "__slots__")
    with pytest.raises(TypeError):
        Finish(FinishReason.STOP)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Finish(reason=FinishReason.STOP).reason = FinishReason.ABORT  # type: ignore[misc]
