"""Linear kernels on decoding shapes: each gptlab kernel build (`gptlab.kernels.kernel_builds()`: AVX2, AVX-VNNI,
AVX-512, AMX) against PyTorch's paths, on the weight matrices of GPT-2 124M and SmolLM2-135M, batch 1 and 32,
bf16/int8/int4.

    python benchmarks/kernel_throughput.py [--threads 2] [--rounds 5] [--models gpt2,smollm2] [--batches 1,32]

Contenders per dtype (bf16 activations throughout, as a bf16 or quantized model decodes):
* bf16: each build's `linear` on the packed weight; `F.linear` (PyTorch's bf16 matmul); oneDNN's prepacked bf16
  (`mkldnn._reorder_linear_weight` + `mkldnn._linear_pointwise`, where this PyTorch has them).
* int8 (per-row scales): each build's `linear`; `aten._weight_int8pack_mm`.
* int4 (groups of 32, asymmetric): each build's `linear`; `aten._weight_int4pack_mm_for_cpu`.

Every contender cycles through enough copies of its weights (>= 3x the L3 cache) that each call reads them from
memory, as decoding does. Rounds interleave the contenders (the order rotates every round); the figure is each
call's median over the rounds. Printed: microseconds per call, GB/s of weight bytes read (the contender's own
layout: int4's scales and offsets count), and the speed against the best other contender of that cell (>1:
faster). Per model, the sum over one token's matrices (12 GPT-2 blocks + head; 30 SmolLM2 blocks + head) gives the
matmul-only ceiling in tokens/s. A read probe (fp32 sum over 1 GiB on the same threads) gives the memory bandwidth
that bounds it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from timing import loadavg, raise_priority  # noqa: E402 - benchmarks/ is on sys.path when run as a script

# (in, out) of each matrix, and how many of it one token reads
MODELS = {
    "gpt2": [((768, 2304), 12), ((768, 768), 12), ((768, 3072), 12), ((3072, 768), 12), ((768, 50257), 1)],
    "smollm2": [((576, 576), 60), ((576, 192), 60), ((576, 1536), 60), ((1536, 576), 30), ((576, 49152), 1)],
}
GROUP = 32
COPY_BYTES = 96 << 20  # per contender: 3x this machine's 32 MiB L3


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def copies(tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    n = max(2, -(-COPY_BYTES // nbytes(*tensors)))
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(n - 1)]


def contenders(dtype: str, W: torch.Tensor, builds: dict) -> dict[str, tuple[int, list[Callable]]]:
    """name -> (weight bytes per call, one callable x -> y per copy of the weights)"""
    N, K = W.shape
    out: dict[str, tuple[int, list[Callable]]] = {}
    first = next(iter(builds.values()), None)
    if dtype == "bf16":
        wb = W.bfloat16()
        if first is not None:
            packed = copies((first.pack(wb),))
            for name, ops in builds.items():
                out[f"gptlab-{name}"] = (nbytes(*packed[0]), [lambda x, p=p, o=ops: o.linear(x, p[0], None, None, N)
                                                              for p in packed])
        plain = copies((wb,))
        out["torch F.linear"] = (nbytes(*plain[0]), [lambda x, w=w: F.linear(x, w[0]) for w in plain])
        mkl = torch.ops.mkldnn
        if torch.backends.mkldnn.is_available() and hasattr(mkl, "_reorder_linear_weight"):
            try:
                pre = copies((mkl._reorder_linear_weight(wb, 1),))
                mkl._linear_pointwise(torch.zeros(1, K, dtype=torch.bfloat16), pre[0][0], None, "none", [], "")
                out["oneDNN packed"] = (nbytes(wb), [lambda x, w=w: mkl._linear_pointwise(x, w[0], None, "none", [],
                                                                                            "") for w in pre])
            except RuntimeError as e:
                print(f"  (oneDNN packed bf16 unavailable: {str(e).splitlines()[0][:80]})")
        return out
    from gptlab.quantize import QuantizedLinear, _scales_and_zeros, _unpadded, unpack_nibbles

    lin = nn.Linear(K, N, bias=False)
    lin.weight.data.copy_(W)
    layer = QuantizedLinear(lin, dtype, GROUP)
    if dtype == "int8":
        if first is not None:
            packed = copies((first.pack_int8(layer.qweight), layer.scale.float()))
            for name, ops in builds.items():
                out[f"gptlab-{name}"] = (nbytes(*packed[0]), [lambda x, p=p, o=ops: o.linear(x, p[0], p[1], None, N)
                                                              for p in packed])
        q = copies((layer.qweight, layer.scale.bfloat16()))
        out["torch int8pack_mm"] = (nbytes(*q[0]), [lambda x, w=w: torch.ops.aten._weight_int8pack_mm(x, *w)
                                                    for w in q])
        return out
    if first is not None:
        packed = copies(tuple(first.pack_int4(unpack_nibbles(layer.qweight), layer.scale, layer.zero)))
        for name, ops in builds.items():
            out[f"gptlab-{name}"] = (nbytes(*packed[0]), [lambda x, p=p, o=ops: o.linear(x, p[0], p[1], None, N)
                                                          for p in packed])
    try:
        rows = N + (-N) % 16  # as gptlab.quantize's int4 path: the CPU packing takes N in multiples of 16
        qi = F.pad(unpack_nibbles(layer.qweight).to(torch.int32), (0, 0, 0, rows - N))
        held = copies((torch.ops.aten._convert_weight_to_int4pack_for_cpu(qi, 1),
                       _scales_and_zeros(layer, torch.bfloat16, rows)))
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        out["torch int4pack_mm"] = (nbytes(*held[0]), [lambda x, w=w: _unpadded(mm(x, w[0], GROUP, w[1]), N)
                                                       for w in held])
    except (RuntimeError, NotImplementedError) as e:
        print(f"  (torch int4 unavailable: {str(e).splitlines()[0][:80]})")
    return out


def measure(fns: list[Callable], x: torch.Tensor, target: float) -> float:
    """Seconds per call: cycles through the copies for about `target` seconds."""
    calls, t0 = 0, time.perf_counter()
    while True:
        for f in fns:
            f(x)
        calls += len(fns)
        elapsed = time.perf_counter() - t0
        if elapsed >= target:
            return elapsed / calls


def bandwidth(rounds: int) -> float:
    """GB/s of an fp32 sum over 1 GiB (a read stream on torch's threads)."""
    t = torch.ones(1 << 28)
    t.sum()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - t0)
    return t.numel() * 4 / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.03, help="seconds per measurement")
    ap.add_argument("--models", default="gpt2,smollm2")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--dtypes", default="bf16,int8,int4")
    args = ap.parse_args()
    raise_priority()
    torch.set_num_threads(args.threads)
    from gptlab.kernels import kernel_builds

    builds = kernel_builds()
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} "
          f"threads, gptlab builds: {', '.join(builds) or 'none'}, load {loadavg()}")
    bw = bandwidth(7)
    print(f"memory read probe (fp32 sum over 1 GiB): {bw:.1f} GB/s")
    g = torch.Generator().manual_seed(0)
    token: dict[tuple[str, str, int], dict[str, float]] = {}
    print(f"{'model':8} {'matrix':>10} {'M':>3} {'dtype':5} {'contender':18} {'us/call':>9} {'GB/s':>6} "
          f"{'%bw':>4} {'vs best other':>13}")
    for model in args.models.split(","):
        for (k, n), count in MODELS[model]:
            W = torch.randn(n, k, generator=g) * 0.02
            for dtype in args.dtypes.split(","):
                cands = contenders(dtype, W, builds)
                for M in map(int, args.batches.split(",")):
                    x = torch.randn(M, k, generator=g).bfloat16()
                    times: dict[str, list[float]] = {name: [] for name in cands}
                    for _, fns in cands.values():
                        measure(fns, x, 0.0)  # warm-up: one pass over the copies
                    names = list(cands)
                    for r in range(args.rounds):
                        for name in names[r % len(names):] + names[:r % len(names)]:
                            times[name].append(measure(cands[name][1], x, args.target))
                    med = {name: statistics.median(ts) for name, ts in times.items()}
                    for name, t in med.items():
                        gbs = cands[name][0] / t / 1e9
                        others = [v for o, v in med.items() if o != name]
                        ratio = f"{min(others) / t:.2f}x" if others else "-"
                        print(f"{model:8} {f'{k}x{n}':>10} {M:>3} {dtype:5} {name:18} {t * 1e6:9.1f} {gbs:6.1f} "
                              f"{100 * gbs / bw:4.0f} {ratio:>13}", flush=True)
                        token.setdefault((model, dtype, M), {}).setdefault(name, 0.0)
                        token[(model, dtype, M)][name] += t * count
                del cands
    print("\nper token, the matrices only (sum of medians x count): ms and the tokens/s ceiling")
    for (model, dtype, M), per in token.items():
        best = min(per.values())
        row = ", ".join(f"{name} {t * 1e3:.2f} ms ({M / t:.0f} tok/s{', best' if t == best else ''})"
                        for name, t in per.items())
        print(f"{model:8} {dtype:5} M={M:<3} {row}")


if __name__ == "__main__":
    main()
