"""C++ kernels shipped as source and built on first use, for CPUs whose PyTorch kernels are slow at decoding shapes.

`linear_avx2.cpp` (see its header): bf16, fp32, int8 and int4 matrix-vector and small-batch products over
weights re-laid out once, for CPUs with AVX2 + FMA; the path for bf16 weights where the CPU has no native bf16
matmul and oneDNN cannot prepack them (AMD Zen 2/3 and older Xeons), and for `gptlab.quantize`'s int8/int4
weights there. GPT-2 124M decoding on a 2-core Zen 3: see `gptlab.generation.packed_linear` and `gptlab.quantize`.
`decode_avx2.cpp`: a GPT-2-shaped model's decode step over those packed weights in one call
(`gptlab.generation.fast_decode`). Both are built into one library (`linear_avx2.h` is what they share;
`int_tiles.h` holds the int8/int4 micro-kernels).

The build (`torch.utils.cpp_extension.load`: a C++ compiler, ~30 s on 2 cores) runs once per machine and torch
version; the library is cached under torch's extensions directory (`TORCH_EXTENSIONS_DIR`) and loaded from there
next time. Where no compiler is present or the build fails, `avx2_ops()` returns None after one warning, and
callers keep their pure-PyTorch path. `GPTLAB_NO_KERNELS=1` turns the kernels off (for comparisons).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = [HERE / "linear_avx2.cpp", HERE / "decode_avx2.cpp", HERE / "decode_step.cpp"]
HEADERS = [HERE / "linear_avx2.h", HERE / "int_tiles.h"]


def cpu_has_avx2() -> bool:
    """Whether this CPU runs AVX2 + FMA code (an x86 CPU, and torch's own dispatch level says so)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return False  # ARM (Apple Silicon, Graviton): nothing x86 is built or probed
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def build_name() -> str:
    """The build's name changes with the source and torch version, so an edited kernel is never loaded stale."""
    import hashlib

    code = b"".join(f.read_bytes() for f in [*SOURCES, *HEADERS])
    digest = hashlib.sha256(code + torch.__version__.encode()).hexdigest()[:12]
    return f"gptlab_avx2_{digest}"


@functools.cache
def avx2_ops() -> Any | None:
    """torch.ops.gptlab_avx2 (`pack`, `linear`), built on first use; None (after one warning) where this CPU lacks
    AVX2, no compiler is present, the build fails, or GPTLAB_NO_KERNELS is set."""
    if os.environ.get("GPTLAB_NO_KERNELS") or not cpu_has_avx2():
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        warnings.warn("gptlab: no C++ compiler found, so bf16 decoding on this CPU runs PyTorch's slower kernels "
                      "(install g++ to build gptlab's AVX2 kernels once)", stacklevel=2)
        return None
    try:
        from torch.utils.cpp_extension import load

        load(name=build_name(), sources=[str(f) for f in SOURCES], is_python_module=False, verbose=False,
             extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as e:  # noqa: BLE001 - any build failure means: keep the PyTorch path
        warnings.warn(f"gptlab: building the AVX2 kernels failed, using PyTorch's ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''})", stacklevel=2)
        return None
    return torch.ops.gptlab_avx2


def avx2_only_ops() -> Any | None:
    """`avx2_ops()` on CPUs whose best vector unit is AVX2 (torch's capability "AVX2": no AVX-512, so oneDNN
    cannot prepack bf16 and PyTorch's bf16 and int8/int4 weight-only kernels are slower than these); None elsewhere
    (CPUs with AVX-512 keep PyTorch's and oneDNN's kernels) or where they could not be built."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return None
    return avx2_ops()


def kernel_builds() -> dict[str, Any]:
    """gptlab's kernel builds this machine can execute, by name ("avx2"); empty where none could be built."""
    ops = avx2_ops()
    return {} if ops is None else {"avx2": ops}
