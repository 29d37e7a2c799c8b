"""GRPO on a verifiable task, on a CPU: one-digit sums ("3+4=" -> "7", `gptlab.train.rewards.arithmetic_records`),
a 2-layer char model first trained on them (SFT, configs/sums_sft.toml), then `train --objective grpo` with the
exact-match reward (configs/sums_grpo.toml): the shipped recipes, keys overridden by the flags below.

    python benchmarks/grpo_arithmetic.py                       # the shipped recipes
    python benchmarks/grpo_arithmetic.py --work /tmp/sums --grpo-lr 1e-3 --group-size 16   # reuse data and SFT

Both stages are `gptlab train` runs (the CLI, in this process), in `--work` (kept: a second call reuses its data
and SFT run) or a temporary directory. The reward is measured before and after GRPO the same way: `--samples`
completions at temperature 1 of each of the first `--prompts` validation prompts, scored by exact match (the
metric GRPO optimizes). Printed: GRPO's rollout reward curve, the mean reward of the SFT model (the peer) and of
the GRPO model, their difference and ratio, and GRPO's training seconds. The target: a gain of at least 0.3
within 10 minutes of GRPO on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def sampled_reward(run: Path, data: Path, prompts: int, samples: int, seed: int) -> float:
    """The mean exact-match reward of `samples` completions (temperature 1) of each of the first `prompts`
    validation prompts, sampled by `run`'s final model through GRPO's own rollout and scoring."""
    import torch

    from gptlab.loading import load_model
    from gptlab.train.batches import StepBatch, TokenSplit
    from gptlab.train.grpo import Grpo, prompts_and_replies
    from gptlab.train.recipe import build_train_config

    model, _ = load_model(str(run), prefer="latest")
    val = TokenSplit.load(data, "val")
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


def overrides(args: argparse.Namespace, keys: dict[str, str]) -> list[str]:
    """Command-line overrides (`--key value`) of the flags given."""
    out = []
    for attr, flag in keys.items():
        value = getattr(args, attr)
        if value is not None:
            out += [flag, str(value)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, help="a directory to keep data and runs in (reused when present)")
    parser.add_argument("--digits", type=int, default=1)
    parser.add_argument("--sft-steps", type=int, help="default: configs/sums_sft.toml's")
    parser.add_argument("--grpo-steps", type=int, help="default: configs/sums_grpo.toml's")
    parser.add_argument("--grpo-lr", type=float)
    parser.add_argument("--group-size", type=int)
    parser.add_argument("--grpo-batch", type=int, help="prompts per GRPO step")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--kl-beta", type=float)
    parser.add_argument("--tag", default="grpo", help="the GRPO run's directory name under --work")
    parser.add_argument("--prompts", type=int, default=100, help="validation prompts the reward is measured on")
    parser.add_argument("--samples", type=int, default=8, help="completions sampled per prompt for the measure")
    parser.add_argument("--threads", type=int, default=2)
    args, args.extra = parser.parse_known_args()  # anything else: overrides of the GRPO recipe (--key value)
    if args.work is None:
        with tempfile.TemporaryDirectory() as tmp:
            return run(args, Path(tmp))
    args.work.mkdir(parents=True, exist_ok=True)
    return run(args, args.work)


def run(args: argparse.Namespace, root: Path) -> int:
    from gptlab.cli import main as gptlab
    from gptlab.train.rewards import arithmetic_records

    data, grpo = root / f"data{args.digits}", root / args.tag
    sft = root / f"sft{args.digits}-{args.sft_steps or 'recipe'}"
    common = ["--data", str(data), "--quiet", "--threads", str(args.threads)]
    if not data.is_dir():
        records = root / "sums.jsonl"
        records.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_records(3000, 0, args.digits)))
        assert gptlab(["prepare", str(records), "--tokenizer", "char", "--block-size", "24", "--no-pack", "--out",
                       str(data)]) == 0
    if not sft.is_dir():
        t0 = time.perf_counter()
        assert gptlab(["train", str(CONFIGS / "sums_sft.toml"), "--out", str(sft), *common,
                       *overrides(args, {"sft_steps": "--max-steps"})]) == 0
        print(f"SFT: {time.perf_counter() - t0:.0f}s")
    before = sampled_reward(sft, data, args.prompts, args.samples, seed=1)
    t0 = time.perf_counter()
    grpo_keys = {"grpo_steps": "--max-steps", "grpo_lr": "--lr", "group_size": "--group-size",
                 "grpo_batch": "--batch-size", "temperature": "--temperature", "kl_beta": "--kl-beta"}
    assert gptlab(["train", str(CONFIGS / "sums_grpo.toml"), "--init-from", str(sft), "--out", str(grpo), *common,
                   *overrides(args, grpo_keys), *args.extra]) == 0
    grpo_seconds = time.perf_counter() - t0
    after = sampled_reward(grpo, data, args.prompts, args.samples, seed=1)
    logged = [json.loads(line) for line in (grpo / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], round(r["reward"], 3)) for r in logged if "reward" in r]
    print(f"GRPO: {curve[-1][0] if curve else '?'} steps in {grpo_seconds:.0f}s")
    print(f"GRPO's rollout reward (step, mean over the step's completions): {curve}")
    print(f"held-out reward (exact match, temperature 1, {args.prompts} prompts x {args.samples}): SFT {before:.3f} "
          f"-> GRPO {after:.3f}: gain {after - before:+.3f}, ratio {after / max(before, 1e-9):.2f}x")
    ok = after - before >= 0.3 and grpo_seconds <= 600
    print("target (gain >= 0.3 within 600 s of GRPO):", "met" if ok else "NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
