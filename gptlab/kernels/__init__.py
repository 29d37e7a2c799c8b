"""C++ kernels shipped as source and built on first use, for CPUs whose PyTorch kernels are slow at decoding shapes.

`linear_avx2.cpp` (see its header): bf16, fp32, int8 and int4 matrix-vector and small-batch products over
weights re-laid out once, for `gptlab.generation.packed_linear` and `gptlab.quantize`'s int8/int4 weights, on CPUs
where they are faster than PyTorch's kernels (`dispatch` measures which path runs each kind of weight here).
`decode_step.cpp`: the decode step of any gptlab model over those packed weights in one call
(`gptlab.generation.native_decode`). `cross_entropy.cpp`: the training loss's softmax cross-entropy and its
gradient in one pass per row (`gptlab.ops.cross_entropy` over LM-head-wide logits). `activations.cpp`: GELU
(erf and tanh forms) with its slope in one pass for training (`gptlab.ops.gelu`). `split_heads.cpp`: an
attention layer's q, k and v cut from its projection, cast, QK-normalized and rotated, and the gradient of
that, in training (`gptlab.heads`). `norms.cpp`: LayerNorm and RMSNorm forward and backward in training
(`gptlab.norms`).
`adamw.cpp`: AdamW's step from bf16 working gradients into the fp32 masters and back into the working weights in
one pass (`gptlab.train.flat`). `dequantize_int4.cpp`: QLoRA's int4 base weight unpacked straight into fp32/bf16
blocks (`gptlab.qlora`). `attention_fp32.cpp`: causal attention in fp32 training and scoring passes, forward and
backward on register tiles (`gptlab.causal_attention`). In the AVX-512 builds only: `attention_backward.cpp`
(causal attention's backward in bf16 training, `gptlab.causal_attention`) and `newton_schulz.cpp` (Muon's
Newton-Schulz over a stack of small matrices, `gptlab.train.muon`), both on `bf16_products.h`'s products on bf16
dot products. All are built into one library (`linear_avx2.h` is what they share; `dense_tiles.h` and
`int_tiles.h` hold the bf16/fp32 and int8/int4 micro-kernels, `exp_fast.h` the vectorizable exp, `simd.h` whole
vectors of fp32 lanes for the loss's and GELU's loops).

The sources are built up to four times, one library each (`kernel_builds()` lists those this machine runs):
`avx2_ops()` (AVX2 + FMA, torch.ops.gptlab_avx2), `avxvnni_ops()` (the same with AVX-VNNI's 256-bit byte dot
products for int4, torch.ops.gptlab_avxvnni: Alder Lake, Zen 5 and later), `avx512_ops()` (AVX-512 F/BW/VL/DQ
with VNNI integer and BF16 dot products, torch.ops.gptlab_avx512: Zen 4, Sapphire Rapids and later) and
`amx_ops()` (the AVX-512 build whose products of many rows run on AMX tiles, `amx_tiles.h`,
torch.ops.gptlab_amx: Sapphire Rapids and later Xeons). All read the same packed weights, so a weight packed once
runs on any; int8/int4 outputs are equal to the bit across the first three, bf16/fp32 ones within fp32 rounding;
the AMX build's tiles multiply int4 weights widened to bf16 by x in bf16, and int8 weights by the other builds'
16-bit fixed-point x on their byte products, whose integer sums they keep exact to the end (see amx_tiles.h).
Which build (or PyTorch) serves each kind of weight is measured once per machine by `gptlab.kernels.dispatch`.
For kernel work on a machine without them, `GPTLAB_KERNEL_EMULATE=1` puts the AVX-VNNI, AVX-512 and AMX builds
the CPU lacks into `kernel_builds()` emulated (`emulated_ops()`): their code, 16-lane vector loops and intrinsics
included, compiled for AVX2 with the intrinsics from SIMDe's headers and AMX's tiles in memory (`emulation.h`).
Many times slower and never chosen by the dispatch; it lets the kernel tests (`GPTLAB_KERNEL_EMULATE=1 python -m
pytest`) run every build's code on any AVX2 CPU.

The build (`torch.utils.cpp_extension.load` of a unity file per core: a C++ compiler, ~22 s on 2 cores) runs once
per machine and torch version; the library is cached under torch's extensions directory (`TORCH_EXTENSIONS_DIR`)
and loaded from there next time. Where no compiler is present or the build fails, `avx2_ops()` / `avx512_ops()`
return None after one warning, and callers keep their pure-PyTorch path. `GPTLAB_NO_KERNELS=1` turns the kernels
off (for comparisons); `GPTLAB_KERNEL_CFLAGS` adds compiler and linker flags to every build (coverage,
sanitizers), each then a build of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gptlab.hardware import cpu_flags
from gptlab.kernels.build import load_library

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = [HERE / "linear_avx2.cpp", HERE / "packing.cpp", HERE / "decode_step.cpp", HERE / "cross_entropy.cpp",
           HERE / "dequantize_int4.cpp", HERE / "activations.cpp", HERE / "split_heads.cpp",
           HERE / "norms.cpp", HERE / "adamw.cpp", HERE / "attention_backward.cpp", HERE / "attention_fp32.cpp",
           HERE / "transpose.cpp", HERE / "newton_schulz.cpp", HERE / "sampling.cpp"]
HEADERS = sorted(HERE.glob("*.h"))
_COMMON_FLAGS = ["-O3", "-fopenmp"]
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]  # F16C: int4's fp16 scales (every AVX2 CPU has it)
# the AVX-512 build: the int8/int4 kernels need VNNI (vpdpwssd), the bf16 one BF16 (vdpbf16ps); Zen 4, Ice Lake
# server with BF16 (Cooper Lake), Sapphire Rapids and later have all of them
AVX512_FLAGS = [*AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx512bf16"]
AVXVNNI_FLAGS = [*AVX2_FLAGS, "-mavxvnni"]
AMX_FLAGS = [*AVX512_FLAGS, "-mamx-tile", "-mamx-bf16", "-mamx-int8"]  # the AVX-512 build plus the tile unit
AMX_CPU_FLAGS = frozenset({"amx_tile", "amx_bf16", "amx_int8"})  # every AMX CPU so far has all three
AVX512_CPU_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                              "avx512_bf16"})
# the emulated builds (tests only, under GPTLAB_KERNEL_EMULATE=1): a build's code for a CPU that lacks it, compiled
# for AVX2 with its intrinsics from SIMDe's headers and AMX's tiles in memory (emulation.h)
EMULATE_ENV = "GPTLAB_KERNEL_EMULATE"
EMULATED_FLAGS = {"avxvnni": [*AVX2_FLAGS, "-DGPTLAB_EMULATE_AVXVNNI"],
                  "avx512": [*AVX2_FLAGS, "-DGPTLAB_EMULATE_AVX512"],
                  "amx": [*AVX2_FLAGS, "-DGPTLAB_EMULATE_AVX512", "-DGPTLAB_EMULATE_AMX"]}
SIMDE_HEADER = "simde/x86/avx512.h"
# more flags for every build, for kernel work: "--coverage -O1" (which lines the tests reach, with gcovr), "-g
# -fsanitize=undefined -fno-sanitize-recover=undefined" (UBSan: undefined behaviour aborts the process). They go into
# the builds' names, so the usual builds stay as they are
EXTRA_FLAGS_ENV = "GPTLAB_KERNEL_CFLAGS"


def _x86() -> bool:
    """An x86-64 CPU: elsewhere (ARM: Apple Silicon, Graviton) nothing x86 is built or probed."""
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_has_avx2() -> bool:
    """Whether this CPU runs AVX2 + FMA code (an x86 CPU, and torch's own dispatch level says so)."""
    return _x86() and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def cpu_has_avxvnni() -> bool:
    """Whether this CPU runs the AVX-VNNI build: AVX2 with the VEX-encoded byte dot products."""
    return cpu_has_avx2() and "avx_vnni" in cpu_flags()


def cpu_has_avx512() -> bool:
    """Whether this CPU runs the AVX-512 build: F/BW/VL/DQ with VNNI and BF16."""
    return _x86() and AVX512_CPU_FLAGS <= cpu_flags()


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this process may run the AMX build: the AVX-512 build's flags, AMX-TILE, -BF16 and -INT8, and Linux's
    permission to use the tile data (asked for once; a kernel or hypervisor that refuses it means no)."""
    if not (cpu_has_avx512() and AMX_CPU_FLAGS <= cpu_flags() and platform.system() == "Linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): granted once for the whole process
        return libc.syscall(158, 0x1023, 18) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def source_digest() -> str:
    """A digest of every source and header: it names the builds (an edited kernel is never loaded stale) and keys
    the dispatch's measurements."""
    return hashlib.sha256(b"".join(f.read_bytes() for f in [*SOURCES, *HEADERS])).hexdigest()[:12]


def _build_name(library: str, flags: list[str]) -> str:
    """The build's name changes with every source and header, the flags, the torch version and where the sources
    are: torch's build reruns whenever its source paths change, so two installs of gptlab on one machine (a
    checkout beside a wheel) would otherwise rebuild each other's library on every first use."""
    key = source_digest() + " ".join(flags) + torch.__version__ + str(SOURCES[0].parent.resolve())
    return f"{library}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _build(library: str, what: str, flags: list[str]) -> Any | None:
    """torch.ops.<library>: the sources compiled with `flags` (their macros pick the library's name), or None after
    one warning where no compiler is present or the build fails."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        warnings.warn(f"gptlab: no C++ compiler found, so decoding and training on this CPU run PyTorch's kernels "
                      f"(install g++ to build gptlab's {what} kernels once)", stacklevel=3)
        return None
    try:
        extra = shlex.split(os.environ.get(EXTRA_FLAGS_ENV, ""))  # compiler and linker both take them
        cflags = [*_COMMON_FLAGS, *flags, *extra]
        load_library(_build_name(library, cflags), SOURCES, cflags, ["-fopenmp", *extra])
        # the output's shape and dtype without running it (Meta kernels, which fake tensors run): torch.compile then
        # traces a model through `linear` (an opaque call in its graph) instead of failing there. Registered through
        # a Library rather than torch.library.register_fake, which looks up each caller's source (~10 ms of
        # start-up through inspect.getmodule over every module loaded)
        meta = _META_LIBRARIES[library] = torch.library.Library(library, "IMPL")  # (once: the builds are cached)
        for name, shapes in (
            ("linear", lambda x, packed, qparams, bias, N: x.new_empty((*x.shape[:-1], N))),
            ("split_heads", _split_heads_shapes),
            ("split_heads_backward", lambda dq, dk, dv, qkv, *_: torch.empty_like(qkv)),
            ("softmax_xent", lambda logits, targets, grad: (logits.new_empty(logits.shape[0], dtype=torch.float32),
                                                            logits.new_empty(logits.shape if grad else (0,)))),
            ("norm_rows", _norm_rows_shapes),
            ("norm_rows_backward", _norm_rows_backward_shapes),
            ("causal_attention_fp32", _attention_fp32_shapes),
            ("causal_attention_fp32_backward",
             lambda grad, q, k, v, *_: (torch.empty_like(q, memory_format=torch.contiguous_format),
                                        torch.empty_like(k, memory_format=torch.contiguous_format),
                                        torch.empty_like(v, memory_format=torch.contiguous_format))),
        ):
            meta.impl(name, shapes, "Meta")
    except Exception as e:  # noqa: BLE001 - any build failure means: keep the PyTorch path
        warnings.warn(f"gptlab: building the {what} kernels failed, using PyTorch's ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''})", stacklevel=3)
        return None
    return getattr(torch.ops, library)


_META_LIBRARIES: dict[str, torch.library.Library] = {}  # kept alive: a Library's registrations end with it


def _split_heads_shapes(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int, n_kv_head: int,
                        interleaved: bool, norm: bool, eps: float, out_dtype: torch.dtype) -> list[torch.Tensor]:
    """split_heads' outputs, shaped, without running it (fake tensors, torch.compile's tracing)."""
    B, T, width = qkv.shape
    hs = width // (n_head + 2 * n_kv_head)
    return [qkv.new_empty((B, heads, T, hs), dtype=out_dtype) for heads in (n_head, n_kv_head, n_kv_head)]


def _attention_fp32_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """causal_attention_fp32's output, (B, H, T, D) over (B, T, H, D) memory, and its log-sum-exp (B, H, T)."""
    B, H, T, D = q.shape
    return q.new_empty(B, T, H, D).permute(0, 2, 1, 3), q.new_empty(B, H, T)


def _norm_rows_shapes(x: torch.Tensor, *_: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


def _norm_rows_backward_shapes(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
                               rstd: torch.Tensor, rms: bool, weight_grad: bool, bias_grad: bool,
                               param_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def param(wanted: bool) -> torch.Tensor:
        return x.new_empty(x.shape[-1] if wanted else 0, dtype=param_dtype if wanted else torch.float32)

    return torch.empty_like(x), param(weight_grad), param(bias_grad)


@functools.cache
def avx2_ops() -> Any | None:
    """torch.ops.gptlab_avx2 (`pack`, `pack_int8`, `pack_int4`, `linear`, `decode_step`), built on first use; None
    (after one warning) where this CPU lacks AVX2, no compiler is present, the build fails, or GPTLAB_NO_KERNELS is
    set."""
    if os.environ.get("GPTLAB_NO_KERNELS") or not cpu_has_avx2():
        return None
    return _build("gptlab_avx2", "AVX2", AVX2_FLAGS)


@functools.cache
def avxvnni_ops() -> Any | None:
    """torch.ops.gptlab_avxvnni: the AVX2 build with AVX-VNNI's `vpdpbusd` for int4 (the other kinds as AVX2's);
    None where the CPU lacks AVX-VNNI or as `avx2_ops()`."""
    if os.environ.get("GPTLAB_NO_KERNELS") or not cpu_has_avxvnni():
        return None
    return _build("gptlab_avxvnni", "AVX-VNNI", AVXVNNI_FLAGS)


@functools.cache
def avx512_ops() -> Any | None:
    """torch.ops.gptlab_avx512: the same operators built for AVX-512 (VNNI integer and BF16 dot products), reading
    the same packed weights as `avx2_ops()`; built on first use, None (after one warning where a build was tried)
    where this CPU lacks any of AVX512F/BW/VL/DQ/VNNI/BF16, on non-x86 CPUs, where no compiler is present, the
    build fails, or GPTLAB_NO_KERNELS is set."""
    if os.environ.get("GPTLAB_NO_KERNELS") or not cpu_has_avx512():
        return None
    return _build("gptlab_avx512", "AVX-512", AVX512_FLAGS)


@functools.cache
def amx_ops() -> Any | None:
    """torch.ops.gptlab_amx: the AVX-512 build whose products of many rows (bf16 from 8, int8 from 6, int4 from 24)
    run on the tile unit (AMX: Sapphire Rapids and later Xeons; amx_tiles.h); None where the CPU or the OS does not
    offer AMX, or as `avx512_ops()`."""
    if os.environ.get("GPTLAB_NO_KERNELS") or not cpu_has_amx():
        return None
    return _build("gptlab_amx", "AMX", AMX_FLAGS)


def simde_found() -> bool:
    """Whether the C++ compiler finds SIMDe's headers (libsimde-dev; elsewhere a checkout named by CPATH), which
    the emulated builds need."""
    dirs = [*os.environ.get("CPATH", "").split(os.pathsep), *os.environ.get("CPLUS_INCLUDE_PATH", "").split(os.pathsep),
            "/usr/local/include", "/usr/include"]
    return any(d and (Path(d) / SIMDE_HEADER).is_file() for d in dirs)


@functools.cache
def emulated_ops(build: str) -> Any | None:
    """torch.ops.gptlab_<build>_emulated: the "avxvnni", "avx512" or "amx" build's code compiled for this AVX2 CPU
    (emulation.h), for testing it where the CPU cannot run it; many times slower. None (after one warning) without
    SIMDe's headers, or as `avx2_ops()`."""
    if os.environ.get("GPTLAB_NO_KERNELS") or not cpu_has_avx2():
        return None
    if not simde_found():
        warnings.warn(f"gptlab: the emulated {build} kernels need SIMDe's headers ({SIMDE_HEADER}): apt install "
                      "libsimde-dev, or point CPATH at a SIMDe checkout", stacklevel=2)
        return None
    return _build(f"gptlab_{build}_emulated", f"emulated {build}", EMULATED_FLAGS[build])


def kernel_builds() -> dict[str, Any]:
    """Every build of the kernels this machine can execute, by name ("avx2", "avxvnni", "avx512", "amx"), each built
    on first use. A weight packed by any build's `pack`/`pack_int8`/`pack_int4` runs on all of them (one layout).
    Under GPTLAB_KERNEL_EMULATE=1 (tests) a build that is not there natively is there emulated (`emulated_ops`;
    `emulated_builds()` names them), so that the tests of every build run on any AVX2 machine."""
    builds = {"avx2": avx2_ops(), **_native_builds()}
    for name in emulated_builds():
        builds[name] = emulated_ops(name)
    return {name: ops for name, ops in builds.items() if ops is not None}


def _native_builds() -> dict[str, Any]:
    """The builds that can be emulated, as this machine builds them natively (None where the CPU lacks one or its
    build failed)."""
    return {"avxvnni": avxvnni_ops(), "avx512": avx512_ops(), "amx": amx_ops()}


def emulated_builds() -> frozenset[str]:
    """The builds that `kernel_builds()` emulates here: under GPTLAB_KERNEL_EMULATE=1 those not built natively
    (the CPU lacks them, or their build failed); else none. The dispatch never chooses one."""
    if not os.environ.get(EMULATE_ENV):
        return frozenset()
    return frozenset(name for name, ops in _native_builds().items() if ops is None)


def training_ops(*tensors: torch.Tensor | None) -> Any | None:
    """`widest_ops()` where gptlab's training kernels (`gptlab.heads`, `gptlab.norms`, `gptlab.ops.gelu`) take these
    tensors (`takes_training_kernels`); None elsewhere. Inference keeps ATen's ops and their bits."""
    return widest_ops() if takes_training_kernels(*tensors) else None


def takes_training_kernels(*tensors: torch.Tensor | None) -> bool:
    """Whether these tensors (None entries skipped) go through the training kernels: all on a CPU in fp32 or bf16,
    outside torch.compile (which fuses ATen's ops itself), in a training step (a gradient wanted of one of them)
    or a scoring pass (`scoring`)."""
    present = [t for t in tensors if t is not None]
    if torch.compiler.is_compiling() or any(t.device.type != "cpu" or t.dtype not in (torch.float32, torch.bfloat16)
                                            for t in present):
        return False
    return _SCORING.get() or gradient_wanted(*present)


def gradient_wanted(*tensors: torch.Tensor) -> bool:
    """Whether autograd will want a gradient through an op on these tensors: grad mode on and one of them needing
    one (a training step's forward, not a scoring pass's)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


_SCORING = contextvars.ContextVar("gptlab_scoring", default=False)


@contextlib.contextmanager
def scoring() -> Iterator[None]:
    """Forward passes inside take the training kernels without a gradient: a split's loss (`evaluate_loss`), whose
    values are ATen's within fp32 rounding either way. The fused heads, norms and short attention save ~15% of
    the CPU speedrun's final evaluation. Elsewhere inference keeps ATen's bits, which the HF parity tests and the
    decode steps follow."""
    token = _SCORING.set(True)
    try:
        yield
    finally:
        _SCORING.reset(token)


def bf16_dot_ops() -> Any | None:
    """The build whose training products run on the CPU's bf16 dot products (`attention_backward.cpp`,
    `newton_schulz.cpp`): the AMX build's tiles, else the AVX-512 build's AVX512-BF16; None without either."""
    return amx_ops() or avx512_ops()


def widest_ops() -> Any | None:
    """The widest build this CPU runs (AVX-512, else AVX2), for the operators that have no per-shape dispatch
    (cross-entropy, the training heads and norms, int4 dequantization); None where neither builds."""
    return avx512_ops() or avx2_ops()
