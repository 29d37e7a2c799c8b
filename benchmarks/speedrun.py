"""Run the CPU recipes end to end and print whole-split validation loss and process wall time; with --nanogpt,
beside nanoGPT's README CPU recipe on the same machine, and the start-up of sampling one token from each.

    python benchmarks/speedrun.py                          # speedrun_cpu.toml, 3 runs
    python benchmarks/speedrun.py --recipe configs/shakespeare_char_1min.toml --runs 1
    python benchmarks/speedrun.py --seeds 1337 1 2 3 4     # one run per seed: the record holds on every one
    python benchmarks/speedrun.py --nanogpt /tmp/nanogpt   # + nanoGPT's recipe, interleaved, and the ratios

Each run is a fresh `gptlab train` process (start-up, imports, training, the final whole-split evaluation and the
checkpoint all count), timed from outside, in its own session with raised priority and Python's bytecode cache
(benchmarks/timing.py), after one untimed step (a first run builds the kernels and writes that cache). Data is
prepared once from shared/data/tinyshakespeare.txt (character level, first 90% train).

With --nanogpt PATH (a nanoGPT checkout, copied to a temporary directory and prepared with its own prepare.py on
the same text), each round also runs nanoGPT's README CPU recipe (`python train.py config/train_shakespeare_char.py
--device=cpu --compile=False ...`, 2000 iterations), whose checkpoint is then scored on the whole validation split
as gptlab scores its own (benchmarks/nanogpt_peer.py). Printed: the medians, whether gptlab's loss is at or below
nanoGPT's, and the speed-up nanoGPT wall / gptlab wall. Then start-up: `gptlab sample RUN --max-new-tokens 1`
against nanoGPT's `python sample.py --num_samples=1 --max_new_tokens=1` on their checkpoints, --startup-rounds
interleaved, medians and the ratio. Timing noise on a shared 2-core machine is large: repeat and read the medians.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import nanogpt_peer
from timing import loadavg, run_timed

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


def prepare(data_dir: Path) -> None:
    if not (data_dir / "meta.json").is_file():
        subprocess.run([sys.executable, "-m", "gptlab.cli", "prepare", str(SHAKESPEARE), "--tokenizer", "char",
                        "--out", str(data_dir)], check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def run_once(recipe: Path, data_dir: Path, out: Path, extra: list[str]) -> tuple[float, float, int]:
    """(val loss, wall seconds, steps) of one `gptlab train` process."""
    wall, _ = run_timed([sys.executable, "-m", "gptlab.cli", "train", str(recipe), "--data", str(data_dir), "--out",
                         str(out), "--quiet", *extra], cwd=REPO)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "val_loss" in r][-1]
    return last["val_loss"], wall, last["step"]


def run_nanogpt(checkout: Path) -> tuple[float, float, int]:
    """(whole-split val loss, wall seconds, iteration of its checkpoint) of nanoGPT's CPU recipe."""
    shutil.rmtree(checkout / nanogpt_peer.OUT_DIR, ignore_errors=True)
    wall, _ = run_timed(nanogpt_peer.train_command(), cwd=checkout)
    scored = nanogpt_peer.whole_split_val(checkout)
    return scored["val_loss"], wall, scored["iter"]


def startup(gptlab_run: Path, nanogpt: Path, rounds: int) -> None:
    """Process wall time to sample one token, gptlab against nanoGPT, interleaved."""
    times: dict[str, list[float]] = {"gptlab": [], "nanoGPT": []}
    for r in range(rounds):
        load = loadavg()
        times["gptlab"].append(run_timed([sys.executable, "-m", "gptlab.cli", "sample", str(gptlab_run),
                                          "--prompt", "\n", "--max-new-tokens", "1"], cwd=REPO)[0])
        times["nanoGPT"].append(run_timed(nanogpt_peer.sample_command(1), cwd=nanogpt)[0])
        print(f"start-up round {r + 1} (load {load}): gptlab sample {times['gptlab'][-1]:.2f}s, "
              f"nanoGPT sample.py {times['nanoGPT'][-1]:.2f}s", flush=True)
    g, n = statistics.median(times["gptlab"]), statistics.median(times["nanoGPT"])
    print(f"start-up, one token: gptlab median {g:.2f}s, nanoGPT median {n:.2f}s: gptlab takes {g / n:.2f}x "
          f"nanoGPT's time (target <= 1.0)")


def summary(name: str, results: list[tuple[float, float]]) -> tuple[float, float]:
    vals, walls = [v for v, _ in results], [w for _, w in results]
    print(f"{name}: val median {statistics.median(vals):.4f} (max {max(vals):.4f}), wall median "
          f"{statistics.median(walls):.2f}s (min {min(walls):.2f}s, max {max(walls):.2f}s) over {len(results)} run(s)")
    return statistics.median(vals), statistics.median(walls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(REPO / "configs" / "speedrun_cpu.toml"))
    parser.add_argument("--runs", type=int, default=3, help="rounds with the recipe's seed (not with --seeds)")
    parser.add_argument("--seeds", type=int, nargs="*", help="one run per seed")
    parser.add_argument("--data", help="a prepared char-level DATA_DIR (default: prepared into a temp dir)")
    parser.add_argument("--target", type=float, default=1.8857,
                        help="whole-split val loss each run must reach, printed as PASS/FAIL (default: nanoGPT's "
                             "README CPU recipe's reported 1.8857)")
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout: run its README CPU recipe beside gptlab's")
    parser.add_argument("--startup-rounds", type=int, default=5, help="with --nanogpt: start-up rounds")
    args, extra = parser.parse_known_args()

    with tempfile.TemporaryDirectory(prefix="gptlab-speedrun-") as tmp:
        data_dir = Path(args.data) if args.data else Path(tmp) / "data"
        prepare(data_dir)
        nanogpt = None
        if args.nanogpt:
            nanogpt = nanogpt_peer.copy_checkout(args.nanogpt, Path(tmp))
            nanogpt_peer.prepare_char_data(nanogpt, SHAKESPEARE)
        seeds = args.seeds or [None] * args.runs
        # one untimed step first: what a first run alone does (build the kernels, write the bytecode cache)
        run_once(Path(args.recipe), data_dir, Path(tmp) / "warm-up", [*extra, "--max-steps", "1",
                                                                     "--warmup-steps", "0"])
        results, peer = [], []
        for i, seed in enumerate(seeds):
            seed_args = ["--seed", str(seed)] if seed is not None else []
            load = loadavg()
            val, wall, steps = run_once(Path(args.recipe), data_dir, Path(tmp) / f"run{i}", extra + seed_args)
            results.append((val, wall))
            ok = "" if args.target is None else ("  PASS" if val <= args.target else "  FAIL")
            print(f"run {i + 1}{f' seed {seed}' if seed is not None else ''} (load {load}): val {val:.4f}  "
                  f"wall {wall:.2f}s  steps {steps}{ok}", flush=True)
            if nanogpt:
                load = loadavg()
                val, wall, it = run_nanogpt(nanogpt)
                peer.append((val, wall))
                print(f"  nanoGPT CPU recipe (load {load}): whole-split val {val:.4f} (checkpoint of iteration {it})  "
                      f"wall {wall:.2f}s", flush=True)
        g_val, g_wall = summary(Path(args.recipe).name, results)
        passed = sum(val <= args.target for val, _ in results)
        print(f"{passed} of {len(results)} run(s) at or below val {args.target}")
        if nanogpt:
            n_val, n_wall = summary("nanoGPT CPU recipe", peer)
            print(f"gptlab's loss {'<=' if g_val <= n_val else '>'} nanoGPT's ({g_val:.4f} vs {n_val:.4f}); "
                  f"speed-up nanoGPT wall / gptlab wall: {n_wall / g_wall:.1f}x (target >= 20)")
            startup(Path(tmp) / "run0", nanogpt, args.startup_rounds)


if __name__ == "__main__":
    main()
