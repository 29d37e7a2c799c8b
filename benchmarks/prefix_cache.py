"""Time to first token in a long chat, with gptlab's prefix cache and without it (`ChatSession(prefix_cache_mb=0)`).

A chat of 8 turns over a 1,500-token system prompt (issue 25's target: turns 2-8 at least 5x faster to their first
token with the cache). Random weights of SmolLM2-135M's shape by default (the preset: 30 layers, width 576, 9 query
and 3 key/value heads, SwiGLU 1536; context 4096) and a character vocabulary, so that 1,500 characters are 1,500 tokens;
greedy replies of up to 32 tokens. Time to first token: from `send` (the prompt rendered and encoded) to the end
of the engine's prefill, which samples the first token. Without the cache every turn prefills the whole
conversation; with it, turn 1 prefills it (and keeps its blocks), and each later turn only what the one before did
not compute.

Each setting runs in a process of its own, in its own session at the highest group priority where root
(`timing.run_timed`), the settings alternating over --rounds; the median over turns 2-8 of the median round
counts, and the ratio without / with is printed. On a shared machine say so beside the figures:

    OMP_NUM_THREADS=2 python benchmarks/prefix_cache.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import sys
import time
from pathlib import Path

from timing import cpu_flags, loadavg, run_timed  # benchmarks/ is on sys.path when a benchmark runs as a script

TURNS = ("Hello, who are you?", "What can you do for me today?", "Tell me about the weather.",
         "And what about tomorrow?", "Why is that so?", "Can you say it in fewer words?", "Thank you kindly.",
         "Goodbye for now.")
WORDS = ("the", "assistant", "answers", "politely", "and", "never", "reveals", "secret", "rules", "of", "this",
         "service", "users", "may", "ask", "about", "weather", "travel", "food", "history", "science", "with")


def system_prompt(tokens: int) -> str:
    rng = random.Random(0)
    text = ""
    while len(text) < tokens:
        text += rng.choice(WORDS) + " "
    return text[:tokens]


def child(args: argparse.Namespace) -> None:
    """One chat of len(TURNS) turns; prints {"ttft": [s per turn], "prefilled": [...], "hit_rate": ...}."""
    import torch

    from gptlab import GPT, GPTConfig
    from gptlab.generation import ChatSession, Engine, SamplingParams
    from gptlab.tokenizer import CharTokenizer

    system = system_prompt(args.system_tokens)
    tokenizer = CharTokenizer.from_text(string.printable)
    torch.manual_seed(0)
    config = GPTConfig.preset("smollm2-135m", vocab_size=tokenizer.vocab_size, block_size=4096, n_layer=args.layers)
    model = GPT(config).eval().to(getattr(torch, args.dtype))
    params = SamplingParams(temperature=0, max_new_tokens=args.reply_tokens)
    session = ChatSession(model, tokenizer, params, system=system, prefix_cache_mb=args.prefix_cache_mb)
    marks: list[float] = []  # when each prefill (which samples the first token) ended
    prefilled: list[int] = []
    add = Engine.add

    def timed_add(engine: Engine, gens: list) -> None:
        before = engine.prefix_cache.stats().hit_tokens if engine.prefix_cache else 0
        add(engine, gens)
        marks.append(time.perf_counter())
        after = engine.prefix_cache.stats().hit_tokens if engine.prefix_cache else 0
        prefilled.append(len(gens[0].prompt_ids) - (after - before))

    Engine.add = timed_add  # type: ignore[method-assign]
    ttft = []
    for text in TURNS:
        start = time.perf_counter()
        session.ask(text)
        ttft.append(marks[-1] - start)
    stats = session.prefix_cache.stats() if session.prefix_cache else None
    print(json.dumps({"ttft": ttft, "prefilled": prefilled, "hit_rate": stats.hit_rate if stats else 0.0}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--prefix-cache-mb", type=float, default=512.0, help="the cache's budget in the timed setting")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    from gptlab.hardware import cpu_name

    print(f"CPU: {cpu_name()} ({cpu_flags()}); {args.layers} layers, {args.dtype}, system prompt "
          f"{args.system_tokens} tokens, {len(TURNS)} turns, replies <= {args.reply_tokens} tokens")
    base = [sys.executable, str(Path(__file__).resolve()), "--child", "--system-tokens", str(args.system_tokens),
            "--reply-tokens", str(args.reply_tokens), "--layers", str(args.layers), "--dtype", args.dtype]
    runs: dict[str, list[dict]] = {"with": [], "without": []}
    for r in range(args.rounds):
        for name, mb in (("with", args.prefix_cache_mb), ("without", 0.0)):
            _, done = run_timed([*base, "--prefix-cache-mb", str(mb)])
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append(result)
            print(f"round {r + 1} {name:>7} the cache (load {loadavg()}): first token per turn (ms) "
                  + " ".join(f"{t * 1000:.0f}" for t in result["ttft"])
                  + f"; prefilled tokens {result['prefilled']}")
    medians = {}
    for name, results in runs.items():
        per_round = [statistics.median(res["ttft"][1:]) for res in results]
        medians[name] = statistics.median(per_round)
        print(f"{name:>7} the cache: median first token on turns 2-{len(TURNS)}: {medians[name] * 1000:.0f} ms"
              + (f" (hit rate {results[-1]['hit_rate']:.0%} of looked-up prompt tokens)" if name == "with" else ""))
    print(f"ratio without / with: {medians['without'] / medians['with']:.1f}x (target >= 5x)")


if __name__ == "__main__":
    main()
