"""SamplingParams: every field is validated and a bad value names its field."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wavecore.engine.sampling_params import SamplingParams

BAD_VALUES: dict[str, list[object]] = {
    "max_tokens": [0, -1, 1.5, "3", True, None],
    "min_tokens": [-1, 2.0, "0", False, None],
    "temperature": [-0.1, 100.5, math.nan, math.inf, "1", True, None],
    "top_p": [0.0, -0.5, 1.01, math.nan, "0.5", None],
    "top_k": [-1, 2.5, "5", True, None],
    "min_p": [-0.01, 1.5, math.nan, None, "0"],
    "seed": [-1, 2**63, 1.0, "7", True],
    "repetition_penalty": [0.0, -1.0, 10.5, math.inf, None, "1"],
    "presence_penalty": [-2.01, 2.01, math.nan, None, "0"],
    "frequency_penalty": [-2.01, 2.01, -math.inf, None, "0"],
    "stop": [("",), ("ok", 3), 5, {"a"}, None, ["", "x"]],
    "stop_token_ids": [(-1,), (1.0,), (True,), ("2",), 7, None],
    "ignore_eos": [1, 0, "yes", None],
    "logprobs": [-1, 21, 1.0, "2", True],
    "structured_outputs": [{"json": {}}, "regex", 1, True],
}


def test_every_field_has_bad_values_under_test() -> None:
    assert set(BAD_VALUES) == {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize(
    ("field", "value"),
    [(field, value) for field, values in BAD_VALUES.items() for value in values],
)
def test_bad_value_raises_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_defaults_are_valid_and_random() -> None:
    params = SamplingParams()
    assert params.temperature == 1.0 and not params.greedy
    assert params.stop == () and params.stop_token_ids == ()


def test_temperature_zero_is_greedy() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_min_tokens_may_not_exceed_max_tokens() -> None:
    SamplingParams(max_tokens=4, min_tokens=4)
    with pytest.raises(ValueError, match=r"min_tokens \(5\) must not exceed max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_lists_and_a_single_stop_string_are_frozen_into_tuples() -> None:
    params = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4])
    assert params.stop == ("a", "bc") and params.stop_token_ids == (3, 4)
    assert SamplingParams(stop="end").stop == ("end",)
    assert hash(params) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=(3, 4)))


def test_params_are_frozen_and_keyword_only() -> None:
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError):
        SamplingParams(16)  # type: ignore[misc]


@pytest.mark.parametrize(
    "values",
    [
        {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0},
        {"temperature": 100.0, "top_p": 1e-9, "top_k": 10**6, "min_p": 1.0},
        {"seed": 0, "logprobs": 0},
        {"seed": 2**63 - 1, "logprobs": 20},
        {"repetition_penalty": 10.0, "presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"temperature": 1, "top_p": 1, "repetition_penalty": 1},
    ],
)
def test_boundary_values_are_accepted(values: dict[str, object]) -> None:
    params = SamplingParams(**values)
    for name, value in values.items():
        assert getattr(params, name) == value


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": st.integers(1, 10_000),
            "temperature": st.floats(0.0, 100.0),
            "top_p": st.floats(0.0, 1.0, exclude_min=True),
            "top_k": st.integers(0, 100_000),
            "min_p": st.floats(0.0, 1.0),
            "seed": st.integers(0, 2**63 - 1),
            "repetition_penalty": st.floats(0.0, 10.0, exclude_min=True),
            "presence_penalty": st.floats(-2.0, 2.0),
            "frequency_penalty": st.floats(-2.0, 2.0),
            "stop": st.lists(st.text(min_size=1), max_size=4).map(tuple),
            "stop_token_ids": st.lists(st.integers(0, 2**20), max_size=4).map(tuple),
            "ignore_eos": st.booleans(),
            "logprobs": st.none() | st.integers(0, 20),
        },
    )
)
def test_any_in_range_combination_is_accepted(values: dict[str, object]) -> None:
    params = SamplingParams(**values)
    for name, value in values.items():
        assert getattr(params, name) == value
