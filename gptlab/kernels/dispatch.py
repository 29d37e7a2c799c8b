"""Which kernel runs a Linear at decoding shapes on this machine, decided by measurement rather than by the name of
the CPU's vector unit.

For each kind of weight (bf16, fp32, int8, int4) the candidates are gptlab's own builds that this CPU can execute
(`gptlab.kernels.kernel_builds`: AVX2, AVX-VNNI, AVX-512, AMX) and PyTorch's path for that kind (oneDNN's packed bf16
product where it works, else `F.linear`; MKL on a transposed fp32 weight; `_weight_int8pack_mm`;
`_weight_int4pack_mm_for_cpu`).
A short probe on first use times each on decoding-shaped products (768 x 2304 and 3072 x 768, over weights larger
than the CPU's cache; batch 1, and batch 32 for engines of 8 rows or more) at the process's thread count,
candidates taking turns, and the fastest wins (a gptlab build within `BUILD_MARGIN` of PyTorch's path counts as
faster: it also runs the one-call decode step). On a 2-core Zen 3 it takes 0.3-2 s a kind and batch, 6 s for all
eight. The result is cached per CPU model, thread count, torch version and kernel source in
~/.cache/gptlab/kernels.json (GPTLAB_CACHE_DIR moves it), so later runs decide in no time; a probe taken while other
work keeps the cores busy is kept only until a run finds the machine quiet (`busy`), and that run probes again.
Measured on an AMD Zen 4 (AVX-512): the old rule "AVX-512 CPUs keep oneDNN and PyTorch's
weight-only kernels" lost 1.3-2.5x at batch 1; at batch 32 oneDNN's bf16 product still wins there
(benchmarks/kernel_throughput.py prints each path's speed on any machine).

`GPTLAB_KERNEL=torch|avx2|avxvnni|avx512|amx` overrides the choice (for comparisons and tests: a build the CPU cannot
run falls back to the probe's choice; an emulated build, under GPTLAB_KERNEL_EMULATE=1, is chosen only so);
`GPTLAB_NO_KERNELS=1` keeps PyTorch's paths everywhere.
"""

from __future__ import annotations

import functools
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gptlab.hardware import busy, cached_measurement, cpu_id
from gptlab.kernels import emulated_builds, kernel_builds, source_digest

KINDS = ("bfloat16", "float32", "int8", "int4")
TORCH = "torch"
CACHE_FILE = "kernels.json"
_SHAPES = ((2304, 768), (768, 3072))  # (N, K): a fused q/k/v projection and an MLP's down projection
_GROUP = 32
SMALL_BATCH, BATCH = 8, 32  # inputs of fewer rows than SMALL_BATCH are probed at 1 row, the others at BATCH
# gptlab's fastest build wins unless PyTorch's path is more than 10% faster on the products alone: with every Linear
# on a build, a decode step runs in one C++ call (generation.native_decode), which the probe does not time: products
# that level make a faster step on the build, and a path clearly faster on the products alone stays faster whole
# (benchmarks/generate_throughput.py measures both).
BUILD_MARGIN = 1.1
# a candidate this many times slower than the leader after the probe's first round cannot win (above BUILD_MARGIN)
SURE_LOSS = 1.5


def kind_of(dtype: torch.dtype | str) -> str:
    """The kind a weight dtype (or a quantization mode, "int8" / "int4") is probed as."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def choice(kind: str, rows: int = 1) -> str:
    """The name of the path that runs `kind` weights here for inputs of about `rows` rows (decoding: the batch): a
    build of `kernel_builds()`, or "torch". Small batches and large ones are probed apart (1 and 32 rows): reading
    the weights dominates the first, arithmetic the second, and a different kernel may win each."""
    builds = kernel_builds()
    forced = os.environ.get("GPTLAB_KERNEL")
    if forced == TORCH or not builds:
        return TORCH
    if forced in builds:
        return forced
    candidates = tuple(sorted(set(builds) - emulated_builds()))
    if not candidates:
        return TORCH
    return _measured(kind, candidates, BATCH if rows >= SMALL_BATCH else 1, torch.get_num_threads())


def chosen_ops(kind: str, rows: int = 1) -> Any | None:
    """The build (torch.ops namespace) that runs `kind` weights here for about `rows` input rows, or None where
    PyTorch's path is faster or there is no build."""
    name = choice(kind, rows)
    return None if name == TORCH else kernel_builds()[name]


@functools.cache
def _measured(kind: str, names: tuple[str, ...], rows: int, threads: int) -> str:
    """The probe's choice, from kernels.json or measured (and saved); remembered per process for these arguments
    (the thread count among them: a choice made on 2 threads is not one for 16)."""
    key = "|".join([cpu_id(), f"threads={threads}", torch.__version__, source_digest(), kind, f"rows={rows}"])

    def read(entry: Any) -> tuple[str, dict[str, float]] | None:
        ok = isinstance(entry, dict) and entry.get("choice") in (*names, TORCH)
        return (entry["choice"], {}) if ok else None

    def measure() -> tuple[str, dict[str, float]]:
        times = probe(kind, names, rows=rows)
        build = min(names, key=times.get)
        return (build if times[build] <= BUILD_MARGIN * times[TORCH] else TORCH), times

    # a choice probed on a busy machine serves runs while it stays busy; the first run on a quiet one measures again
    choice, _ = cached_measurement(CACHE_FILE, key, read, measure,
                                   stored=lambda c: {"choice": c[0], "seconds": c[1]}, is_busy=busy)
    return choice


def probe(kind: str, names: tuple[str, ...] | None = None, rounds: int = 4, calls: int = 3,
          rows: int = 1) -> dict[str, float]:
    """Seconds for each candidate ("torch" and each build in `names`) to run the probe's products (inputs of
    `rows` rows) once over weights several times the size of the CPU's last-level cache (decoding streams its
    weights from memory; a probe whose weights stay in cache measures another machine). The fastest of `rounds` x
    `calls` passes, candidates taking turns: on a shared machine another process's time slice lands in some
    passes, never in a kernel's favour, so the minimum is what each path can do. A candidate whose fastest pass of
    the first round takes `SURE_LOSS` times the leader's or more sits out the other rounds (its time stays that
    pass's): it cannot win, and the slowest candidate's passes were most of a probe's time."""
    builds = kernel_builds()
    names = tuple(builds) if names is None else names
    gen = torch.Generator().manual_seed(0)  # not the global one: a seeded run's draws stay as they are
    bytes_per_weight = {"float32": 4, "bfloat16": 2, "int8": 1, "int4": 0.5}[kind]
    copies = max(1, math.ceil(_working_set() / (bytes_per_weight * sum(n * k for n, k in _SHAPES))))
    runs: dict[str, list] = {name: [] for name in (TORCH, *names)}
    for n, k in _SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.02
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16 if kind != "float32" else torch.float32)
        weight = _quantized(kind, w)
        for _ in range(copies):  # each copy laid out anew: its own memory
            runs[TORCH].append(_torch_product(kind, weight, x))
            for name in names:
                runs[name].append(_build_product(builds[name], kind, weight, x))
    best = dict.fromkeys(runs, float("inf"))
    running = list(runs)
    for round_ in range(rounds):
        for name in running:
            for _ in range(calls):
                t0 = time.perf_counter()
                for product in runs[name]:
                    product()
                best[name] = min(best[name], time.perf_counter() - t0)
        if round_ == 0:
            lead = min(best.values())
            running = [name for name in running if best[name] < SURE_LOSS * lead]
    return best


def _working_set(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Bytes of weights the probe streams a candidate: four times the last-level cache (Linux's sysfs), from 64 MiB
    to 512 MiB. The cap: a virtual machine reports its host's whole cache (491,520K on a 2-core Xeon slice, whose
    reads already slow to memory speed past 64 MiB), and four times that for each of four candidates held 15 GB
    and kept a first run probing for minutes."""
    llc = 0
    for index in caches.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            llc = max(llc, int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1))
        except (OSError, ValueError):
            continue
    return min(max(4 * llc, 64 * 2**20), 512 * 2**20)


def _int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w as gptlab.quantize's int4 (q in 0..15, per-group scale and zero), for the probe only."""
    groups = w.view(w.shape[0], -1, _GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = lo + 8 * scale
    q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).view_as(w)
    return q, scale, zero


def _quantized(kind: str, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """w as every candidate takes it before laying it out its own way: (w,) for the float kinds, int8's (q, scale),
    int4's (q, scale, zero). Made once per shape, not per copy: quantizing each copy anew took most of a probe."""
    if kind == "int8":
        scale = w.abs().amax(1).clamp(min=1e-8) / 127
        return (w / scale[:, None]).round().to(torch.int8), scale
    return _int4(w) if kind == "int4" else (w,)


def _torch_product(kind: str, weight: tuple[torch.Tensor, ...], x: torch.Tensor):  # noqa: ANN202 - () -> Tensor
    """PyTorch's path for `kind` as gptlab runs it (generation.packed_linear, quantize), on a copy of its own."""
    if kind == "float32":
        wt = weight[0].t().contiguous()
        return lambda: x @ wt
    if kind == "bfloat16":
        wb = weight[0].bfloat16()
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(wb, 1)
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        except (AttributeError, RuntimeError, NotImplementedError):
            return lambda: F.linear(x, wb)
    if kind == "int8":
        q, s = weight[0].clone(), weight[1].bfloat16()
        return lambda: torch.ops.aten._weight_int8pack_mm(x, q, s)
    q, scale, zero = weight
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    pairs = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()
    return lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, _GROUP, pairs)


def _build_product(ops: Any, kind: str, weight: tuple[torch.Tensor, ...], x: torch.Tensor):  # noqa: ANN202
    n = weight[0].shape[0]
    if kind in ("float32", "bfloat16"):
        packed = ops.pack(weight[0].to(x.dtype))
        return lambda: ops.linear(x, packed, None, None, n)
    if kind == "int8":
        packed, scale = ops.pack_int8(weight[0]), weight[1]
        return lambda: ops.linear(x, packed, scale, None, n)
    packed, qparams = ops.pack_int4(*weight)
    return lambda: ops.linear(x, packed, qparams, None, n)
