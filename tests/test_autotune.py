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


# the eager candidates of a recipe whose dtype and attention dtype are "auto", in the order they are timed
EAGER = ["float32", "bfloat16", "bfloat16+fp32 attention"]


class ScriptedRuns:
    """make_probe for `choose`: each run's step advances the fake clock by its candidate's milliseconds (bf16 with
    fp32 attention, unless given, 1 ms slower than bf16)."""

    def __init__(self, clock: Clock, ms: dict[str, float], fail_compile: bool = False) -> None:
        self.clock, self.fail_compile, self.made = clock, fail_compile, []
        self.ms = {**({"bfloat16+fp32 attention": ms["bfloat16"] + 1} if "bfloat16" in ms else {}), **ms}

    @contextlib.contextmanager
    def __call__(self, cfg: TrainConfig):  # noqa: ANN204
        fp32_attention = cfg.dtype == "bfloat16" and cfg.attention_fp32 is True
        name = cfg.dtype + (autotune.FP32_ATTENTION if fp32_attention else "") + ("+compile" if cfg.compile else "")
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
    assert choice.ms_per_step == pytest.approx({"float32": fp32_ms, "bfloat16": bf16_ms,
                                                "bfloat16+fp32 attention": bf16_ms + 1})
    assert runs.made == EAGER * autotune.ROUNDS  # a run of 100 steps is short: no compile tried
    assert choice.attention_fp32 is (False if want == "bfloat16" else None)
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
    assert measured == 3 * autotune.ROUNDS and again.dtype == first.dtype and "cached in" in again.why
    autotune.choose(_cfg(batch_size=16), runs, {"vocab_size": 65})  # another shape: measured
    assert len(runs.made) == 2 * measured
    path = autotune.cache_dir() / autotune.CACHE_FILE
    cached = json.loads(path.read_text())
    for entry in cached.values():
        entry["ms_per_step"] = {"float32": "fast"}
    path.write_text(json.dumps(cached))
    assert autotune.choose(_cfg(), runs, {"vocab_size": 65}).dtype == "bfloat16" and len(runs.made) == 3 * measured
    for entry in cached.values():  # an entry from before the attention's dtype was measured: measured again
        entry["ms_per_step"] = {"float32": 50.0}
        del entry["attention_fp32"]
    path.write_text(json.dumps(cached))
    assert autotune.choose(_cfg(), runs, {"vocab_size": 65}).attention_fp32 is False
    assert len(runs.made) == 4 * measured
    cached = json.loads(path.read_text())
    for entry in cached.values():  # a number where a bool belongs: measured again, never trained as 1
        entry["attention_fp32"] = 1
    path.write_text(json.dumps(cached))
    assert autotune.choose(_cfg(), runs, {"vocab_size": 65}).attention_fp32 is False
    assert len(runs.made) == 5 * measured


def test_a_choice_measured_on_a_busy_machine_is_kept_until_a_run_finds_it_quiet(
        clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"busy": True}
    monkeypatch.setattr(autotune, "busy", lambda: state["busy"])
    runs = ScriptedRuns(clock, {"float32": 50.0, "bfloat16": 30.0})
    measured = 3 * autotune.ROUNDS
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
    assert runs.made == EAGER * autotune.ROUNDS + ["bfloat16+compile"]  # at the faster dtype


def test_bf16s_attention_dtype_is_measured_with_it_and_set_in_the_recipe(clock: Clock) -> None:
    runs = ScriptedRuns(clock, {"float32": 50.0, "bfloat16": 30.0, "bfloat16+fp32 attention": 25.0,
                                "bfloat16+fp32 attention+compile": 20.0})
    choice = autotune.choose(_cfg(max_steps=100_000), runs, {})
    assert (choice.dtype, choice.attention_fp32, choice.compile) == ("bfloat16", True, True)
    assert runs.made == EAGER * autotune.ROUNDS + ["bfloat16+fp32 attention+compile"]  # compiled as it won
    assert "dtype bfloat16 (attention in fp32), compiled" in choice.describe()
    cfg = autotune.resolve_auto_switches(_cfg(), "cpu", 1, None, runs, {}, True)
    assert (cfg.dtype, cfg.attention_fp32) == ("bfloat16", True)


@pytest.mark.parametrize("attention_fp32", [True, False])
def test_a_recipes_own_attention_dtype_is_kept_and_not_measured(clock: Clock, attention_fp32: bool) -> None:
    runs = ScriptedRuns(clock, {"float32": 50.0, "bfloat16": 30.0, "bfloat16+fp32 attention": 30.0})
    choice = autotune.choose(_cfg(attention_fp32=attention_fp32), runs, {})
    assert (choice.dtype, choice.attention_fp32) == ("bfloat16", None)
    bf16 = "bfloat16+fp32 attention" if attention_fp32 else "bfloat16"
    assert runs.made == ["float32", bf16] * autotune.ROUNDS
    cfg = autotune.resolve_auto_switches(_cfg(attention_fp32=attention_fp32), "cpu", 1, None, runs, {}, True)
    assert cfg.attention_fp32 is attention_fp32


def test_where_fp32_wins_the_attention_is_left_to_the_rule(clock: Clock) -> None:
    runs = ScriptedRuns(clock, {"float32": 20.0, "bfloat16": 30.0})
    cfg = autotune.resolve_auto_switches(_cfg(), "cpu", 1, None, runs, {}, True)
    assert (cfg.dtype, cfg.attention_fp32) == ("float32", "auto")


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


def test_a_real_run_on_a_cpu_taken_for_native_bf16_records_its_measured_attention_dtype(
        tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """The three candidates run as real probes (bf16 emulated here, which only makes them slower), and the run
    trains, and records, the dtype and the attention's dtype that won."""
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "native_low_precision_matmul", lambda dtype: True)
    measured = []
    real = autotune._ms_per_step

    def timed(make_probe, cfg, warmup=2):  # noqa: ANN001, ANN202 - records what each probe trained
        measured.append((cfg.dtype, cfg.attention_fp32))
        return real(make_probe, cfg, warmup)

    monkeypatch.setattr(autotune, "_ms_per_step", timed)
    data, run = make_data(tmp_path / "data", chars=20_000), tmp_path / "run"
    recipe = write_recipe(tmp_path, dtype="auto", max_steps=2, warmup_steps=1, eval_interval=0, threads=1)
    assert main(["train", str(recipe), "--data", str(data), "--out", str(run)]) == 0
    assert measured == [("float32", "auto"), ("bfloat16", False), ("bfloat16", True)] * autotune.ROUNDS
    out = capsys.readouterr().out.split("auto: ", 1)[1].splitlines()[0]
    config = json.loads((list_step_checkpoints(run)[-1] / "state.json").read_text())["config"]
    if config["dtype"] == "bfloat16":
        assert isinstance(config["attention_fp32"], bool)
        assert f"(attention in {'fp32' if config['attention_fp32'] else 'bf16'})" in out
    else:
        assert config["dtype"] == "float32" and "attention in" not in out
    assert "bfloat16+fp32 attention" in out
