"""Every recipe key at its extremes, written to a TOML file and run through `gptlab train`: either the run trains
(a tiny model, 2 steps) and exits 0, or the command exits 2 with one `error:` line naming the key. Never an internal
error (GPTLAB_DEBUG=1 turns one into a failing exception here), a traceback, a hang (a SIGALRM bound per row) or a
huge allocation (the process's peak resident memory may not jump during a row).

`test_recipe_extremes` checks the same values against `build_train_config`; this sweep adds what only a real run
shows: the data's vocabulary, the memory check, the trainer's own set-up. Rows run in-process (`gptlab.cli.main`);
a handful run as real processes to prove the exit code and the one line on stderr.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, TINY_RECIPE, cli_outcome, make_data, one_line_error

from gptlab.train.recipe import _MODEL_FIELDS, _TRAIN_FIELDS

KEYS = sorted(set(_TRAIN_FIELDS) | set(_MODEL_FIELDS))
SLOW_KEYS = {"compile", "eval_tasks"}  # torch.compile's first compile, lm-eval's task index: ~15 s each
ROW_SECONDS = 120  # a bound per row, not a performance target: only a hang comes near it
ROW_MEMORY_MB = 1024  # a row that raises the peak resident memory by more than this made a huge allocation
# TOML text of each extreme; TOML has nan and inf, and integers of any size reach the reader as Python ints
EXTREMES = {"zero": "0", "minus-one": "-1", "huge": str(2**70), "half": "0.5", "text": '"x"', "empty": '""',
            "true": "true", "list": "[1]", "table": "{ a = 1 }", "nan": "nan", "inf": "inf", "minus-inf": "-inf",
            "huge-string": '"' + "x" * 1_000_000 + '"'}
BASE = {**TINY_RECIPE, "max_steps": 2, "warmup_steps": 1, "log_interval": 1, "eval_interval": 2, "eval_tokens": 64,
        "batch_size": 2, "block_size": 16}
# rows that run a long time by design: a run of 2**70 steps trains until it is stopped (max_time bounds it here)
BOUNDED_BY_TIME = {("max_steps", "huge"): {"max_time": 2.0}}


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def write_row(path: Path, key: str, literal: str, extra: dict[str, object]) -> Path:
    values = {k: toml_value(v) for k, v in {**BASE, **extra}.items() if k != key}
    path.write_text("".join(f"{k} = {v}\n" for k, v in values.items()) + f"{key} = {literal}\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recipe_cli")
    return {"root": root, "data": make_data(root, chars=3000)}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def check_row(world: dict[str, Path], key: str, label: str) -> str | None:
    """None when `key = EXTREMES[label]` trained or was refused in one line naming the key, else what went wrong."""
    name = f"{key}-{label}"
    recipe = write_row(world["root"] / f"{name}.toml", key, EXTREMES[label], BOUNDED_BY_TIME.get((key, label), {}))
    before = peak_rss_mb()
    rc, lines = cli_outcome(["train", str(recipe), "--data", str(world["data"]), "--out", str(world["root"] / name),
                         "--quiet"], ROW_SECONDS)
    grew = peak_rss_mb() - before
    recipe.unlink()
    if grew > ROW_MEMORY_MB:
        return f"{name}: peak memory grew by {grew:.0f} MB"
    if rc == 0:
        return None
    errors = [line for line in lines if line.startswith("error:")]
    if rc != 2 or len(errors) != 1:
        return f"{name}: exit {rc}, {lines[-3:]}"
    aliases = (key, key.replace("_", " "), "preset", "model")  # `model` names a preset
    if not any(a in errors[0] for a in aliases):
        return f"{name}: the error does not name {key}: {errors[0][:200]}"
    return None


@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_KEYS else k for k in KEYS])
def test_every_recipe_key_at_its_extremes_trains_or_exits_2_naming_it(
    key: str, world: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPTLAB_DEBUG", "1")  # an internal error raises here instead of printing one line
    monkeypatch.setenv("GPTLAB_NO_KERNELS", "1")  # which kernel runs is not what a recipe key's check is about
    failures = [f for label in EXTREMES if (f := check_row(world, key, label))]
    assert not failures, "\n".join(failures)


# --- a few as real processes: the exit code and the one line on stderr, as a user sees them ----------------------
@pytest.mark.parametrize(("key", "label"), [("lr", "nan"), ("n_embd", "text"), ("batch_size", "huge"),
                                            ("dropout", "table")])
def test_a_bad_recipe_key_exits_2_with_one_line_from_a_process(world: dict[str, Path], key: str, label: str) -> None:
    recipe = write_row(world["root"] / f"process-{key}.toml", key, EXTREMES[label], {})
    env = {**os.environ, "GPTLAB_NO_KERNELS": "1"}
    proc = subprocess.run([sys.executable, "-m", "gptlab.cli", "train", str(recipe), "--data", str(world["data"]),
                           "--out", str(world["root"] / f"process-{key}"), "--quiet"], capture_output=True,
                          text=True, timeout=600, env=env, cwd=REPO)
    line = one_line_error(proc.returncode, proc.stderr)
    assert key in line or key.replace("_", " ") in line, line
