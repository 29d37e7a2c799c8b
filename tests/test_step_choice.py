"""Which decode step an engine runs, by timing whole steps (`gptlab.generation.step_choice`): the decision's logic
on scripted timings (never this machine's speed), its cache, and one real timing on every build this machine runs.
That the chosen step computes what the plain forward does is tested in test_fast_decode.py."""

from __future__ import annotations

import math

import pytest
import torch
from families import model_of

from gptlab.generation import step_choice
from gptlab.quantize import quantize_model


@pytest.fixture
def scripted(tmp_path, monkeypatch: pytest.MonkeyPatch) -> dict:  # noqa: ANN001
    """The dispatch chose PyTorch's path for the batch and "avx512" is its fastest build; whole steps take
    `times` (ms); `calls` counts the timings."""
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GPTLAB_KERNEL", raising=False)
    state = {"choice": "torch", "times": {"avx512": 2.0, "torch": 3.0}, "calls": 0, "busy": False}
    monkeypatch.setattr(step_choice, "choice", lambda kind, rows: state["choice"])
    monkeypatch.setattr(step_choice, "fastest_build", lambda kind, rows: "avx512")
    monkeypatch.setattr(step_choice, "busy", lambda: state["busy"])

    def time_steps(model, rows, build):  # noqa: ANN001, ANN202
        state["calls"] += 1
        return dict(state["times"])

    monkeypatch.setattr(step_choice, "time_steps", time_steps)
    return state


def test_the_faster_whole_step_wins_and_is_cached(scripted: dict) -> None:
    model = model_of("llama", torch.bfloat16)
    assert step_choice.blocks_build(model, 16, torch.float32) == "avx512"
    assert step_choice.blocks_build(model, 16, torch.float32) == "avx512" and scripted["calls"] == 1  # read back
    scripted["times"] = {"avx512": 3.0, "torch": 2.0}
    assert step_choice.blocks_build(model, 32, torch.float32) is None and scripted["calls"] == 2  # another batch
    assert step_choice.blocks_build(model_of("gpt2", torch.bfloat16), 16, torch.float32) is None  # another model
    assert scripted["calls"] == 3


def test_a_timing_on_a_busy_machine_is_used_but_not_kept(scripted: dict) -> None:
    model = model_of("llama", torch.bfloat16)
    scripted["busy"] = True
    assert step_choice.blocks_build(model, 16, torch.float32) == "avx512"
    scripted["busy"] = False
    assert step_choice.blocks_build(model, 16, torch.float32) == "avx512" and scripted["calls"] == 2
    assert step_choice.blocks_build(model, 16, torch.float32) == "avx512" and scripted["calls"] == 2


def test_nothing_is_timed_where_the_dispatch_already_runs_a_build_or_the_native_step_cannot_run(
        scripted: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_of("llama", torch.bfloat16)
    assert step_choice.blocks_build(model, 16, torch.bfloat16) is None  # the C++ step takes an fp32 cache
    quantized = quantize_model(model_of("llama", torch.bfloat16), "int8")  # no plain Linear in the blocks
    assert step_choice.blocks_build(quantized, 16, torch.float32) is None
    model.hooks = object()  # hook points set: the plain forward runs
    assert step_choice.blocks_build(model, 16, torch.float32) is None
    scripted["choice"] = "avx512"  # the products already on a build: the C++ step runs anyway
    assert step_choice.blocks_build(model_of("llama", torch.bfloat16), 16, torch.float32) is None
    scripted["choice"] = "torch"
    monkeypatch.setattr(step_choice, "available_memory", lambda device: 1000)  # no room for a second pack
    assert step_choice.blocks_build(model_of("llama", torch.bfloat16), 16, torch.float32) is None
    assert scripted["calls"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_steps_are_timed_on_every_build(build_name: str, dtype: torch.dtype) -> None:
    """A real timing of both contenders (they ran: finite, positive) leaves the model as it was."""
    model = model_of("llama", dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    times = step_choice.time_steps(model, 4, build_name)
    assert set(times) == {build_name, "torch"} and all(0 < t < math.inf for t in times.values())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "forward" not in model.lm_head.__dict__  # the packs' forwards are gone again
