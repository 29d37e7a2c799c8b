"""DPO step throughput and peak memory, gptlab against trl's DPOTrainer with a peft LoRA, on the same weights and
the same batch: a SmolLM2-135M-shaped Llama (random weights, saved once with transformers' `save_pretrained`, and
imported into gptlab by its Hugging Face interop, as `--init-from DIR` does).

    python benchmarks/dpo_throughput.py                         # 8 layers, 4 pairs, prompt 192 + replies 64..192
    python benchmarks/dpo_throughput.py --layers 30 --rounds 3  # the full shape

The step: LoRA rank 16, alpha 32 on every linear layer of the blocks, the base frozen in `--dtype` (bf16 by
default), adapters fp32; the reference is the base with the adapters off (no second model in either); beta 0.1;
AdamW on the adapters, clipping at 1.0.
- gptlab: `gptlab train --objective dpo --init-from DIR --lora-rank 16 --lora-alpha 32` as its trainer runs it,
  from its parts (`build_model`, `Precision`, `build_objective`, `build_optimizers`), the pairs as the trainer's
  rows (chosen, rejected; cut after the longest reply).
- trl: `DPOTrainer(model, args=DPOConfig(...), peft_config=LoraConfig(...))`, its own collator (right-padded
  [chosen; rejected] rows) and its `compute_loss` (policy, then the reference under `use_adapter`), then
  backward, clipping and `torch.optim.AdamW(fused=True)`: trl's loss path without the Trainer loop around it.
Each contender runs in its own process per round (rounds interleaved, raised priority: `timing.py`), so its peak
memory is that process's max RSS ("step peak": the high-water mark from the first step on). Both first compute
the DPO loss of one batch with the initial adapters (B = 0: the policy is the reference, so log 2), which must
agree. Tokens are the pairs' real tokens (prompt + reply, twice), the same for both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

# benchmarks/ is on sys.path when a benchmark runs as a script
from finetune_throughput import (
    ALPHA,
    BETAS,
    CLIP,
    LLAMA,
    LR,
    RANK,
    TARGETS,
    WEIGHT_DECAY,
    child_result,
    interleaved_rounds,
    medians,
    rss_kib,
)
from timing import raise_priority

BETA = 0.1
NAMES = ("gptlab", "trl")


def pair_batches(args: argparse.Namespace, vocab: int) -> list[list[dict[str, list[int]]]]:
    """One list of pairs (prompt_ids, chosen_ids, rejected_ids) per step, the same in every process."""
    import random

    rng = random.Random(1234)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    return [[{"prompt_ids": ids(args.prompt), "chosen_ids": ids(rng.randint(args.reply // 3, args.reply)),
              "rejected_ids": ids(rng.randint(args.reply // 3, args.reply))} for _ in range(args.pairs)]
            for _ in range(1 + args.warmup + args.steps)]


def gptlab_contender(args: argparse.Namespace):  # noqa: ANN201 - (step, description)
    import torch

    from gptlab.hardware import retain_freed_memory
    from gptlab.train import build_train_config
    from gptlab.train.batches import rows_of_pairs
    from gptlab.train.objectives import build_objective
    from gptlab.train.optim import build_optimizers, optimizer_spec
    from gptlab.train.precision import Precision
    from gptlab.train.setup import build_model

    retain_freed_memory()  # as `gptlab train` does
    cfg = build_train_config({"init_from": str(args.base), "dtype": args.dtype, "batch_size": args.pairs, "lr": LR,
                              "adam_betas": list(BETAS), "weight_decay": WEIGHT_DECAY, "grad_clip": CLIP,
                              "lora_rank": RANK, "lora_alpha": ALPHA, "objective": "dpo", "beta": BETA})
    model = build_model(cfg, LLAMA["vocab_size"], "cpu")
    precision = Precision(model, cfg.dtype, "cpu", True, distributed=False)
    objective = build_objective(cfg, precision.train_module)
    optimizers = build_optimizers(model, optimizer_spec(cfg))

    def step(pairs: list[dict], train: bool = True) -> float:
        x, y = rows_of_pairs(pairs)
        with torch.set_grad_enabled(train), precision.autocast():
            loss, _ = objective.loss(precision.train_module, x, y, 1 / len(pairs))
        if train:
            precision.backward(loss)
            precision.step(optimizers, cfg.grad_clip)
        return float(loss)

    return step, f"{precision.mode} base {args.dtype}, LoRA adapters off as the reference"


def trl_contender(args: argparse.Namespace):  # noqa: ANN201 - (step, description)
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging
    from trl import DPOConfig, DPOTrainer

    logging.set_verbosity_error()
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(LLAMA["vocab_size"])}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  eos_token="t1", pad_token="t2")
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=getattr(torch, args.dtype))
    config = DPOConfig(output_dir=str(args.base.parent / "trl"), beta=BETA, report_to=[], use_cpu=True,
                       per_device_train_batch_size=args.pairs, max_length=None, bf16=False, fp16=False)
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, args=config, processing_class=tok, peft_config=lora,
                         train_dataset=Dataset.from_list([{"prompt": "t5", "chosen": "t6", "rejected": "t7"}]))
    net = trainer.model
    net.train()
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True)

    def step(pairs: list[dict], train: bool = True) -> float:
        inputs = trainer.data_collator(pairs)
        with torch.set_grad_enabled(train):
            loss = trainer._compute_loss(net, inputs, return_outputs=False)
        if train:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.item()

    return step, f"peft LoRA on a {args.dtype} base, trl's reference (use_adapter)"


def run_child(args: argparse.Namespace) -> None:
    if not args.no_priority:
        raise_priority()
    import torch

    t0 = time.perf_counter()
    step, description = (gptlab_contender if args.child == "gptlab" else trl_contender)(args)
    setup = time.perf_counter() - t0
    check, *batches = pair_batches(args, LLAMA["vocab_size"])
    loss0 = step(check, train=False)
    try:  # reset the high-water mark: the step peak is measured from here
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    times = []
    for i, pairs in enumerate(batches):
        t = time.perf_counter()
        step(pairs)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    tokens = [sum(2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in b)
              for b in batches[args.warmup:]]
    print("RESULT " + json.dumps({
        "description": description, "setup_s": setup, "check_loss": loss0, "times": times, "tokens": tokens,
        "threads": torch.get_num_threads(), "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "step_peak_kib": rss_kib("VmHWM")}), flush=True)


def run_contender(args: argparse.Namespace, name: str) -> dict:
    flags = ("base", "dtype", "pairs", "prompt", "reply", "warmup", "steps")
    cmd = [sys.executable, __file__, "--child", name] + [x for f in flags for x in (f"--{f}", str(getattr(args, f)))]
    return child_result(cmd + (["--no-priority"] if args.no_priority else []), dict(os.environ), name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per process first")
    parser.add_argument("--pairs", type=int, default=4, help="preference pairs per step")
    parser.add_argument("--prompt", type=int, default=192, help="prompt tokens")
    parser.add_argument("--reply", type=int, default=192, help="longest reply (replies: a third of it to all)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the frozen base's")
    parser.add_argument("--no-priority", action="store_true", help="do not raise the timed processes' priority")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return
    setup = f"{args.dtype} base; {args.pairs} pairs of prompt {args.prompt} + replies up to {args.reply}"
    results = interleaved_rounds(args, NAMES, setup, lambda name: run_contender(args, name),
                                 lambda res: sum(res["tokens"]) / sum(res["times"]))
    ours, peer = results["gptlab"][0], results["trl"][0]
    diff = abs(ours["check_loss"] - peer["check_loss"])
    print(f"\ninitial DPO loss: gptlab {ours['check_loss']:.6f}, trl {peer['check_loss']:.6f} (log 2 = "
          f"{math.log(2):.6f}), diff {diff:.2e}")
    summary = medians(results, lambda res: sum(res["tokens"]) / sum(res["times"]))
    (t1, p1, s1), (t2, p2, s2) = summary["gptlab"], summary["trl"]
    print(f"ratio gptlab / trl: tokens/s {t1 / t2:.2f}x, peak RSS {p1 / p2:.2f}x, step peak {s1 / s2:.2f}x")
    if diff > 2e-2:
        sys.exit("the initial losses disagree")


if __name__ == "__main__":
    main()
