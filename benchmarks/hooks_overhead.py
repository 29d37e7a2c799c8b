"""What the hook points cost: the forward with no hook set against the same forward of the code before hook points.

The peer is gptlab's own `model.py` and `attention.py` at `--base` (default: the commit before the one that added
`tap`), read from git into a temporary package and given the same weights; its logits are checked to equal
today's. Timed, in turns over `--rounds` (medians of `--reps` forwards each, under torch.no_grad):

- base: the forward before hook points;
- no hooks: today's forward with none set (the claim: equal to base within noise);
- one hook: a no-op function at one layer's `hook_resid_post` (fused attention stays);
- cache all: `run_with_cache` of every point (the explicit attention path everywhere, copies kept).

For a prefill (`--seq` tokens) and a one-token forward, at batch 1. Nothing is asserted: timings are noisy (run it
alone; the load average is printed).

    python benchmarks/hooks_overhead.py [--layers 4 --width 256 --seq 128 --rounds 7 --reps 20]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from timing import loadavg  # benchmarks/ is on sys.path when a benchmark runs as a script

from gptlab import GPT, GPTConfig, run_with_cache
from gptlab.hardware import cpu_name
from gptlab.hooks import hooked

REPO = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout


def base_model_class(rev: str | None) -> tuple[type, str]:
    """The GPT class of model.py / attention.py at `rev` (default: before hook points), as a separate module."""
    if rev is None:
        added = git("log", "--format=%H", "--reverse", "-S", "def tap(", "--", "gptlab/attention.py").split()[0]
        rev = f"{added}^"
    directory = Path(tempfile.mkdtemp(prefix="gptlab-base-"))
    (directory / "base_attention.py").write_text(git("show", f"{rev}:gptlab/attention.py"))
    model = git("show", f"{rev}:gptlab/model.py").replace("from gptlab.attention import", "from base_attention import")
    (directory / "base_model.py").write_text(model)
    sys.path.insert(0, str(directory))
    return importlib.import_module("base_model").GPT, git("rev-parse", "--short", rev).strip()


def timed(fn, reps: int) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="git revision of the peer (default: the commit before hook points)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()

    BaseGPT, rev = base_model_class(args.base)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=max(args.seq, 16), n_layer=args.layers,
                    n_head=args.width // 64, n_embd=args.width)
    model = GPT(cfg).eval()
    base = BaseGPT(cfg).eval()
    base.load_state_dict(model.state_dict())
    print(f"model: {args.layers} layers, width {args.width}, vocabulary {args.vocab}; peer: model.py at {rev}; "
          f"{torch.get_num_threads()} threads; {cpu_name()}; load average {loadavg()}")
    noop = {f"blocks.{args.layers // 2}.hook_resid_post": lambda x: None}
    for seq in (args.seq, 1):
        idx = torch.randint(0, args.vocab, (1, seq))
        with torch.no_grad():
            torch.testing.assert_close(model(idx)[0], base(idx)[0], atol=0, rtol=0)

            def with_one_hook(idx: torch.Tensor = idx) -> None:
                with hooked(model, noop):
                    model(idx)

            contenders = {"base": lambda idx=idx: base(idx), "no hooks": lambda idx=idx: model(idx),
                          "one hook": with_one_hook, "cache all": lambda idx=idx: run_with_cache(model, idx)}
            times: dict[str, list[float]] = {name: [] for name in contenders}
            for fn in contenders.values():
                timed(fn, 2)  # warm-up
            for _ in range(args.rounds):
                for name, fn in contenders.items():
                    times[name].append(timed(fn, args.reps))
        medians = {name: statistics.median(t) for name, t in times.items()}
        print(f"\nforward of {seq} token{'s' if seq > 1 else ''} (median of {args.rounds} rounds x {args.reps}):")
        for name, t in medians.items():
            print(f"  {name:<10} {t * 1e3:8.3f} ms   {t / medians['base']:.3f}x base")


if __name__ == "__main__":
    main()
