"""wavecore.channels: messages between client, coordinator and engine ranks.

Two layers:

* the wire format (`registry`, `fields`, `typed_arrays`, `codec`): frozen dataclasses
  registered under CBOR tags, encoded as positional arrays, decoded strictly;
* the transport (`nng_io`, `streams`, `sockets`, `handshake`): pynng sockets driven by
  anyio on asyncio or trio, with per-tick batching, bounded buffers and anyio's
  end-of-stream / closed / broken vocabulary.

`wavecore.channels.testing.check_channel_pair` is the conformance suite for channel pairs.
This package never imports `wavecore.engine`.
"""

from .builtin_messages import EndOfStream, Hello, Welcome
from .codec import DEFAULT_MAX_DEPTH, DEFAULT_MAX_MESSAGE_SIZE, Codec
from .errors import (
    ChannelError,
    DecodeError,
    EncodeError,
    HandshakeError,
    MessageTooLargeError,
    RegistrationError,
)
from .handshake import WIRE_VERSION, answer_handshake, config_hash, request_handshake
from .registry import (
    ENGINE_TAGS,
    EXPERIMENT_TAGS,
    RESERVED_TAGS,
    MessageRegistry,
    default_registry,
)
from .sockets import open_pair, open_pub, open_pull, open_push, open_rep, open_req, open_sub
from .streams import MessageReceiver, MessageSender, MessageStream

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "ENGINE_TAGS",
    "EXPERIMENT_TAGS",
    "RESERVED_TAGS",
    "WIRE_VERSION",
    "ChannelError",
    "Codec",
    "DecodeError",
    "EncodeError",
    "EndOfStream",
    "HandshakeError",
    "Hello",
    "MessageReceiver",
    "MessageRegistry",
    "MessageSender",
    "MessageStream",
    "MessageTooLargeError",
    "RegistrationError",
    "Welcome",
    "answer_handshake",
    "config_hash",
    "default_registry",
    "open_pair",
    "open_pub",
    "open_pull",
    "open_push",
    "open_rep",
    "open_req",
    "open_sub",
    "request_handshake",
]
