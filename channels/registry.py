"""The message registry: which frozen dataclasses may travel, and under which CBOR tag.

A message is `tag([field0, field1, ...])`: a CBOR tag naming the class around a
positional array of its fields in declaration order (never a map of field names). The
registry compiles, once per class, a writer (generated code, see `writer.CborWriter`;
long int-sequence fields become typed arrays) and a decoder (generated straight-line
code around one `FieldCheck` per field, see `fields`), so the hot path does no
introspection.

Tag plan (all in CBOR's first-come-first-served range; tags below 30000 are IANA's and
are never registered here):

* 30000-30099: `wavecore.channels` itself (batch frame 30000, array dtype marker 30001,
  end-of-stream 30002, handshake 30010-30011). Reserved; `register` refuses them.
* 30100-30999: the `wavecore.engine` protocol.
* 31000-31999: tests, benchmarks and experiments.

`default_registry` is the one the engine should use; separate `MessageRegistry()`
instances (each with the channel built-ins) are for tests and tools.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import cbor2

from .builtin_messages import BUILTIN_MESSAGES
from .errors import DecodeError, RegistrationError
from .fields import FieldCheck, Rejected, compile_check, exact_type, field_kind
from .writer import CborWriter

T = TypeVar("T")

RESERVED_TAGS = range(30000, 30100)
ENGINE_TAGS = range(30100, 31000)
EXPERIMENT_TAGS = range(31000, 32000)
_REGISTRABLE = range(ENGINE_TAGS.start, EXPERIMENT_TAGS.stop)

MessageDecoder = Callable[[Any], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class MessageType:
    """What the registry knows about one registered class."""

    cls: type
    tag: int
    field_names: tuple[str, ...]
    field_hints: tuple[str, ...]
    decode: MessageDecoder


class MessageRegistry:
    """Maps registered dataclasses to CBOR tags and back.

    Register with the decorator form::

        @registry.register(tag=30100)
        @dataclass(frozen=True, slots=True, kw_only=True)
        class Submit:
            request_id: str
            prompt_token_ids: tuple[int, ...]
    """

    def __init__(self) -> None:
        self._by_tag: dict[int, MessageType] = {}
        self._by_class: dict[type, MessageType] = {}
        # `Codec` encodes with `writer`; `encoders` is for tools that call cbor2 directly
        # ({class: encoder(encoder, value)}, without typed-array int sequences).
        self.encoders: dict[type, Callable[[Any, Any], None]] = {}
        self.writer = CborWriter()
        self.decoders: dict[int, MessageDecoder] = {}
        for cls, tag in BUILTIN_MESSAGES:
            self.register_reserved(cls, tag=tag)

    def register(self, cls: type[T] | None = None, *, tag: int) -> Any:
        """Register `cls` under `tag` (30100-31999); usable as a decorator."""
        if tag not in _REGISTRABLE:
            raise RegistrationError(
                f"tag {tag} is outside the registrable range "
                f"{_REGISTRABLE.start}-{_REGISTRABLE.stop - 1} (see wavecore.channels.registry)"
            )

        def decorate(target: type[T]) -> type[T]:
            self._add(target, tag)
            return target

        return decorate if cls is None else decorate(cls)

    def register_reserved(self, cls: type[T], *, tag: int) -> type[T]:
        """For `wavecore.channels` itself: register a built-in in the reserved range."""
        if tag not in RESERVED_TAGS:
            raise RegistrationError(f"tag {tag} is not in the reserved range")
        self._add(cls, tag)
        return cls

    def message_type(self, cls: type) -> MessageType:
        try:
            return self._by_class[cls]
        except KeyError:
            raise RegistrationError(f"{cls.__qualname__} is not registered") from None

    def is_registered(self, cls: type) -> bool:
        return cls in self._by_class

    def types(self) -> dict[int, type]:
        """Every registered class by tag."""
        return {tag: entry.cls for tag, entry in sorted(self._by_tag.items())}

    def fingerprint(self) -> str:
        """A short digest of every tag, class name and field: equal on both ends or mismatch."""
        layout = [
            [tag, entry.cls.__qualname__, list(entry.field_names), list(entry.field_hints)]
            for tag, entry in sorted(self._by_tag.items())
        ]
        return hashlib.sha256(cbor2.dumps(layout, canonical=True)).hexdigest()[:16]

    def _add(self, cls: type, tag: int) -> None:
        name = getattr(cls, "__qualname__", repr(cls))
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise RegistrationError(f"{name} must be a dataclass to be registered")
        if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise RegistrationError(f"{name} must be a frozen dataclass")
        if tag in self._by_tag:
            raise RegistrationError(
                f"tag {tag} is already taken by {self._by_tag[tag].cls.__qualname__}"
            )
        if cls in self._by_class:
            raise RegistrationError(
                f"{name} is already registered with tag {self._by_class[cls].tag}"
            )
        fields = dataclasses.fields(cls)
        if any(not field.init for field in fields):
            raise RegistrationError(f"{name}: every field must be an __init__ field")
        try:
            hints = typing.get_type_hints(cls)
        except NameError as error:
            raise RegistrationError(f"{name}: cannot resolve type hints ({error})") from None
        names = tuple(field.name for field in fields)
        checks = tuple(compile_check(hints[n], f"{name}.{n}") for n in names)
        entry = MessageType(
            cls=cls,
            tag=tag,
            field_names=names,
            field_hints=tuple(repr(hints[n]) for n in names),
            decode=_message_decoder(cls, names, checks, tuple(exact_type(hints[n]) for n in names)),
        )
        self._by_tag[tag] = entry
        self._by_class[cls] = entry
        self.encoders[cls] = _message_encoder(tag, names)
        self.writer.add_message(cls, tag, tuple((n, field_kind(hints[n])) for n in names))
        self.decoders[tag] = entry.decode


def _message_encoder(tag: int, names: tuple[str, ...]) -> Callable[[Any, Any], None]:
    if not names:

        def encode_empty(encoder: Any, value: Any) -> None:
            encoder.encode(cbor2.CBORTag(tag, ()))

        return encode_empty
    getter = operator.attrgetter(*names)
    if len(names) == 1:

        def encode_one(encoder: Any, value: Any) -> None:
            encoder.encode(cbor2.CBORTag(tag, (getter(value),)))

        return encode_one

    def encode(encoder: Any, value: Any) -> None:
        encoder.encode(cbor2.CBORTag(tag, getter(value)))

    return encode


def _message_decoder(
    cls: type,
    names: tuple[str, ...],
    checks: tuple[FieldCheck, ...],
    exact: tuple[type | None, ...],
) -> MessageDecoder:
    """Generate the decoder of one class: unpack, check each field, construct.

    The source is generated (as `dataclasses` does for `__init__`) so that the hot path is
    straight-line code: a field whose value already has its hint's exact type (str, int,
    float, bytes, bool, None, a nested message) costs one `type(x) is T` test, any other
    goes through its `FieldCheck`.
    Field errors reject only this message (`Rejected`), so that the rest of a batch frame
    still arrives; structural garbage elsewhere fails the whole frame.
    """
    type_name = cls.__qualname__
    namespace: dict[str, Any] = {
        "cls": cls,
        "type_name": type_name,
        "Rejected": Rejected,
        "DecodeError": DecodeError,
    }
    lines = [
        "def decode(value):",
        "    if type(value) is not tuple:",
        "        return Rejected(type_name, 'expected a positional array of fields')",
        f"    if len(value) != {len(names)}:",
        f"        return Rejected(type_name, f'expected {len(names)} fields, got {{len(value)}}')",
    ]
    if names:
        lines.append(f"    {''.join(f'f{i}, ' for i in range(len(names)))}= value")
    for index, (name, check, exact_kind) in enumerate(zip(names, checks, exact, strict=True)):
        namespace[f"check{index}"] = check
        namespace[f"exact{index}"] = exact_kind
        namespace[f"where{index}"] = f"field {name!r}: "
        test = "" if exact_kind is None else f"if type(f{index}) is not exact{index}: "
        lines += [
            "    try:",
            f"        {test}f{index} = check{index}(f{index})",
            "    except DecodeError as error:",
            f"        return Rejected(type_name, where{index} + error.reason)",
        ]
    if _plain_slotted_init(cls, names):
        # The generated __init__ would only store the fields: store them straight into the
        # slots (a frozen __init__ pays for object.__setattr__ and keyword parsing).
        namespace["new"] = object.__new__
        lines.append("    message = new(cls)")
        for index, name in enumerate(names):
            namespace[f"store{index}"] = cls.__dict__[name].__set__
            lines.append(f"    store{index}(message, f{index})")
        lines.append("    return message")
    else:
        arguments = ", ".join(f"{name}=f{index}" for index, name in enumerate(names))
        lines += [
            "    try:",
            f"        return cls({arguments})",
            "    except (TypeError, ValueError) as error:",
            "        return Rejected(type_name, f'rejected by {type_name}: {error}')",
        ]
    # The source is built above from field names (identifiers) and indices only.
    exec("\n".join(lines), namespace)
    return namespace["decode"]


def _plain_slotted_init(cls: type, names: tuple[str, ...]) -> bool:
    """Whether `cls(**fields)` would do nothing but store each field in its slot.

    True for a slotted dataclass whose `__init__` is the one `dataclasses` generated (its
    code comes from `exec`, file "<string>") and that has no `__post_init__`.
    """
    init = cls.__dict__.get("__init__")
    code = getattr(init, "__code__", None)
    return (
        code is not None
        and code.co_filename == "<string>"
        and cls.__dataclass_params__.init  # type: ignore[attr-defined]
        and not hasattr(cls, "__post_init__")
        and all(isinstance(cls.__dict__.get(name), types.MemberDescriptorType) for name in names)
    )


default_registry = MessageRegistry()
