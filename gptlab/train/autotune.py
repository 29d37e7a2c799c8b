"""`dtype = "auto"` and `compile = "auto"` on a CPU, decided by timing this run's own step on this machine.

Whether bf16 beats fp32 on a CPU depends on more than its flags: with AVX512-BF16 or AMX the matmuls are
faster in bf16, but a small model's step is mostly casts, norms and the optimizer, which bf16 does not speed
up. So where the CPU multiplies bf16 natively, a few optimizer steps of the run itself (its model, batch,
sequence length, objective and adapters, built by the caller's `make_probe`) are timed in fp32 and in bf16, and
the faster one trains. Without native bf16 (AVX2-only CPUs) bf16 is emulated and always slower: fp32, unmeasured.
With `attention_fp32 = "auto"` the bf16 step is timed twice, its attention in bf16 and in fp32 (which of PyTorch's
and gptlab's attention kernels serve each, and how fast, depends on the head size, the sequence length and the
CPU), and the fastest of the three candidates trains.

torch.compile costs a compile before its first step (tens of seconds to minutes). It is tried only for a run
whose eager steps would take longer than `COMPILE_PAYBACK_SECONDS` (its max_steps at the measured step time,
or its max_time), and chosen only when its measured step is faster by `COMPILE_MARGIN`.

Each decision is printed with its figures and kept in the cache folder (`train_choices.json`, per CPU, thread
count, torch version and the step's shapes), so later runs of the same shapes start at once; a choice measured
while other work kept the cores busy is kept only until a run finds the machine quiet, and that run measures again.
A resumed run keeps its checkpoint's choice, and several processes (torchrun) or a GPU keep the fixed rules of
`setup.resolve_dtype` and `config.resolve_device_switches`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from gptlab.fileio import json_digest
from gptlab.hardware import busy, cache_dir, cached_measurement, cpu_id
from gptlab.ops import native_low_precision_matmul
from gptlab.train.config import TrainConfig
from gptlab.train.setup import resolve_dtype

CACHE_FILE = "train_choices.json"
COMPILE_PAYBACK_SECONDS = 600.0  # a shorter run does not earn back a CPU compile
COMPILE_MARGIN = 0.9  # compiled steps must take at most this share of the eager ones
PROBE_SECONDS = 1.0  # timed steps per candidate: at least MIN_STEPS and about this long, at most MAX_STEPS
MIN_STEPS, MAX_STEPS = 3, 10
ROUNDS = 2  # each dtype is timed in this many runs, alternating
LONG_RUN_STEPS = 1000  # with no time budget, fewer steps are taken as a short run (no compile tried)


class ProbeRun(Protocol):
    """What the probe needs of a run: one optimizer step at a time."""

    def train_step(self) -> torch.Tensor: ...


MakeProbe = Callable[[TrainConfig], AbstractContextManager[ProbeRun]]  # a run of a recipe, let go of on exit


FP32_ATTENTION = "+fp32 attention"  # a candidate's name: bf16 with its attention in fp32


@dataclasses.dataclass
class Choice:
    dtype: str
    compile: bool
    # candidate ("float32", "bfloat16", "bfloat16+fp32 attention", "bfloat16+compile") -> its fastest step, ms
    ms_per_step: dict[str, float]
    why: str  # what decided it, for the log
    attention_fp32: bool | None  # bf16's attention in fp32, where measured here; None: the recipe's rule decides

    def describe(self) -> str:
        figures = ", ".join(f"{name} {ms:.1f} ms/step" for name, ms in self.ms_per_step.items())
        measured = f" (measured here: {figures})" if figures else ""
        attention = "" if self.attention_fp32 is None else (
            f" (attention in {'fp32' if self.attention_fp32 else 'bf16'})")
        return (f"dtype {self.dtype}{attention}, {'compiled' if self.compile else 'not compiled'}{measured}; "
                f"{self.why}")


def wants_measurement(cfg: TrainConfig, device: str, world: int) -> bool:
    """Whether this run's "auto" switches are decided by `choose`: a CPU run in one process with an "auto"
    dtype, or an "auto" compile and a recipe long enough that a compile might pay back."""
    return device == "cpu" and world == 1 and (cfg.dtype == "auto" or (cfg.compile == "auto" and _may_be_long(cfg)))


def _may_be_long(cfg: TrainConfig) -> bool:
    """A recipe that may run past COMPILE_PAYBACK_SECONDS: a time budget at least that long, or none and many
    steps (the measured step time then says)."""
    if cfg.max_time is not None:
        return cfg.max_time >= COMPILE_PAYBACK_SECONDS
    return cfg.max_steps >= LONG_RUN_STEPS


def choose(cfg: TrainConfig, make_probe: MakeProbe, shapes: dict[str, Any]) -> Choice:
    """The dtype and compile switch for `cfg` on this CPU, from train_choices.json or measured (and saved).
    `shapes` names what the step's time depends on beyond the recipe's own fields (the vocabulary, the data's
    sequence length)."""
    def read(entry: Any) -> Choice | None:  # a damaged entry is measured again
        try:
            choice = Choice(**entry) if isinstance(entry, dict) else None
        except TypeError:
            return None
        if choice is None or not _valid(choice):
            return None
        return dataclasses.replace(choice, why=f"{choice.why} (cached in {cache_dir() / CACHE_FILE})")

    return cached_measurement(CACHE_FILE, _cache_key(cfg, shapes), read, lambda: _measure(cfg, make_probe),
                              stored=dataclasses.asdict, keep=lambda c: bool(c.ms_per_step), is_busy=busy)


def _candidates(cfg: TrainConfig) -> dict[str, TrainConfig]:
    """The eager recipes timed against each other, by name: fp32 and bf16, and bf16 with its attention in fp32
    where the recipe leaves the attention's dtype to "auto"."""
    eager = dataclasses.replace(cfg, compile=False)
    if cfg.attention_fp32 != "auto":
        return {dtype: dataclasses.replace(eager, dtype=dtype) for dtype in ("float32", "bfloat16")}
    return {"float32": dataclasses.replace(eager, dtype="float32"),
            "bfloat16": dataclasses.replace(eager, dtype="bfloat16", attention_fp32=False),
            "bfloat16" + FP32_ATTENTION: dataclasses.replace(eager, dtype="bfloat16", attention_fp32=True)}


def _measure(cfg: TrainConfig, make_probe: MakeProbe) -> Choice:
    times: dict[str, float] = {}
    attention_fp32 = None
    if cfg.dtype != "auto":
        dtype = cfg.dtype
    elif not native_low_precision_matmul(torch.bfloat16):
        dtype = "float32"
    else:
        candidates = _candidates(cfg)
        for _ in range(ROUNDS):  # interleaved: a burst of other work slows one round, not one candidate
            for name, candidate in candidates.items():
                ms = _ms_per_step(make_probe, candidate)
                times[name] = min(times.get(name, ms), ms)
        fastest = min(times, key=times.__getitem__)
        dtype = candidates[fastest].dtype
        if dtype == "bfloat16" and cfg.attention_fp32 == "auto":
            attention_fp32 = candidates[fastest].attention_fp32
    why = "bf16 is emulated on this CPU" if cfg.dtype == "auto" and not times else ""
    # the recipe a compile is timed in: the chosen dtype, and the attention's where it was measured
    chosen_cfg = dataclasses.replace(cfg, dtype=dtype, compile=False,
                                     **({} if attention_fp32 is None else {"attention_fp32": attention_fp32}))

    def chosen(compiled: bool, reason: str) -> Choice:
        return Choice(dtype, compiled, times, reason, attention_fp32)

    if cfg.compile != "auto":
        return chosen(bool(cfg.compile), why or "compile as the recipe sets it")
    if not _may_be_long(cfg):
        return chosen(False, _join(why, "a run this short does not pay back a compile"))
    eager_name = dtype + (FP32_ATTENTION if attention_fp32 else "")
    eager = times.get(eager_name)
    if eager is None:
        eager = times[eager_name] = _ms_per_step(make_probe, chosen_cfg)
    run_seconds = min(cfg.max_steps * eager / 1000, cfg.max_time or float("inf"))
    if run_seconds < COMPILE_PAYBACK_SECONDS:
        return chosen(False, _join(why, f"a compile does not pay back in a run of ~{run_seconds:.0f} s"))
    compiled = f"{eager_name}+compile"
    try:
        times[compiled] = _ms_per_step(make_probe, dataclasses.replace(chosen_cfg, compile=True), warmup=3)
    except Exception as e:  # noqa: BLE001 - a model torch.compile cannot take trains eagerly, saying why
        return chosen(False, _join(why, f"torch.compile failed here ({type(e).__name__})"))
    faster = times[compiled] <= COMPILE_MARGIN * eager
    return chosen(faster, _join(why, "the faster step" if faster else "compiling does not pay here"))


def _ms_per_step(make_probe: MakeProbe, cfg: TrainConfig, warmup: int = 2) -> float:
    """The fastest of a few of this recipe's optimizer steps, after `warmup` steps (allocation, kernel choice, a
    compile): other work on the machine only ever adds time. The run's random streams are left as they were."""
    with torch.random.fork_rng(devices=[]), make_probe(cfg) as run:
        for _ in range(warmup):
            float(run.train_step())
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < MAX_STEPS and (len(times) < MIN_STEPS or time.perf_counter() - start < PROBE_SECONDS):
            t0 = time.perf_counter()
            float(run.train_step())  # the step's work done (a CPU runs it eagerly; this is its one read)
            times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def _cache_key(cfg: TrainConfig, shapes: dict[str, Any]) -> str:
    """This CPU, its thread count, torch and every recipe field a step's time depends on (not the seed, the
    schedule's lengths, the run's bookkeeping)."""
    skip = {"seed", "max_steps", "max_time", "warmup_steps", "lr_decay_steps", "eval_interval", "eval_iters",
            "log_interval", "checkpoint_interval", "keep_last", "tracker", "tracker_project", "eval_tasks",
            "eval_tasks_interval", "eval_tasks_limit", "tensorboard"}
    fields = {k: v for k, v in cfg.to_dict().items() if k not in skip}
    return "|".join([cpu_id(), f"threads={torch.get_num_threads()}", torch.__version__, json_digest([fields, shapes])])


def _valid(choice: Choice) -> bool:
    return (choice.dtype in ("float32", "bfloat16") and isinstance(choice.compile, bool)
            and (choice.attention_fp32 is None or isinstance(choice.attention_fp32, bool))  # (not 0 or 1)
            and isinstance(choice.why, str) and isinstance(choice.ms_per_step, dict)
            and all(isinstance(v, float | int) and not isinstance(v, bool) for v in choice.ms_per_step.values()))


def resolve_auto_switches(cfg: TrainConfig, device: str, world: int, saved: dict[str, Any] | None,
                          make_probe: MakeProbe, shapes: dict[str, Any],
                          quiet: bool) -> TrainConfig:
    """`cfg` with its "auto" dtype (and on a CPU its "auto" compile) decided: as the checkpoint being resumed
    (`saved`, its resolved recipe) decided them; by measurement for a CPU run in one process; else by the
    fixed rule of `setup.resolve_dtype` (GPUs, several processes)."""
    if cfg.dtype != "auto" and cfg.compile != "auto":
        return cfg
    if saved is not None:  # a resumed run trains as it started, whatever a measurement would say today
        keep = {k: saved.get(k) for k in ("dtype", "compile") if getattr(cfg, k) == "auto"}
        valid = keep.get("dtype", "float32") in ("float32", "bfloat16", "float16")
        if valid and keep.get("compile", True) in (True, False):
            return dataclasses.replace(cfg, **keep)
    if wants_measurement(cfg, device, world):
        choice = choose(cfg, make_probe, shapes)
        if not quiet:
            print(f"auto: {choice.describe()}")
        cfg = dataclasses.replace(cfg, dtype=choice.dtype, compile=choice.compile)
        if choice.attention_fp32 is not None and cfg.attention_fp32 == "auto":
            cfg = dataclasses.replace(cfg, attention_fp32=choice.attention_fp32)
        return cfg
    if cfg.dtype == "auto":
        cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, device))
        if not quiet:
            print(f"dtype auto: {cfg.dtype} on {device}")
    return cfg


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)
