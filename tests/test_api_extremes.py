"""The Python API's arguments at their extremes and wrong types: `generate` / `generate_batch` either generate
or raise a ValueError naming the argument; never a TypeError / AttributeError / OverflowError deep inside the
engine. (SamplingParams' own fields are swept in test_recipe_extremes.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_model

from gptlab.errors import GptlabError
from gptlab.generation.api import generate, generate_batch
from gptlab.generation.params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=2, temperature=0)
VALUES = {"zero": 0, "minus-one": -1, "huge": 2**70, "nan": math.nan, "inf": math.inf, "float": 1.5, "text": "x",
          "empty-text": "", "none": None, "true": True, "list": [1], "nested": [[1]], "table": {"a": 1}}


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def outcome(call) -> str | None:  # noqa: ANN001 - a zero-argument callable
    try:
        call()
    except (GptlabError, ValueError) as e:
        assert "\n" not in str(e), str(e)
        return str(e)
    return None


@pytest.mark.parametrize("label", VALUES)
def test_every_prompt_token_at_its_extremes_is_generated_or_refused_as_the_prompt(model, label: str) -> None:
    value = VALUES[label]
    message = outcome(lambda: generate_batch(model, [[value]], GREEDY))
    if label not in ("zero",):  # only a real token id in the vocabulary is a prompt
        assert message is not None and "prompt" in message, f"{label}: {message}"


@pytest.mark.parametrize("argument", ["params", "tokenizer", "speculate", "steering", "prompts"])
@pytest.mark.parametrize("label", VALUES)
def test_every_generate_batch_argument_at_its_extremes_names_itself(model, argument: str, label: str) -> None:
    value = VALUES[label]
    kwargs = {argument: value} if argument != "prompts" else {}
    prompts = value if argument == "prompts" else [[1, 2]]
    if argument == "params":
        message = outcome(lambda: generate_batch(model, prompts, value))
    else:
        message = outcome(lambda: generate_batch(model, prompts, GREEDY, **kwargs))
    if message is not None:
        assert argument.rstrip("s") in message, f"{argument}={label}: {message}"


@pytest.mark.parametrize("argument", ["pad_id", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
                                      "not_a_field"])
@pytest.mark.parametrize("label", VALUES)
def test_every_generate_keyword_at_its_extremes_names_itself(model, argument: str, label: str) -> None:
    idx = torch.tensor([[1, 2], [3, 4]])
    kwargs = {"max_new_tokens": 2, "temperature": 0, argument: VALUES[label]}
    message = outcome(lambda: generate(model, idx, **kwargs))
    if message is not None:
        assert argument in message, f"{argument}={label}: {message}"
    if argument == "not_a_field":
        assert message is not None


@pytest.mark.parametrize("idx", [torch.zeros((0, 3), dtype=torch.long), torch.ones((1, 2)), torch.ones((1, 2)).bool(),
                                 torch.ones((1, 1, 1), dtype=torch.long), [[1, 2]], torch.tensor([[300]])])
def test_an_idx_that_is_not_token_ids_is_refused_by_name(model, idx) -> None:  # noqa: ANN001
    message = outcome(lambda: generate(model, idx, 2))
    assert message is not None and ("idx" in message or "prompt" in message), message


def test_a_huge_pad_id_that_fits_is_used_and_one_past_is_refused(model) -> None:
    idx = torch.tensor([[1], [2]], dtype=torch.int16)
    out = generate(model, idx, 3, temperature=0, stop_token_ids=list(range(256)), pad_id=32767)
    assert out.shape == (2, 2) and out.dtype == torch.int16  # every token stops: one step each, nothing padded
    assert outcome(lambda: generate(model, idx, 3, pad_id=32768)) is not None


def test_zero_new_tokens_gives_the_prompt_back(model) -> None:
    idx = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(generate(model, idx, 0), idx)
