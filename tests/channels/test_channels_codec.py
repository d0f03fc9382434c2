"""The wire format: round trips for every registered type, strictness, fuzzing."""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass

import cbor2
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wavecore.channels import Codec, DecodeError, EncodeError, MessageRegistry, RegistrationError
from wavecore.channels.testing import conformance_registry

registry = MessageRegistry()


class Finish(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"


class Priority(enum.IntEnum):
    LOW = 0
    HIGH = 1


@registry.register(tag=31000)
@dataclass(frozen=True, slots=True, kw_only=True)
class Output:
    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: Finish | None


@registry.register(tag=31001)
@dataclass(frozen=True, slots=True, kw_only=True)
class Everything:
    number: int
    ratio: float
    flag: bool
    blob: bytes
    nothing: None
    pair: tuple[str, int]
    names: list[str]
    scores: dict[str, float]
    priority: Priority
    outputs: tuple[Output, ...]
    maybe: Output | None


@registry.register(tag=31002)
@dataclass(frozen=True, slots=True, kw_only=True)
class Arrays:
    array: np.ndarray
    tensor: torch.Tensor


@registry.register(tag=31003)
@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutputs:
    """The columnar per-step output shape recommended in `wavecore.channels`."""

    step: int
    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    token_counts: list[int]
    finish_reasons: tuple[Finish | None, ...]


@registry.register(tag=31004)
@dataclass(frozen=True, slots=True, kw_only=True)
class Checked:
    value: int

    def __post_init__(self) -> None:
        if self.value < 0:
            raise ValueError("value must be non-negative")


codec = Codec(registry)
ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
text = st.text(max_size=20)
outputs = st.builds(
    Output,
    request_id=text,
    new_token_ids=st.tuples() | st.lists(ints, max_size=40).map(tuple),
    finish_reason=st.none() | st.sampled_from(Finish),
)
everything = st.builds(
    Everything,
    number=ints,
    ratio=st.floats(allow_nan=False),
    flag=st.booleans(),
    blob=st.binary(max_size=32),
    nothing=st.none(),
    pair=st.tuples(text, ints),
    names=st.lists(text, max_size=4),
    scores=st.dictionaries(text, st.floats(allow_nan=False), max_size=4),
    priority=st.sampled_from(Priority),
    outputs=st.lists(outputs, max_size=4).map(tuple),
    maybe=st.none() | outputs,
)


@given(outputs)
def test_output_round_trip(message: Output) -> None:
    assert codec.decode(codec.encode(message)) == message


@given(everything)
def test_everything_round_trip(message: Everything) -> None:
    decoded = codec.decode(codec.encode(message))
    assert decoded == message
    assert type(decoded.priority) is Priority and type(decoded.names) is list


@given(
    st.builds(
        lambda seq, payload: conformance_registry.types()[31990](seq=seq, payload=payload),
        ints,
        st.binary(max_size=16),
    )
)
def test_conformance_message_round_trip(message: object) -> None:
    conformance = Codec(conformance_registry)
    assert conformance.decode(conformance.encode(message)) == message


@pytest.mark.parametrize(
    "dtype",
    [
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "bool",
    ],
)
def test_numpy_dtypes_round_trip(dtype: str) -> None:
    array = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    message = Arrays(array=array, tensor=torch.zeros(0))
    decoded = codec.decode(codec.encode(message))
    assert decoded.array.dtype == array.dtype and decoded.array.shape == array.shape
    np.testing.assert_array_equal(decoded.array, array)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16]
)
def test_tensor_round_trip(dtype: torch.dtype) -> None:
    tensor = (torch.arange(12) % 5).to(dtype).reshape(3, 4)
    decoded = codec.decode(codec.encode(Arrays(array=np.zeros(1), tensor=tensor)))
    assert decoded.tensor.dtype == dtype and torch.equal(decoded.tensor, tensor)


def test_arrays_travel_as_rfc8746_typed_arrays() -> None:
    encoded = codec.encode(Arrays(array=np.ones(3, dtype=np.float32), tensor=torch.zeros(1)))
    raw = cbor2.loads(encoded)
    array = raw.value[0]
    assert array.tag == 40 and list(array.value[0]) == [3] and array.value[1].tag == 85


def test_messages_are_positional_arrays() -> None:
    raw = cbor2.loads(codec.encode(Output(request_id="r", new_token_ids=(1,), finish_reason=None)))
    assert raw.tag == 31000 and list(raw.value) == ["r", (1,), None]


def _raw(tag: int, *fields: object) -> bytes:
    return cbor2.dumps(cbor2.CBORTag(tag, list(fields)))


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (_raw(31999, 1), "unknown CBOR tag 31999"),
        (_raw(31000, "r", [1]), "expected 3 fields, got 2"),
        (_raw(31000, "r", [1], None, 4), "expected 3 fields, got 4"),
        (_raw(31000, 5, [1], None), "field 'request_id': expected str, got int"),
        (_raw(31000, "r", [1, "x"], None), "field 'new_token_ids': [1]: expected int, got str"),
        (_raw(31000, "r", [True], None), "expected int, got bool"),
        (_raw(31003, 1, ["a", 2], [], [], []), "field 'request_ids': [1]: expected str, got int"),
        (_raw(31003, 1, [], [], [1.5], []), "field 'token_counts': [0]: expected int, got float"),
        (_raw(31000, "r", [], "bogus"), "'bogus' is not a Finish"),
        (_raw(31000, "r", [], None) + b"\x00", "1 trailing bytes"),
        (
            cbor2.dumps(cbor2.CBORTag(31000, cbor2.CBORTag(28, ["r", [], None]))),
            "tag 28 is not allowed",
        ),
        (cbor2.dumps([1, 2]), "expected a registered message"),
        (b"", "empty frame"),
        (b"\x81" * 100, "depth"),
        (
            cbor2.dumps(
                cbor2.CBORTag(31002, [cbor2.CBORTag(40, [[5], cbor2.CBORTag(85, b"\0" * 8)]), None])
            ),
            "do not match",
        ),
    ],
)
def test_strict_decoding_names_the_problem(data: bytes, reason: str) -> None:
    with pytest.raises(DecodeError, match=None) as info:
        codec.decode(data)
    assert reason in info.value.reason


def test_oversize_frames_are_refused() -> None:
    small = Codec(registry, max_message_size=64)
    data = codec.encode(Output(request_id="r" * 100, new_token_ids=(), finish_reason=None))
    with pytest.raises(DecodeError, match="exceeds max_message_size"):
        small.decode(data)


def test_registration_errors() -> None:
    other = MessageRegistry()

    @dataclass(frozen=True)
    class Fine:
        value: int

    with pytest.raises(RegistrationError, match="outside the registrable range"):
        other.register(Fine, tag=30005)
    other.register(Fine, tag=31000)
    with pytest.raises(RegistrationError, match="already taken"):
        other.register(tag=31000)(
            dataclass(frozen=True)(type("Other", (), {"__annotations__": {"x": int}}))
        )

    @dataclass
    class Mutable:
        value: int

    with pytest.raises(RegistrationError, match="frozen"):
        other.register(Mutable, tag=31001)

    @dataclass(frozen=True)
    class Weird:
        value: set[int]

    with pytest.raises(RegistrationError, match="unsupported field type"):
        other.register(Weird, tag=31002)


def test_unregistered_values_cannot_be_encoded() -> None:
    @dataclass(frozen=True)
    class Stranger:
        value: int

    with pytest.raises(EncodeError, match="not a registered message"):
        codec.encode(Stranger(value=1))
    with pytest.raises(EncodeError, match="cannot be sent"):
        codec.encode(Output(request_id="r", new_token_ids=(object(),), finish_reason=None))  # type: ignore[arg-type]


@given(st.binary(max_size=200))
def test_fuzz_random_bytes_only_raise_decode_error(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        codec.decode_frame(data)


samples = [
    codec.encode(Output(request_id="abc", new_token_ids=(1, 2, 3), finish_reason=Finish.STOP)),
    codec.batch_frame(
        [
            codec.encode(Output(request_id=str(i), new_token_ids=(i,), finish_reason=None))
            for i in range(3)
        ]
    ),
    codec.encode(Arrays(array=np.arange(6, dtype=np.int32).reshape(2, 3), tensor=torch.ones(2))),
    codec.encode(Output(request_id="t", new_token_ids=tuple(range(-3, 9)), finish_reason=None)),
]


@given(
    st.sampled_from(samples),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
    st.integers(0, 10_000),
)
def test_fuzz_mutated_frames_only_raise_decode_error(
    sample: bytes, flips: list[tuple[int, int]], cut: int
) -> None:
    data = bytearray(sample)
    for position, value in flips:
        data[position % len(data)] = value
    with contextlib.suppress(DecodeError):
        codec.decode_frame(bytes(data[: max(1, cut % (len(data) + 1))]))


step_outputs = st.integers(0, 40).flatmap(
    lambda size: st.builds(
        StepOutputs,
        step=st.integers(0, 2**31),
        request_ids=st.lists(text, min_size=size, max_size=size).map(tuple),
        token_ids=st.lists(ints, max_size=3 * size).map(tuple),
        token_counts=st.lists(st.integers(0, 3), min_size=size, max_size=size),
        finish_reasons=st.lists(
            st.none() | st.sampled_from(Finish), min_size=size, max_size=size
        ).map(tuple),
    )
)


@given(step_outputs)
def test_columnar_step_outputs_round_trip(message: StepOutputs) -> None:
    decoded = codec.decode(codec.encode(message))
    assert decoded == message
    assert type(decoded.token_ids) is tuple and type(decoded.token_counts) is list
    assert all(type(token) is int for token in decoded.token_ids)


def _token_ids_on_the_wire(token_ids: tuple[object, ...]) -> object:
    message = Output(request_id="r", new_token_ids=token_ids, finish_reason=None)  # type: ignore[arg-type]
    return cbor2.loads(codec.encode(message)).value[1]


@pytest.mark.parametrize(
    ("token_ids", "tag"),
    [
        (tuple(range(8)), 70),  # uint32
        (tuple(range(-4, 4)), 79),  # int64
        ((2**63,) * 8, 71),  # uint64
        ((2**32,) * 8, 79),  # too wide for uint32
    ],
)
def test_long_int_sequences_travel_as_typed_arrays(token_ids: tuple[int, ...], tag: int) -> None:
    wire = _token_ids_on_the_wire(token_ids)
    assert isinstance(wire, cbor2.CBORTag) and wire.tag == tag
    decoded = codec.decode(
        codec.encode(Output(request_id="r", new_token_ids=token_ids, finish_reason=None))
    )
    assert decoded.new_token_ids == token_ids


@pytest.mark.parametrize(
    "token_ids",
    [tuple(range(7)), (1, 2, 3, 4, 5, 6, 7, True), (-(2**64),) + (1,) * 7],
)
def test_short_or_mixed_int_sequences_travel_as_plain_arrays(token_ids: tuple[int, ...]) -> None:
    assert list(_token_ids_on_the_wire(token_ids)) == list(token_ids)  # type: ignore[call-overload]


def test_ints_outside_64_bits_cannot_be_encoded() -> None:
    with pytest.raises(EncodeError, match="64-bit"):
        codec.encode(Output(request_id="r", new_token_ids=(2**64,), finish_reason=None))


def _typed(tag: int, data: bytes) -> cbor2.CBORTag:
    return cbor2.CBORTag(tag, data)


@pytest.mark.parametrize(
    ("token_ids", "reason"),
    [
        (_typed(85, b"\0" * 8), "expected int, got a typed array of float32"),
        (_typed(70, b"\0" * 7), "7 bytes is not a multiple of 4"),
        (_typed(66, b"\0" * 8), "unknown CBOR tag 66"),  # big-endian uint32: refused
        (_typed(70, "text"), "must wrap a byte string"),
        (cbor2.CBORTag(40, [[2, 2], _typed(70, b"\0" * 16)]), "one-dimensional"),
        (cbor2.CBORTag(40, [[3], _typed(70, b"\0" * 16)]), "do not match"),
        (cbor2.CBORTag(30001, ["bool", cbor2.CBORTag(40, [[2], _typed(64, b"\0\1")])]), "of bool"),
    ],
)
def test_malformed_typed_int_sequences_are_refused(token_ids: object, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        codec.decode(_raw(31000, "r", token_ids, None))
    assert reason in info.value.reason


def test_post_init_rejections_become_decode_errors() -> None:
    assert codec.decode(_raw(31004, 3)) == Checked(value=3)
    with pytest.raises(DecodeError, match="rejected by Checked: value must be non-negative"):
        codec.decode(_raw(31004, -1))


def test_a_bad_field_rejects_only_its_message_in_a_batch() -> None:
    good = codec.encode(Output(request_id="a", new_token_ids=tuple(range(9)), finish_reason=None))
    bad = _raw(31000, "b", _typed(85, b"\0" * 4), None)
    decoded = codec.decode_frame(codec.batch_frame([good, bad, good]))
    assert decoded[0] == decoded[2] == codec.decode(good)
    assert isinstance(decoded[1], DecodeError) and "float32" in decoded[1].reason


@pytest.mark.parametrize(
    "array",
    [
        np.array(3.5, dtype=np.float32),  # 0-d
        np.arange(12).reshape(3, 4)[:, ::2],  # not contiguous
        np.zeros((0, 3)),
        np.arange(4, dtype=">i4"),  # big-endian: sent little-endian
    ],
)
def test_array_shapes_and_layouts_round_trip(array: np.ndarray) -> None:
    decoded = codec.decode(codec.encode(Arrays(array=array, tensor=torch.tensor(2.0))))
    assert decoded.array.shape == array.shape and decoded.tensor.shape == ()
    np.testing.assert_array_equal(decoded.array, array)
