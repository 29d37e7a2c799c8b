"""QLoRA's memory target: the peak memory of `gptlab train --lora-rank R --quantize int4` against the same LoRA run
with its base frozen in bf16 (no --quantize), on the same model, data, seed and steps, each contender in a process
of its own; and their losses after the steps. The target: int4 peak <= 0.45x the bf16 run's, the loss within 2%.

    python benchmarks/qlora_memory.py --layers 18 --width 4096 --eval-tokens 256   # the memory target: 3.2B
    python benchmarks/qlora_memory.py --layers 18 --width 4096 --steps 50 --eval-tokens 1024 --lr 2e-4  # and the loss
    python benchmarks/qlora_memory.py --steps 50      # the losses after 50 steps, TinyLlama 1.1B's shape
    python benchmarks/qlora_memory.py                 # the memory at TinyLlama 1.1B's shape: 3 steps
    python benchmarks/qlora_memory.py --layers 2 --width 512          # a quick check that it runs

What the int4 base saves is a fixed part of the bf16 base's bytes (0.625 bytes a weight where bf16 takes 2); what
both runs hold besides (torch and the libraries, the adapters' AdamW state, activations) is the same, so the ratio
falls toward 0.31 as the model grows: below about 3B parameters the rest outweighs the saving (README: the measured
figures).

The base: `--preset`'s shape (default TinyLlama 1.1B: 22 Llama blocks of width 2048, 969M parameters in them;
`--layers` / `--width` change its depth and width) over tiny Shakespeare's characters (the vocabulary is the data's
65 characters, so the blocks are the weights, as in a real model, where the process's own footprint (torch, the
libraries: a few hundred MiB) is a small part), freshly initialized and saved in bf16 (`--base DIR`: a checkpoint
of your own, with the char tokenizer of `--text`). Both runs: LoRA rank 16 on every block Linear, dtype bfloat16,
batch `--batch` x `--seq` characters, activation checkpointing (QLoRA's setting: the blocks' activations would
otherwise outweigh an int4 base; `--no-checkpointing` keeps them), `--steps` steps, the same seed, the validation
loss over `--eval-tokens` characters scored `--batch` windows at a time. The peak memory is reached within the
first steps; the losses need the 50.

Printed per contender: the trainer's own estimate ("memory per step: at least ..."), the process's peak RSS
(VmHWM: loading included, nothing subtracted), the train loss and the validation loss at the last step; then the
ratios int4 / bf16.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import raise_priority  # benchmarks/ is on sys.path when a benchmark runs as a script

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(argv: list[str]) -> int:
    """One contender: `gptlab train` in this process, then its peak RSS as a JSON line."""
    from gptlab.cli import main as gptlab

    rc = gptlab(argv)
    print(json.dumps({"rc": rc, "peak_rss": peak_rss()}))
    return rc


def make_base(args: argparse.Namespace, data: Path, out: Path) -> None:
    """A freshly initialized GPT of the preset's shape over the data's characters, saved in bf16 with the data's
    tokenizer."""
    import torch

    from gptlab.checkpoint import save_model
    from gptlab.config import GPTConfig
    from gptlab.model import GPT
    from gptlab.tokenizer import load_tokenizer
    from gptlab.train.setup import init_weights

    tokenizer = load_tokenizer(data)
    config = GPTConfig.preset(args.preset, block_size=args.seq, vocab_size=tokenizer.vocab_size,
                              **shape_overrides(args))
    with torch.device("meta"):
        model = GPT(config)
    model.to(torch.bfloat16).to_empty(device="cpu")  # made in bf16: a base of billions of weights fits twice
    init_weights(model, seed=0)
    save_model(out, model, tokenizer)
    blocks = sum(p.numel() for b in model.iter_blocks() for p in b.parameters())
    print(f"base: {args.preset}'s shape, {config.n_layer} layers x {config.n_embd}, {blocks / 1e6:.0f}M parameters "
          f"in the blocks, {config.vocab_size} characters")


def shape_overrides(args: argparse.Namespace) -> dict:
    """--layers and --width over the preset's shape: heads of 128, the preset's ratios of query to key/value heads
    and of hidden to model width."""
    from gptlab.presets import PRESETS

    preset, shape = PRESETS[args.preset], {}
    if args.layers:
        shape["n_layer"] = args.layers
    if args.width:
        heads = max(1, args.width // 128)
        shape.update(n_embd=args.width, n_head=heads,
                     n_kv_head=max(1, heads * preset.get("n_kv_head", preset["n_head"]) // preset["n_head"]))
        if preset.get("mlp_hidden"):
            shape["mlp_hidden"] = 64 * round(preset["mlp_hidden"] * args.width / preset["n_embd"] / 64)
    return shape


def contender(args: argparse.Namespace, root: Path, base: Path, data: Path, quantize: str | None) -> dict:
    """Run one contender in a child process; its estimate line, peak RSS and final losses."""
    name = quantize or "bf16"
    recipe = root / f"{name}.toml"
    recipe.write_text(f"batch_size = {args.batch}\nmax_steps = {args.steps}\nwarmup_steps = 2\nlr = {args.lr}\n"
                      f"eval_interval = {args.steps}\neval_tokens = {args.eval_tokens}\n"
                      f"eval_batch_size = {args.batch}\nlog_interval = {args.log_interval or args.steps}\n"
                      'dtype = "bfloat16"\nlora_rank = 16\nlora_alpha = 32\ntensorboard = false\n'
                      f"activation_checkpointing = {str(not args.no_checkpointing).lower()}\n")
    argv = ["train", str(recipe), "--init-from", str(base), "--data", str(data), "--out", str(root / name),
            "--threads", str(args.threads), *(["--quantize", quantize] if quantize else [])]
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(argv)], capture_output=True, text=True,
                          preexec_fn=None if args.normal_priority else raise_priority, check=False)
    lines = done.stdout.splitlines()
    result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {"rc": done.returncode}
    if result["rc"] != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    estimate = next((line for line in lines if line.startswith("memory per step")), "(no estimate printed)")
    return {"name": name, "estimate": estimate, "peak_rss": result["peak_rss"],
            "train_loss": [r["train_loss"] for r in rows if "train_loss" in r][-1],
            "val_loss": [r["val_loss"] for r in rows if "val_loss" in r][-1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--preset", default="tinyllama-1.1b", help="the base's shape (default: tinyllama-1.1b)")
    parser.add_argument("--layers", type=int, help="blocks (default: the preset's)")
    parser.add_argument("--width", type=int, help="n_embd, 128 per head (default: the preset's)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3; the loss target: 50)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="the adapters' peak learning rate (default 1e-3; at billions of parameters it makes "
                             "both runs' losses spike, and QLoRA's own recipes take 1e-4 to 2e-4)")
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="keep every block's activations (default: activation checkpointing, as QLoRA trains)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-interval", type=int,
                        help="steps between metrics.jsonl's train rows (default: the last step only), to follow a "
                             "long run in its temporary folder")
    parser.add_argument("--normal-priority", action="store_true",
                        help="leave the contenders at this process's priority (default: raised, as timed runs are; "
                             "a long run on a shared machine may rather stay nice)")
    parser.add_argument("--text", type=Path, default=TEXT, help="the training text (default: tiny Shakespeare)")
    parser.add_argument("--base", type=Path, help="a base checkpoint of your own (its tokenizer: --text's chars)")
    parser.add_argument("--work", type=Path,
                        help="keep the data, the base and both runs (metrics.jsonl: the loss curves) in this folder "
                             "instead of a temporary one; a base already there is reused")
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))

    from gptlab.checkpoint import CONFIG_FILE
    from gptlab.cli import main as gptlab
    from gptlab.data.dataset import META

    with tempfile.TemporaryDirectory() as tmp:
        root = args.work or Path(tmp)
        data = root / "data"
        if not (data / META).exists():
            assert gptlab(["prepare", str(args.text), "--tokenizer", "char", "--out", str(data)]) == 0
        base = args.base or root / "base"
        if args.base is None and not (base / CONFIG_FILE).exists():
            make_base(args, data, base)
        for name in ("bf16", "int4"):
            shutil.rmtree(root / name, ignore_errors=True)  # a run folder left by an earlier try would be resumed
        results = [contender(args, root, base, data, q) for q in (None, "int4")]
    for r in results:
        print(f"{r['name']:>5}: peak RSS {r['peak_rss'] / 2**20:,.0f} MiB; after {args.steps} steps train loss "
              f"{r['train_loss']:.4f}, val loss {r['val_loss']:.4f}; {r['estimate']}")
    bf16, int4 = results
    memory = int4["peak_rss"] / bf16["peak_rss"]
    loss = abs(int4["val_loss"] / bf16["val_loss"] - 1)
    print(f"int4 / bf16: peak RSS {memory:.2f}x (target <= 0.45x), val loss {int4['val_loss'] / bf16['val_loss']:.4f}x "
          f"(target within 2%), train loss {int4['train_loss'] / bf16['train_loss']:.4f}x")
    print("target:", "met" if memory <= 0.45 and loss <= 0.02 else "NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
