"""The seconds of a QLoRA training step with the int4 base dequantized by gptlab's C++ kernel
(gptlab/kernels/dequantize_int4.cpp) against the same step through ATen's ops (unpack, fp32 multiply and add, the
bf16 cast), alternated in one process on the same model and batch; and of dequantizing every block Linear once.

    python benchmarks/qlora_step.py                         # one block of the 3.17B shape (18 x 4096 in qlora_memory)
    python benchmarks/qlora_step.py --layers 2 --width 2048 --repeats 5

The model: `--preset`'s shape (TinyLlama 1.1B's ratios, `--layers` / `--width` as in qlora_memory.py) over a
65-word vocabulary, its block Linears int4 (groups of 32) with rank-16 adapters, bf16; the step: forward and
backward of `--batch` x `--seq` tokens (no optimizer: the adapters' update costs the same both ways). The median
of `--repeats` per contender, each repeat running both; the ratio is ATen's seconds over the kernel's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from qlora_memory import shape_overrides  # benchmarks/ is on sys.path when a benchmark runs as a script
from timing import loadavg

from gptlab import qlora
from gptlab.config import GPTConfig
from gptlab.lora import LoRASpec, add_lora
from gptlab.model import GPT
from gptlab.qlora import FrozenQuantizedLinear, quantize_base


def model_for(args: argparse.Namespace) -> GPT:
    config = GPTConfig.preset(args.preset, block_size=args.seq, vocab_size=65, **shape_overrides(args))
    torch.manual_seed(0)
    model = quantize_base(GPT(config).to(torch.bfloat16), "int4")
    return add_lora(model, LoRASpec(rank=16, alpha=32, quantize="int4"), dtype=torch.bfloat16)


def step_seconds(model: GPT, tokens: torch.Tensor) -> float:
    t0 = time.perf_counter()
    _, loss = model(tokens, tokens)
    loss.backward()
    return time.perf_counter() - t0


def dequantize_seconds(model: GPT) -> float:
    layers = [m for m in model.modules() if isinstance(m, FrozenQuantizedLinear)]
    t0 = time.perf_counter()
    for layer in layers:
        for rows in qlora.weight_blocks(layer, along_rows=True):
            qlora._dequantized(layer, torch.bfloat16, rows, slice(None))
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tinyllama-1.1b")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = model_for(args)
    tokens = torch.randint(0, 65, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    native = qlora._native_dequantize_int4
    if native(next(m for m in model.modules() if isinstance(m, FrozenQuantizedLinear)),
              torch.empty(1, 1, dtype=torch.bfloat16)) is None:
        raise SystemExit("gptlab's kernels are not available here (GPTLAB_NO_KERNELS, no compiler, not x86)")
    times: dict[str, list[tuple[float, float]]] = {"kernel": [], "aten": []}
    for _ in range(args.repeats + 1):  # the first round warms both up and is not counted
        for name, choice in (("kernel", native), ("aten", lambda *_: None)):
            qlora._native_dequantize_int4 = choice
            times[name].append((step_seconds(model, tokens), dequantize_seconds(model)))
    qlora._native_dequantize_int4 = native
    medians = {name: [statistics.median(t[i] for t in rounds[1:]) for i in (0, 1)] for name, rounds in times.items()}
    for name, (step, dequantize) in medians.items():
        print(f"{name:>6}: step {step:.3f} s, dequantizing every block Linear once {dequantize:.3f} s")
    print(f"aten / kernel: step {medians['aten'][0] / medians['kernel'][0]:.2f}x, dequantization "
          f"{medians['aten'][1] / medians['kernel'][1]:.2f}x (load average {loadavg()}, {torch.get_num_threads()} "
          "threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
