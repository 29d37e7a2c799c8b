"""Run the CPU recipes end to end and print whole-split validation loss and process wall time.

    python benchmarks/speedrun.py                          # speedrun_cpu.toml, 3 runs
    python benchmarks/speedrun.py --recipe configs/shakespeare_char_1min.toml --runs 1
    python benchmarks/speedrun.py --seeds 1 2 3 4 5        # one run per seed

Each run is a fresh `gptlab train` process (start-up, imports, training, the final whole-split evaluation and the
checkpoint all count), timed from outside. Data is prepared once from shared/data/tinyshakespeare.txt
(character level, first 90% train). Timing noise on a shared 2-core machine is large: repeat and read the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


def prepare(data_dir: Path) -> None:
    if not (data_dir / "meta.json").is_file():
        subprocess.run([sys.executable, "-m", "gptlab.cli", "prepare", str(SHAKESPEARE), "--tokenizer", "char",
                        "--out", str(data_dir)], check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def run_once(recipe: Path, data_dir: Path, out: Path, extra: list[str]) -> tuple[float, float, int]:
    """(val loss, wall seconds, steps) of one `gptlab train` process."""
    cmd = [sys.executable, "-m", "gptlab.cli", "train", str(recipe), "--data", str(data_dir), "--out", str(out),
           "--quiet", *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "val_loss" in r][-1]
    return last["val_loss"], wall, last["step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(REPO / "configs" / "speedrun_cpu.toml"))
    parser.add_argument("--runs", type=int, default=3, help="runs with the recipe's seed (ignored with --seeds)")
    parser.add_argument("--seeds", type=int, nargs="*", help="one run per seed")
    parser.add_argument("--data", help="a prepared char-level DATA_DIR (default: prepared into a temp dir)")
    parser.add_argument("--target", type=float, default=None, help="val loss to reach (printed as pass/fail)")
    args, extra = parser.parse_known_args()

    with tempfile.TemporaryDirectory(prefix="gptlab-speedrun-") as tmp:
        data_dir = Path(args.data) if args.data else Path(tmp) / "data"
        prepare(data_dir)
        seeds = args.seeds or [None] * args.runs
        results = []
        for i, seed in enumerate(seeds):
            seed_args = ["--seed", str(seed)] if seed is not None else []
            val, wall, steps = run_once(Path(args.recipe), data_dir, Path(tmp) / f"run{i}", extra + seed_args)
            results.append((val, wall))
            ok = "" if args.target is None else ("  PASS" if val <= args.target else "  FAIL")
            print(f"run {i + 1}{f' seed {seed}' if seed is not None else ''}: val {val:.4f}  wall {wall:.2f}s  "
                  f"steps {steps}{ok}", flush=True)
    vals, walls = [v for v, _ in results], [w for _, w in results]
    print(f"{Path(args.recipe).name}: val median {statistics.median(vals):.4f} (max {max(vals):.4f}), "
          f"wall median {statistics.median(walls):.2f}s (min {min(walls):.2f}s, max {max(walls):.2f}s) "
          f"over {len(results)} run(s)")


if __name__ == "__main__":
    main()
