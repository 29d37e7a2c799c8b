"""The files a run directory holds, and gptlab's caches beside it, damaged in every way their format allows, in the
style of test_damaged_files (whose WHOLE and VALUES damages these reuse: empty, cut, not JSON, not UTF-8, binary,
NaN, huge, nested 100,000 deep, a directory in the file's place; every key removed, set to each wrong value, and
one key added).

A run's files (RUN_FILES: a row per file and the readers that read it: `gptlab plot`, `--resume`, `sample` /
`eval` through `load_model`, `eval`'s default data, `upload`'s model card) answer in one line naming the file, or
read fine. A cache
(CACHES: hardware.json's measured FLOP/s, kernels.json's probe choices) is measured again and rewritten, silently.
A new file kind is one row.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import make_data, write_recipe
from test_damaged_files import VALUES, WHOLE, assert_one_line_or_loads, damage_whole

from gptlab.cli import main


def _plot(run: Path) -> None:
    from gptlab.inspection.curves import read_curves

    read_curves(run)
    read_curves(run, x="tokens")
    read_curves(run, x="time")


def _resume(run: Path) -> None:
    from gptlab.train.rundir import checkpoint_to_resume, trim_metrics

    checkpoint_to_resume(run)
    trim_metrics(run / "metrics.jsonl", 1, quiet=True)


def _load(run: Path) -> None:
    from gptlab.loading import load_model

    load_model(run)


def _card(run: Path) -> None:
    from gptlab.interop.upload import read_run

    read_run(run)


def _eval_data(run: Path) -> None:
    from gptlab.checkpoint import recorded_data_dir

    recorded_data_dir(run)  # what `gptlab eval RUN` scores without --data
    recorded_data_dir(run / STEP)


STEP = "checkpoints/step-0000002"
# (file in the run directory, what reads it)
RUN_FILES: list[tuple[str, Callable[[Path], None]]] = [
    ("metrics.jsonl", _plot), ("metrics.jsonl", _resume), ("metrics.jsonl", _card),
    ("config.resolved.json", _plot), ("config.resolved.json", _card), ("config.resolved.json", _eval_data),
    (f"{STEP}/state.json", _resume), (f"{STEP}/state.json", _load), ("checkpoints/best/state.json", _load),
]  # a checkpoint's config.json and tokenizer_meta.json: test_damaged_files' FILES


@pytest.fixture(scope="module")
def good_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("damaged_run")
    data = make_data(root, chars=8000)
    recipe = write_recipe(root, max_steps=2, checkpoint_interval=2, eval_interval=2, log_interval=1,
                          eval_tokens=128, warmup_steps=1)
    run = root / "run"
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run), "--quiet"]) == 0
    return run


def _copy(good_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(good_run, run)
    return run


def _key_damages(row: dict) -> list[tuple[str, dict]]:
    """Each key removed and set to each of VALUES, and one unknown key added."""
    out = [("extra-key", {**row, "unexpected": 1})]
    for key in row:
        out.append((f"{key}=removed", {k: v for k, v in row.items() if k != key}))
        out += [(f"{key}={label}", {**row, key: value}) for label, value in VALUES.items()]
    return out


def _check(read: Callable[[Path], None], run: Path, name: str, label: str, failures: list[str]) -> None:
    try:
        assert_one_line_or_loads(read, run, name)
    except BaseException as e:  # noqa: BLE001 - collected: one report lists every damage that fails
        failures.append(f"{label}: {type(e).__name__}: {' '.join(str(e).split())[:160]}")


@pytest.mark.parametrize(("name", "read"), RUN_FILES, ids=lambda x: getattr(x, "__name__", x))
def test_a_damaged_run_file_is_one_line_naming_it(good_run: Path, tmp_path: Path, name: str,
                                                  read: Callable[[Path], None]) -> None:
    failures: list[str] = []
    for how in WHOLE:
        run = _copy(good_run, tmp_path / f"whole-{how}")
        damage_whole(run / name, how)
        _check(read, run, name, f"whole {how}", failures)
    run = _copy(good_run, tmp_path / "keys")
    path = run / name
    original = path.read_text()
    lines = original.splitlines() if name.endswith(".jsonl") else [original]
    for index in sorted({0, len(lines) - 1}):  # a row of a .jsonl (the first and the last), or the whole object
        row = json.loads(lines[index])
        damages = _key_damages(row) + [(f"line {how}", how) for how in WHOLE if how not in ("cut", "directory")]
        for label, damaged in damages:
            text = WHOLE[damaged].decode("utf-8", "replace") if isinstance(damaged, str) else json.dumps(damaged)
            path.write_text("\n".join([*lines[:index], text, *lines[index + 1:]]) + "\n")
            _check(read, run, name, f"row {index} {label}", failures)
        path.write_text(original)
    assert not failures, "\n".join(failures)


# --- caches: measured again, silently -----------------------------------------------------------------------------
def _hardware(cache: Path) -> None:
    from gptlab import hardware

    flops = hardware.peak_flops("cpu")
    assert math.isfinite(flops) and flops > 0


PROBES: list[object] = []


def _quick_probe(device: object, dtype: object, n: int, seconds: float) -> float:
    """hardware's matmul probe as a constant, counted: what is tested is the cache around it (a real probe, a
    quarter of a second of matmuls, ran once per damage)."""
    PROBES.append(device)
    return 1e11


CACHES: list[tuple[str, Callable[[Path], None]]] = [("hardware.json", _hardware)]


@pytest.mark.parametrize(("name", "measure"), CACHES, ids=lambda x: getattr(x, "__name__", x))
def test_a_damaged_cache_is_measured_again_and_rewritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         name: str, measure: Callable[[Path], None]) -> None:
    from gptlab import hardware

    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path))
    measure(tmp_path)  # the real probe, once
    monkeypatch.setattr(hardware, "_probe", _quick_probe)
    PROBES.clear()
    good = json.loads((tmp_path / name).read_text())
    damages = [(how, None) for how in WHOLE] + [(label, {k: value for k in good}) for label, value in VALUES.items()]
    for how, content in damages:
        path = tmp_path / name
        if path.is_dir():
            path.rmdir()
        path.write_text(json.dumps(good))
        if content is None:
            damage_whole(path, how)
        else:
            path.write_text(json.dumps(content))
        before = len(PROBES)
        measure(tmp_path)  # no exception, a sound measurement
        value = None if content is None else next(iter(content.values()))
        usable = isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf
        assert len(PROBES) == before + (not usable), f"{how}: measured again only where the value is unusable"
        if how != "directory":
            assert isinstance(json.loads(path.read_text()), dict), how  # rewritten as a JSON object


@pytest.mark.parametrize("how", list(WHOLE))
def test_the_cache_reader_gives_an_empty_object_for_any_damage(tmp_path: Path, how: str) -> None:
    """kernels.json and hardware.json go through one reader: whatever is wrong, the caller measures again."""
    from gptlab.fileio import read_json_or_empty

    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"key": {"choice": "torch"}}))
    damage_whole(path, how)
    assert read_json_or_empty(path) == {} or how in ("cut",)
