"""`gptlab prepare` against the tokenizer's own batch encode on the same cores: tokens/s and peak memory.

Two tokenizers: GPT-2's BPE through tiktoken (`--tokenizer gpt2`, peer `encode_ordinary_batch`) and a `tokenizers`
byte-level BPE (`--tokenizer-from DIR`, peer `encode_batch_fast`): GPT-2's vocabulary and merges loaded into
`tokenizers` from `--gpt2-files` (encoder.json + vocab.bpe; default ../shared/data/gpt2), else one trained on the
source text.

The corpus is varied text of `--mb` megabytes (the issue's size: `--mb 1000`), generated from tiny Shakespeare with
a seeded RNG: its words drawn at random (one in ten glued to another, so the words are not a small set any cache
holds), its line lengths and blank lines kept. It is written once to `--corpus-dir` (default /tmp) and reused.
The peers read the same file in the same ~1 MiB-character chunks and encode `--workers` of them per batch call:
the tokenizer alone, no scan, no writing. gptlab's figure is the whole `prepare` in its own process (the scan that
hashes and validates the input, encoding in its process pool, writing the token files), so the ratio is what the
pipeline around the tokenizer costs. Rounds alternate the contenders; medians. gptlab's peak RSS (its process and
its workers) at `--mb` and at `--small-mb` (prepared once more per tokenizer) shows whether memory grows with
the input.

    python benchmarks/prepare_throughput.py [--mb 1000] [--small-mb 100] [--workers 2] [--rounds 2]
        [--tokenizers gpt2 hf] [--shard-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
sys.path.insert(0, str(REPO / "benchmarks"))

from timing import loadavg  # noqa: E402

GLUE = 0.1  # share of words glued to the next drawn word
BLOCK_WORDS = 1 << 20


def make_corpus(path: Path, megabytes: int, source: Path, seed: int) -> None:
    """`megabytes` MB of lines of words drawn from `source` (seeded), written to `path` through a temporary file."""
    text = source.read_text(encoding="utf-8")
    lines = text.split("\n")
    words = np.array([w for line in lines for w in line.split()], dtype=object)
    # each word ends its line with the source's odds; a line after it is blank with the source's odds
    ends = sum(1 for line in lines if line.split()) / len(words)
    blank = sum(1 for line in lines if not line.split()) / len(lines)
    rng = np.random.default_rng(seed)
    target = megabytes * 1_000_000
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        written = 0
        while written < target:
            w = words[rng.integers(len(words), size=BLOCK_WORDS)]
            glued = rng.random(BLOCK_WORDS) < GLUE
            w[glued] = w[glued] + words[rng.integers(len(words), size=int(glued.sum()))]
            u = rng.random(BLOCK_WORDS)
            sep = np.where(u < ends * blank, "\n\n", np.where(u < ends, "\n", " ")).astype(object)
            block = "".join((w + sep).tolist())
            written += f.write(block[: target - written])  # ASCII text: one character per byte
        f.write("\n")
    os.replace(tmp, path)


def corpus_file(directory: Path, megabytes: int, source: Path, seed: int) -> Path:
    path = directory / f"gptlab-prepare-corpus-{megabytes}MB-seed{seed}.txt"
    if not path.is_file():
        t0 = time.perf_counter()
        make_corpus(path, megabytes, source, seed)
        print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
    return path


def hf_tokenizer_dir(out: Path, gpt2_files: Path, source: Path) -> Path:
    """A `tokenizers` byte-level BPE saved where `--tokenizer-from` reads it: GPT-2's if its files are there."""
    from gptlab.tokenizer import HFTokenizer

    if (gpt2_files / "encoder.json").is_file() and (gpt2_files / "vocab.bpe").is_file():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.BPE.from_file(str(gpt2_files / "encoder.json"), str(gpt2_files / "vocab.bpe")))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        HFTokenizer(tok, "hf", eot_id=tok.token_to_id("<|endoftext|>")).save(out)
    else:
        from gptlab.data.text_stream import chunk_text, iter_file_text

        HFTokenizer.train(chunk_text(iter_file_text(source)), 8192).save(out)
    return out


def _chunks(corpus: Path, workers: int) -> Iterator[list[str]]:
    from gptlab.data.text_stream import chunk_text, iter_file_text

    batch = []
    for chunk in chunk_text(iter_file_text(corpus)):
        batch.append(chunk)
        if len(batch) == workers:
            yield batch
            batch = []
    if batch:
        yield batch


def peer_encoder(kind: str, tok_dir: Path) -> tuple[str, Callable[[list[str]], int]]:
    """(name, encode a batch -> its token count) of the tokenizer's own batch encode."""
    from gptlab.tokenizer import load_tokenizer

    if kind == "gpt2":
        enc = load_tokenizer(tok_dir)._enc
        return "tiktoken encode_ordinary_batch", lambda batch: sum(
            map(len, enc.encode_ordinary_batch(batch, num_threads=len(batch))))
    tok = load_tokenizer(tok_dir)._tok
    return "tokenizers encode_batch_fast", lambda batch: sum(
        len(e.ids) for e in tok.encode_batch_fast(batch, add_special_tokens=False))


def peer_tokens_per_sec(encode: Callable[[list[str]], int], corpus: Path, workers: int) -> tuple[float, int]:
    t0, n = time.perf_counter(), 0
    for batch in _chunks(corpus, workers):
        n += encode(batch)
    return n / (time.perf_counter() - t0), n


def tree_rss_kib(root: int) -> int:
    """Resident memory of process `root` and all its descendants (the pool's workers are the forkserver's
    children, which `getrusage(RUSAGE_CHILDREN)` never sees), in KiB, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total


def gptlab_tokens_per_sec(corpus: Path, out: Path, tok_dir: Path, workers: int,
                          shard_tokens: int | None) -> tuple[float, int, int]:
    """Run `gptlab prepare` in its own process: (tokens/s, tokens, peak RSS of it and its workers in KiB, sampled
    every 0.2 s)."""
    shutil.rmtree(out, ignore_errors=True)
    code = (
        "import json, time\n"
        "from gptlab.data import prepare\n"
        "if __name__ == '__main__':\n"
        "    t0 = time.perf_counter()\n"
        f"    m = prepare([{str(corpus)!r}], {str(out)!r}, tokenizer=None, tokenizer_from={str(tok_dir)!r}, "
        f"workers={workers}, shard_tokens={shard_tokens!r})\n"
        "    print(json.dumps([m['train_tokens'] + m['val_tokens'], time.perf_counter() - t0]))\n"
    )
    env = {**os.environ, "GPTLAB_NO_PROGRESS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss_kib(proc.pid))
        time.sleep(0.2)
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"gptlab prepare failed: {stderr[-2000:]}")
    shutil.rmtree(out, ignore_errors=True)
    tokens, seconds = json.loads(stdout.strip().splitlines()[-1])
    return tokens / seconds, tokens, peak


def compare(kind: str, tok_dir: Path, corpus: Path, small: Path | None, tmp: Path, args: argparse.Namespace) -> None:
    name, encode = peer_encoder(kind, tok_dir)
    peer, ours, rss = [], [], 0
    for r in range(args.rounds):
        tps, n_peer = peer_tokens_per_sec(encode, corpus, args.workers)
        peer.append(tps)
        tps, n_ours, peak = gptlab_tokens_per_sec(corpus, tmp / "out", tok_dir, args.workers, args.shard_tokens)
        ours.append(tps)
        rss = max(rss, peak)
        print(f"  round {r + 1} (load {loadavg()}): {name} {peer[-1]:,.0f} tokens/s ({n_peer:,} tokens), gptlab "
              f"prepare {ours[-1]:,.0f} tokens/s ({n_ours:,} tokens)")
    a, b = statistics.median(ours), statistics.median(peer)
    line = (f"{kind}: gptlab prepare {a:,.0f} tokens/s, {name} {b:,.0f} tokens/s: ratio {a / b:.2f}x; "
            f"peak RSS of prepare and its workers {rss / 1024:.0f} MiB at {args.mb} MB")
    if small is not None:
        _, _, small_rss = gptlab_tokens_per_sec(small, tmp / "out", tok_dir, args.workers, args.shard_tokens)
        line += f", {small_rss / 1024:.0f} MiB at {args.small_mb} MB"
    print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=200, help="corpus size in MB (the issue's: 1000)")
    ap.add_argument("--small-mb", type=int, default=100, help="the second size whose peak RSS is compared (0: none)")
    ap.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokenizers", nargs="+", choices=["gpt2", "hf"], default=["gpt2", "hf"])
    ap.add_argument("--shard-tokens", type=int, help="prepare into shards of this many tokens")
    ap.add_argument("--source", type=Path, help="the text whose words are drawn (default: tiny Shakespeare)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus-dir", type=Path, default=Path(tempfile.gettempdir()),
                    help="where the generated corpora are kept between runs")
    ap.add_argument("--gpt2-files", type=Path, default=SHARED / "gpt2",
                    help="encoder.json + vocab.bpe for the `tokenizers` BPE (else one is trained on the source)")
    args = ap.parse_args()
    if args.source is None:
        from gptlab.data import fetch_shakespeare

        args.source = fetch_shakespeare()
    corpus = corpus_file(args.corpus_dir, args.mb, args.source, args.seed)
    small = corpus_file(args.corpus_dir, args.small_mb, args.source, args.seed) if args.small_mb else None
    print(f"corpus {corpus.stat().st_size / 1e6:.0f} MB, {args.workers} workers, {os.cpu_count()} CPUs, "
          f"load {loadavg()}")
    with tempfile.TemporaryDirectory(prefix="gptlab-prepare-bench-") as tmp:
        for kind in args.tokenizers:
            tok_dir = Path(tmp) / f"tok-{kind}"
            if kind == "gpt2":
                from gptlab.tokenizer import GPT2Tokenizer

                GPT2Tokenizer().save(tok_dir)
            else:
                hf_tokenizer_dir(tok_dir, args.gpt2_files, args.source)
            compare(kind, tok_dir, corpus, small, Path(tmp), args)


if __name__ == "__main__":
    main()
