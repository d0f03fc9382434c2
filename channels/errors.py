"""The exceptions of `wavecore.channels`.

Everything the package raises for bad data derives from `ChannelError`. Transport
lifetime errors use anyio's vocabulary instead (`anyio.EndOfStream`,
`anyio.ClosedResourceError`, `anyio.BrokenResourceError`, `anyio.BusyResourceError`), so
that channels compose with anyio's own streams.
"""

from __future__ import annotations


class ChannelError(Exception):
    """Base class of every data error raised by `wavecore.channels`."""


class RegistrationError(ChannelError, TypeError):
    """A message class cannot be registered (bad tag, unsupported field type, duplicate)."""


class EncodeError(ChannelError, ValueError):
    """A value cannot be put on the wire (unregistered type, unsupported dtype, too large)."""


class DecodeError(ChannelError, ValueError):
    """Received bytes are not a valid message; `reason` says why in plain words.

    Decoding never constructs anything but registered dataclasses, builtin containers,
    enums of registered fields, and numpy arrays / torch tensors.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MessageTooLargeError(EncodeError):
    """A frame to send exceeds the channel's `max_message_size`; nothing was sent."""


class HandshakeError(ChannelError):
    """The peer speaks another protocol version or runs with another configuration."""
