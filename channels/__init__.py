"""wavecore.channels: messages between client, coordinator and engine ranks.

Two layers:

* the wire format (`registry`, `fields`, `typed_arrays`, `codec`): frozen dataclasses
  registered under CBOR tags, encoded as positional arrays, decoded strictly;
* the transport (`nng_io`, `streams`, `sockets`, `handshake`): pynng sockets driven by
  anyio on asyncio or trio, with per-tick batching, bounded buffers and anyio's
  end-of-stream / closed / broken vocabulary; frames signed and checked with a shared
  key where the deployment gives one (`frame_signer`).

`wavecore.channels.testing.check_channel_pair` is the conformance suite for channel pairs.
This package never imports `wavecore.engine`.

Message shapes that stay fast: the cost of a message grows with the number of CBOR items
in it, not with its bytes. A field declared `tuple[int, ...]` / `list[int]` travels as one
typed array once it holds 8 or more ints (see `writer`), so per-step outputs should be
*columnar*, one message per step rather than one small message per request::

    @dataclass(frozen=True, slots=True, kw_only=True)
    class StepOutputs:
        step: int
        request_ids: tuple[str, ...]  # the requests that produced tokens this step
        token_ids: tuple[int, ...]  # their new tokens, concatenated in request order
        token_counts: tuple[int, ...]  # request i owns the next token_counts[i] token_ids
        finish_reasons: tuple[str | None, ...]  # None while request i is still running

(bench/channels.py measures exactly this message, `step_round_us`, against the row-wise
`tuple[Output, ...]` shape, `step_rows_round_us`.)
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
from .frame_signer import KEY_ENVIRONMENT, ChannelKey, FrameSigner
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
from .tls import ChannelTLS

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "ENGINE_TAGS",
    "EXPERIMENT_TAGS",
    "KEY_ENVIRONMENT",
    "RESERVED_TAGS",
    "WIRE_VERSION",
    "ChannelError",
    "ChannelKey",
    "ChannelTLS",
    "Codec",
    "DecodeError",
    "EncodeError",
    "EndOfStream",
    "FrameSigner",
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
