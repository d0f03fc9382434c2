"""The lockstep group's store, signed (`engine/dp/signed_store.py`): a stranger who
reaches the TCPStore but lacks the channel key cannot have a value of its own taken
for a member's (written, or copied from another key), and what it writes or reads
beside the members' own writes does not disturb the group forming."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from dp_helpers import in_two_ranks

from wavecore.channels import ChannelKey
from wavecore.engine.dp.collective import DPGroup
from wavecore.engine.dp.signed_store import (
    STORE_CHANNEL,
    SignedStore,
    StoreAuthenticationError,
    open_group_store,
)

TIMEOUT = timedelta(seconds=20)  # a hang guard: every wait here ends at once


@pytest.fixture
def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)


def stranger(server: dist.TCPStore) -> dist.TCPStore:
    """A client of the store with no key: it reads and writes raw values."""
    return dist.TCPStore("127.0.0.1", server.port, None, False, timeout=TIMEOUT)


def test_a_value_not_written_with_the_key_is_refused(server: dist.TCPStore) -> None:
    key = ChannelKey.generate()
    # A short timeout: how long a refused value is read again before the refusal.
    short = timedelta(seconds=0.05)
    member = open_group_store("127.0.0.1", server.port, size=1, timeout=short, key=key)
    member.set("group/0/0", b"member 0's address")
    assert member.get("group/0/0") == b"member 0's address"
    other = stranger(server)
    other.set("group/0/1", b"the stranger's address")
    with pytest.raises(StoreAuthenticationError, match="'group/0/1' fails authentication"):
        member.get("group/0/1")
    # A signed value moved to another key, or written under another engine's key.
    other.set("group/0/1", other.get("group/0/0"))
    with pytest.raises(StoreAuthenticationError):
        member.get("group/0/1")
    foreign = SignedStore(stranger(server), ChannelKey.generate().derived(STORE_CHANNEL))
    foreign.set("group/0/1", b"the stranger's address")
    with pytest.raises(StoreAuthenticationError):
        member.get("group/0/1")
    for short in (b"", b"x" * 15):
        other.set("group/0/1", short)
        with pytest.raises(StoreAuthenticationError):
            member.get("group/0/1")


def test_a_group_forms_over_the_signed_store_with_a_stranger_writing_and_reading(
    server: dist.TCPStore,
) -> None:
    other = stranger(server)
    # Before the members: a value under a member's own key (which its write replaces:
    # a peer that reads the stranger's value first reads again) and under keys of no
    # member.
    other.set("strange/0/0", b"x")
    other.set("strange/arrived/9", b"1")
    other.set("elsewhere", b"y")

    def vote(rank: int) -> Any:
        def run(group: DPGroup) -> bool:
            group.start_vote(has_unfinished=rank == 1, pending_pause=False, wave=0, step_counter=1)
            return group.await_vote().any_unfinished

        return run

    results = in_two_ranks([vote(0), vote(1)], port=server.port, prefix="strange")
    assert results == [True, True]
    # Readable, but signed: what a stranger reads is a member's value with its MAC.
    assert len(other.get("strange/0/0")) > 16
