"""GPU throughput against the peers in the same process, on the same GPU (`benchmarks/gpu.sh` runs it after the
CUDA tests):

    python benchmarks/gpu.py train --nanogpt PATH    # GPT-2 124M, B16 x T1024, bf16, torch.compile, fused AdamW
    python benchmarks/gpu.py decode                  # GPT-2 124M bf16 greedy, batch 1 and 32, 256 new tokens

train: one optimizer step as `gptlab train` runs it (the trainer's precision and optimizers) against nanoGPT's
model.py with its own recipe (vocabulary padded to 50,304, configure_optimizers' fused AdamW, bf16 autocast),
both compiled, random tokens. The contenders take turns over --rounds; each figure is the median step over its
rounds. MFU against the datasheet's dense bf16 peak with nanoGPT's FLOP count (6N + 12 L H Q T per token,
N without position embeddings), beside gptlab's own count over its measured matmul peak (what `gptlab train`
logs). With --pad, gptlab's model at nanoGPT's padded vocabulary too.

decode: gptlab's engine (its decode steps in CUDA graphs) against transformers' GPT2LMHeadModel.generate with a
static cache (transformers compiles its decode step for that cache by itself) and with its default dynamic cache,
the same random weights, greedy, every row generating all its tokens. tokens/s counts new tokens over the whole
call (prefill included), the median of --rounds after a warm-up call. With --compiled, gptlab's step under
torch.compile too. Also gptlab's int8 and int4 weights at batch 1, with their weights' bytes on the GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

GPT2 = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024)
DEVICE = "cuda"  # --device cpu: a dry run of the code paths on a machine without a GPU (figures meaningless)


def cuda_time(fn, n: int) -> float:  # noqa: ANN001 - a zero-argument callable
    """Seconds per call of `fn`, over n calls between two synchronizations."""
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n


# kernel names -> what they do (first match wins): where a step's GPU time goes
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "sdpa")),  # before matmul: cuDNN's use wgmma too
                ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "wgmma")),
                ("optimizer", ("adam", "multi_tensor", "foreach")),
                ("compiled fusions (triton)", ("triton",)),
                ("copies and fills", ("memcpy", "memset", "copy", "fill")))


def profile_step(name: str, step, steps: int) -> None:  # noqa: ANN001 - a zero-argument callable
    """GPU time per step by kind of kernel (KERNEL_KINDS) beside the wall time, then the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    wall = cuda_time(step, steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    # the kernels themselves: the CPU-side ops that launched them report the same time again
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kinds: dict[str, float] = {}
    for e in kernels:
        kind = next((k for k, keys in KERNEL_KINDS if any(t in e.key.lower() for t in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total / 1e3 / steps
    busy = sum(kinds.values())
    print(f"\n  {name}: {wall * 1e3:.1f} ms/step wall, {busy:.1f} ms/step of kernels (GPU idle "
          f"{max(wall * 1e3 - busy, 0):.1f} ms)")
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"    {kind:28s} {ms:7.2f} ms/step  {ms / busy:6.1%}")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]:
        print(f"      {e.self_device_time_total / 1e3 / steps:7.3f} ms/step  x{e.count // steps:<4d} {e.key[:110]}")


def describe() -> str:
    if DEVICE != "cuda":
        return f"{DEVICE} (dry run), torch {torch.__version__}"
    p = torch.cuda.get_device_properties(0)
    return f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"


# --- training ---------------------------------------------------------------------------------------------------------
def gptlab_trainer_step(x: torch.Tensor, vocab: int, compile: bool):  # noqa: ANN201
    from gptlab.model import GPT
    from gptlab.train import build_train_config
    from gptlab.train.optim import build_optimizers, optimizer_spec
    from gptlab.train.precision import Precision

    cfg = build_train_config({"model": "gpt2", "optimizer": "adamw", "dtype": "bfloat16", "block_size": 1024})
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = GPT(cfg.model_config(vocab_size=vocab)).train()
    # what `gptlab train` runs on a GPU: autocast bf16, attention in bf16 ("auto"), fused AdamW, compile ("auto")
    precision = Precision(model, "bfloat16", DEVICE, attention_fp32=DEVICE != "cuda", distributed=False)
    optimizers = build_optimizers(model, optimizer_spec(cfg))
    net = torch.compile(precision.train_module) if compile else precision.train_module
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step() -> None:
        with precision.autocast():
            _, loss = net(inputs, targets)
        precision.backward(loss)
        precision.step(optimizers, cfg.grad_clip)

    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    return step, n, model


def nanogpt_step(x: torch.Tensor, checkout: Path, compile: bool):  # noqa: ANN201
    sys.path.insert(0, str(Path(__file__).parent))
    from nanogpt_peer import import_model

    module = import_model(checkout)
    torch.manual_seed(0)
    model = module.GPT(module.GPTConfig(vocab_size=50304, dropout=0.0, bias=True, **GPT2)).to(DEVICE).train()
    opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), DEVICE)
    net = torch.compile(model) if compile else model
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step() -> None:  # nanoGPT's train.py: autocast bf16, backward, clip, step, zero_grad(set_to_none)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            _, loss = net(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model.get_num_params(), model


def train(args: argparse.Namespace) -> None:
    from gptlab.flops import flops_per_token
    from gptlab.hardware import datasheet_flops, peak_flops, use_tensor_cores

    use_tensor_cores()
    B, T, c = args.batch, 1024, not args.no_compile
    x = torch.randint(0, 50257, (B, T + 1), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    contenders = {}
    for name, make in [("gptlab", lambda: gptlab_trainer_step(x, 50257, c)),
                       *([("gptlab vocab 50304", lambda: gptlab_trainer_step(x, 50304, c))] if args.pad else []),
                       *([("nanoGPT", lambda: nanogpt_step(x, Path(args.nanogpt), c))] if args.nanogpt else [])]:
        t0 = time.perf_counter()
        try:
            step, n, model = make()
            for _ in range(args.warmup):  # compiles
                step()
            cuda_time(lambda: None, 1)
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
            continue
        contenders[name] = (step, n, model)
        print(f"{name}: {n / 1e6:.1f}M parameters (without wpe), built and warmed up (compiled: {c}) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(args.rounds):
        names = list(contenders)
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(cuda_time(contenders[name][0], args.steps))
    peak = datasheet_flops(DEVICE)
    measured = peak_flops(DEVICE, torch.bfloat16)
    print(f"\ntraining GPT-2 124M, B{B} x T{T}, bf16 autocast, compile, fused AdamW; {describe()}")
    print(f"datasheet bf16 peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s; measured 4096^3 bf16 matmul "
          f"{measured / 1e12:.0f} TFLOP/s")
    rates = {}
    for name, (_, n, model) in contenders.items():
        sec = statistics.median(times[name])
        tok_s = B * T / sec
        rates[name] = tok_s
        nano_flops = 6 * n + 12 * GPT2["n_layer"] * GPT2["n_head"] * (GPT2["n_embd"] // GPT2["n_head"]) * T
        own = f"  gptlab-count MFU {tok_s * flops_per_token(model.config, T) / measured:.1%} of measured" \
            if name.startswith("gptlab") else ""
        mfu = f"{tok_s * nano_flops / peak:.1%}" if peak else "n/a"
        print(f"  {name:20s} {sec * 1e3:7.1f} ms/step  {tok_s:9,.0f} tok/s  MFU {mfu} of datasheet{own}  "
              f"peak mem {torch.cuda.max_memory_allocated() / 2**30 if DEVICE == 'cuda' else 0:.1f} GiB (all of them)")
    if "nanoGPT" in rates and "gptlab" in rates:
        best = max(v for k, v in rates.items() if k.startswith("gptlab"))
        print(f"  ratio gptlab / nanoGPT: {rates['gptlab'] / rates['nanoGPT']:.2f}x (best gptlab form "
              f"{best / rates['nanoGPT']:.2f}x)")
    if args.profile and DEVICE == "cuda":
        for name, (step, _, _) in contenders.items():
            profile_step(name, step, args.profile)


# --- decoding ---------------------------------------------------------------------------------------------------------
def gptlab_decode(model, batch: int, prompt: torch.Tensor, new: int, compile: bool = False):  # noqa: ANN001, ANN201
    from gptlab.generation import Engine, SamplingParams

    # compiled: a cache of what the rows need (one compilation per shape), as transformers sizes its static cache
    engine = Engine(model, batch, compile_decode=compile, max_len=prompt.shape[1] + new if compile else None)

    def run() -> None:
        gens = [engine.prepare(prompt[i].tolist(), SamplingParams(max_new_tokens=new, temperature=0))
                for i in range(batch)]
        engine.add(gens)
        while engine.running:
            engine.step()
        assert all(len(g.token_ids) == new for g in gens)

    return run, engine


def hf_decode(model, batch: int, prompt: torch.Tensor, new: int, cache: str | None):  # noqa: ANN001, ANN201
    ids = prompt[:batch].to(DEVICE)
    extra = {"cache_implementation": cache} if cache else {}

    def run() -> None:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, **extra)
        assert out.shape[1] == ids.shape[1] + new

    return run


def decode(args: argparse.Namespace) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from gptlab.hardware import use_tensor_cores
    from gptlab.interop import from_hf

    use_tensor_cores()
    torch.manual_seed(0)
    hf_cpu = GPT2LMHeadModel(GPT2Config(n_positions=1024, attn_implementation="sdpa")).eval()
    with_hf_dir = Path(args.workdir) / "gpt2-random"
    hf_cpu.save_pretrained(with_hf_dir)
    hf = hf_cpu.to(DEVICE, torch.bfloat16)
    ours = from_hf(with_hf_dir, device=DEVICE, dtype=torch.bfloat16).eval()
    new = args.new_tokens
    prompt = torch.randint(0, 50257, (32, 16), generator=torch.Generator().manual_seed(1))
    print(f"\ndecoding GPT-2 124M (random weights), bf16, greedy, 16-token prompts, {new} new tokens; {describe()}")
    for batch in args.batches:
        runs = {}
        run, engine = gptlab_decode(ours, batch, prompt, new)
        runs["gptlab"] = run
        if args.compiled:
            runs["gptlab compiled step"], _ = gptlab_decode(ours, batch, prompt, new, compile=True)
        runs["transformers static cache"] = hf_decode(hf, batch, prompt, new, "static")
        runs["transformers dynamic cache"] = hf_decode(hf, batch, prompt, new, None)
        rates: dict[str, list[float]] = {k: [] for k in runs}
        for name, fn in runs.items():  # warm-up: captures, compiles
            t0 = time.perf_counter()
            fn()
            print(f"  warm-up {name} b{batch}: {time.perf_counter() - t0:.1f} s", flush=True)
        for r in range(args.rounds):
            names = list(runs)
            for name in names[r % len(names):] + names[: r % len(names)]:
                rates[name].append(batch * new / cuda_time(runs[name], 1))
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(f"  batch {batch}: gptlab decode step = {engine.kernels()['decode step']}")
        for name, v in med.items():
            print(f"    {name:28s} {v:9,.0f} tok/s")
        best = max(v for k, v in med.items() if k.startswith("gptlab"))
        print(f"    ratio gptlab / transformers static: {med['gptlab'] / med['transformers static cache']:.2f}x "
              f"(best gptlab form {best / med['transformers static cache']:.2f}x); "
              f"/ dynamic: {med['gptlab'] / med['transformers dynamic cache']:.2f}x")
    bf16_bytes = sum(m.weight.numel() * 2 for m in ours.modules() if isinstance(m, torch.nn.Linear))
    for mode in ("int8", "int4"):
        quantized_decode(args, with_hf_dir, mode, prompt, bf16_bytes)


def quantized_decode(args: argparse.Namespace, hf_dir: Path, mode: str, prompt: torch.Tensor, bf16_bytes: int) -> None:
    """gptlab's `mode` weights at batch 1 through each kernel this device has for them (quantize's candidates,
    each forced in turn), and with --compiled the step under torch.compile too (inductor may fuse the widening)."""
    from gptlab import quantize
    from gptlab.interop import from_hf

    key = (DEVICE, mode)
    # PyTorch's int8 weight-only kernel too, which quantize passes over on a GPU (to see that it still should)
    candidates = tuple(dict.fromkeys([*quantize._KERNELS.get(key, (None,)),
                                      *([quantize._int8_weight_only] if mode == "int8" else [])]))
    variants = [(make, False) for make in candidates] + ([(candidates[0], True)] if args.compiled else [])
    new = args.new_tokens
    for make, compiled in variants:
        label = f"gptlab {mode} b1 [{make.__name__ if make else 'reference'}{', compiled step' if compiled else ''}]"
        saved = quantize._KERNELS.get(key)
        try:
            if make is not None:
                quantize._KERNELS[key] = (make,)
                quantize._working_kernel.cache_clear()
            cpu = quantize.quantize_model(from_hf(hf_dir, dtype=torch.float32).eval(), mode,
                                          128 if mode == "int4" else None)
            before = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
            q = cpu.to(DEVICE, torch.bfloat16)
            with torch.inference_mode():  # the kernels' own copies of the weights are made on the first call
                q(prompt[:1].to(DEVICE))
            held = (torch.cuda.memory_allocated() if DEVICE == "cuda" else 0) - before
            qbytes = sum(b.numel() * b.element_size() for m in q.modules() if isinstance(m, quantize.QuantizedLinear)
                         for b in m.buffers())
            run, engine = gptlab_decode(q, 1, prompt, new, compile=compiled)
            run()
            rate = statistics.median(new / cuda_time(run, 1) for _ in range(args.rounds))
            print(f"  {label}: {rate:,.0f} tok/s, Linear weights {qbytes / 2**20:.0f} MiB (bf16: "
                  f"{bf16_bytes / 2**20:.0f} MiB), whole model on the GPU after a forward {held / 2**20:.0f} MiB, "
                  f"{engine.kernels()}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on: the other figures stand
            print(f"  {label}: failed: {type(e).__name__}: {e}", flush=True)
        finally:
            if saved is not None:
                quantize._KERNELS[key] = saved
            quantize._working_kernel.cache_clear()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("train")
    t.add_argument("--nanogpt", help="a nanoGPT checkout (its model.py joins as the peer)")
    t.add_argument("--pad", action="store_true", help="also gptlab's model at nanoGPT's padded vocabulary")
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--warmup", type=int, default=8)
    t.add_argument("--steps", type=int, default=10)
    t.add_argument("--rounds", type=int, default=3)
    t.add_argument("--no-compile", action="store_true")
    t.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="then each contender's GPU time by kind of kernel over STEPS steps (torch.profiler)")
    d = sub.add_parser("decode")
    d.add_argument("--new-tokens", type=int, default=256)
    d.add_argument("--rounds", type=int, default=3)
    d.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    d.add_argument("--compiled", action="store_true", help="also gptlab's decode step under torch.compile")
    d.add_argument("--workdir", default="/tmp")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the code (no meaningful figures)")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs an NVIDIA GPU")
    train(args) if args.what == "train" else decode(args)


if __name__ == "__main__":
    main()
