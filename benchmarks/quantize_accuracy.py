"""Weight-only int8 / int4 (`--quantize`): perplexity against bf16, and decode speed against llama.cpp q8_0 / q4_0.

Accuracy: `gptlab eval` on the validation split of tiny Shakespeare, char-level and GPT-2 tokens, for the same
model run in bf16 (`--dtype bfloat16`), int8 and int4 (`--quantize`, bf16 activations), with the ratios
int8 / bf16 and int4 / bf16 (targets: within 1% and 5%). The models are trained here into a temporary directory
unless given: the char one by configs/speedrun_cpu.toml (~15 s on 2 cores), the GPT-2-token one by GPT2_RECIPE
below (4 layers, width 128, 300 steps of 8 x 128 tokens: a few minutes on 2 cores). Or pass --char-run / --gpt2-run
with their --char-data / --gpt2-data.

Speed: decode tokens/s at batch 1 (a 16-token prompt, --new-tokens greedy, 2 threads) of a GPT-2 124M-shaped
model with random weights, as benchmarks/generate_throughput.py times it: gptlab in fp32, bf16, int8 and int4,
and llama.cpp (when llama-cpp-python is installed) on the same weights through gptlab's GGUF export in q8_0 and
q4_0. The contenders alternate over --rounds; the median counts; the ratios gptlab int8 / llama.cpp q8_0 and
gptlab int4 / llama.cpp q4_0 are printed. Nothing is asserted. On a shared machine:

    OMP_NUM_THREADS=2 setsid sh -c 'echo -20 > /proc/self/autogroup; exec python benchmarks/quantize_accuracy.py'

Needs GPT-2's tokenizer files (TIKTOKEN_CACHE_DIR for an offline machine; ../shared/data/tiktoken_cache is used
when it exists).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_throughput import LlamaCpp  # noqa: E402 - a sibling script: the same llama.cpp decoding loop
from timing import loadavg  # benchmarks/ is on sys.path when a benchmark runs as a script

from gptlab import GPT, GPTConfig, generate, quantize_model  # noqa: E402
from gptlab.generation.api import PACK_MIN_TOKENS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
GPT2_RECIPE = {  # a small GPT-2-architecture model on GPT-2 tokens; widths divisible by every int4 group size
    "model": "gpt2", "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128, "batch_size": 8,
    "max_steps": 300, "optimizer": "adamw", "lr": 3e-3, "warmup_steps": 20, "schedule": "cosine",
    "weight_decay": 0.1, "eval_interval": 0, "log_interval": 50, "tensorboard": False, "threads": 2, "seed": 1337,
}


def timed(fn) -> float:  # noqa: ANN001
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


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


class LlamaCppQuantized(LlamaCpp):
    GGUF = {"q8_0": "q8_0", "q4_0": "q4_0"}  # gptlab's GGUF export writes both


class Gptlab:
    def __init__(self, name: str, model: GPT) -> None:
        self.name, self.model = name, model

    def setting(self, dtype: str, batch: int) -> None:
        pass

    def generate(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        return generate(self.model, idx, n, temperature=0)


def speed(args: argparse.Namespace, tmp: Path) -> None:
    torch.manual_seed(0)
    base = GPT(GPTConfig.preset("gpt2")).eval()
    contenders: list = []
    for label, mode, dtype in (("fp32", None, torch.float32), ("bf16", None, torch.bfloat16),
                               ("int8", "int8", args.quantized_dtype), ("int4", "int4", args.quantized_dtype)):
        model = GPT(base.config).eval()
        model.load_state_dict(base.state_dict())
        if mode:
            quantize_model(model, mode, args.group_size if mode == "int4" else None)
        contenders.append(Gptlab(f"gptlab {label}", model.to(dtype)))
    try:
        for gguf_dtype in ("q8_0", "q4_0"):
            peer = LlamaCppQuantized(base, tmp, args.threads, 16 + args.new_tokens + 16)
            peer.name = f"llama.cpp {gguf_dtype}"
            peer.dtype = gguf_dtype
            contenders.append(peer)
    except ImportError as e:
        print(f"skipping llama.cpp: {e.name or e} is not installed (pip install 'gptlab[bench]')")
    idx = torch.randint(0, base.config.vocab_size, (1, 16))
    for c in contenders:
        c.setting(getattr(c, "dtype", ""), 1)
        c.generate(idx, PACK_MIN_TOKENS)  # warm-up: first-call allocations, kernels' weight copies, packing
    rates: dict[str, list[float]] = {c.name: [] for c in contenders}
    for r in range(args.rounds):
        load = loadavg()
        for c in contenders:
            rate = args.new_tokens / timed(lambda c=c: c.generate(idx, args.new_tokens))
            rates[c.name].append(rate)
            print(f"  round {r + 1} (load {load}) {c.name:>16}: {rate:7.1f} tokens/s", flush=True)
    for c in contenders:
        getattr(c, "close", lambda: None)()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\nGPT-2 124M shape, batch 1 decode, {args.new_tokens} new tokens, greedy, {args.threads} threads, "
          f"CPU {torch.backends.cpu.get_cpu_capability()}: medians of {args.rounds} rounds, tokens/s")
    print("| " + " | ".join(med) + " |\n|" + "---|" * len(med) + "\n| " + " | ".join(f"{v:.1f}" for v in med.values())
          + " |")
    for ours, theirs in (("gptlab int8", "llama.cpp q8_0"), ("gptlab int4", "llama.cpp q4_0"),
                         ("gptlab int8", "gptlab bf16"), ("gptlab int8", "gptlab fp32")):
        if theirs in med:
            print(f"{ours} / {theirs}: {med[ours] / med[theirs]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--char-run", help="a trained char-level run (default: train configs/speedrun_cpu.toml here)")
    ap.add_argument("--char-data", help="its data directory")
    ap.add_argument("--gpt2-run", help="a trained GPT-2-token run (default: train GPT2_RECIPE here)")
    ap.add_argument("--gpt2-data", help="its data directory")
    ap.add_argument("--text", default=str(SHARED / "tinyshakespeare.txt"), help="text to train and evaluate on")
    ap.add_argument("--group-size", type=int, default=32, help="int4's group size")
    ap.add_argument("--quantized-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype of the quantized models' other weights (embeddings, norms) in the speed test")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip", choices=["accuracy", "speed"], help="run only the other part")
    ap.add_argument("--workdir", help="where to prepare data and train (kept; default: a temporary directory)")
    args = ap.parse_args()
    args.quantized_dtype = getattr(torch, args.quantized_dtype)
    if (SHARED / "tiktoken_cache").is_dir():
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED / "tiktoken_cache"))
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.skip != "accuracy":
            workdir = Path(args.workdir or tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            accuracy(trained_models(args, workdir), args.group_size)
        if args.skip != "speed":
            speed(args, Path(tmp))


if __name__ == "__main__":
    main()
