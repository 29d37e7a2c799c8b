"""Training throughput of one full optimizer step (forward, backward, clip, AdamW) at GPT-2 124M shape, for
gptlab's GPT (as `gptlab train` runs it) and for transformers' GPT2LMHeadModel, in the same process.

    python benchmarks/train_throughput.py                      # batch 4 x 256, bf16, 2 warm-up + 6 timed steps
    python benchmarks/train_throughput.py --dtype float32 --steps 4
    python benchmarks/train_throughput.py --compile            # gptlab's model under torch.compile too
    python benchmarks/train_throughput.py --nanogpt /tmp/nanogpt --compile --rounds 3   # + nanoGPT's model
    python benchmarks/train_throughput.py --skip-hf --profile 3   # + each contender's per-op breakdown
    python benchmarks/train_throughput.py --skip-hf --preset smollm2-135m --aten-form   # a Llama shape, with and
                                                               # without gptlab's training kernels

Prints the median tokens/s over the timed steps and MFU against this machine's measured matmul peak
(gptlab.hardware), then the ratio gptlab / transformers. Random tokens: throughput does not depend on the data.
In fp32 on an x86 CPU the medians also say what share of the CPU's FMA peak (`fma_peak.py`: nothing but fused
multiply-adds in registers) the step's matmuls ran at: the ceiling that bounds any ratio to a peer.

--preset NAME trains gptlab's model of that preset's shape instead of GPT-2's (the peers are GPT-2 models and only
join at GPT-2's shape). --aten-form adds gptlab's same step with its C++ training kernels switched off (the
attention's heads, the norms and the loss through ATen's ops, `gptlab.heads` / `gptlab.norms` / `gptlab.ops`) and
prints what the kernels give.

With --nanogpt PATH (a nanoGPT checkout), nanoGPT's model.py joins at the same shape (GPT-2 124M, its padded vocabulary
50304, no dropout) in the forms it can run on a CPU: as its train.py runs it there (fp32: train.py uses autocast only
on CUDA; its configure_optimizers' AdamW, fused only on CUDA), with bf16 autocast and fused AdamW, and with --compile
also compiled. The contenders take turns over --rounds, each round starting with the next one (the order moved a
contender's figure by ~10% on a 2-core machine); each one's figure is the median over its rounds, and the ratio is
gptlab's best form over the best peer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from fma_peak import fma_peak
from timing import loadavg  # benchmarks/ is on sys.path when a benchmark runs as a script


def time_steps(step, warmup: int, steps: int) -> list[float]:  # noqa: ANN001 - a zero-argument callable
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def op_breakdown(step, steps: int, top: int = 14) -> None:  # noqa: ANN001 - a zero-argument callable
    """torch.profiler over `steps` steps (after one warm-up): each op's share of the self CPU time and its calls per
    step, most time first; then the casts and layout copies (aten::copy_) per step, which a lean step keeps to the
    ones that must exist, and the matmuls' share of the self time (what fusing everything else could win)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"    {e.key:42s} {100 * e.self_cpu_time_total / total:5.1f}%  {e.count / steps:7.1f} calls/step")
    copies = next((e.count for e in prof.key_averages() if e.key == "aten::copy_"), 0)
    print(f"    aten::copy_ calls per step: {copies / steps:.1f}", flush=True)
    matmul = sum(e.self_cpu_time_total for e in events if is_matmul(e.key))
    print(f"    matmuls (mm, addmm, bmm, linear kernels, SDPA): {100 * matmul / total:.1f}% of the self time; "
          f"everything else {100 * (total - matmul) / total:.1f}%", flush=True)


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise")


def is_matmul(op: str) -> bool:
    """Whether a profiler key is a matrix product (SDPA's kernels are attention's two products and their softmax)."""
    return op in MATMUL_OPS or "scaled_dot_product" in op


def gptlab_step(args: argparse.Namespace, x: torch.Tensor):  # noqa: ANN201
    """One `gptlab train` optimizer step, built from the trainer's own parts."""
    from gptlab.model import GPT
    from gptlab.train import build_train_config
    from gptlab.train.config import resolve_device_switches
    from gptlab.train.optim import build_optimizers, optimizer_spec
    from gptlab.train.precision import Precision

    attention = {"auto": "auto", "float32": True, "bfloat16": False}[args.attention]
    cfg = build_train_config({"model": args.preset, "optimizer": "adamw", "dtype": args.dtype,
                              "block_size": args.seq, "optimizer_impl": args.optimizer_impl,
                              "attention_fp32": attention})
    cfg = resolve_device_switches(cfg, "cpu")  # attention's dtype as `gptlab train` picks it here
    torch.manual_seed(0)
    model = GPT(cfg.model_config(vocab_size=vocab_size(args))).train()
    precision = Precision(model, cfg.dtype, "cpu", cfg.attention_fp32, distributed=args.autocast)
    optimizers = build_optimizers(model, optimizer_spec(cfg))
    net = torch.compile(precision.train_module) if args.compile else precision.train_module

    def step() -> None:
        with precision.autocast():
            _, loss = net(x[:, :-1].contiguous(), x[:, 1:].contiguous())  # its loss views the targets
        precision.backward(loss)
        precision.step(optimizers, cfg.grad_clip)

    attention = " (fp32 attention)" if cfg.attention_fp32 and precision.mode != "float32" else ""
    return step, model.num_parameters(), f"{precision.mode}{attention}{' + compile' if args.compile else ''}"


def vocab_size(args: argparse.Namespace) -> int:
    from gptlab.config import GPTConfig

    return 50257 if args.preset == "gpt2" else GPTConfig.preset(args.preset).vocab_size


def aten_ops(step):  # noqa: ANN001, ANN201 - a zero-argument callable, and one
    """`step` with gptlab's C++ training kernels switched off: every caller asks `gptlab.kernels.widest_ops()` for
    them at each call, and gets None."""
    import gptlab.kernels as kernels

    def run() -> None:
        real = kernels.widest_ops
        kernels.widest_ops = lambda: None
        try:
            step()
        finally:
            kernels.widest_ops = real

    return run


def hf_step(args: argparse.Namespace, x: torch.Tensor):  # noqa: ANN201
    """transformers' GPT-2 with the usual recipe: fp32 weights, bf16 autocast, fused AdamW, clipping."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=1024, attn_implementation="sdpa")).train()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=True)
    autocast = (args.peer_dtype or args.dtype) != "float32"

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss  # HF shifts labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    n_params = sum(p.numel() for p in model.parameters())  # tied head counted once
    return step, n_params, "autocast" if autocast else "float32"


def nanogpt_step(args: argparse.Namespace, x: torch.Tensor, form: str):  # noqa: ANN201
    """nanoGPT's model: "own" as its train.py runs on a CPU, "autocast" (bf16 + fused AdamW), "compile" (fused
    AdamW, compiled, in the peers' precision)."""
    import nanogpt_peer

    ng = nanogpt_peer.import_model(args.nanogpt)
    torch.manual_seed(0)
    model = ng.GPT(ng.GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, dropout=0.0,
                                bias=True)).train()
    if form == "own":
        opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu")
    else:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=6e-4, betas=(0.9, 0.95), fused=True)
    net = torch.compile(model) if form == "compile" else model
    autocast = form != "own" and (args.peer_dtype or args.dtype) != "float32"

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _, loss = net(x[:, :-1].contiguous(), x[:, 1:].contiguous())  # its loss views the targets
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    kind = "fp32 (its CPU path)" if form == "own" else ("autocast" if autocast else "fp32") + " + fused AdamW"
    return step, model.get_num_params(), kind + (" + compile" if form == "compile" else "")


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
    parser.add_argument("--attention", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="gptlab: attention's dtype under bf16 (auto: as `gptlab train` picks it on a CPU)")
    parser.add_argument("--optimizer-impl", default="torch", choices=["torch", "gptlab"])
    parser.add_argument("--preset", default="gpt2", help="gptlab's model shape (peers join only at gpt2's)")
    parser.add_argument("--aten-form", action="store_true",
                        help="also gptlab's step with its C++ training kernels off (ATen's ops)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--nanogpt", help="a nanoGPT checkout: its model joins as a peer")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, the contenders taking turns")
    parser.add_argument("--peer-dtype", choices=["float32", "bfloat16"],
                        help="the peers' precision (default --dtype; float32 on CPUs whose bf16 matmuls are slow)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the timing, each contender's per-op breakdown over STEPS steps (torch.profiler)")
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

    # the models have GPT-2 124M's matmuls (a tied head), or the preset's; MFU counts them as `gptlab train` does
    flops = flops_per_token(GPTConfig.preset(args.preset, vocab_size=vocab_size(args)), args.seq)
    peak = peak_flops("cpu", torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    fma = fma_peak(torch.get_num_threads()) if args.dtype == "float32" else None
    if fma:
        print(f"fp32 FMA peak {fma / 1e12:.3f} TFLOP/s on {torch.get_num_threads()} threads; the matmul peak MFU is "
              f"counted against, {peak / 1e12:.3f} TFLOP/s, is {100 * peak / fma:.1f}% of it")
    x = torch.randint(0, vocab_size(args), (args.batch, args.seq + 1))
    tokens = args.batch * args.seq
    runs = [("gptlab", lambda: gptlab_step(args, x))]
    if args.compile:
        runs.append(("gptlab", lambda: gptlab_step(argparse.Namespace(**{**vars(args), "compile": False}), x)))
    if args.aten_form:
        def without_kernels() -> tuple:
            step, n, mode = gptlab_step(args, x)
            return aten_ops(step), n, f"{mode}, ATen ops"

        runs.append(("gptlab", without_kernels))
    peers_fit = args.preset == "gpt2"
    if not args.skip_hf and peers_fit:
        runs.append(("transformers", lambda: hf_step(args, x)))
    if args.nanogpt and peers_fit:
        bf16 = (args.peer_dtype or args.dtype) == "bfloat16"
        for form in ["own"] + (["autocast"] if bf16 else []) + (["compile"] if args.compile else []):
            runs.append(("nanoGPT", lambda form=form: nanogpt_step(args, x, form)))
    contenders = []
    for name, build in runs:
        step, _, mode = build()
        contenders.append((name, mode, step))
    medians: dict[tuple[str, str], list[float]] = {(name, mode): [] for name, mode, _ in contenders}
    for r in range(args.rounds):
        print(f"round {r + 1} (load {loadavg()})")
        # each round starts with the next contender: going first (or after a given one) is nobody's for good
        for name, mode, step in contenders[r % len(contenders):] + contenders[: r % len(contenders)]:
            times = time_steps(step, args.warmup, args.steps)
            tps = tokens / statistics.median(times)
            medians[(name, mode)].append(tps)
            print(f"  {name:13s} {mode:26s} {tps:8.1f} tokens/s (median of {args.steps}; best "
                  f"{tokens / min(times):.1f})  MFU {100 * flops * tps / peak:.1f}% of {peak / 1e12:.2f} TFLOP/s",
                  flush=True)
    best: dict[str, float] = {}
    for (name, mode), tps_list in medians.items():
        tps = statistics.median(tps_list)
        best[name] = max(best.get(name, 0.0), tps)
        of_fma = f" ({100 * flops * tps / fma:.1f}% of the FMA peak)" if fma else ""
        print(f"median {name:13s} {mode:26s} {tps:8.1f} tokens/s  MFU {100 * flops * tps / peak:.1f}%{of_fma}")
    if args.profile:
        for name, mode, step in contenders:
            print(f"per-op self CPU time, {name} {mode} ({args.profile} steps):")
            op_breakdown(step, args.profile)
    if args.aten_form:
        own = {mode: statistics.median(v) for (name, mode), v in medians.items() if name == "gptlab"}
        off = next(tps for mode, tps in own.items() if mode.endswith("ATen ops"))
        on = max(tps for mode, tps in own.items() if not mode.endswith("ATen ops"))
        print(f"ratio gptlab with its training kernels / with ATen's ops: {on / off:.2f}x")
    peers = {k: v for k, v in best.items() if k != "gptlab"}
    for name, tps in peers.items():
        print(f"ratio gptlab / {name} (best forms): {best['gptlab'] / tps:.2f}x")
    if peers:
        print(f"ratio gptlab / best peer: {best['gptlab'] / max(peers.values()):.2f}x (target >= 1.3)")


if __name__ == "__main__":
    main()
