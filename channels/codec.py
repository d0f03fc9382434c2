"""The strict CBOR wire format: messages, batch frames, limits.

A *message* encodes to one CBOR data item, `tag([fields...])` (see `registry`; the
bytes are written by `writer`, which sends long int sequences as typed arrays). A
*frame* is what one nng message carries: either a single message or a batch,
`30000([message, message, ...])`, built by concatenating already-encoded messages behind
an array header (no re-encoding). Frames are decoded in one cbor2 pass with a tag hook:
registered tags become dataclasses bottom-up, tags 40/64-87/30001 become arrays, and
every other tag, including cbor2's own semantic tags (shared references, bignums,
datetimes, sets...), is refused.

Strictness: unknown tag, wrong field count or type, trailing bytes, a frame larger than
`max_message_size` or nested deeper than `max_depth` raise `DecodeError`. A message whose
fields fail their checks inside an otherwise well-formed batch is reported on its own
(`decode_frame` returns the `DecodeError` in its place), so one bad message never drops
its neighbours.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import cbor2

from .builtin_messages import TAG_BATCH
from .errors import DecodeError, EncodeError
from .fields import Rejected
from .registry import MessageRegistry, default_registry
from .typed_arrays import TYPED_ARRAY_TAGS, decode_array_tag

DEFAULT_MAX_MESSAGE_SIZE = 64 * 1024 * 1024
DEFAULT_MAX_DEPTH = 32

# cbor2 decodes these tags itself; strict decoding refuses them all (28/29 could even build
# cyclic structures).
_CBOR2_SEMANTIC_TAGS = (
    0,
    1,
    2,
    3,
    4,
    5,
    25,
    28,
    29,
    30,
    35,
    36,
    37,
    52,
    54,
    100,
    256,
    258,
    260,
    261,
    1004,
    55799,
)


def _refuse_tag(tag: int) -> Any:
    def refuse(value: Any, immutable: bool) -> Any:
        raise DecodeError(f"CBOR tag {tag} is not allowed in wavecore messages")

    return refuse


_REFUSED = {tag: _refuse_tag(tag) for tag in _CBOR2_SEMANTIC_TAGS}


class _BatchItems(tuple):  # type: ignore[type-arg]
    """The decoded content of a batch frame (a marker type, never user-visible)."""


def _array_header(count: int) -> bytes:
    """The CBOR header of a definite-length array (major type 4)."""
    if count < 24:
        return bytes((0x80 | count,))
    if count < 0x100:
        return bytes((0x98, count))
    if count < 0x10000:
        return b"\x99" + count.to_bytes(2, "big")
    return b"\x9a" + count.to_bytes(4, "big")


_BATCH_TAG_HEADER = b"\xd9" + TAG_BATCH.to_bytes(2, "big")


class Codec:
    """Encodes registered messages to bytes and decodes frames back, strictly."""

    def __init__(
        self,
        registry: MessageRegistry = default_registry,
        *,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        max_depth: int = DEFAULT_MAX_DEPTH,
    ) -> None:
        if max_message_size <= 0:
            raise ValueError(f"max_message_size must be positive, got {max_message_size}")
        if max_depth <= 0:
            raise ValueError(f"max_depth must be positive, got {max_depth}")
        self.registry = registry
        self.max_message_size = max_message_size
        self.max_depth = max_depth
        self._decoders = registry.decoders
        self._classes = registry.encoders.keys()
        self._encode = registry.writer.encode

    # -- encoding ------------------------------------------------------------------------

    def encode(self, message: object) -> bytes:
        """One registered message as a CBOR data item (also a valid single-message frame)."""
        try:
            return self._encode(message)
        except EncodeError:
            raise
        except (TypeError, ValueError, OverflowError) as error:
            raise EncodeError(f"cannot encode {type(message).__qualname__}: {error}") from None

    @staticmethod
    def batch_frame(encoded_messages: Iterable[bytes]) -> bytes:
        """One frame carrying several already-encoded messages, in order."""
        items = list(encoded_messages)
        return b"".join((_BATCH_TAG_HEADER, _array_header(len(items)), *items))

    # -- decoding ------------------------------------------------------------------------

    def decode(self, data: bytes) -> Any:
        """Exactly one message; a batch frame or any defect raises `DecodeError`."""
        value = self._decode_item(data)
        if isinstance(value, _BatchItems):
            raise DecodeError("expected a single message, got a batch frame")
        return self._accept(value)

    def decode_frame(self, data: bytes) -> list[Any]:
        """The messages of a frame, in order; a rejected message appears as its DecodeError."""
        value = self._decode_item(data)
        if isinstance(value, _BatchItems):
            return [item if type(item) is not Rejected else _rejection(item) for item in value]
        return [self._accept(value)]

    def _accept(self, value: Any) -> Any:
        if type(value) is Rejected:
            raise _rejection(value)
        if type(value) not in self._classes:
            raise DecodeError(f"expected a registered message, got {_kind(value)}")
        return value

    def _decode_item(self, data: bytes) -> Any:
        if type(data) is not bytes:
            raise DecodeError(f"frames are bytes, got {type(data).__name__}")
        if len(data) > self.max_message_size:
            raise DecodeError(
                f"frame of {len(data)} bytes exceeds max_message_size {self.max_message_size}"
            )
        if not data:
            raise DecodeError("empty frame")
        stream = io.BytesIO(data)
        decoder = cbor2.CBORDecoder(
            stream,
            tag_hook=self._tag_hook,
            semantic_decoders=_REFUSED,
            max_depth=self.max_depth,
            str_errors="strict",
        )
        try:
            value = decoder.decode()
        except DecodeError:
            raise
        except cbor2.CBORDecodeError as error:
            cause = error.__cause__
            if isinstance(cause, DecodeError):
                raise DecodeError(cause.reason) from None
            raise DecodeError(f"malformed CBOR: {error}") from None
        except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as error:
            raise DecodeError(f"malformed CBOR: {type(error).__name__}: {error}") from None
        if stream.tell() != len(data):
            raise DecodeError(f"{len(data) - stream.tell()} trailing bytes after the message")
        return value

    def _tag_hook(self, tag: cbor2.CBORTag, immutable: bool) -> Any:
        number = tag.tag
        decode = self._decoders.get(number)
        if decode is not None:
            return decode(tag.value)
        if number in TYPED_ARRAY_TAGS:
            return decode_array_tag(tag)
        if number == TAG_BATCH:
            return self._batch_items(tag.value)
        raise DecodeError(f"unknown CBOR tag {number}")

    def _batch_items(self, value: Any) -> _BatchItems:
        if type(value) is not tuple:
            raise DecodeError("a batch frame must wrap an array of messages")
        classes = self._classes
        for index, item in enumerate(value):
            if type(item) not in classes and type(item) is not Rejected:
                raise DecodeError(f"batch item {index} is {_kind(item)}, not a message")
        return _BatchItems(value)


def _rejection(rejected: Rejected) -> DecodeError:
    return DecodeError(f"invalid {rejected.type_name}: {rejected.reason}")


def _kind(value: object) -> str:
    if isinstance(value, _BatchItems):
        return "a nested batch"
    return f"a bare {type(value).__name__}"
