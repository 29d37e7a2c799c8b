"""dtype and compile "auto" on a CPU: decided by timing the run's own step (gptlab.train.autotune).

The decision logic runs against scripted runs on a fake clock (each step "takes" what the test says), so what is
asserted is the choice for given step times, never a machine's speed. One real run shows the wiring: a tiny
recipe with dtype "auto" trains with a concrete dtype recorded in its checkpoint, and resumes with that one.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from helpers import make_data, write_recipe

from gptlab.checkpoint import list_step_checkpoints
from gptlab.cli import main
from gptlab.train import autotune
from gptlab.train.config import TrainConfig


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class ScriptedRuns:
    """make_probe for `choose`: each run's step advances the fake clock by its candidate's milliseconds."""

    def __init__(self, clock: Clock, ms: dict[str, float], fail_compile: bool = False) -> None:
        self.clock, self.ms, self.fail_compile, self.made = clock, ms, fail_compile, []

    @contextlib.contextmanager
    def __call__(self, cfg: TrainConfig):  # noqa: ANN204
        name = cfg.dtype + ("+compile" if cfg.compile else "")
        self.made.append(name)
        if cfg.compile and self.fail_compile:
            raise RuntimeError("inductor cannot")
        runs = self

        class Run:
            def train_step(self) -> torch.Tensor:
                runs.clock.now += runs.ms[name] / 1000
                return torch.tensor(1.0)

        yield Run()


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Clock:
    fake = Clock()
    monkeypatch.setattr(autotune, "time", fake)
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "busy", lambda: False)
    monkeypatch.setattr(autotune, "native_low_precision_matmul", lambda dtype: True)
    return fake


def _cfg(**changes: object) -> TrainConfig:
    return TrainConfig(**{"model": "tiny", "dtype": "auto", "compile": "auto", "max_steps": 100, **changes})


@pytest.mark.parametrize(("fp32_ms", "bf16_ms", "want"), [(50.0, 30.0, "bfloat16"), (30.0, 50.0, "float32")])
def test_the_faster_dtype_is_chosen_and_reported(clock: Clock, fp32_ms: float, bf16_ms: float, want: str) -> None:
    runs = ScriptedRuns(clock, {"float32": fp32_ms, "bfloat16": bf16_ms})
    choice = autotune.choose(_cfg(), runs, {"vocab_size": 65})
    assert (choice.dtype, choice.compile) == (want, False)
    assert choice.ms_per_step == pytest.approx({"float32": fp32_ms, "bfloat16": bf16_ms})
    assert runs.made == ["float32", "bfloat16"] * autotune.ROUNDS  # a run of 100 steps is short: no compile tried
    assert f"float32 {fp32_ms:.1f} ms/step" in choice.describe() and "does not pay back" in choice.describe()


def test_without_native_bf16_float32_is_kept_unmeasured(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(autotune, "native_low_precision_matmul", lambda dtype: False)
    runs = ScriptedRuns(clock, {})
    choice = autotune.choose(_cfg(), runs, {})
    assert (choice.dtype, choice.compile, runs.made) == ("float32", False, [])
    assert "emulated" in choice.why


def test_the_choice_is_cached_per_shape_and_a_damaged_entry_is_measured_again(clock: Clock) -> None:
    runs = ScriptedRuns(clock, {"float32": 50.0, "bfloat16": 30.0})
    first = autotune.choose(_cfg(), runs, {"vocab_size": 65})
    again = autotune.choose(_cfg(seed=7, max_steps=200), runs, {"vocab_size": 65})  # the seed and length: same key
    measured = len(runs.made)
    assert measured == 2 * autotune.ROUNDS and again.dtype == first.dtype and "cached in" in again.why
    autotune.choose(_cfg(batch_size=16), runs, {"vocab_size": 65})  # another shape: measured
    assert len(runs.made) == 2 * measured
    path = autotune.cache_dir() / autotune.CACHE_FILE
    cached = json.loads(path.read_text())
    for entry in cached.values():
        entry["ms_per_step"] = {"float32": "fast"}
    path.write_text(json.dumps(cached))
    assert autotune.choose(_cfg(), runs, {"vocab_size": 65}).dtype == "bfloat16" and len(runs.made) == 3 * measured


def test_a_choice_measured_on_a_busy_machine_is_kept_until_a_run_finds_it_quiet(
        clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"busy": True}
    monkeypatch.setattr(autotune, "busy", lambda: state["busy"])
    runs = ScriptedRuns(clock, {"float32": 50.0, "bfloat16": 30.0})
    measured = 2 * autotune.ROUNDS
    autotune.choose(_cfg(), runs, {})
    autotune.choose(_cfg(), runs, {})  # still busy: the provisional choice serves
    assert len(runs.made) == measured
    state["busy"] = False
    autotune.choose(_cfg(), runs, {})  # quiet: measured again, and kept for good
    assert len(runs.made) == 2 * measured
    for state["busy"] in (False, True):
        assert autotune.choose(_cfg(), runs, {}).dtype == "bfloat16" and len(runs.made) == 2 * measured


@pytest.mark.parametrize(("compiled_ms", "want"), [(20.0, True), (29.0, False)])
def test_a_long_run_compiles_only_where_the_compiled_step_is_faster(clock: Clock, compiled_ms: float,
                                                                   want: bool) -> None:
    runs = ScriptedRuns(clock, {"float32": 50.0, "bfloat16": 30.0, "bfloat16+compile": compiled_ms})
    choice = autotune.choose(_cfg(max_steps=100_000), runs, {})
    assert (choice.dtype, choice.compile) == ("bfloat16", want)
    assert runs.made == ["float32", "bfloat16"] * autotune.ROUNDS + ["bfloat16+compile"]  # at the faster dtype


def test_an_explicit_dtype_times_only_the_compile_question(clock: Clock) -> None:
    runs = ScriptedRuns(clock, {"float32": 50.0, "float32+compile": 10.0})
    choice = autotune.choose(_cfg(dtype="float32", max_time=3600.0, max_steps=10**6), runs, {})
    assert (choice.dtype, choice.compile, runs.made) == ("float32", True, ["float32", "float32+compile"])
    # a long budget of fast steps: 1,000 steps of 50 ms is under the pay-back time, so no compile is tried
    runs = ScriptedRuns(clock, {"float32": 50.0})
    choice = autotune.choose(_cfg(dtype="float32", max_steps=1000, batch_size=4), runs, {})
    assert (choice.compile, runs.made) == (False, ["float32"])


def test_a_compile_that_fails_trains_eagerly_and_says_why(clock: Clock) -> None:
    runs = ScriptedRuns(clock, {"float32": 50.0, "bfloat16": 30.0}, fail_compile=True)
    choice = autotune.choose(_cfg(max_steps=100_000), runs, {})
    assert (choice.dtype, choice.compile) == ("bfloat16", False) and "RuntimeError" in choice.why


def test_short_cpu_runs_with_an_explicit_dtype_measure_nothing() -> None:
    assert not autotune.wants_measurement(_cfg(dtype="float32"), "cpu", 1)  # compile auto, 100 steps
    assert autotune.wants_measurement(_cfg(), "cpu", 1)
    assert not autotune.wants_measurement(_cfg(), "cpu", 2)  # torchrun: the fixed rule
    assert not autotune.wants_measurement(_cfg(), "cuda", 1)


def test_a_resumed_run_keeps_its_checkpoints_choice(clock: Clock) -> None:
    runs = ScriptedRuns(clock, {"float32": 50.0, "bfloat16": 30.0})
    cfg = autotune.resolve_auto_switches(_cfg(), "cpu", 1, {"dtype": "float32", "compile": False}, runs, {}, True)
    assert (cfg.dtype, cfg.compile, runs.made) == ("float32", False, [])


def test_a_real_run_records_the_measured_dtype_and_resumes_with_it(tmp_path: Path, capsys,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path / "cache"))
    data, run = make_data(tmp_path / "data", chars=20_000), tmp_path / "run"
    recipe = write_recipe(tmp_path, dtype="auto", max_steps=6, warmup_steps=1,
                          checkpoint_interval=3, eval_interval=0, threads=1)
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run), "--max-steps", "3"]) == 0
    out = capsys.readouterr().out
    state = json.loads((list_step_checkpoints(run)[-1] / "state.json").read_text())
    chosen = state["config"]["dtype"]
    assert chosen in ("float32", "bfloat16") and chosen in out.split("auto: ", 1)[1].split(",", 1)[0]
    assert "gptlab-probe-" not in "".join(str(p) for p in run.rglob("*"))  # the probes trained elsewhere
    # whatever a measurement would say now, the resumed run trains in the dtype it started with
    other = "float32" if chosen == "bfloat16" else "bfloat16"
    monkeypatch.setattr(autotune, "choose", lambda *a: pytest.fail(f"measured again (would pick {other})"))
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run), "--resume", "--quiet"]) == 0
    state = json.loads((list_step_checkpoints(run)[-1] / "state.json").read_text())
    assert (state["step"], state["config"]["dtype"]) == (6, chosen)
