"""The rank loop's inputs, from the client's messages (`engine.messages`)."""

from __future__ import annotations

from typing import Any

from wavecore.engine import messages as m
from wavecore.engine.request import EngineRequest
from wavecore.statemachines import (
    AbortRequests,
    Call,
    GroupLost,
    NewRequest,
    PauseMode,
    PauseRequested,
    ReportStats,
    ResetPrefixCache,
    ResumeRequested,
    SleepRequested,
    StartWave,
    StopRequests,
    SwitchRequested,
    WakeUpRequested,
)


class BadCall(ValueError):
    """A utility call whose arguments no machine event takes; answered with this error."""

    def __init__(self, call_id: int, detail: str) -> None:
        super().__init__(detail)
        self.call_id = call_id


def loop_input_of(item: Any) -> object | None:
    """The `RankLoop` input for one message, or None for a message no rank takes."""
    if isinstance(item, m.AddRequest):
        request = EngineRequest(
            request_id=item.request_id,
            prompt_token_ids=item.prompt_token_ids,
            params=item.params,
            lora=item.lora,
        )
        return NewRequest(request_id=item.request_id, wave=item.wave, payload=request)
    if isinstance(item, m.AbortRequests):
        return AbortRequests(request_ids=item.request_ids)
    if isinstance(item, m.StopRequests):
        return StopRequests(request_ids=item.request_ids)
    if isinstance(item, m.StartDPWave):
        return StartWave(wave=item.wave, exclude_rank=item.exclude_rank)
    if isinstance(item, m.SwitchGroup):
        return Call(call_id=item.call_id, request=SwitchRequested(dp_size=item.dp_size))
    if isinstance(item, m.LeaveGroup):
        return Call(call_id=item.call_id, request=GroupLost())
    if isinstance(item, m.UtilityCall):
        try:
            return Call(call_id=item.call_id, request=_call_request(item))
        except (ValueError, KeyError) as error:
            raise BadCall(item.call_id, f"{type(error).__name__}: {error}") from None
    return None


def _call_request(call: m.UtilityCall) -> object:
    """The loop's request for a client's utility call; ValueError for bad arguments."""
    method = call.method
    if method == "pause":
        return PauseRequested(mode=PauseMode(call.pause_mode))
    if method == "sleep":
        mode = PauseMode(call.pause_mode or PauseMode.ABORT.value)
        return SleepRequested(level=call.sleep_level or 0, mode=mode)
    if method == "wake_up":
        tags = None if call.wake_tags is None else frozenset(call.wake_tags)
        return WakeUpRequested(tags=tags)
    requests = {
        "resume": ResumeRequested,
        "reset_prefix_cache": ResetPrefixCache,
        "stats": ReportStats,
    }
    return requests[method]()
