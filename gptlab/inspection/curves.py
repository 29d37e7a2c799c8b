"""Training curves from runs' metrics.jsonl (`gptlab.train.runlog`): train and val loss and the learning rate,
against the step, the tokens seen or the training time.

A logged row carries step, train_loss, lr, tokens_seen, elapsed_sec (and val_loss when it evaluated; a preference
run's rows reward_margin and reward_accuracy too); the final evaluation is a row of its own with only step,
val_loss, elapsed_sec and tokens_seen (and the benchmarks' "eval/..." scores when the recipe has eval_tasks).
Tokens are the row's tokens_seen: the input tokens the run's steps fed so far, as the trainer summed them (packed
windows at their length, a preference pair's two rows cut after their longest reply). Rows of runs older than that
field have none: theirs are estimated as steps x batch_size x block_size, from the run's config.resolved.json
(batch_size counts sequences per optimizer step over all processes), which counts a pair as one window and whole
model contexts where windows are shorter. A run may have no val rows (eval_interval 0 and killed early): its val
curve is empty.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from gptlab.errors import GptlabError
from gptlab.fileio import parse_json, read_json_object, read_utf8

METRICS_FILE = "metrics.jsonl"  # as gptlab.train.runlog writes it (train sits beside this layer: no import)
RESOLVED_CONFIG = "config.resolved.json"  # checkpoint.layout's name; not imported: that module imports torch
X_AXES = ("step", "tokens", "time")


@dataclass
class Series:
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)


@dataclass
class Curve:
    """One run's curves against the chosen x axis."""

    name: str
    train_loss: Series
    val_loss: Series
    lr: Series
    # a preference run's (dpo, ipo): the chosen reply's reward minus the rejected one's, and how often it is higher
    reward_margin: Series = field(default_factory=Series)
    reward_accuracy: Series = field(default_factory=Series)
    # benchmark scores logged during training (eval_tasks): "eval/<task>/<metric>" -> its series
    evals: dict[str, Series] = field(default_factory=dict)


def _x(row: dict, axis: str, tokens_per_step: Callable[[], int]) -> float:
    if axis == "time":
        return float(row["elapsed_sec"])
    if axis == "step":
        return float(row["step"])
    if _plottable(row.get("tokens_seen")):  # what the trainer counted; older rows: the estimate
        return float(row["tokens_seen"])
    return float(row["step"]) * tokens_per_step()


def _tokens_per_step(run: Path) -> int:
    path = run / RESOLVED_CONFIG
    if not path.is_file():
        raise GptlabError(f"{path} is missing: --x tokens needs the run's batch_size and block_size (its metrics "
                          "rows predate tokens_seen)")
    cfg = read_json_object(path)
    try:
        return int(cfg["train"]["batch_size"]) * int(cfg["model"]["block_size"])
    except (KeyError, TypeError, ValueError):
        raise GptlabError(f"{path} has no train.batch_size and model.block_size") from None


def _plottable(value: object) -> bool:
    """A number a curve can hold: not a bool, and within a float's range (a huge integer is not)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and abs(value) <= 1.7e308


def read_curves(run: str | Path, x: str = "step", name: str | None = None) -> Curve:
    """The curves of one run directory; a one-line error for a run that has logged nothing yet."""
    if x not in X_AXES:
        raise GptlabError(f"--x must be one of {', '.join(X_AXES)}, got {x!r}")
    run = Path(run)
    if not run.is_dir():
        raise GptlabError(f"{run} is not a run directory (`gptlab train --out DIR` makes one)")
    path = run / METRICS_FILE
    text = read_utf8(path) if path.is_file() else ""
    if not text.strip():
        raise GptlabError(f"{run} has no metrics yet: {METRICS_FILE} is written at the first log step "
                          "(log_interval)")
    tokens = cache(lambda: _tokens_per_step(run))  # read only for rows without tokens_seen
    curve = Curve(name or run.resolve().name, Series(), Series(), Series())
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = parse_json(line)
            at = _x(row, x, tokens)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError):
            raise GptlabError(f"{path}:{n} is not a metrics row (step, elapsed_sec, losses)") from None
        for key, series in (("train_loss", curve.train_loss), ("val_loss", curve.val_loss), ("lr", curve.lr),
                            ("reward_margin", curve.reward_margin), ("reward_accuracy", curve.reward_accuracy)):
            if _plottable(row.get(key)):
                series.x.append(at)
                series.y.append(float(row[key]))
        for key, value in row.items():
            if key.startswith("eval/") and _plottable(value):
                series = curve.evals.setdefault(key, Series())
                series.x.append(at)
                series.y.append(float(value))
    if not curve.train_loss.x and not curve.val_loss.x:
        raise GptlabError(f"{path} has no loss rows yet")
    return curve
