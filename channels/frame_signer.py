"""Authenticated frames: a keyed MAC and a counter on every frame of a channel.

Theory of operation:

1. A `ChannelKey` is a secret shared by every process of one deployment (32 random
   bytes by default). Each channel derives a key of its own from it and the channel's
   name (`ChannelKey.signer(name)`), which both ends give: a frame recorded on one
   channel fails the check on every other.
2. A `FrameSigner` is one end of one channel. `sign` puts a header in front of the
   frame: this end's sender id (8 random bytes, new for every signer), a counter that
   grows by one per frame, and a BLAKE2b MAC (16 bytes) over the header, the frame and
   what travels beside it in clear (a PUB frame's topic, which SUB filters on).
3. `verify` checks the MAC first (in constant time) and decodes nothing of a frame
   that fails it; then the counter, which must be above the last one accepted from
   that sender id: a frame replayed, or delivered twice, is refused. Each receiving end
   remembers the last counter of `MAX_SENDERS` sender ids, the oldest forgotten first
   (a channel has a handful of senders: its peers, and a new id per process restart).
4. A refusal raises `DecodeError`, which a receiver hands to its `on_invalid` handler
   (counted and logged there) and skips: no unauthenticated byte reaches the decoder.

What this protects against, and what it does not: anyone who can reach a socket but
does not hold the key can neither inject, forge, splice nor replay a frame, nor end a
stream. It does not hide what crosses the network (prompts and outputs travel in the
clear over tcp: keep that traffic on a private network, or give the key TLS files,
`with_tls`, which `sockets` applies to every tcp channel), nor does it stop a process
that holds the key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections import OrderedDict
from pathlib import Path

from .errors import DecodeError
from .tls import ChannelTLS

KEY_SIZE = 32
_ID_SIZE = 8
_COUNTER_SIZE = 8
_MAC_SIZE = 16
SIGNATURE_SIZE = _ID_SIZE + _COUNTER_SIZE + _MAC_SIZE
MAX_SENDERS = 4096
# The environment variable a headless process may take its key from (hex), so that
# the key never shows on a command line.
KEY_ENVIRONMENT = "WAVECORE_CHANNEL_KEY"


class ChannelKey:
    """A deployment's shared secret; `signer(name)` gives one end of channel `name`.
    It also carries this process's TLS files for tcp channels, if any (`tls`): the
    credentials of a channel travel together to every process and every socket."""

    __slots__ = ("_secret", "tls")

    def __init__(self, secret: bytes, tls: ChannelTLS | None = None) -> None:
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("a channel key needs at least 16 bytes")
        self._secret = secret
        self.tls = tls

    def with_tls(self, tls: ChannelTLS | None) -> ChannelKey:
        return ChannelKey(self._secret, tls)

    @classmethod
    def generate(cls) -> ChannelKey:
        return cls(secrets.token_bytes(KEY_SIZE))

    @classmethod
    def from_hex(cls, text: str, *, source: str = "the key") -> ChannelKey:
        try:
            secret = bytes.fromhex(text.strip())
        except ValueError:
            raise ValueError(f"{source} is not hexadecimal") from None
        if len(secret) < 16:
            raise ValueError(f"{source} holds {len(secret)} bytes; a channel key needs 16 or more")
        return cls(secret)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ChannelKey:
        """Read a key file (hex, e.g. `openssl rand -hex 32 > key`)."""
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read the channel key file {path}: {error}") from None
        return cls.from_hex(text, source=f"the channel key file {path}")

    def hex(self) -> str:
        return self._secret.hex()

    def derived(self, channel: str) -> bytes:
        """The key of channel `channel` alone (32 bytes), derived from the secret."""
        return hashlib.blake2b(
            channel.encode(), key=self._secret, digest_size=32, person=b"wavecore-chan"
        ).digest()

    def signer(self, channel: str) -> FrameSigner:
        return FrameSigner(self.derived(channel), tls=self.tls)

    def __repr__(self) -> str:  # never the secret itself
        return "ChannelKey(...)"

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled for spawned processes: it travels in multiprocessing's pipe, never argv.
        return (ChannelKey, (self._secret, self.tls))


class FrameSigner:
    """One end of one channel: signs what it sends, verifies what it receives."""

    __slots__ = ("_counter", "_key", "_last_seen", "_sender", "tls")

    def __init__(self, key: bytes, *, tls: ChannelTLS | None = None) -> None:
        self._key = key
        # The TLS files of this end's tcp socket (`sockets` applies them).
        self.tls = tls
        self._sender = secrets.token_bytes(_ID_SIZE)
        self._counter = 0
        self._last_seen: OrderedDict[bytes, int] = OrderedDict()

    def _mac(self, header: bytes, beside: bytes, frame: bytes | memoryview) -> bytes:
        mac = hashlib.blake2b(key=self._key, digest_size=_MAC_SIZE)
        mac.update(header)
        mac.update(len(beside).to_bytes(4, "big"))
        mac.update(beside)
        mac.update(frame)
        return mac.digest()

    def sign(self, frame: bytes, beside: bytes = b"") -> bytes:
        """`frame` signed, the MAC covering `beside` too (a topic sent in clear)."""
        self._counter += 1
        header = self._sender + self._counter.to_bytes(_COUNTER_SIZE, "big")
        return header + self._mac(header, beside, frame) + frame

    def verify(self, signed: bytes, beside: bytes = b"") -> bytes:
        """The frame inside `signed` (with `beside` as it was signed); raises
        `DecodeError` (rule 4) when it fails."""
        if len(signed) < SIGNATURE_SIZE:
            raise DecodeError(f"an unauthenticated frame ({len(signed)} bytes, no signature)")
        view = memoryview(signed)
        header = bytes(view[: _ID_SIZE + _COUNTER_SIZE])
        frame = view[SIGNATURE_SIZE:]
        mac = bytes(view[_ID_SIZE + _COUNTER_SIZE : SIGNATURE_SIZE])
        if not hmac.compare_digest(mac, self._mac(header, beside, frame)):
            raise DecodeError("a frame that failed authentication (wrong key or altered)")
        sender, counter = header[:_ID_SIZE], int.from_bytes(header[_ID_SIZE:], "big")
        last = self._last_seen.get(sender, 0)
        if counter <= last:
            raise DecodeError(f"a replayed frame (counter {counter}, last accepted {last})")
        self._last_seen[sender] = counter
        self._last_seen.move_to_end(sender)
        if len(self._last_seen) > MAX_SENDERS:
            self._last_seen.popitem(last=False)
        return bytes(frame)
