"""Training throughput of one full optimizer step (forward, backward, clip, AdamW) at GPT-2 124M shape, for
gptlab's GPT (as `gptlab train` runs it) and for transformers' GPT2LMHeadModel, in the same process.

    python benchmarks/train_throughput.py                      # batch 4 x 256, bf16, 2 warm-up + 6 timed steps
    python benchmarks/train_throughput.py --dtype float32 --steps 4
    python benchmarks/train_throughput.py --compile            # gptlab's model under torch.compile too

Prints the median tokens/s over the timed steps and MFU against this machine's measured matmul peak
(gptlab.hardware), then the ratio gptlab / transformers. Random tokens: throughput does not depend on the data.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def time_steps(step, warmup: int, steps: int) -> list[float]:  # noqa: ANN001 - a zero-argument callable
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def gptlab_step(args: argparse.Namespace, x: torch.Tensor):  # noqa: ANN201
    """One `gptlab train` optimizer step, built from the trainer's own parts."""
    from gptlab.model import GPT
    from gptlab.train import build_train_config
    from gptlab.train.optim import build_optimizers
    from gptlab.train.precision import Precision
    from gptlab.train.trainer import optimizer_spec

    cfg = build_train_config({"model": "gpt2", "optimizer": "adamw", "dtype": args.dtype, "block_size": args.seq,
                              "optimizer_impl": args.optimizer_impl, "attention_fp32": not args.bf16_attention})
    torch.manual_seed(0)
    model = GPT(cfg.model_config(vocab_size=50257)).train()
    precision = Precision(model, cfg.dtype, "cpu", cfg.attention_fp32, distributed=args.autocast)
    optimizers = build_optimizers(model, optimizer_spec(cfg))
    net = torch.compile(precision.train_module) if args.compile else precision.train_module

    def step() -> None:
        with precision.autocast():
            _, loss = net(x[:, :-1], x[:, 1:])
        precision.backward(loss)
        precision.step(optimizers, cfg.grad_clip)

    return step, model.num_parameters(), f"{precision.mode}{' + compile' if args.compile else ''}"


def hf_step(args: argparse.Namespace, x: torch.Tensor):  # noqa: ANN201
    """transformers' GPT-2 with the usual recipe: fp32 weights, bf16 autocast, fused AdamW, clipping."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=1024, attn_implementation="sdpa")).train()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=True)
    autocast = args.dtype != "float32"

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss  # HF shifts labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    n_params = sum(p.numel() for p in model.parameters())  # tied head counted once
    return step, n_params, "autocast" if autocast else "float32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="torch.compile gptlab's model")
    parser.add_argument("--autocast", action="store_true", help="gptlab: autocast instead of bf16 working weights")
    parser.add_argument("--bf16-attention", action="store_true", help="gptlab: attention in bf16, not fp32")
    parser.add_argument("--optimizer-impl", default="torch", choices=["torch", "gptlab"])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc as it is (gptlab train keeps freed memory: fewer page faults)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from gptlab.config import GPTConfig
    from gptlab.flops import flops_per_token
    from gptlab.hardware import peak_flops, retain_freed_memory

    if not args.default_malloc:  # as `gptlab train` does; process-wide, so transformers gets it too
        print(f"freed memory kept for reuse (glibc mallopt): {retain_freed_memory()}")

    # both models have GPT-2 124M's matmuls (a tied head); MFU counts them as `gptlab train` does
    flops = flops_per_token(GPTConfig.preset("gpt2", vocab_size=50257), args.seq)
    peak = peak_flops("cpu", torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    x = torch.randint(0, 50257, (args.batch, args.seq + 1))
    tokens = args.batch * args.seq
    results = {}
    runs = [("gptlab", gptlab_step)] + ([] if args.skip_hf else [("transformers", hf_step)])
    for name, build in runs:
        step, _, mode = build(args, x)
        times = time_steps(step, args.warmup, args.steps)
        tps = tokens / statistics.median(times)
        mfu = flops * tps / peak
        results[name] = tps
        print(f"{name:13s} {mode:22s} {tps:8.1f} tokens/s (median of {args.steps}; best {tokens / min(times):.1f})"
              f"  MFU {100 * mfu:.1f}% of {peak / 1e12:.2f} TFLOP/s", flush=True)
        del step
    if len(results) == 2:
        print(f"ratio gptlab / transformers: {results['gptlab'] / results['transformers']:.2f}x")


if __name__ == "__main__":
    main()
