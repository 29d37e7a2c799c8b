"""`gptlab prepare --tokenizer gpt2` against tiktoken's own `encode_ordinary_batch` on the same cores: tokens/s.

The corpus is tiny Shakespeare repeated up to `--mb` megabytes (default 200; the issue's figure is at 1 GB:
`--mb 1024`). The peer reads the same file in the same ~1 MiB-character chunks and encodes `--workers` of them at
a time with `encode_ordinary_batch(num_threads=workers)`: the tokenizer alone, no scan, no writing. gptlab's
figure is the whole `prepare` (the scan that hashes and validates the input, encoding in its process pool, writing
the token files), so the ratio is what the pipeline around the tokenizer costs. Rounds alternate the two; medians.
Peak memory (max RSS of this process and of the worker processes) shows the stream stays bounded.

    python benchmarks/prepare_throughput.py [--mb 200] [--workers 4] [--rounds 2] [--shard-tokens N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from timing import loadavg  # noqa: E402


def make_corpus(path: Path, megabytes: int, source: Path) -> None:
    """`source` repeated (whole copies, then a cut after a newline) to `megabytes` MB."""
    text = source.read_bytes()
    target = megabytes * 1_000_000
    with open(path, "wb") as f:
        written = 0
        while written + len(text) <= target:
            f.write(text)
            written += len(text)
        rest = text[: target - written]
        f.write(rest[: rest.rfind(b"\n") + 1])


def tiktoken_tokens_per_sec(corpus: Path, workers: int) -> tuple[float, int]:
    from gptlab.data.text_stream import chunk_text, iter_file_text
    from gptlab.tokenizer import GPT2Tokenizer

    enc = GPT2Tokenizer()._enc
    t0, n, batch = time.perf_counter(), 0, []
    for chunk in chunk_text(iter_file_text(corpus)):
        batch.append(chunk)
        if len(batch) == workers:
            n += sum(map(len, enc.encode_ordinary_batch(batch, num_threads=workers)))
            batch = []
    if batch:
        n += sum(map(len, enc.encode_ordinary_batch(batch, num_threads=workers)))
    return n / (time.perf_counter() - t0), n


def gptlab_tokens_per_sec(corpus: Path, out: Path, workers: int, shard_tokens: int | None) -> tuple[float, int, int]:
    """Run `gptlab prepare` in its own process: (tokens/s, tokens, peak RSS of it and its workers in KiB)."""
    shutil.rmtree(out, ignore_errors=True)
    code = (
        "import json, resource, sys, time\n"
        "from gptlab.data import prepare\n"
        "t0 = time.perf_counter()\n"
        f"m = prepare([{str(corpus)!r}], {str(out)!r}, tokenizer='gpt2', workers={workers}, "
        f"shard_tokens={shard_tokens!r})\n"
        "dt = time.perf_counter() - t0\n"
        "rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
        "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "print(json.dumps([m['train_tokens'] + m['val_tokens'], dt, rss]))\n"
    )
    env = {**os.environ, "GPTLAB_NO_PROGRESS": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    import json

    tokens, seconds, rss = json.loads(result.stdout.strip().splitlines()[-1])
    return tokens / seconds, tokens, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=200, help="corpus size in MB (the issue's: 1024)")
    ap.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shard-tokens", type=int, help="prepare into shards of this many tokens")
    ap.add_argument("--source", type=Path, help="the text to repeat (default: tiny Shakespeare)")
    args = ap.parse_args()
    if args.source is None:
        from gptlab.data import fetch_shakespeare

        args.source = fetch_shakespeare()
    with tempfile.TemporaryDirectory(prefix="gptlab-prepare-bench-") as tmp:
        corpus = Path(tmp) / "corpus.txt"
        make_corpus(corpus, args.mb, args.source)
        print(f"corpus {corpus.stat().st_size / 1e6:.0f} MB, {args.workers} workers, {os.cpu_count()} CPUs, "
              f"load {loadavg()}")
        peer, ours, rss = [], [], 0
        for r in range(args.rounds):
            tps, n_peer = tiktoken_tokens_per_sec(corpus, args.workers)
            peer.append(tps)
            tps, n_ours, peak = gptlab_tokens_per_sec(corpus, Path(tmp) / "out", args.workers, args.shard_tokens)
            ours.append(tps)
            rss = max(rss, peak)
            print(f"round {r + 1}: tiktoken {peer[-1]:,.0f} tokens/s ({n_peer:,} tokens), gptlab prepare "
                  f"{ours[-1]:,.0f} tokens/s ({n_ours:,} tokens)")
        a, b = statistics.median(ours), statistics.median(peer)
        print(f"gptlab prepare {a:,.0f} tokens/s, tiktoken encode_ordinary_batch {b:,.0f} tokens/s: ratio "
              f"{a / b:.2f}x; peak RSS of prepare and its workers {rss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
