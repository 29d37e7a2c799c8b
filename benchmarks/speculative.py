"""Batch-1 greedy decoding with speculative decoding against the target alone (issue 25's target: >= 1.5x tokens/s at
identical output).

Two character-level models are trained by `gptlab train` on tiny Shakespeare (configs/speedrun_cpu.toml's recipe,
same data, same steps): the target (--target-layers, default 12) and a draft of --draft-layers (default 2), both of
width --width. Each prompt (lines of the play) is continued greedily by --new-tokens tokens four ways in turn: the
target alone, with the draft (`speculate=draft`), with the draft quantized (--draft-quantize, default int8: what
`gptlab sample --draft-quantize` loads), and with prompt lookup (`speculate="ngram"`), over --rounds;
every output must equal the target's own. The prompts also include an editing task: a passage, then an instruction
line, then its first words again (prompt lookup's case: the continuation repeats the input). Tokens/s per setting
(median round) and the ratios to the target alone, measured interleaved in this one process, are printed, with how
the editing prompt's output begins: a small model trained briefly does not copy the passage (tried: the same 12
layers, and 4 layers for 600 steps, on the play with as many characters again of such editing examples appended),
and prompt lookup then only gains where the output repeats itself.

The runs are kept in --work (trained once). On a shared machine say so beside the figures:

    OMP_NUM_THREADS=2 python benchmarks/speculative.py --work /tmp/spec-bench --text ../shared/data/tinyshakespeare.txt
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from timing import cpu_flags, loadavg  # benchmarks/ is on sys.path when a benchmark runs as a script

REPO = Path(__file__).resolve().parent.parent
PASSAGE = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
           "Arise, fair sun, and kill the envious moon,\nWho is already sick and pale with grief.\n")
PROMPTS = ("ROMEO:\n", "KING HENRY:\nWhat say you, lords?\n", "First Citizen:\n",
           PASSAGE + "\nThe same, again:\n\n" + PASSAGE[:40])


def gptlab(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "gptlab.cli", *args], check=True, cwd=REPO)


def train(work: Path, text: str, layers: int, width: int, steps: int) -> Path:
    """A run of `layers` layers on the prepared data (trained once per setting)."""
    data = work / "data"
    if not (data / "meta.json").exists():
        gptlab("prepare", text, "--tokenizer", "char", "--out", str(data))
    run = work / f"l{layers}-w{width}-s{steps}"
    if not (run / "checkpoints").exists():
        gptlab("train", "configs/speedrun_cpu.toml", "--data", str(data), "--out", str(run), "--n_layer",
               str(layers), "--n_embd", str(width), "--n_head", str(max(1, width // 64)), "--block_size", "256",
               "--max_steps", str(steps))
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="where the data and the two runs are kept")
    p.add_argument("--text", default="shakespeare", help="the corpus (a text file, or a corpus name)")
    p.add_argument("--target-layers", type=int, default=12)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--draft-quantize", choices=("int8", "int4"), default="int8",
                   help="the quantized draft's weights (the plain draft keeps the checkpoint's fp32)")
    args = p.parse_args()

    import torch

    from gptlab.generation import Engine, SamplingParams
    from gptlab.hardware import cpu_name
    from gptlab.loading import load_model

    args.work.mkdir(parents=True, exist_ok=True)
    target, tok = load_model(train(args.work, args.text, args.target_layers, args.width, args.steps))
    draft_run = train(args.work, args.text, args.draft_layers, args.width, args.steps)
    draft, _ = load_model(draft_run)
    quantized, _ = load_model(draft_run, quantize=args.draft_quantize)
    print(f"CPU: {cpu_name()} ({cpu_flags()}); threads {torch.get_num_threads()}; target {args.target_layers} layers, "
          f"draft {args.draft_layers}, width {args.width}, {args.steps} steps; greedy, {args.new_tokens} new tokens, "
          f"{args.draft_tokens} guesses per check")
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eot=True)
    settings = {"target alone": None, "draft model": draft, f"draft {args.draft_quantize}": quantized,
                "prompt lookup": "ngram"}
    engines = {name: Engine(target, 1, tokenizer=tok, speculate=spec, draft_tokens=args.draft_tokens)
               for name, spec in settings.items()}
    rates: dict[str, dict[int, list[float]]] = {name: {i: [] for i in range(len(PROMPTS))} for name in settings}
    for r in range(args.rounds):
        for i, prompt in enumerate(PROMPTS):
            outputs = {}
            for name, engine in engines.items():  # interleaved: each prompt's settings back to back
                gen = engine.prepare(tok.encode(prompt), params)
                start = time.perf_counter()
                engine.run([gen])
                rates[name][i].append(len(gen.token_ids) / (time.perf_counter() - start))
                outputs[name] = gen.token_ids
            if any(out != outputs["target alone"] for out in outputs.values()):
                raise SystemExit(f"prompt {i}: a speculative output differs from the target's own")
            if r == 0 and i == len(PROMPTS) - 1:  # whether the target does the editing task (copies the passage)
                print("the editing prompt's output begins: " + repr(tok.decode(outputs["target alone"])[:120]))
        print(f"round {r + 1} done (load {loadavg()})")
    for name, engine in engines.items():
        stats = engine.speculator.stats if engine.speculator else None
        accepted = (f"; {stats.accepted:,} of {stats.proposed:,} guesses accepted "
                    f"({stats.accepted / max(1, stats.proposed):.0%})") if stats else ""
        print(f"{name:>13}: tokens/s per prompt "
              + " ".join(f"{statistics.median(rates[name][i]):.0f}" for i in range(len(PROMPTS))) + accepted)
    for name in list(settings)[1:]:
        ratios = [statistics.median(rates[name][i]) / statistics.median(rates["target alone"][i])
                  for i in range(len(PROMPTS))]
        print(f"{name} / target alone: " + " ".join(f"{x:.2f}x" for x in ratios)
              + f" (prompts 1-{len(PROMPTS) - 1}: Shakespeare; last: editing) (target >= 1.5x)")


if __name__ == "__main__":
    main()
