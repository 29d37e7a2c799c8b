"""Causal attention's forward + backward for training on a CPU, GPT-2's heads (12 of 64), in the candidate forms a
step could run it: how fast each is against SDPA's bf16 kernel and how far each lands from exact.

    python benchmarks/train_attention.py                      # B4 x T256 and B8 x T512, bf16 inputs
    python benchmarks/train_attention.py --shapes 4x256 --threads 1 --rounds 9

Forms (q, k, v and the output's gradient are bf16, as a bf16 step hands them over):
- "sdpa bf16": F.scaled_dot_product_attention, is_causal (what the step runs now: ATen's CPU flash kernel);
- "sdpa fp32": the same on fp32 copies, the output rounded back (what `attention_fp32` chooses);
- "sdpa math": SDPA's math backend (SDPBackend.MATH) in bf16;
- "matmul bf16": q k^T and p v as batched bf16 GEMMs (oneDNN) over the whole T x T square, the softmax in fp32:
  the scores are rounded to bf16 before the softmax (the GEMM's output dtype), where SDPA keeps them in fp32;
- "matmul fp32": the same with fp32 GEMMs.
Each runs the forward and autograd's backward to (dq, dk, dv). Rounds are interleaved (every form once per round),
so load on a shared machine moves them alike; each form's minimum over the rounds is kept, and printed with its
ratio to "sdpa bf16" in the same run. The error column is the largest absolute difference of the output and the
three gradients from a float64 reference written from the maths (softmax(q k^T / sqrt(hs) + causal mask) v and its
gradients by autograd in float64), next to that of "sdpa bf16": a form much further off than SDPA is not a
drop-in replacement.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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


FORMS = {"sdpa bf16": sdpa, "sdpa fp32": sdpa_fp32, "sdpa math": sdpa_math,
         "matmul bf16": matmul_attention(torch.bfloat16), "matmul fp32": matmul_attention(torch.float32)}


def forward_backward(attend: Callable, inputs: Tensors, grad: torch.Tensor) -> Tensors:
    out = attend(*inputs)
    return (out.detach(), *torch.autograd.grad(out, inputs, grad))


def largest_error(results: Tensors, reference: Tensors) -> float:
    return max((r.double() - ref).abs().max().item() for r, ref in zip(results, reference, strict=True))


def run_shape(batch: int, seq: int, n_head: int, head_size: int, rounds: int) -> None:
    torch.manual_seed(0)
    inputs = tuple(torch.randn(batch, n_head, seq, head_size, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
    grad = torch.randn(batch, n_head, seq, head_size, dtype=torch.bfloat16)
    exact = tuple(x.detach().double().requires_grad_() for x in inputs)
    reference = forward_backward(matmul_attention(torch.float64), exact, grad.double())
    errors = {name: largest_error(forward_backward(fn, inputs, grad), reference) for name, fn in FORMS.items()}
    best = dict.fromkeys(FORMS, float("inf"))
    for _ in range(rounds):
        for name, fn in FORMS.items():
            start = time.perf_counter()
            forward_backward(fn, inputs, grad)
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"B{batch} x T{seq}, {n_head} heads of {head_size}, {torch.get_num_threads()} threads "
          f"(best of {rounds} interleaved rounds):")
    for name in FORMS:
        print(f"  {name:12s} {best[name] * 1e3:8.2f} ms  {best['sdpa bf16'] / best[name]:5.2f}x sdpa bf16   "
              f"max |error| {errors[name]:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["4x256", "8x512"], help="BATCHxSEQ")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for shape in args.shapes:
        batch, seq = (int(n) for n in shape.split("x"))
        run_shape(batch, seq, args.heads, args.head_size, args.rounds)


if __name__ == "__main__":
    main()
