"""Which decode step an engine runs on a CPU, decided by timing whole steps of its own model.

The kernel dispatch (`gptlab.kernels.dispatch`) picks each Linear's path by timing products alone, once per
machine. A decode step is more than its products: where the blocks' Linears run on one of gptlab's builds, the
blocks run as one C++ call (`native_decode`), without the Python and ATen time between the products; where they
run on PyTorch's path, the step is the Python lean step. Which whole step is faster depends on the model and the
batch: at batch 16 the one-call step of a small 6-layer model beats oneDNN's faster products, while GPT-2's
larger products at batch 32 stay faster on oneDNN; and two builds whose products time alike on the probe's two
shapes stream a whole model's 48 Linears at different speeds. A rule on products alone loses one way or another.

So an engine that can run the C++ step times a few decode steps of its own model at its own batch (the blocks
and the LM head), on each build this CPU runs and on PyTorch's path (the lean step), taking turns, and runs the
fastest (`decode_path`). The builds share one packed layout, so they are timed on one copy of the weights;
PyTorch's path needs a second, so it is left out where that copy would not fit in a quarter of the free memory.
The answer is cached with the dispatch's in kernels.json per CPU, thread count, torch, kernel source,
model shape, dtype and batch (a timing taken on a busy machine: only until a run finds it quiet), so later engines of
the same model and batch decide in no time.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch
import torch.nn as nn

from gptlab.fileio import json_digest
from gptlab.generation import native_decode
from gptlab.generation.fast_decode import decode_hidden, lean_step_exact
from gptlab.generation.packed_linear import PackedLinears, packable
from gptlab.hardware import available_memory, busy, cached_measurement, cpu_id
from gptlab.kernels import emulated_builds, kernel_builds, source_digest
from gptlab.kernels.dispatch import CACHE_FILE, TORCH
from gptlab.kv_cache import KVCache
from gptlab.model import GPT

CONTEXT = 64  # keys each row holds while steps are timed: a short chat's, so attention weighs as in use
STEPS, ROUNDS = 3, 3  # steps per turn, turns per contender: the fastest step of each counts
_TIMED: dict[str, dict[str, float]] = {}  # this process's answers, by cache key


def decode_path(model: GPT, rows: int, cache_dtype: torch.dtype | None = None) -> str | None:
    """The path of the Linears whose whole decode step was fastest for this model at `rows` rows: a build (the
    C++ step runs the blocks) or "torch" (the lean step over PyTorch's products), for `PackedLinears(path=)`.
    None where nothing is timed and the dispatch's per-product choice stands: no build, a forced choice
    (`GPTLAB_KERNEL`), or a model or cache the C++ step cannot run. Each path is timed over the KV cache it would
    run with (`step_cache_dtype`), or over `cache_dtype`'s where the caller fixed it."""
    weight = _block_weight(model)
    if weight is None or weight.device.type != "cpu":
        return None
    if cache_dtype not in (None, torch.float32, native_decode.cache_dtype(model)):
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16) or not lean_step_exact(model):
        return None
    builds = tuple(sorted(set(kernel_builds()) - emulated_builds()))
    if not builds or os.environ.get("GPTLAB_KERNEL"):
        return None
    paths = builds + ((TORCH,) if _room_for_a_second_pack(model) else ())
    times = _measured(model, weight.dtype, rows, paths, cache_dtype)
    return min(times, key=times.__getitem__) if times else None


def step_cache_dtype(model: GPT, path: str | None) -> torch.dtype:
    """How a CPU engine stores keys and values for the decode step on `path`: the C++ step's (a bf16 model's in
    bf16, which it reads as exactly as fp32 and in half the time at large batches), else fp32 (PyTorch's bf16
    attention is the slower one at decoding shapes, see `default_cache_dtype`)."""
    return native_decode.cache_dtype(model) if path not in (None, TORCH) else torch.float32


def _block_weight(model: GPT) -> torch.Tensor | None:
    """A plain Linear's weight inside the blocks (its dtype and device stand for all of them), or None."""
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    if not isinstance(blocks, nn.Module):
        return None
    return next((m.weight for m in blocks.modules() if packable(m)), None)


def _room_for_a_second_pack(model: GPT) -> bool:
    """PyTorch's packs are held beside the builds' while they take turns: time them only where that second copy of
    the weights takes at most a quarter of the memory still free."""
    free = available_memory("cpu")
    weights = sum(m.weight.nbytes for m in model.modules() if packable(m))
    return free is None or 4 * weights <= free


def _measured(model: GPT, dtype: torch.dtype, rows: int, paths: tuple[str, ...],
              cache_dtype: torch.dtype | None) -> dict[str, float]:
    """Milliseconds per step on each path, from kernels.json or timed (and saved: provisionally on a busy machine); {}
    where the C++ step cannot run this model. Kept per model shape and switches and weights' dtype (what a step's
    time depends on, not the weights) and batch."""
    key = "|".join(["decode step", cpu_id(), f"threads={torch.get_num_threads()}", torch.__version__,
                    source_digest(), json_digest([model.config.to_dict(), str(dtype)]), f"rows={rows}",
                    ",".join(paths), f"cache={cache_dtype or 'per path'}"])

    def read(entry: Any) -> dict[str, float] | None:
        times = entry.get("ms per step") if isinstance(entry, dict) else None
        ok = times == {} or (isinstance(times, dict) and all(isinstance(times.get(p), float) for p in paths))
        return times if ok else None

    if key not in _TIMED:  # this process's later engines take it from here (also where the cache folder is read-only)
        _TIMED[key] = cached_measurement(CACHE_FILE, key, read, lambda: time_steps(model, rows, paths, cache_dtype),
                                         stored=lambda t: {"ms per step": t}, is_busy=busy)
    return _TIMED[key]




@torch.inference_mode()
def time_steps(model: GPT, rows: int, paths: tuple[str, ...],
               cache_dtype: torch.dtype | None = None) -> dict[str, float]:
    """Milliseconds of the fastest decode step (the blocks and the LM head) of `rows` rows holding CONTEXT keys
    each, on each of `paths`: a build through the C++ step, "torch" through the lean step, each over a cache of
    `cache_dtype` or (None) the one it would run with; {} where the C++ step cannot run this model (a norm of
    another epsilon)."""
    max_len = min(model.config.block_size, CONTEXT + STEPS)
    caches = {path: KVCache(model.config, rows, max_len, dtype=cache_dtype or step_cache_dtype(model, path),
                            attend_dtype=None if cache_dtype else torch.float32) for path in paths}
    start = min(CONTEXT, max_len - STEPS)
    gen = torch.Generator().manual_seed(0)  # not the global one: a seeded run's draws stay as they are
    tokens = torch.randint(model.config.vocab_size, (rows, 1), generator=gen)
    builds = [p for p in paths if p != TORCH]
    packs = {TORCH: PackedLinears(model, rows, path=TORCH)} if TORCH in paths else {}
    native = {}
    if builds:  # one copy of the blocks' weights serves every build (the layout is theirs alike); a head each
        with PackedLinears(model, rows, path=builds[0]).active(refresh=False):
            gathered = native_decode.weights(model, caches[builds[0]])
        if gathered is None:
            return {}
        native = {b: dataclasses.replace(gathered, ops=kernel_builds()[b], head=None) for b in builds}  # heads: below
        packs.update({b: PackedLinears(model.lm_head, rows, path=b) for b in builds})  # the C++ step leaves it out
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(ROUNDS):
        for path in paths:
            caches[path].lengths.fill_(start)
            with packs[path].active(refresh=False):
                for _ in range(STEPS):
                    t0 = time.perf_counter()
                    h = decode_hidden(model, tokens, caches[path], native=native.get(path, False))
                    model.logits(h[:, -1])
                    best[path] = min(best[path], time.perf_counter() - t0)
    return {path: 1000 * seconds for path, seconds in best.items()}
