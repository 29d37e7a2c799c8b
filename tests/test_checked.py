"""gptlab.checked: a field's bound holds exactly for the values its requirement names, and the configurations that
use it refuse every value out of range in one `InvalidField` naming the field."""

from __future__ import annotations

import dataclasses
import math
import types
import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gptlab.checked import Bound, InvalidField, bounded, bounds_of, check_fields
from gptlab.config import GPTConfig, switches_of
from gptlab.generation.params import InvalidSamplingParam, SamplingParams
from gptlab.train.config import TrainConfig

values = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                   st.text(max_size=3))
ends = st.one_of(st.none(), st.integers(-5, 5))


@given(value=values, kind=st.sampled_from([int, float]), low=ends, high=ends, low_open=st.booleans(),
       high_open=st.booleans(), optional=st.booleans())
def test_a_bound_holds_exactly_for_the_values_it_describes(value, kind, low, high, low_open, high_open, optional):
    bound = Bound(kind, low, high, low_open, high_open, optional)
    if value is None:
        expected = optional
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and isinstance(value, float)):
        expected = False
    elif not math.isfinite(value):
        expected = False
    else:
        above = low is None or (value > low if low_open else value >= low)
        below = high is None or (value < high if high_open else value <= high)
        expected = above and below
    assert bound.holds(value) == expected


@pytest.mark.parametrize(("bound", "text"), [
    (Bound(int, 1, 65536), "must be an integer in [1, 65536]"),
    (Bound(float, 0, low_open=True), "must be a number > 0"),
    (Bound(float, 0, 1, high_open=True, optional=True), "must be in [0, 1) or null"),
    (Bound(float), "must be a number (finite)"),
    (Bound(int, 2, optional=True), "must be an integer >= 2 or null"),
])
def test_a_requirement_reads_as_the_bound(bound: Bound, text: str) -> None:
    assert bound.requirement() == text


def test_the_first_field_out_of_range_is_named_with_its_value() -> None:
    @dataclasses.dataclass
    class Settings:
        width: int = bounded(8, int, low=1)
        rate: float = bounded(0.5, low=0, high=1)

    check_fields(Settings())
    with pytest.raises(InvalidField, match=r"^width must be an integer >= 1, got 0$") as e:
        check_fields(Settings(width=0, rate=2.0))
    assert (e.value.field, e.value.value) == ("width", 0)
    with pytest.raises(InvalidField, match=r"^lr\.rate must be in \[0, 1\], got nan$"):
        check_fields(Settings(rate=math.nan), prefix="lr.")


def numeric_fields(cls: type) -> list[str]:
    """Fields holding one number (or None): not lists of numbers, which keep their hand-written rules."""
    hints = typing.get_type_hints(cls)

    def options(tp: object) -> set:
        return set(typing.get_args(tp)) if typing.get_origin(tp) in (typing.Union, types.UnionType) else {tp}

    return [f.name for f in dataclasses.fields(cls) if {int, float} & options(hints[f.name])]


@pytest.mark.parametrize("cls", [GPTConfig, SamplingParams, TrainConfig])
def test_every_number_of_the_configurations_has_its_bound(cls: type) -> None:
    assert set(numeric_fields(cls)) <= set(bounds_of(cls)), set(numeric_fields(cls)) - set(bounds_of(cls))


@pytest.mark.parametrize("name", sorted(bounds_of(GPTConfig)))
def test_gptconfig_refuses_each_number_out_of_range_naming_it(name: str) -> None:
    for bad in (math.nan, math.inf, -1, True, "1"):
        with pytest.raises(InvalidField) as e:
            GPTConfig(**{name: bad})
        assert e.value.field == name, e.value


@pytest.mark.parametrize("name", sorted(switches_of(GPTConfig)))
def test_gptconfig_refuses_a_switch_that_is_not_a_bool_naming_it(name: str) -> None:
    # "false" from a hand-written JSON config is truthy: taken as given, it built the other model
    for bad in ("false", "true", 0, 1, [], *([] if switches_of(GPTConfig)[name] else [None])):
        with pytest.raises(InvalidField) as e:
            GPTConfig(**{name: bad})
        assert e.value.field == name and "true or false" in str(e.value), e.value


@pytest.mark.parametrize("name", sorted(bounds_of(SamplingParams)))
def test_sampling_params_refuse_each_number_out_of_range_naming_it(name: str) -> None:
    for bad in (math.nan, math.inf, True, "1"):
        with pytest.raises(InvalidSamplingParam) as e:
            SamplingParams(**{name: bad})
        assert e.value.field == name and isinstance(e.value, InvalidField), e.value
