"""This machine: which device to run on, its peak matmul throughput for MFU, and how the process's allocator
should behave.

`resolve_device` turns a --device flag ("auto", "cpu", "cuda:1") into a device that exists, or a one-line error;
for a CUDA device it also lets fp32 matmuls use the tensor cores (TF32), as nanoGPT and nanochat do.
`gpu_has_bf16` says whether a GPU multiplies bf16 in hardware (not emulated), and `inference_dtype` turns a
--dtype flag ("auto": bf16 on such a GPU, fp16 on an older one, fp32 on a CPU) into a dtype.

`retain_freed_memory` keeps glibc from handing large freed blocks back to the OS (see its docstring): on CPUs
it takes hundreds of thousands of page faults out of every GPT-2-sized training step.

`peak_flops`, for model FLOPs utilization (MFU): MFU against a datasheet number (an A100's 312 TFLOP/s) says
nothing on a laptop CPU. Instead a short probe times large square matmuls in fp32 and bf16 on the training
device and thread count, and caches the best rate in ~/.cache/gptlab/hardware.json (GPTLAB_CACHE_DIR overrides
the folder). MFU is then "share of what this machine's matmul kernels reach", honest for comparing recipes on
one machine. The other half of MFU, the FLOPs per token, is `gptlab.flops`.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_json, read_json_or_empty

T = TypeVar("T")

if TYPE_CHECKING:
    pass

CACHE_FILE = "hardware.json"


DEVICE_TYPES = ("cpu", "cuda", "mps")  # where a model can run (not "meta": tensors without data)


def resolve_device(name: str = "auto", flag: str = "--device") -> str:
    """"auto" is "cuda" when a GPU is there, else "mps" on a Mac whose Metal device works, else "cpu". Anything else
    must name a device this machine has (cpu, cuda, cuda:N, mps): otherwise a one-line GptlabError naming `flag`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if _mps_works() else "cpu"
        if name == "cuda":
            use_tensor_cores()
        return name
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise GptlabError(f"{flag} {name!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type not in DEVICE_TYPES:
        raise GptlabError(f"{flag} {name!r} cannot run a model: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise GptlabError(f"{flag} {name!r} requested but CUDA is not available here; use {flag} cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise GptlabError(f"{flag} {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                              f"numbered from 0")
        use_tensor_cores()
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise GptlabError(f"{flag} {name!r} requested but MPS is not available here; use {flag} cpu")
    return name


def use_tensor_cores() -> None:
    """fp32 matmuls and convolutions on CUDA may round their inputs to TF32 (10-bit mantissa, fp32 accumulation):
    ~3x faster on Ampere and later, and what every GPU training recipe (nanoGPT, nanochat) sets. Process-wide."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def gpu_has_bf16(device: str | torch.device) -> bool:
    """Whether `device` is a GPU that multiplies bf16 in hardware: compute capability 8.0 (Ampere) or later, or
    any ROCm GPU. Not torch.cuda.is_bf16_supported(): by default it also counts sm70/75 (V100, T4), which only
    emulate bf16, far slower than fp16 with loss scaling there."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)


def inference_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """The weights' dtype a --dtype flag names. "auto": bf16 on a GPU with bf16 units, fp16 on an older GPU, fp32
    elsewhere (a CPU's fp32 keeps logits exact to the reference; bf16 there is an explicit choice)."""
    if name != "auto":
        return getattr(torch, name)
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if gpu_has_bf16(device) else torch.float16
    return torch.float32


def weights_dtype(dtype: torch.dtype | str | None, what: str = "dtype") -> torch.dtype | None:
    """A Python argument naming the weights' dtype (a torch.dtype or its name, "bfloat16"; None: as stored),
    checked before any weight is read: a one-line GptlabError naming `what` instead of torch's TypeError from
    deep in a cast, after the whole checkpoint was read."""
    if dtype is None:
        return None
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise GptlabError(f"{what} must be a floating-point torch.dtype or its name (float32, bfloat16, float16), "
                          f"got {dtype!r}")
    return resolved


def _mps_works() -> bool:
    """Apple's Metal device is there and runs a small matmul (it can be listed yet unusable, e.g. in a VM)."""
    if not torch.backends.mps.is_available():
        return False
    try:
        x = torch.ones(4, 4, device="mps")
        return bool((x @ x).sum().item() == 64.0)
    except RuntimeError:
        return False


def max_threads() -> int:
    """The most intra-op threads `set_threads` accepts: 4 per CPU (beyond that OpenMP only spins and thousands
    of threads take minutes to start)."""
    return 4 * (os.cpu_count() or 1)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads(n: int, flag: str = "threads") -> None:
    """torch's intra-op thread count, checked against this machine (`max_threads`)."""
    if not 1 <= n <= max_threads():
        raise GptlabError(f"{flag} must be between 1 and {max_threads()} (4 per CPU of this machine), got {n}")
    torch.set_num_threads(n)


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes that can still be allocated on `device` (CPU: MemAvailable of /proc/meminfo), or None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def retain_freed_memory(trim_above: int | None = None) -> bool:
    """Make glibc's malloc keep freed memory for reuse (no mmap for big blocks; the heap trimmed only past
    `trim_above` bytes of free memory at its top, never when None).

    PyTorch's CPU tensors come straight from malloc. By default glibc serves blocks over 32 MB (and often
    smaller ones) with a fresh mmap and unmaps them on free, and trims the heap's top once twice the last such
    block is free, so a step that makes and drops a few (B*T, vocab) logits tensors touches new pages every time:
    hundreds of thousands of page faults a step for GPT-2 124M's training, a good share of its time
    (tests/test_train.py counts them); a served decoding step at 64 rows of GPT-2's vocabulary spent 4 ms
    dividing its logits by the temperature and 5.3 ms in their softmax, 0.9 and 1.9 ms with the memory kept. The
    cost: memory a process freed stays reserved by it, which a training process reuses on its next step anyway;
    a long-lived server, whose sizes vary, passes `trim_above` to hand back what it stops needing.
    Process-wide; `gptlab train/eval/sample/serve` call it. Returns whether it applied (False off glibc Linux,
    e.g. macOS or musl).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's <malloc.h> parameter numbers
    trim = 2**31 - 1 if trim_above is None else min(trim_above, 2**31 - 1)
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, trim))


def cache_dir() -> Path:
    return Path(os.environ.get("GPTLAB_CACHE_DIR") or Path.home() / ".cache" / "gptlab")


# Arm's CPU part numbers (/proc/cpuinfo's "CPU part" under implementer 0x41) for the cores servers and boards carry;
# another part is named by its numbers, which still tell it apart in the caches.
_ARM_PARTS = {0xD08: "Cortex-A72", 0xD0B: "Cortex-A76", 0xD0C: "Neoverse N1", 0xD40: "Neoverse V1",
              0xD41: "Cortex-A78", 0xD49: "Neoverse N2", 0xD4F: "Neoverse V2", 0xD8E: "Neoverse N3",
              0xD84: "Neoverse V3"}


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of Linux's /proc/cpuinfo (empty elsewhere)."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return {}


def parse_cpuinfo(text: str) -> dict[str, str]:
    """Fields of /proc/cpuinfo's first processor block: x86 writes "model name" and "flags", arm64 "CPU
    implementer", "CPU part", "CPU variant", "CPU revision" and "Features"."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields and not line.strip():
                break  # the end of the first processor's block
            continue
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_name(cpuinfo: dict[str, str] | None = None) -> str:
    """The CPU's model name: x86's "model name", an arm64 core by its implementer and part ("Neoverse N1 r3p1"),
    macOS's brand string ("Apple M2"), else what `platform` says."""
    info = _cpuinfo() if cpuinfo is None else cpuinfo
    if "model name" in info:
        return info["model name"]
    if "CPU part" in info:
        try:
            implementer, part = int(info.get("CPU implementer", "0"), 16), int(info["CPU part"], 16)
            variant, revision = int(info.get("CPU variant", "0"), 16), int(info.get("CPU revision", "0"))
        except ValueError:
            return f"arm64 {info['CPU part']}"
        core = _ARM_PARTS.get(part) if implementer == 0x41 else None
        return f"{core or f'arm64 implementer {implementer:#x} part {part:#x}'} r{variant}p{revision}"
    if cpuinfo is None and sys.platform == "darwin":
        import subprocess

        try:
            brand = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                   timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            brand = ""
        if brand:
            return brand
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: dict[str, str] | None = None) -> frozenset[str]:
    """The CPU's feature flags as Linux lists them ("flags" on x86, "Features" on arm64; empty elsewhere). The OS
    lists a vector unit only where it saves its registers, so a listed flag can be used."""
    info = _cpuinfo() if cpuinfo is None else cpuinfo
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def cpu_id() -> str:
    """This CPU for the caches of measurements (kernels.json, hardware.json): its model name and a digest of its
    flags. The name alone does not tell CPUs apart: a cloud VM shows "AMD EPYC" for a Zen 3, a Zen 4 and a Zen 5,
    whose kernels differ, and a home directory can outlive the machine under it."""
    import hashlib

    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]
    return f"{cpu_name()} [{flags}]"


def _device_key(device: torch.device, dtype: torch.dtype) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_id()
    return f"{device.type}|{name}|threads={torch.get_num_threads()}|{str(dtype).removeprefix('torch.')}"


def _probe(device: torch.device, dtype: torch.dtype, n: int, seconds: float) -> float:
    """Best FLOP/s of n x n x n matmuls over about `seconds`. Draws from its own generator: a run's random
    stream (init, dropout) must not depend on whether the probe ran or its result was cached."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up: kernel selection, page faults
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        sync()
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


PROVISIONAL = "provisional|"  # a cached timing's mark: taken while the machine was busy


def cached_measurement(file_name: str, key: str, read: Callable[[Any], T | None], measure: Callable[[], T],
                       stored: Callable[[T], Any] = lambda value: value,
                       keep: Callable[[T], bool] = lambda value: True,
                       is_busy: Callable[[], bool] | None = None) -> T:
    """A measurement of this machine, kept under `key` in the cache folder's JSON file `file_name`: the kept entry
    where `read` makes a value of it (a missing or damaged entry reads as None and is measured again), else
    `measure()`, written back as `stored(value)` unless `keep(value)` says not (a read-only home: measured again
    next time).

    A timing passes `is_busy` (`busy`): one taken while the machine was busy is kept as provisional (marked under
    PROVISIONAL + key): later runs use it while the machine stays busy, and the first to find it quiet measures
    again. Dropping such a timing instead made every run on a loaded machine measure anew."""
    path = cache_dir() / file_name
    cached = read_json_or_empty(path)
    value = read(cached.get(key))
    mark = PROVISIONAL + key
    if value is not None and not (is_busy is not None and cached.get(mark) is True and not is_busy()):
        return value
    value = measure()
    if keep(value):
        cached[key] = stored(value)
        if is_busy is not None and is_busy():
            cached[mark] = True
        else:
            cached.pop(mark, None)
        try:
            atomic_write_json(path, cached)
        except (OSError, GptlabError):
            pass
    return value


def busy() -> bool:
    """Whether other work keeps this machine's cores busy (a load average above their count). A probe taken then
    measures the contention as much as what it times (one spike made a kernel build look 20x slower than it is),
    so its result is kept only until a run finds the machine quiet (`cached_measurement`)."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:  # no load average (Windows)
        return False


def peak_flops(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """Peak matmul FLOP/s of `device` in `dtype`: measured once (a fraction of a second), then cached."""
    device = torch.device(device)
    n = 4096 if device.type == "cuda" else 1024

    def read(value: Any) -> float | None:  # anything but a positive finite number is measured again
        ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf
        return float(value) if ok else None

    return cached_measurement(CACHE_FILE, _device_key(device, dtype), read,
                              lambda: _probe(device, dtype, n, seconds=0.5 if device.type == "cuda" else 0.25))


# Dense bf16 tensor-core FLOP/s from NVIDIA's datasheets (no sparsity), by a substring of the device's name, most
# specific first: the peak that nanoGPT, nanochat and Lightning report MFU against on a GPU.
DATASHEET_BF16_FLOPS = (
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12),
    ("GH200", 989e12), ("B200", 2250e12), ("B100", 1750e12), ("A100", 312e12), ("A800", 312e12),
    ("A10G", 70e12), ("A10", 125e12), ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12),
    ("RTX 4090", 165e12), ("RTX 3090", 71e12), ("A6000", 155e12),
)


def datasheet_flops(device: str | torch.device) -> float | None:
    """The datasheet's dense bf16 FLOP/s of a CUDA device, or None for one the table does not know."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in DATASHEET_BF16_FLOPS if key in name), None)

