"""Which decode step an engine runs on a CPU, decided by timing whole steps of its own model.

The kernel dispatch (`gptlab.kernels.dispatch`) picks each Linear's path by timing products alone. Where every
Linear of the blocks runs on one of gptlab's builds, the blocks run as one C++ call (`native_decode`), without
the Python and ATen time between the products; where PyTorch's path wins the products, the step is the Python
lean step. Which whole step is faster depends on the model and the batch, not on the products alone: at batch
16 the one-call step of a small 6-layer model beats oneDNN's faster products by a wide margin, while GPT-2's
larger products at batch 32 stay faster on oneDNN. A rule on products alone loses one way or the other.

So where the dispatch chose PyTorch's path for an engine's batch but a build can run the blocks, `blocks_build`
times a few decode steps of the engine's own model both ways (the blocks' Linears packed for the build and the
C++ step, against the dispatch's packs and the lean step; the LM head on the dispatch's choice in both), taking
turns, at the engine's batch, and the faster whole step wins. The answer is cached with the dispatch's in
kernels.json per CPU, thread count, torch, kernel source, model shape, dtype and batch (a measurement taken on a
busy machine is used but not kept), so an engine of the same model and batch decides in no time afterwards.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from typing import Any

import torch
import torch.nn as nn

from gptlab.generation import native_decode
from gptlab.generation.fast_decode import decode_hidden, lean_step_exact
from gptlab.generation.packed_linear import PackedLinears, packable
from gptlab.hardware import available_memory, busy, cached_measurement, cpu_id
from gptlab.kernels import source_digest
from gptlab.kernels.dispatch import CACHE_FILE, TORCH, choice, fastest_build, kind_of
from gptlab.kv_cache import KVCache
from gptlab.model import GPT

CONTEXT = 64  # keys each row holds while steps are timed: a short chat's, so attention weighs as in use
STEPS, ROUNDS = 3, 3  # steps per turn, turns per contender: the fastest step of each counts


def blocks_build(model: GPT, rows: int, cache_dtype: torch.dtype) -> str | None:
    """The build to pack the blocks' Linears for, so that the one-call C++ step runs an engine of `rows` rows
    (`PackedLinears(blocks_on=...)`), where that whole step was measured faster than the dispatch's choice;
    None: the dispatch's per-product choice stands (it is already a build, there is none, the C++ step cannot run
    this model, or the lean step on PyTorch's path was faster)."""
    weight = _block_weight(model)
    if weight is None or weight.device.type != "cpu" or cache_dtype != torch.float32:
        return None
    if weight.dtype not in (torch.float32, torch.bfloat16) or not lean_step_exact(model):
        return None
    kind = kind_of(weight.dtype)
    build = fastest_build(kind, rows)
    if build is None or choice(kind, rows) != TORCH or not _room_for_a_second_pack(model):
        return None
    return build if _measured(model, rows, build) else None


def _block_weight(model: GPT) -> torch.Tensor | None:
    """A plain Linear's weight inside the blocks (its dtype and device stand for all of them), or None."""
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    if not isinstance(blocks, nn.Module):
        return None
    return next((m.weight for m in blocks.modules() if packable(m)), None)


def _room_for_a_second_pack(model: GPT) -> bool:
    """The two contenders' packs are held at once while they take turns: time them only where a second copy of
    the weights takes at most a quarter of the memory still free."""
    free = available_memory("cpu")
    weights = sum(m.weight.nbytes for m in model.modules() if packable(m))
    return free is None or 4 * weights <= free


def _measured(model: GPT, rows: int, build: str) -> bool:
    """Whether the C++ step on `build` beats the lean step on the dispatch's packs for this model at `rows` rows,
    from kernels.json or timed (and saved unless the machine was busy)."""
    key = "|".join(["decode step", cpu_id(), f"threads={torch.get_num_threads()}", torch.__version__,
                    source_digest(), _model_digest(model), f"rows={rows}", build])

    def read(entry: Any) -> dict[str, float] | None:
        times = entry.get("ms per step") if isinstance(entry, dict) else None
        ok = isinstance(times, dict) and all(isinstance(times.get(n), float) for n in (build, TORCH))
        return times if ok else None

    times = cached_measurement(CACHE_FILE, key, read, lambda: time_steps(model, rows, build),
                               stored=lambda t: {"ms per step": t}, keep=lambda t: not busy())
    return times[build] < times[TORCH]


@functools.cache
def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_digest(model: GPT) -> str:
    """The model's shape and switches, and its weights' dtype: what a step's time depends on (not the weights)."""
    return _digest(json.dumps([model.config.to_dict(), str(_block_weight(model).dtype)], sort_keys=True,
                              default=str))


@torch.inference_mode()
def time_steps(model: GPT, rows: int, build: str) -> dict[str, float]:
    """Milliseconds of the fastest decode step (the blocks and the LM head) of `rows` rows holding CONTEXT keys
    each: with the blocks on `build` through the C++ step, and on the dispatch's packs through the lean step."""
    cache = KVCache(model.config, rows, min(model.config.block_size, CONTEXT + STEPS), dtype=torch.float32)
    start = min(CONTEXT, cache.max_len - STEPS)
    gen = torch.Generator().manual_seed(0)  # not the global one: a seeded run's draws stay as they are
    tokens = torch.randint(model.config.vocab_size, (rows, 1), generator=gen)
    contenders = {build: PackedLinears(model, rows, blocks_on=build), TORCH: PackedLinears(model, rows)}
    native = {}
    with contenders[build].active(refresh=False):
        native[build] = native_decode.weights(model, cache)
    if native[build] is None:  # something the C++ step cannot run (another norm epsilon): the lean step stands
        return {build: float("inf"), TORCH: 0.0}
    best = dict.fromkeys(contenders, float("inf"))
    for _ in range(ROUNDS):
        for name, packs in contenders.items():
            cache.lengths.fill_(start)
            with packs.active(refresh=False, only=model.lm_head if name == build else None):
                for _ in range(STEPS):
                    t0 = time.perf_counter()
                    h = decode_hidden(model, tokens, cache, native=native.get(name) or False)
                    model.logits(h[:, -1])
                    best[name] = min(best[name], time.perf_counter() - t0)
    return {name: 1000 * seconds for name, seconds in best.items()}
