"""GRPO on a verifiable task, on a CPU: one-digit sums ("3+4=" -> "7", `gptlab.train.rewards.arithmetic_records`),
a 2-layer char model first trained on them (SFT), then `train --objective grpo` with the exact-match reward.

    python benchmarks/grpo_arithmetic.py                       # SFT 300 steps, GRPO 120 steps
    python benchmarks/grpo_arithmetic.py --grpo-steps 200 --digits 2

Both stages are `gptlab train` runs (the CLI, in this process), in a temporary directory. The reward is measured
before and after GRPO the same way: `--samples` completions at temperature 1 of each of the first `--prompts`
validation prompts, scored by exact match (the metric GRPO optimizes, on prompts it never trained on). Printed:
the mean reward of the SFT model (the peer) and of the GRPO model, their difference and ratio, and GRPO's
training seconds. The target: a gain of at least 0.3 within 10 minutes of GRPO on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def sampled_reward(run: Path, data: Path, prompts: int, samples: int, seed: int) -> float:
    """The mean exact-match reward of `samples` completions (temperature 1) of each of the first `prompts`
    validation prompts, sampled by `run`'s final model through GRPO's own rollout and scoring."""
    import torch

    from gptlab.loading import load_model
    from gptlab.train.batches import Split, StepBatch
    from gptlab.train.grpo import Grpo, prompts_and_replies
    from gptlab.train.recipe import build_train_config

    model, _ = load_model(str(run), prefer="latest")
    val = Split.load(data, "val")
    window = int(val.window_tokens)
    count = min(prompts, len(val.tokens) // window)
    rows = StepBatch(val.tokens[: count * window].reshape(count, window).astype("int64"),
                     val.mask[: count * window].reshape(count, window), 0)
    x, y = rows.micro(0, 1, 0, 1)
    cfg = build_train_config({"objective": "grpo", "group_size": samples, "max_new_tokens": 4})
    torch.manual_seed(seed)
    objective = Grpo(cfg, model, data)
    pairs = prompts_and_replies(x, y)
    prompt_ids, replies = [p for p, _ in pairs], [r for _, r in pairs]
    return float(objective.score(prompt_ids, replies, objective.rollout(prompt_ids)).mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--digits", type=int, default=1)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--grpo-steps", type=int, default=120)
    parser.add_argument("--grpo-lr", type=float, default=2e-4)
    parser.add_argument("--prompts", type=int, default=100, help="validation prompts the reward is measured on")
    parser.add_argument("--samples", type=int, default=4, help="completions sampled per prompt for the measure")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from gptlab.cli import main as gptlab
    from gptlab.train.rewards import arithmetic_records

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        records = root / "sums.jsonl"
        records.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_records(3000, 0, args.digits)))
        data = root / "data"
        assert gptlab(["prepare", str(records), "--tokenizer", "char", "--block-size", "24", "--no-pack", "--out",
                       str(data)]) == 0
        common = ["--data", str(data), "--quiet", "--threads", str(args.threads), "--tensorboard", "false"]
        sft_recipe = root / "sft.toml"
        sft_recipe.write_text(f'model = "speedrun-char"\nbatch_size = 32\nmax_steps = {args.sft_steps}\n'
                              "warmup_steps = 20\nlr = 3e-3\ndropout = 0.0\nlog_interval = 50\n")
        t0 = time.perf_counter()
        assert gptlab(["train", str(sft_recipe), "--out", str(root / "sft"), *common]) == 0
        sft_seconds = time.perf_counter() - t0
        before = sampled_reward(root / "sft", data, args.prompts, args.samples, seed=1)
        grpo_recipe = root / "grpo.toml"
        grpo_recipe.write_text(f'init_from = "{root / "sft"}"\nobjective = "grpo"\nbatch_size = 8\ngroup_size = 8\n'
                               f"max_new_tokens = 4\nmax_steps = {args.grpo_steps}\nwarmup_steps = 5\n"
                               f'lr = {args.grpo_lr}\nschedule = "constant"\nlog_interval = 10\n')
        t0 = time.perf_counter()
        assert gptlab(["train", str(grpo_recipe), "--out", str(root / "grpo"), *common]) == 0
        grpo_seconds = time.perf_counter() - t0
        after = sampled_reward(root / "grpo", data, args.prompts, args.samples, seed=1)
        logged = [json.loads(line) for line in (root / "grpo" / "metrics.jsonl").read_text().splitlines()]
        curve = [round(r["reward"], 3) for r in logged if "reward" in r]
    print(f"SFT: {args.sft_steps} steps in {sft_seconds:.0f}s; GRPO: {args.grpo_steps} steps in {grpo_seconds:.0f}s")
    print(f"GRPO's rollout reward every 10 steps: {curve}")
    print(f"held-out reward (exact match, temperature 1, {args.prompts} prompts x {args.samples}): SFT {before:.3f} "
          f"-> GRPO {after:.3f}: gain {after - before:+.3f}, ratio {after / max(before, 1e-9):.2f}x")
    ok = after - before >= 0.3 and grpo_seconds <= 600
    print("target (gain >= 0.3 within 600 s of GRPO):", "met" if ok else "NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
