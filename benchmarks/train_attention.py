"""Causal attention's forward + backward for training on a CPU, in the candidate forms a step could run it: how fast
each is against SDPA's kernel in the same dtype and how far each lands from exact.

    python benchmarks/train_attention.py                      # GPT-2's heads (12 of 64), B4 x T256 and B8 x T512, bf16
    python benchmarks/train_attention.py --shapes 4x256 --threads 1 --rounds 9
    python benchmarks/train_attention.py --dtype float32 --shapes 32x64 16x128 --heads 2 --head-size 32
                                                              # the CPU speedrun's fp32 attention (32 x 2 x 64 x 32)

Forms with bf16 inputs (q, k, v and the output's gradient as a bf16 step hands them over):
- "sdpa bf16": F.scaled_dot_product_attention, is_causal (ATen's CPU flash kernel);
- "gptlab bf16": `gptlab.causal_attention` (ATen's forward, gptlab's backward on bf16 dot products), where this CPU's
  kernels have them (AVX512-BF16 or AMX) and the shape is in its blocks of 32;
- "sdpa fp32": SDPA on fp32 copies, the output rounded back (what `attention_fp32` chooses);
- "sdpa math": SDPA's math backend (SDPBackend.MATH) in bf16;
- "matmul bf16": q k^T and p v as batched bf16 GEMMs (oneDNN) over the whole T x T square, the softmax in fp32:
  the scores are rounded to bf16 before the softmax (the GEMM's output dtype), where SDPA keeps them in fp32;
- "matmul fp32": the same with fp32 GEMMs.
With `--dtype float32` (fp32 inputs, as an fp32 step hands them over): "sdpa fp32", "gptlab fp32" (the forward and
backward of kernels/attention_fp32.cpp through `gptlab.causal_attention`, where it serves the shape: up to
`FP32_MAX_LEN` positions), "sdpa math" and "matmul fp32".
Each runs the forward and autograd's backward to (dq, dk, dv). Rounds are interleaved (every form once per round),
so load on a shared machine moves them alike; each form's minimum and median over the rounds are printed, each with
its ratio to SDPA in the same dtype in the same run (on a noisy 2-core machine the two can differ: an op of many
parallel regions loses more to a preempted core than one of a single region). The error column is the largest
absolute difference of the output and the three gradients from a float64 reference written from the maths
(softmax(q k^T / sqrt(hs) + causal mask) v and its gradients by autograd in float64), next to SDPA's: a form much
further off than SDPA is not a drop-in replacement. A gptlab form is left out where it does not serve the shape on
this CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gptlab import causal_attention

Tensors = tuple[torch.Tensor, ...]


def matmul_attention(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """softmax(q k^T * scale + causal mask) v with the GEMMs in `dtype` and the softmax in fp32."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.shape[-2]
        visible = torch.ones(T, T, dtype=torch.bool).tril()
        scores = q.to(dtype) @ k.to(dtype).transpose(-2, -1) * q.shape[-1] ** -0.5
        weights = F.softmax(scores.float().masked_fill(~visible, float("-inf")), dim=-1).to(dtype)
        return (weights @ v.to(dtype)).to(q.dtype)
    return attend


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return sdpa(q.float(), k.float(), v.float()).to(q.dtype)


def sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa(q, k, v)


def gptlab_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = causal_attention.attention(q, k, v, q.shape[-1] ** -0.5)
    if out is None:
        raise LookupError("gptlab's kernels do not serve this shape on this CPU")
    return out


def forms(dtype: torch.dtype) -> dict[str, Callable]:
    if dtype == torch.float32:
        return {"sdpa fp32": sdpa, "gptlab fp32": gptlab_attention, "sdpa math": sdpa_math,
                "matmul fp32": matmul_attention(torch.float32)}
    return {"sdpa bf16": sdpa, "gptlab bf16": gptlab_attention, "sdpa fp32": sdpa_fp32, "sdpa math": sdpa_math,
            "matmul bf16": matmul_attention(torch.bfloat16), "matmul fp32": matmul_attention(torch.float32)}


def forward_backward(attend: Callable, inputs: Tensors, grad: torch.Tensor) -> Tensors:
    out = attend(*inputs)
    return (out.detach(), *torch.autograd.grad(out, inputs, grad))


def largest_error(results: Tensors, reference: Tensors) -> float:
    return max((r.double() - ref).abs().max().item() for r, ref in zip(results, reference, strict=True))


def run_shape(batch: int, seq: int, n_head: int, head_size: int, rounds: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    inputs = tuple(torch.randn(batch, n_head, seq, head_size, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, n_head, seq, head_size, dtype=dtype)
    exact = tuple(x.detach().double().requires_grad_() for x in inputs)
    reference = forward_backward(matmul_attention(torch.float64), exact, grad.double())
    errors, candidates = {}, {}
    for name, fn in forms(dtype).items():
        try:
            errors[name] = largest_error(forward_backward(fn, inputs, grad), reference)
            candidates[name] = fn
        except LookupError:
            pass  # a gptlab form where its kernel does not serve the shape here
    baseline = next(iter(candidates))
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            forward_backward(fn, inputs, grad)
            times[name].append(time.perf_counter() - start)
    best = {name: min(t) for name, t in times.items()}
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"B{batch} x T{seq}, {n_head} heads of {head_size}, {str(dtype)[6:]} inputs, {torch.get_num_threads()} "
          f"threads ({rounds} interleaved rounds; best and median):")
    for name in candidates:
        print(f"  {name:12s} {best[name] * 1e3:8.2f} ms  {best[baseline] / best[name]:5.2f}x {baseline}   median "
              f"{median[name] * 1e3:8.2f} ms  {median[baseline] / median[name]:5.2f}x   max |error| {errors[name]:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["4x256", "8x512"], help="BATCHxSEQ")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for shape in args.shapes:
        batch, seq = (int(n) for n in shape.split("x"))
        run_shape(batch, seq, args.heads, args.head_size, args.rounds, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
