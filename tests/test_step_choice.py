"""Which decode step an engine runs, by timing whole steps (`gptlab.generation.step_choice`): the decision's logic
on scripted timings (never this machine's speed), its cache, and real timings on the builds this machine runs.
That each step computes what the plain forward does is tested in test_fast_decode.py."""

from __future__ import annotations

import math

import pytest
import torch
from families import model_of

from gptlab.generation import native_decode, step_choice
from gptlab.generation.packed_linear import PackedLinears, kernel_packed
from gptlab.hooks import hooked
from gptlab.kv_cache import KVCache
from gptlab.quantize import quantize_model


@pytest.fixture
def scripted(tmp_path, monkeypatch: pytest.MonkeyPatch) -> dict:  # noqa: ANN001
    """Two builds; whole steps take `times` (ms) on each path; `calls` lists the paths of each timing."""
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GPTLAB_KERNEL", raising=False)
    state = {"times": {"avx2": 3.0, "avx512": 2.0, "torch": 4.0}, "calls": [], "busy": False}
    monkeypatch.setattr(step_choice, "kernel_builds", lambda: {"avx2": "A", "avx512": "B"})
    monkeypatch.setattr(step_choice, "emulated_builds", frozenset)
    monkeypatch.setattr(step_choice, "busy", lambda: state["busy"])
    monkeypatch.setattr(step_choice, "_TIMED", {})  # this process's answers: none yet

    def time_steps(model, rows, paths, cache_dtype=None):  # noqa: ANN001, ANN202
        state["calls"].append(paths)
        return {p: state["times"][p] for p in paths}

    monkeypatch.setattr(step_choice, "time_steps", time_steps)
    return state


def test_the_fastest_whole_step_wins_and_is_cached(scripted: dict) -> None:
    model = model_of("llama", torch.bfloat16)
    assert step_choice.decode_path(model, 16, torch.float32) == "avx512"
    step_choice._TIMED.clear()  # a new process: read from kernels.json
    assert step_choice.decode_path(model, 16, torch.float32) == "avx512" and len(scripted["calls"]) == 1
    assert scripted["calls"] == [("avx2", "avx512", "torch")]
    scripted["times"] = {"avx2": 3.0, "avx512": 5.0, "torch": 2.0}
    assert step_choice.decode_path(model, 32, torch.float32) == "torch"  # another batch: timed again
    assert step_choice.decode_path(model_of("gpt2", torch.bfloat16), 16, torch.float32) == "torch"  # another model
    assert len(scripted["calls"]) == 3


def test_a_timing_on_a_busy_machine_is_kept_until_a_run_finds_it_quiet(scripted: dict) -> None:
    model = model_of("llama", torch.bfloat16)
    scripted["busy"] = True
    assert step_choice.decode_path(model, 16, torch.float32) == "avx512"
    assert step_choice.decode_path(model, 16, torch.float32) == "avx512" and len(scripted["calls"]) == 1
    step_choice._TIMED.clear()  # a new process, the machine still busy: the provisional timing serves
    assert step_choice.decode_path(model, 16, torch.float32) == "avx512" and len(scripted["calls"]) == 1
    scripted["busy"] = False
    step_choice._TIMED.clear()  # a new process on a quiet machine: timed again, and kept for good
    assert step_choice.decode_path(model, 16, torch.float32) == "avx512" and len(scripted["calls"]) == 2
    for scripted["busy"] in (False, True):
        step_choice._TIMED.clear()
        assert step_choice.decode_path(model, 16, torch.float32) == "avx512" and len(scripted["calls"]) == 2


def test_pytorchs_path_is_left_out_where_its_copy_would_not_fit(scripted: dict, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(step_choice, "available_memory", lambda device: 1000)
    assert step_choice.decode_path(model_of("llama", torch.bfloat16), 1, torch.float32) == "avx512"
    assert scripted["calls"] == [("avx2", "avx512")]  # the builds share one copy of the weights


def test_nothing_is_timed_where_the_native_step_cannot_run_or_a_path_is_forced(scripted: dict,
                                                                             monkeypatch) -> None:  # noqa: ANN001
    model = model_of("llama", torch.bfloat16)
    assert step_choice.decode_path(model_of("llama"), 16, torch.bfloat16) is None  # an fp32 model's keys in bf16
    assert step_choice.decode_path(model, 16, torch.float16) is None  # the C++ step reads fp32 or a bf16 model's
    quantized = quantize_model(model_of("llama", torch.bfloat16), "int8")  # no plain Linear in the blocks
    assert step_choice.decode_path(quantized, 16, torch.float32) is None
    with hooked(model, {"hook_embed": lambda x: None}):  # hook points set (on this thread): the plain forward runs
        assert step_choice.decode_path(model, 16, torch.float32) is None
    monkeypatch.setenv("GPTLAB_KERNEL", "avx2")
    assert step_choice.decode_path(model_of("llama", torch.bfloat16), 16, torch.float32) is None
    monkeypatch.delenv("GPTLAB_KERNEL")
    monkeypatch.setattr(step_choice, "kernel_builds", dict)  # no build (no compiler, ARM, GPTLAB_NO_KERNELS)
    assert step_choice.decode_path(model_of("llama", torch.bfloat16), 16, torch.float32) is None
    assert scripted["calls"] == []


def test_each_path_is_timed_over_the_cache_it_runs_with(scripted: dict, monkeypatch) -> None:  # noqa: ANN001
    """The C++ step reads a bf16 model's keys from a bf16 cache (exact, half the bytes); the lean step attends over
    fp32 ones; a cache the caller names is timed as named."""
    seen = []
    monkeypatch.setattr(step_choice, "time_steps", lambda model, rows, paths, cache_dtype: seen.append(cache_dtype)
                        or {p: scripted["times"][p] for p in paths})
    bf16, fp32 = model_of("llama", torch.bfloat16), model_of("llama")
    assert step_choice.step_cache_dtype(bf16, "avx512") == torch.bfloat16
    assert step_choice.step_cache_dtype(bf16, "torch") == step_choice.step_cache_dtype(bf16, None) == torch.float32
    assert step_choice.step_cache_dtype(fp32, "avx512") == torch.float32
    assert step_choice.decode_path(bf16, 8) == step_choice.decode_path(bf16, 9, torch.float32) == "avx512"
    assert seen == [None, torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_steps_are_timed_on_every_path(dtype: torch.dtype) -> None:
    """Real timings of every build this machine runs and of PyTorch's path (they ran: finite, positive); the
    model is left as it was, no pack's forward installed."""
    from gptlab.kernels import kernel_builds

    if not kernel_builds():
        pytest.skip("no build of gptlab's kernels runs here")
    model = model_of("llama", dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    paths = (*sorted(kernel_builds()), "torch")
    times = step_choice.time_steps(model, 4, paths)
    assert set(times) == set(paths) and all(0 < t < math.inf for t in times.values())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_model_the_native_step_cannot_run_times_nothing(build_name: str) -> None:
    model = model_of("llama")
    model.transformer.h[1].ln_2.eps = 1e-3  # the C++ step takes the config's epsilon for every norm
    assert step_choice.time_steps(model, 2, (build_name, "torch")) == {}


def test_linears_on_torch_keep_the_lean_step(build_name: str, monkeypatch) -> None:  # noqa: ANN001
    """The whole step on PyTorch's path won: the Linears leave gptlab's kernel even where the dispatch chose it
    for their products."""
    monkeypatch.setenv("GPTLAB_KERNEL", build_name)
    model = model_of("llama", torch.bfloat16)
    with PackedLinears(model, 1, path="torch").active():
        assert all(kernel_packed(m) is None for m in model.modules())
        assert native_decode.weights(model, KVCache(model.config, 1, 8)) is None
