"""Keeping a PULL receiver open while a scale removes some of its senders.

A PULL receiver ends once it has counted its expected end-of-stream markers, and a
closing PUSH sender sends up to `MARKERS_PER_SENDER` of them (the channels layer repeats
the marker so that it is surely on the wire). A rank that leaves during serving would
thus end the client's output receiver or the coordinator early: before ranks leave,
the receivers expect that many more markers. An overestimate only matters at shutdown,
where the launcher's grace period and reaping bound it. The channels layer has no public
call for this yet, so this one place reaches into it.
"""

from __future__ import annotations

from wavecore.channels import MessageReceiver

MARKERS_PER_SENDER = 3


def expect_more_ends(receiver: MessageReceiver, markers: int) -> None:
    if markers < 0:
        raise ValueError(f"expect_more_ends needs markers >= 0, got {markers}")
    receiver._reader._ends_left += markers  # see the module docstring
