"""nanoGPT as a peer in the benchmarks: a checkout given by path (never committed, never changed: it is copied to a
temporary directory first), its character-level Shakespeare data, its README's CPU recipe, its `sample.py`, and the
whole-split validation loss of its checkpoint scored as gptlab scores its own.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanogpt     # any machine with the network
    python benchmarks/speedrun.py --nanogpt /tmp/nanogpt            # the speedrun and start-up ratios
    python benchmarks/train_throughput.py --nanogpt /tmp/nanogpt    # its model at GPT-2 124M shape

Used by `speedrun.py` and `train_throughput.py`; not run on its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

# The README's "I only have a macbook" recipe, word for word (nanoGPT @3adf61e).
CPU_RECIPE = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
              "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
              "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
OUT_DIR = "out-shakespeare-char"  # the recipe's config writes its checkpoint here

# Scores `OUT_DIR/ckpt.pt` on the whole validation split as `gptlab eval` does: non-overlapping windows of the
# context length over all of val.bin, every target counted once, fp32. Runs inside the copied checkout.
WHOLE_SPLIT_EVAL = """
import json, numpy as np, torch
from model import GPT, GPTConfig
ckpt = torch.load("{out}/ckpt.pt", map_location="cpu", weights_only=True)
model = GPT(GPTConfig(**ckpt["model_args"]))
model.load_state_dict({{k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}})
model.eval()
val = torch.from_numpy(np.fromfile("data/shakespeare_char/val.bin", dtype=np.uint16).astype(np.int64))
T, total, count = model.config.block_size, 0.0, 0
n_full = (len(val) - 1) // T  # whole windows, scored 64 at a time; then the shorter last one
windows = [(val[:n_full * T].view(-1, T)[b:b + 64], val[1:n_full * T + 1].view(-1, T)[b:b + 64])
           for b in range(0, n_full, 64)]
if n_full * T < len(val) - 1:
    windows.append((val[n_full * T:-1][None], val[n_full * T + 1:][None]))
with torch.no_grad():
    for x, y in windows:
        logits, _ = model(x, y)  # with targets, nanoGPT returns logits for every position
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").item()
        count += y.numel()
print(json.dumps({{"val_loss": total / count, "targets": count, "iter": ckpt["iter_num"]}}))
"""


def copy_checkout(checkout: Path, into: Path) -> Path:
    """A working copy of a nanoGPT checkout (its data folders are written to, so never the user's own)."""
    checkout = Path(checkout)
    if not (checkout / "train.py").is_file() or not (checkout / "model.py").is_file():
        sys.exit(f"--nanogpt {checkout}: not a nanoGPT checkout (no train.py / model.py)")
    dest = into / "nanogpt"
    shutil.copytree(checkout, dest, ignore=shutil.ignore_patterns(".git", "out*", "*.bin", "*.pkl", "input.txt"))
    return dest


def prepare_char_data(nanogpt: Path, text_file: Path) -> None:
    """nanoGPT's own prepare.py on the given tiny Shakespeare file (placed where it would download it)."""
    data = nanogpt / "data" / "shakespeare_char"
    shutil.copyfile(text_file, data / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, stdout=subprocess.DEVNULL)


def train_command(extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "train.py", *CPU_RECIPE, *(extra or [])]


def whole_split_val(nanogpt: Path, out_dir: str = OUT_DIR) -> dict:
    """{"val_loss", "targets", "iter"} of the recipe's checkpoint, scored on all of val.bin."""
    r = subprocess.run([sys.executable, "-c", WHOLE_SPLIT_EVAL.format(out=out_dir)], cwd=nanogpt, check=True,
                       capture_output=True, text=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def sample_command(max_new_tokens: int, out_dir: str = OUT_DIR) -> list[str]:
    return [sys.executable, "sample.py", f"--out_dir={out_dir}", "--device=cpu", "--num_samples=1",
            f"--max_new_tokens={max_new_tokens}"]


def import_model(nanogpt: Path):  # noqa: ANN201 - nanoGPT's module
    """nanoGPT's model.py as a module (for its GPT and GPTConfig)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("nanogpt_model", Path(nanogpt) / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
