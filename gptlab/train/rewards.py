"""GRPO's verifiable rewards: the recipe names a Python function, gptlab has one built in, and a task to try it on.

A reward function has the signature

    def reward(prompt: str, completion: str, reference: str) -> float

`prompt` is the prompt's text as the model saw it (the chat template's rendering), `completion` the sampled reply
without its stop string, `reference` the record's own completion (the reply `gptlab prepare` stored, cut where a
reply stops). A recipe names it as `reward = "package.module:function"` (importable from where `gptlab train`
runs); `load_reward` resolves it before the first step, with a one-line error for a name that does not import, and
`reward_value` stops the run with one naming it when it returns anything but a finite number.

Built in: `exact_match`, 1.0 when the completion's first line equals the reference's (whitespace around them
ignored), else 0.0; and `arithmetic_records`, an endless supply of sums ("12+7=" -> "19") written as
prompt/completion records, for an SFT stage and then GRPO on the same format (README, `benchmarks/grpo_arithmetic.py`).

No torch here: the recipe is checked (`check_rollout_settings`) before anything heavy is imported.
"""

from __future__ import annotations

import importlib
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

from gptlab.errors import GptlabError

RewardFunction = Callable[[str, str, str], float]


def exact_match(prompt: str, completion: str, reference: str) -> float:
    """1.0 when the completion's first line is the reference's (surrounding whitespace ignored), else 0.0."""
    return float(_first_line(completion) == _first_line(reference))


def _first_line(text: str) -> str:
    stripped = text.strip()
    return stripped.splitlines()[0].strip() if stripped else ""


def load_reward(spec: str) -> RewardFunction:
    """The function `spec` ("module:function") names; a GptlabError naming it when it cannot be imported."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise GptlabError(f"reward = {spec!r}: expected \"module:function\", e.g. gptlab.train.rewards:exact_match")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise GptlabError(f"reward = {spec!r}: cannot import {module_name} ({e})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise GptlabError(f"reward = {spec!r}: {module_name} has no function {name}")
    return function


def reward_value(spec: str, value: Any) -> float:
    """A reward function's return as a finite float; a GptlabError naming the function for anything else (a None
    or a nan would otherwise make its group's advantages nan, and the run stop on a nan loss)."""
    try:
        number = math.nan if isinstance(value, (str, bytes)) else float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise GptlabError(f"reward = {spec!r} returned {str(value)[:40]!r} for a completion: a reward must be a "
                          "finite number")
    return number


def arithmetic_records(n: int, seed: int, digits: int = 2) -> Iterator[dict[str, str]]:
    """`n` prompt/completion records "a+b=" -> "a+b" with a, b of up to `digits` digits, drawn from `seed`."""
    draw = random.Random(seed)
    top = 10**digits - 1
    for _ in range(n):
        a, b = draw.randint(0, top), draw.randint(0, top)
        yield {"prompt": f"{a}+{b}=", "completion": str(a + b)}


def check_rollout_settings(cfg: Any) -> None:
    """One-line errors for GRPO's keys beyond their ranges (which `TrainConfig`'s fields bound): the reward
    must import (a TrainConfig; called by its `validate`)."""
    if cfg.objective == "grpo":
        load_reward(cfg.reward)
