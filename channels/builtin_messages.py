"""The messages `wavecore.channels` itself sends: end of stream and the handshake.

They live in the reserved tag range and are registered into every `MessageRegistry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .registry import MessageRegistry

TAG_BATCH = 30000
TAG_END_OF_STREAM = 30002
TAG_STREAM_BARRIER = 30003
TAG_HELLO = 30010
TAG_WELCOME = 30011


@dataclass(frozen=True, slots=True, kw_only=True)
class EndOfStream:
    """Sent by a closing sender after its last message; the receiver then ends its stream."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamBarrier:
    """Sent twice after a PUSH sender's `EndOfStream`: once nng accepts the second, the
    marker is on the wire. Receivers skip it, so each sender ends exactly once."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """The first message of a connection, from the dialing side."""

    wire_version: int  # the `wavecore.channels` frame format
    protocol_version: int  # the application's (engine's) protocol
    config_hash: str
    registry_fingerprint: str
    peer_name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Welcome:
    """The answer to `Hello`; `accepted` is False with a `reason` on any mismatch."""

    wire_version: int
    protocol_version: int
    config_hash: str
    registry_fingerprint: str
    peer_name: str
    accepted: bool
    reason: str


def register_builtins(registry: MessageRegistry) -> None:
    registry.register_reserved(EndOfStream, tag=TAG_END_OF_STREAM)
    registry.register_reserved(StreamBarrier, tag=TAG_STREAM_BARRIER)
    registry.register_reserved(Hello, tag=TAG_HELLO)
    registry.register_reserved(Welcome, tag=TAG_WELCOME)
