"""Every recipe key (training and model) at its extremes, from a TOML recipe and from the command line: either a
config comes back or one line naming the key; never another exception. Non-finite numbers, negative numbers
and wrong types are refused for every key, so none can reach a run as a silent nan or a crash."""

from __future__ import annotations

import math
import typing

import pytest

from gptlab.errors import GptlabError
from gptlab.train.recipe import _MODEL_FIELDS, _TRAIN_FIELDS, _field_type, build_train_config

KEYS = sorted(set(_TRAIN_FIELDS) | set(_MODEL_FIELDS))
EXTREMES = {"zero": 0, "minus-one": -1, "huge": 2**62, "huge-float": 1e308, "tiny": 1e-300, "nan": math.nan,
            "inf": math.inf, "minus-inf": -math.inf, "text": "x", "empty": "", "list": [1], "table": {"a": 1},
            "true": True}
ALWAYS_REFUSED = ("minus-one", "nan", "inf", "minus-inf")  # no key takes a negative or non-finite value
NUMERIC = [k for k in KEYS if any(t in (int, float) for t in (_field_type(k), *typing.get_args(_field_type(k))))
           or (typing.get_origin(_field_type(k)) is tuple and float in typing.get_args(_field_type(k)))]
NEEDS = {"lora_rank": {"init_from": "base"}}  # a key that is checked only with another


def outcome(values: dict[str, object], overrides: dict[str, str] | None = None) -> str | None:
    """None when the values make a config, else the one-line error."""
    try:
        build_train_config(values, overrides)
    except (GptlabError, ValueError) as e:
        message = str(e)
        assert "\n" not in message, message
        return message
    return None


@pytest.mark.parametrize("key", KEYS)
def test_every_key_at_its_extremes_is_a_config_or_one_line_naming_it(key: str) -> None:
    aliases = (key, key.replace("_", " "), "preset")  # `model` names a preset
    for label, value in EXTREMES.items():
        message = outcome({**NEEDS.get(key, {}), key: value})
        if message is not None:
            assert any(a in message for a in aliases), f"{key}={label}: {message}"
        elif label in ALWAYS_REFUSED:
            pytest.fail(f"{key} = {value!r} was accepted")


@pytest.mark.parametrize("key", NUMERIC)
def test_every_numeric_key_from_the_command_line_refuses_nan_inf_and_negatives(key: str) -> None:
    for text in ("nan", "inf", "-inf", "-1", "1e999"):
        message = outcome(dict(NEEDS.get(key, {})), {key: text})
        assert message is not None, f"--{key.replace('_', '-')} {text} was accepted"
        assert key in message or key.replace("_", " ") in message or "preset" in message, message


# --- the Python API's sampling fields (the CLI's flags and the server's fields reach them through from_fields) --
SAMPLING_VALUES = {**EXTREMES, "null": None, "list-of-text": ["x"], "list-of-huge": [2**70], "list-of-nan": [math.nan],
                   "bias-nan": {"1": math.nan}, "hundred-thousand": list(range(100_000))}


def sampling_fields() -> list[str]:
    import dataclasses

    from gptlab.generation.params import SamplingParams

    return [f.name for f in dataclasses.fields(SamplingParams)]


@pytest.mark.parametrize("name", sampling_fields())
def test_every_sampling_field_at_its_extremes_is_params_or_one_line_naming_it(name: str) -> None:
    from gptlab.generation.params import SamplingParams

    for label, value in SAMPLING_VALUES.items():
        try:
            SamplingParams(**{name: value})
        except ValueError as e:  # InvalidSamplingParam, what the CLI and the server turn into exit 2 / a 400
            assert str(e).startswith(name) and "\n" not in str(e), f"{name}={label}: {e}"
