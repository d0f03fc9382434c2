"""The messages `wavecore.channels` itself sends: end of stream and the handshake.

They live in the reserved tag range; every `MessageRegistry` registers `BUILTIN_MESSAGES`
when it is created. This module only declares them and imports nothing of this package,
so the registry can depend on it and not the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# Each built-in class with its reserved tag, in registration order.
BUILTIN_MESSAGES: tuple[tuple[type, int], ...] = (
    (EndOfStream, TAG_END_OF_STREAM),
    (StreamBarrier, TAG_STREAM_BARRIER),
    (Hello, TAG_HELLO),
    (Welcome, TAG_WELCOME),
)
