"""The startup handshake: agree on wire format, protocol version and configuration.

The dialing side sends `Hello`; the listening side answers `Welcome` with `accepted`
False and a reason on any mismatch, and both sides raise `HandshakeError` naming the
mismatch. Run it over `open_req`/`open_rep` (or a PAIR). The registry fingerprint is
compared too, so that two builds with different message layouts never talk.
"""

from __future__ import annotations

import hashlib
from typing import Any

import cbor2

from .builtin_messages import Hello, Welcome
from .errors import DecodeError, HandshakeError

# 2: long `tuple[int, ...]` / `list[int]` fields travel as typed arrays (see `writer`).
# 3: a closing PUSH sender's barrier frames are `StreamBarrier`, not more end markers.
WIRE_VERSION = 3


def config_hash(config: Any) -> str:
    """A stable digest of plain config data (dicts, lists, str, numbers, bools, None)."""
    try:
        return hashlib.sha256(cbor2.dumps(config, canonical=True)).hexdigest()[:16]
    except (cbor2.CBOREncodeError, TypeError, ValueError) as error:
        raise TypeError(f"config_hash needs plain data: {error}") from None


def _mismatches(mine: tuple[int, int, str, str], theirs: tuple[int, int, str, str]) -> list[str]:
    names = ("wire_version", "protocol_version", "config_hash", "registry_fingerprint")
    return [
        f"{name}: ours {ours!r}, theirs {their!r}"
        for name, ours, their in zip(names, mine, theirs, strict=True)
        if ours != their
    ]


async def request_handshake(
    stream: Any, *, protocol_version: int, config_hash: str, peer_name: str
) -> Welcome:
    """Dialer side: send `Hello`, return the accepting `Welcome` or raise `HandshakeError`."""
    fingerprint = stream.codec.registry.fingerprint()
    await stream.send(
        Hello(
            wire_version=WIRE_VERSION,
            protocol_version=protocol_version,
            config_hash=config_hash,
            registry_fingerprint=fingerprint,
            peer_name=peer_name,
        )
    )
    reply = await stream.receive()
    if type(reply) is not Welcome:
        raise HandshakeError(f"expected Welcome, got {type(reply).__qualname__}")
    if not reply.accepted:
        raise HandshakeError(f"{reply.peer_name} refused the handshake: {reply.reason}")
    problems = _mismatches(
        (WIRE_VERSION, protocol_version, config_hash, fingerprint),
        (reply.wire_version, reply.protocol_version, reply.config_hash, reply.registry_fingerprint),
    )
    if problems:
        raise HandshakeError("handshake mismatch: " + "; ".join(problems))
    return reply


async def answer_handshake(
    stream: Any, *, protocol_version: int, config_hash: str, peer_name: str
) -> Hello:
    """Listener side: receive `Hello`, answer `Welcome`; raise `HandshakeError` on mismatch."""
    fingerprint = stream.codec.registry.fingerprint()
    try:
        hello = await stream.receive()
    except DecodeError as error:
        raise HandshakeError(f"unreadable Hello: {error.reason}") from error
    if type(hello) is not Hello:
        raise HandshakeError(f"expected Hello, got {type(hello).__qualname__}")
    problems = _mismatches(
        (WIRE_VERSION, protocol_version, config_hash, fingerprint),
        (hello.wire_version, hello.protocol_version, hello.config_hash, hello.registry_fingerprint),
    )
    reason = "; ".join(problems)
    await stream.send(
        Welcome(
            wire_version=WIRE_VERSION,
            protocol_version=protocol_version,
            config_hash=config_hash,
            registry_fingerprint=fingerprint,
            peer_name=peer_name,
            accepted=not problems,
            reason=reason,
        )
    )
    if problems:
        raise HandshakeError(f"refused {hello.peer_name}: {reason}")
    return hello
