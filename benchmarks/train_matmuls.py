"""The matmuls of one GPT-2 training step, each timed alone: what fraction of this machine's matmul peak each reaches,
and so the best MFU a step can have when everything outside the matmuls costs nothing.

    python benchmarks/train_matmuls.py                       # GPT-2 124M, batch 4 x 256, bf16
    python benchmarks/train_matmuls.py --batch 8 --seq 512
    python benchmarks/train_matmuls.py --dtype float32 --repeats 9

Every Linear of the step (q/k/v, attention's output, the MLP's two, the LM head as gptlab runs it: its 64-aligned
rows and the rest apart) runs three products: the forward (x W^T), the input's gradient (dY W) and the weight's
gradient (dY^T x). Each is timed in the candidate forms a step could use:
- "linear": as autograd runs nn.Linear now (the weight [out, in], transposed views into oneDNN's bf16 GEMM);
- "w[in,out]": the weight stored transposed (x W, dY W^T, the gradient as x^T dY), the other memory order;
- "no-onednn": with torch.backends.mkldnn off, ATen's fallback GEMM (MKL for fp32; its own kernel for bf16);
- "packed": the forward through oneDNN's prepacked weight (mkldnn._linear_pointwise), an upper bound: training
  would pay for a repack after every optimizer step.
Attention's products (q k^T and a v, forward and backward) run inside SDPA, timed as one causal forward + backward
against their counted FLOPs (gptlab.flops: half the T x T square).

Times are the minimum over --repeats runs interleaved with the peak's probe (a square bf16 GEMM, as
gptlab.hardware measures it), so load on a shared machine moves both alike; each row prints its share of that
peak. The summary adds every product at its best form, each Linear's count per step, and prints
    MFU cap = counted FLOPs of a step / (best matmul seconds of a step) / peak,
the ceiling a step reaches only if the norms, activations, loss, optimizer and framework took no time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def best_seconds(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    fn()  # warm-up: oneDNN builds its kernel for the shape on first use
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def linear_shapes(n_embd: int, n_layer: int, vocab: int) -> list[tuple[str, int, int, int]]:
    """(name, in, out, count per step) of GPT-2's Linears; the head as gptlab.ops runs an odd vocabulary: its
    64-aligned rows as one product, the rest as another."""
    aligned = vocab // 64 * 64
    shapes = [("qkv", n_embd, 3 * n_embd, n_layer), ("attn proj", n_embd, n_embd, n_layer),
              ("mlp fc", n_embd, 4 * n_embd, n_layer), ("mlp proj", 4 * n_embd, n_embd, n_layer),
              ("head", n_embd, aligned, 1)]
    if vocab > aligned:
        shapes.append(("head rest", n_embd, vocab - aligned, 1))
    return shapes


def product_forms(tokens: int, fan_in: int, fan_out: int, dtype: torch.dtype) -> dict[str, dict[str, Callable]]:
    """For one Linear: product -> form -> a zero-argument callable running it."""
    x = torch.randn(tokens, fan_in, dtype=dtype)
    dy = torch.randn(tokens, fan_out, dtype=dtype)
    w = torch.randn(fan_out, fan_in, dtype=dtype) * fan_in ** -0.5
    wt = w.t().contiguous()  # [in, out]

    def without_onednn(fn: Callable) -> Callable:
        def run() -> object:
            with torch.backends.mkldnn.flags(enabled=False):
                return fn()
        return run

    forms = {
        "forward": {"linear": lambda: F.linear(x, w), "w[in,out]": lambda: x @ wt},
        "input grad": {"linear": lambda: dy @ w, "w[in,out]": lambda: dy @ wt.t()},
        "weight grad": {"linear": lambda: dy.t() @ x, "w[in,out]": lambda: x.t() @ dy},
    }
    for product in forms.values():
        product["no-onednn"] = without_onednn(product["linear"])
    if dtype == torch.bfloat16 and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, tokens)
        forms["forward"]["packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return forms


def attention_step(batch: int, seq: int, n_head: int, head_size: int, dtype: torch.dtype) -> Callable:
    """SDPA's causal forward and backward at the step's shape."""
    q, k, v = (torch.randn(batch, n_head, seq, head_size, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, n_head, seq, head_size, dtype=dtype)

    def run() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5, help="timings per product (the minimum is kept)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--attention-dtype", choices=["float32", "bfloat16"],
                        help="attention's dtype (default --dtype: gptlab train runs GPT-2's 64-wide heads in the "
                             "compute dtype on a CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from gptlab.config import GPTConfig
    from gptlab.flops import flops_per_token, keys_per_query
    from gptlab.hardware import peak_flops

    dtype = getattr(torch, args.dtype)
    config = GPTConfig.preset("gpt2", vocab_size=50257)
    tokens = args.batch * args.seq
    square = torch.randn(1024, 1024, dtype=dtype)
    peak = 2 * 1024 ** 3 / best_seconds(lambda: square @ square, args.repeats, inner=4)
    print(f"GPT-2 124M, {args.batch} x {args.seq} = {tokens} tokens, {args.dtype}, {torch.get_num_threads()} threads")
    rows, total_seconds = [], 0.0
    for name, fan_in, fan_out, count in linear_shapes(config.n_embd, config.n_layer, config.vocab_size):
        for product, forms in product_forms(tokens, fan_in, fan_out, dtype).items():
            # ATen's bf16 fallback is one to two orders of magnitude off: timed once, not a contender worth minutes
            seconds = {form: best_seconds(fn, 1 if form == "no-onednn" and dtype == torch.bfloat16 else args.repeats)
                       for form, fn in forms.items()}
            peak = max(peak, 2 * 1024 ** 3 / best_seconds(lambda: square @ square, 1, inner=4))
            trainable = {f: s for f, s in seconds.items() if f != "packed"}  # packing each step is not free
            best_form = min(trainable, key=trainable.get)
            total_seconds += count * trainable[best_form]
            rows.append((f"{name:9s} {fan_in:5d}->{fan_out:<5d} x{count:<2d} {product:11s}",
                         2 * tokens * fan_in * fan_out, seconds, best_form))
    attention_dtype = getattr(torch, args.attention_dtype or args.dtype)
    attention = attention_step(args.batch, args.seq, config.n_head, config.head_size, attention_dtype)
    attention_flops = 3 * 4 * config.n_head * config.head_size * keys_per_query(config, 0, args.seq) * tokens
    attention_seconds = best_seconds(attention, args.repeats)
    total_seconds += config.n_layer * attention_seconds
    # every share against the best peak seen in the run: the least loaded moment's
    print(f"peak {peak / 1e12:.3f} TFLOP/s (best 1024^3 GEMM of the run; gptlab.hardware's cached "
          f"{peak_flops('cpu', dtype) / 1e12:.3f}); each product's share of it per form:")
    for label, flops, seconds, best_form in rows:
        shares = "  ".join(f"{form} {100 * flops / s / peak:5.1f}%" for form, s in seconds.items())
        print(f"  {label} {shares}   best: {best_form}")
    print(f"  attention (SDPA causal fwd+bwd, {attention_dtype}) x{config.n_layer}: "
          f"{100 * attention_flops / attention_seconds / peak:5.1f}%")
    step_flops = flops_per_token(config, args.seq) * tokens
    print(f"best matmul time per step {total_seconds:.3f} s for {step_flops / 1e12:.3f} TFLOP counted: "
          f"MFU cap {100 * step_flops / total_seconds / peak:.1f}% of the peak; "
          f"at most {tokens / total_seconds:.0f} tokens/s at this run's speeds")

if __name__ == "__main__":
    main()
