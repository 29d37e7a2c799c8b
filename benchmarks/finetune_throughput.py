"""Fine-tuning throughput and peak memory of one LoRA training step, gptlab against peft + transformers, on the same
weights: a SmolLM2-135M-shaped Llama (random weights, saved once with transformers' `save_pretrained`).

    python benchmarks/finetune_throughput.py                                   # full shape: 30 layers, 4 x 512
    python benchmarks/finetune_throughput.py --layers 8 --steps 3 --rounds 3   # a quicker run
    python benchmarks/finetune_throughput.py --full                            # also full fine-tuning

The step: LoRA rank 16, alpha 32 on every linear layer of the blocks (q, k, v, o, gate, up, down), the base frozen
in bf16, the adapters fp32, AdamW on the adapters, global-norm clipping at 1.0.
- gptlab: the model as `gptlab train --init-from DIR --lora-rank 16 --lora-alpha 32 --dtype bfloat16` runs it,
  built from the trainer's parts (`build_model`, `Precision`, `build_optimizers`, the trainer's summed loss times
  1 / targets, `Precision.step`), with glibc malloc keeping freed memory as `gptlab train` sets it.
- peft: `AutoModelForCausalLM.from_pretrained(DIR, dtype=bfloat16)` + `get_peft_model(LoraConfig(...))` (adapters
  fp32: peft's autocast_adapter_dtype), `torch.optim.AdamW(fused=True)`, `model(input_ids, labels=input_ids).loss`,
  backward, clip, step, zero_grad: the usual loop.
With `--full`, all parameters train: gptlab's bf16 trainer step (fp32 master weights and AdamW state, a bf16
working copy runs forward/backward) against a transformers Trainer-style loop (`Trainer(bf16=True)` on a CPU:
fp32 weights under bf16 autocast, fused AdamW, clipping).

Each contender runs in its own process per round (rounds interleaved), so its peak memory is that process's max
RSS: "peak" is the whole process (loading included), "step peak" the high-water mark from the first warm-up step
on. Before timing, each computes the loss of one fixed batch with the initial weights; the two must agree (the
adapters' B starts at zero, so both compute the base model's loss). Prints per-round tokens/s and peak RSS, then
medians and the ratios gptlab / peer.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from timing import cpu_flags, loadavg, raise_priority  # benchmarks/ is on sys.path when a benchmark runs as a script

LLAMA = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
             rope_theta=100000.0)  # SmolLM2-135M's shape
RANK, ALPHA = 16, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR, BETAS, WEIGHT_DECAY, CLIP = 1e-4, (0.9, 0.95), 0.1, 1.0
LOSS_TOLERANCE = 2e-2  # bf16
PEERS = {"gptlab": "peft", "gptlab-full": "hf-full"}


# --- the child processes: one contender each -----------------------------------------------------------------------
def token_batches(args: argparse.Namespace, vocab: int):  # noqa: ANN201 - (check batch, step batches)
    """The loss-check batch and one batch per step, (batch, seq + 1) random tokens; the same in every process."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    check = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
    steps = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
             for _ in range(args.warmup + args.steps)]
    return check, steps


def gptlab_contender(args: argparse.Namespace, full: bool):  # noqa: ANN201 - (step, check_loss, description)
    """`gptlab train`'s step, from the trainer's own parts."""
    import torch

    from gptlab.hardware import retain_freed_memory
    from gptlab.train import build_train_config
    from gptlab.train.optim import build_optimizers, lr_schedule, optimizer_spec, set_lr
    from gptlab.train.precision import Precision
    from gptlab.train.setup import build_model

    if not args.default_malloc:
        retain_freed_memory()  # as `gptlab train` does
    values = {"init_from": str(args.base), "dtype": "bfloat16", "batch_size": args.batch, "lr": LR,
              "adam_betas": list(BETAS), "weight_decay": WEIGHT_DECAY, "grad_clip": CLIP}
    if not full:
        values.update(lora_rank=RANK, lora_alpha=ALPHA)
    cfg = build_train_config(values)
    model = build_model(cfg, LLAMA["vocab_size"], "cpu")
    precision = Precision(model, cfg.dtype, "cpu", cfg.attention_fp32, distributed=False)
    optimizers = build_optimizers(model, optimizer_spec(cfg))
    schedule, net = lr_schedule(cfg), precision.train_module
    counter = {"step": 0}

    def check_loss(ids: torch.Tensor) -> float:
        targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -1)], dim=1)  # the same targets as HF's labels
        with torch.no_grad(), precision.autocast():
            return float(net(ids, targets)[1])

    def step(x: torch.Tensor) -> float:
        set_lr(optimizers, schedule.multiplier(counter["step"], counter["step"] / 1000))
        inputs, targets = x[:, :-1], x[:, 1:]
        with precision.autocast():
            _, loss = net(inputs, targets, reduction="sum")
            loss = loss * (1.0 / targets.numel())
        precision.backward(loss)
        value = loss.item()
        precision.step(optimizers, cfg.grad_clip)
        counter["step"] += 1
        return value

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return step, check_loss, f"{precision.mode}, {trainable / 1e6:.2f}M trainable"


def peft_contender(args: argparse.Namespace, full: bool):  # noqa: ANN201 - (step, check_loss, description)
    """The usual transformers (+ peft) fine-tuning loop."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    if full:  # what transformers' Trainer(bf16=True) does on a CPU: fp32 weights, bf16 autocast
        model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
        autocast = True
    else:
        from peft import LoraConfig, get_peft_model

        model = AutoModelForCausalLM.from_pretrained(args.base, dtype=getattr(torch, args.peft_dtype))
        model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
        autocast = False
    model.config.use_cache = False
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True)

    def check_loss(ids: torch.Tensor) -> float:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return float(model(input_ids=ids, labels=ids).loss)

    def step(x: torch.Tensor) -> float:
        ids = x[:, :-1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself
        loss.backward()
        value = loss.item()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value

    base = "bf16" if args.peft_dtype == "bfloat16" else "fp32"
    kind = "bf16 autocast on fp32 weights" if full else f"{base} base, fp32 adapters"
    return step, check_loss, f"{kind}, {sum(p.numel() for p in params) / 1e6:.2f}M trainable"


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def run_child(args: argparse.Namespace) -> None:
    if not args.no_priority:
        raise_priority()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    build = gptlab_contender if args.child.startswith("gptlab") else peft_contender
    t0 = time.perf_counter()
    step, check_loss, description = build(args, full=args.child.endswith("full"))
    setup = time.perf_counter() - t0
    check, batches = token_batches(args, LLAMA["vocab_size"])
    loss0 = check_loss(check)
    try:  # reset the high-water mark: the step peak is measured from here
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    times, losses = [], []
    for i, x in enumerate(batches):
        t = time.perf_counter()
        losses.append(step(x))
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    result = {"name": args.child, "description": description, "setup_s": setup, "check_loss": loss0,
              "times": times, "losses": losses, "threads": torch.get_num_threads(),
              "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "step_peak_kib": rss_kib("VmHWM")}
    print("RESULT " + json.dumps(result), flush=True)


# --- the parent: weights, rounds, summary --------------------------------------------------------------------------
def save_base(directory: Path, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**LLAMA, "num_hidden_layers": layers})).save_pretrained(directory)


def run_contender(args: argparse.Namespace, name: str) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--base", str(args.base), "--batch", str(args.batch),
           "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    cmd += (["--threads", str(args.threads)] if args.threads else []) + (["--no-priority"] if args.no_priority else [])
    cmd += (["--default-malloc"] if args.default_malloc else []) + ["--peft-dtype", args.peft_dtype]
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return child_result(cmd, env, name)


def child_result(cmd: list[str], env: dict[str, str], name: str) -> dict:
    """Run one contender's process in a session of its own; its "RESULT {json}" line, or exit naming it."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, start_new_session=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def interleaved_rounds(args: argparse.Namespace, names: list[str] | tuple[str, ...], setup: str,
                       run: Callable[[str], dict], tokens_per_sec: Callable[[dict], float]) -> dict[str, list[dict]]:
    """On a base of `args.layers` layers saved for the run (`args.base`), each contender's process once per round,
    taking turns; a line per process (tokens/s, peak RSS, the load)."""
    from gptlab.hardware import cpu_name  # gptlab is imported late: the children measure their own memory

    with tempfile.TemporaryDirectory(prefix="gptlab_bench_") as tmp:
        args.base = Path(tmp) / "base"
        save_base(args.base, args.layers)
        print(f"CPU: {cpu_name()} ({os.cpu_count()} cores; {cpu_flags()}); SmolLM2-135M shape with {args.layers} "
              f"layers; {setup}; {args.warmup} warm-up + {args.steps} timed steps per process, {args.rounds} rounds")
        return _rounds(names, args.rounds, run, tokens_per_sec)


def _rounds(names: list[str] | tuple[str, ...], rounds: int, run: Callable[[str], dict],
            tokens_per_sec: Callable[[dict], float]) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names:
            load = loadavg()
            res = run(name)
            results[name].append(res)
            peak, step_peak = res["peak_kib"] / 2**20, res["step_peak_kib"] / 2**20
            print(f"round {r + 1} {name:12s} {tokens_per_sec(res):8.1f} tokens/s  peak RSS {peak:5.2f} GiB, step peak "
                  f"{step_peak:5.2f} GiB  [load {load}, {res['threads']} threads, setup {res['setup_s']:.1f} s]",
                  flush=True)
    return results


def medians(results: dict[str, list[dict]], tokens_per_sec: Callable[[dict], float]
            ) -> dict[str, tuple[float, float, float]]:
    """Each contender's median over rounds of tokens/s, peak RSS and step peak (GiB), printed a line each."""
    summary = {}
    width = max(len(runs[0]["description"]) for runs in results.values())
    for name, runs in results.items():
        tps = statistics.median(tokens_per_sec(res) for res in runs)
        peak = statistics.median(res["peak_kib"] for res in runs) / 2**20
        step_peak = statistics.median(res["step_peak_kib"] for res in runs) / 2**20
        summary[name] = (tps, peak, step_peak)
        print(f"{name:12s} {runs[0]['description']:{width}s} median {tps:8.1f} tokens/s  peak RSS {peak:5.2f} GiB  "
              f"step peak {step_peak:5.2f} GiB")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per process first")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layers", type=int, default=LLAMA["num_hidden_layers"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--full", action="store_true", help="also full fine-tuning (all parameters, bf16)")
    parser.add_argument("--only-full", action="store_true", help="only full fine-tuning")
    parser.add_argument("--no-priority", action="store_true", help="do not raise the timed processes' priority")
    parser.add_argument("--default-malloc", action="store_true", help="gptlab: leave glibc malloc as it is")
    parser.add_argument("--peft-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="peft's base dtype (float32: what to use on a CPU without bf16 matmuls)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return

    pairs = ([] if args.only_full else [("gptlab", "peft")]) + ([("gptlab-full", "hf-full")]
                                                                if args.full or args.only_full else [])
    names = [n for pair in pairs for n in pair]
    tokens = args.batch * args.seq
    results = interleaved_rounds(args, names, f"threads {args.threads or 'torch default'}; batch {args.batch} x "
                                 f"{args.seq}", lambda name: run_contender(args, name),
                                 lambda res: tokens / statistics.median(res["times"]))
    print()
    failed = False
    for ours, peer in pairs:
        a, b = results[ours][0], results[peer][0]
        diff = abs(a["check_loss"] - b["check_loss"])
        ok = diff < LOSS_TOLERANCE
        failed |= not ok
        print(f"initial loss on one batch: {ours} {a['check_loss']:.4f}, {peer} {b['check_loss']:.4f}, diff "
              f"{diff:.4f} ({'OK' if ok else 'MISMATCH'}: tolerance {LOSS_TOLERANCE})")
    summary = medians(results, lambda res: tokens / statistics.median(res["times"]))
    for ours, peer in pairs:
        (t1, p1, s1), (t2, p2, s2) = summary[ours], summary[peer]
        print(f"ratio {ours} / {peer}: tokens/s {t1 / t2:.2f}x, peak RSS {p1 / p2:.2f}x, step peak {s1 / s2:.2f}x")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
