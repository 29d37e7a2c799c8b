"""Weight-only int8 / int4 (`--quantize`): perplexity against bf16.

`gptlab eval` on the validation split of tiny Shakespeare, char-level and GPT-2 tokens, for the same model run in
bf16 (`--dtype bfloat16`), int8 and int4 (`--quantize`), with the ratios int8 / bf16 and int4 / bf16 (targets:
within 0.1% and 2%). The models are trained here into a temporary directory unless given: the char one by
configs/speedrun_cpu.toml (~15 s on 2 cores), the GPT-2-token one by GPT2_RECIPE below (4 layers, width 128, 300
steps of 8 x 128 tokens: a few minutes on 2 cores). Or pass --char-run / --gpt2-run with their --char-data /
--gpt2-data. The evaluation runs the kernels `--quantize` runs on this machine (where the dispatch picks gptlab's
own, as on every x86 CPU tried so far, int8's activations are 16-bit fixed point and int4's int8 blocks of 32), so
the figures are those of the fast path.

Decode speed of the same modes against llama.cpp's q8_0 / q4_0 and CTranslate2's int8 is
benchmarks/generate_throughput.py's `--settings 1:int8,1:int4`.

Needs GPT-2's tokenizer files (TIKTOKEN_CACHE_DIR for an offline machine; ../shared/data/tiktoken_cache is used
when it exists).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
GPT2_RECIPE = {  # a small GPT-2-architecture model on GPT-2 tokens; widths divisible by every int4 group size
    "model": "gpt2", "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128, "batch_size": 8,
    "max_steps": 300, "optimizer": "adamw", "lr": 3e-3, "warmup_steps": 20, "schedule": "cosine",
    "weight_decay": 0.1, "eval_interval": 0, "log_interval": 50, "tensorboard": False, "threads": 2, "seed": 1337,
}


def gptlab_cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "gptlab.cli", *args], capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"gptlab {' '.join(args[:1])} failed: {out.stderr.strip()}")
    return out.stdout


def toml(values: dict) -> str:
    def value(v: object) -> str:
        return json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)

    return "".join(f"{k} = {value(v)}\n" for k, v in values.items())


def trained_models(args: argparse.Namespace, tmp: Path) -> list[tuple[str, str, str]]:
    """(name, run, data) for the char and GPT-2-token models: given, or prepared and trained here."""
    models = []
    for name, run, data, tokenizer, recipe in (
        ("char", args.char_run, args.char_data, "char", REPO / "configs" / "speedrun_cpu.toml"),
        ("GPT-2 tokens", args.gpt2_run, args.gpt2_data, "gpt2", None),
    ):
        if run is None:
            data, run = tmp / f"data-{tokenizer}", tmp / f"run-{tokenizer}"
            print(f"preparing {args.text} ({tokenizer}) and training the {name} model ...", flush=True)
            gptlab_cli("prepare", str(args.text), "--tokenizer", tokenizer, "--out", str(data))
            if recipe is None:
                recipe = tmp / "gpt2_tokens.toml"
                recipe.write_text(toml(GPT2_RECIPE))
            gptlab_cli("train", str(recipe), "--data", str(data), "--out", str(run), "--quiet")
        elif data is None:
            raise SystemExit(f"error: give the {name} run's data directory too")
        models.append((name, str(run), str(data)))
    return models


def accuracy(models: list[tuple[str, str, str]], group_size: int) -> None:
    print(f"\nvalidation perplexity (`gptlab eval --dtype bfloat16`; int4 group size {group_size})")
    print("| model | bf16 | int8 | int4 | int8 / bf16 | int4 / bf16 |")
    print("|---|---|---|---|---|---|")
    for name, run, data in models:
        ppl = {}
        for label, flags in (("bf16", []), ("int8", ["--quantize", "int8"]),
                             ("int4", ["--quantize", "int4", "--group-size", str(group_size)])):
            out = gptlab_cli("eval", run, "--data", data, "--json", "--dtype", "bfloat16", *flags)
            ppl[label] = json.loads(out)["perplexity"]
        print(f"| {name} | {ppl['bf16']:.3f} | {ppl['int8']:.3f} | {ppl['int4']:.3f} | "
              f"{ppl['int8'] / ppl['bf16']:.4f} | {ppl['int4'] / ppl['bf16']:.4f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--char-run", help="a trained char-level run (default: train configs/speedrun_cpu.toml here)")
    ap.add_argument("--char-data", help="its data directory")
    ap.add_argument("--gpt2-run", help="a trained GPT-2-token run (default: train GPT2_RECIPE here)")
    ap.add_argument("--gpt2-data", help="its data directory")
    ap.add_argument("--text", default=str(SHARED / "tinyshakespeare.txt"), help="text to train and evaluate on")
    ap.add_argument("--group-size", type=int, default=32, help="int4's group size")
    ap.add_argument("--workdir", help="where to prepare data and train (kept; default: a temporary directory)")
    args = ap.parse_args()
    if (SHARED / "tiktoken_cache").is_dir():
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED / "tiktoken_cache"))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        accuracy(trained_models(args, workdir), args.group_size)


if __name__ == "__main__":
    main()
