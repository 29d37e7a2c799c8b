"""Generation throughput: gptlab's engine against peers (transformers, llama.cpp, CTranslate2), same weights.

A model of GPT-2 124M's shape (`--family gpt2`) or SmolLM2-135M's (`--family llama`: 30 layers, width 576, 9 query
and 3 key/value heads, SwiGLU 1536, GPT-2's vocabulary), random weights, a 16-token prompt, 256 new tokens, greedy,
2 threads, at batch 1 and 32. Every peer gets gptlab's own weights: transformers and CTranslate2 through
`gptlab.interop.save_hf` (CTranslate2's converter reads that directory), llama.cpp through gptlab's GGUF export
(`save_gguf`, in the setting's dtype: bf16 or f32; for the int8 / int4 settings llama.cpp's q8_0 / q4_0 beside
gptlab's `--quantize int8` / `int4` (group 32), and CTranslate2's int8). llama.cpp runs two ways: llama-cpp-python's
low-level bindings decode a batch the way its `batched` example does (one `llama_batch` holding a token of each of
the B sequences per step, greedy by an argmax over the returned logits), and, with `--llama-bench BUILD_DIR`,
llama.cpp's own `llama-bench` (batch 1) and `llama-batched-bench` (batch B) programs, which report generation
tokens/s without Python around them. Tokens/s = batch x new tokens / wall time of the whole call (prefill included)
for the in-process contenders. Each contender runs in a process of its own (same seed, same random weights), so no
engine's idle threads (llama.cpp's spin-waiting pool) compete with another's timing. Contenders alternate over
--rounds, so a busy spell on a shared machine hits all of them; the median round counts, and the ratio gptlab /
peer is printed. Nothing is asserted: timings are noisy.

Printed too: the CPU's model and vector flags, which kernel ran each of gptlab's Linears and which decode step
(`Engine.kernels`), how many ATen ops the profiler counts in one of gptlab's decode steps (framework time, counted
rather than timed: it does not move with the machine's load), and at batch 1 the share of the memory-bandwidth
limit each contender reaches (weights read per token / a read probe's GB/s: a batch-1 step reads every weight
once; >= 85% is where the best engines stand).

Peers are optional (the `bench` extra): a missing one is skipped with a message. On a shared machine run it in
its own session with raised priority (see the README):

    OMP_NUM_THREADS=2 setsid sh -c 'echo -20 > /proc/self/autogroup; exec python benchmarks/generate_throughput.py \
        --family llama --peers llamacpp --llama-bench LLAMA_CPP/build --settings 1:bfloat16,1:int8,1:int4,32:bfloat16'

GPT-2's tokenizer is needed for the GGUF file (TIKTOKEN_CACHE_DIR for an offline machine).
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from decode_peers import DTYPES, CTranslate2, LlamaBench, LlamaCpp, Transformers
from timing import cpu_flags, loadavg  # benchmarks/ is on sys.path when a benchmark runs as a script

from gptlab import GPT, GPTConfig, generate, quantize_model
from gptlab.generation import Engine
from gptlab.generation.api import PACK_MIN_TOKENS
from gptlab.hardware import cpu_name

QUANTIZED = ("int8", "int4")  # weight-only, gptlab's `--quantize` (int4 in groups of 32); other weights fp32


class Gptlab:
    name = "gptlab"

    def __init__(self, model: GPT) -> None:
        self.source, self.model = model, model

    def setting(self, dtype: str, batch: int) -> None:
        if dtype in QUANTIZED:  # a quantized copy of the fp32 model (the source stays as it is)
            self.model = quantize_model(copy.deepcopy(self.source.float()), dtype)
        else:
            self.model = self.source.to(DTYPES[dtype])  # fp32 -> bf16 -> fp32 rounds the weights: harmless here

    def generate(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        return generate(self.model, idx, n, temperature=0)

    def kernels(self, batch: int) -> str:
        # (a cache of a few positions: the report does not depend on its length, and a full-context one for 32
        # rows of SmolLM2's shape took longer to zero than the timed run)
        report = Engine(self.model, batch, max_len=8).kernels()
        return (f"decode step {report['decode step']}; " + ", ".join(f"{n} x{c}" for n, c in report["linears"].items())
                + f"; {aten_ops_per_token(self.model, batch):.0f} ATen ops a decode step")


def aten_ops_per_token(model: GPT, batch: int) -> float:
    """ATen ops the profiler records per decode step (generating PACK_MIN_TOKENS tokens and 16 more: the
    difference over 16; both runs on the packed weights, as a timed run): a count of the framework's work around
    the kernels that does not depend on the machine's load."""
    from torch.profiler import ProfilerActivity, profile

    idx = torch.zeros(batch, 16, dtype=torch.long)
    counts = []
    for n in (PACK_MIN_TOKENS, PACK_MIN_TOKENS + 16):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            generate(model, idx, n, temperature=0)
        counts.append(sum(1 for e in prof.events() if e.name.startswith("aten::")))
    return (counts[1] - counts[0]) / 16


def family_config(family: str) -> GPTConfig:
    """The benchmark's model shape: GPT-2 124M, or SmolLM2-135M's Llama shape with GPT-2's vocabulary."""
    if family == "gpt2":
        return GPTConfig.preset("gpt2")
    return GPTConfig.preset("smollm2-135m", vocab_size=GPTConfig.preset("gpt2").vocab_size)


# bytes per weight each format reads (q8_0: 32 int8 + an f16 scale; q4_0: 32 nibbles + an f16 scale; gptlab's int4:
# 32 nibbles + an fp16 scale and offset; int8: an fp32 scale per row, negligible)
BYTES = {"gptlab": {"float32": 4, "bfloat16": 2, "int8": 1, "int4": 0.625},
         "llama.cpp": {"float32": 4, "bfloat16": 2, "int8": 34 / 32, "int4": 18 / 32}}


def weight_bytes(model: GPT, contender: str, dtype: str) -> float:
    """Bytes of Linear weights (every block's and the LM head) a batch-1 decode step reads."""
    table = BYTES["gptlab" if contender == "gptlab" else "llama.cpp"]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return sum(m.weight.numel() for m in linears) * table[dtype]


def read_bandwidth(threads: int) -> float:
    """Bytes/s of a sum over 1 GiB of fp32 (best of 5), at the benchmark's thread count."""
    torch.set_num_threads(threads)
    data = torch.ones(2**28)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        data.sum()
        best = max(best, data.numel() * 4 / (time.perf_counter() - t))
    return best


def make_contender(name: str, model: GPT, args: argparse.Namespace, tmp: Path) -> object:
    """gptlab or one peer, holding `model`'s weights (ImportError where the peer is not installed)."""
    if name == "gptlab":
        return Gptlab(model)
    if name == "llamacpp":
        return LlamaCpp(model, tmp, args.threads, args.prompt_len + args.new_tokens + 16)
    if name == "llama-bench":
        return LlamaBench(model, tmp, args.threads, Path(args.llama_bench))
    if name not in ("transformers", "ct2"):
        raise ValueError(name)
    from gptlab.interop import save_hf
    from gptlab.tokenizer import GPT2Tokenizer

    hf_dir = tmp / "hf"
    save_hf(model, hf_dir, GPT2Tokenizer())
    if name == "transformers":
        return Transformers(model, hf_dir, args.threads)
    return CTranslate2(model, hf_dir, args.threads, tmp)


def worker(conn, name: str, args: argparse.Namespace) -> None:  # noqa: ANN001
    """One contender in a process of its own, so that no engine's threads (llama.cpp's spin-waiting pool,
    torch's OpenMP team) run beside another's timing: it builds the same random model (same seed), then answers
    ("setting", dtype, batch) and ("generate", idx, n) -> (seconds, tokens) until ("close",)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(family_config(args.family)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            contender = make_contender(name, model, args, Path(tmp))
        except ImportError as e:
            conn.send(("missing", f"{e.name or e} is not installed (pip install 'gptlab[bench]')"))
            return
        conn.send(("ready", getattr(contender, "name", name)))
        while (msg := conn.recv())[0] != "close":
            if msg[0] == "kernels":
                conn.send(contender.kernels(*msg[1:]) if hasattr(contender, "kernels") else "")
            elif msg[0] == "rate":  # a contender that times itself (llama.cpp's own benchmark programs)
                conn.send(contender.rate(*msg[1:]))
            elif msg[0] == "setting":
                try:
                    contender.setting(*msg[1:])
                    conn.send(None)
                except (ValueError, RuntimeError) as e:  # e.g. CTranslate2 without bf16 on this CPU, or int4
                    conn.send(str(e).splitlines()[0])
            else:
                t = time.perf_counter()
                out = contender.generate(*msg[1:])
                conn.send((time.perf_counter() - t, out))
        getattr(contender, "close", lambda: None)()


class ContenderDied(RuntimeError):
    """A contender's process ended under a request (a crash in a peer's library, say)."""


class Remote:
    """The parent's handle on a worker process."""

    def __init__(self, ctx, name: str, args: argparse.Namespace) -> None:  # noqa: ANN001
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker, args=(child, name, args), daemon=True)
        self.process.start()
        status, self.name = self.conn.recv()
        self.missing = self.name if status == "missing" else None

    def ask(self, *msg: object) -> Any:
        """The worker's answer to msg; ContenderDied, with how it ended, where its process ended instead."""
        try:
            self.conn.send(msg)
            return self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self.process.join(5)
            code = self.process.exitcode
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            raise ContenderDied(f"{self.name}'s process died ({how})") from None

    def setting(self, dtype: str, batch: int) -> str | None:
        """None, or why this contender cannot run the setting."""
        return self.ask("setting", dtype, batch)

    def generate(self, idx: torch.Tensor, n: int) -> tuple[float, torch.Tensor]:
        return self.ask("generate", idx, n)

    def rate(self, idx: torch.Tensor, n: int) -> float:
        """Tokens/s over n new tokens for idx's batch (the contender's own timing where it has one)."""
        if self.name == "llama-bench":
            return self.ask("rate", idx.shape[1], n)
        return idx.shape[0] * n / self.generate(idx, n)[0]

    def kernels(self, batch: int) -> str:
        return self.ask("kernels", batch)

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(("close",))
        self.process.join()


def check_tokens(contenders: list[Remote], V: int, args: argparse.Namespace) -> None:
    """How many greedy tokens (fp32, batch 2) each peer shares with gptlab before the first difference."""
    idx = torch.randint(0, V, (2, args.prompt_len))
    contenders = [c for c in contenders if c.name != "llama-bench"]  # it reports rates, not tokens
    for c in contenders:
        c.setting("float32", 2)
    ours = contenders[0].generate(idx, args.check_tokens)[1][:, args.prompt_len :]
    for c in contenders[1:]:
        theirs = c.generate(idx, args.check_tokens)[1][:, args.prompt_len :]
        same = (ours == theirs).all(dim=0).int().cumprod(0).sum()
        print(f"greedy tokens (fp32, batch 2): {c.name} agrees with gptlab on the first {int(same)}/"
              f"{args.check_tokens}")


PEERS = ("transformers", "llamacpp", "ct2")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=["gpt2", "llama"], default="gpt2",
                    help="GPT-2 124M's shape, or SmolLM2-135M's Llama shape (GPT-2's vocabulary)")
    ap.add_argument("--settings", default="1:float32,1:bfloat16,32:bfloat16",
                    help="batch:dtype pairs to time (dtype float32, bfloat16, int8 or int4)")
    ap.add_argument("--peers", default="transformers",
                    help="comma-separated peers: transformers, llamacpp, ct2 ('' for gptlab alone)")
    ap.add_argument("--llama-bench", metavar="BUILD_DIR",
                    help="also time llama.cpp's own llama-bench / llama-batched-bench from BUILD_DIR/bin")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per setting, contenders alternating")
    ap.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared with each peer (0: none)")
    args = ap.parse_args()
    args.names = [p for p in args.peers.split(",") if p]
    for p in args.names:
        if p not in PEERS:
            raise SystemExit(f"error: --peers: unknown peer {p!r} ({', '.join(PEERS)})")
    if args.llama_bench:
        args.names.append("llama-bench")
    return args


def time_setting(contenders: list[Remote], B: int, dtype: str, V: int, args: argparse.Namespace) -> dict:
    """Median tokens/s of each contender that runs this setting, over interleaved rounds. A contender whose process
    dies (a peer's library crashing on this CPU, say) is said so and left out of this setting and the rest of the
    run (removed from `contenders`); the others go on."""
    idx = torch.randint(0, V, (B, args.prompt_len))
    running = []

    def died(c: Remote, e: ContenderDied) -> None:
        print(f"  {e} at batch {B} {dtype}: left out of the rest of the run", flush=True)
        contenders.remove(c)
        if c in running:
            running.remove(c)

    for c in list(contenders):
        try:
            problem = c.setting(dtype, B)
            if problem:
                print(f"  skipping {c.name} at batch {B} {dtype}: {problem}")
                continue
            if c.name != "llama-bench":
                # warm-up: first-call allocations, kernel selection, and weight packing (generate packs them once
                # per model from PACK_MIN_TOKENS new tokens on, as llama.cpp lays its weights out once at load)
                c.generate(idx, PACK_MIN_TOKENS)
            if c.name == "gptlab":
                print(f"  gptlab at batch {B} {dtype}: {c.kernels(B)}")
            running.append(c)
        except ContenderDied as e:
            died(c, e)
    result: dict[str, list[float]] = {c.name: [] for c in running}
    for r in range(args.rounds):
        load = loadavg()
        order = running[r % len(running):] + running[: r % len(running)] if running else []  # who goes first rotates
        for c in order:
            try:
                rate = c.rate(idx, args.new_tokens)
            except ContenderDied as e:
                died(c, e)
                result.pop(c.name)
                continue
            result[c.name].append(rate)
            print(f"  round {r + 1} (load {load}) batch {B:>3} {dtype:>8} {c.name:>12}: {rate:8.1f} tokens/s",
                  flush=True)
    return {k: statistics.median(v) for k, v in result.items()}


def main() -> None:
    args = parse_args()
    torch.manual_seed(1)
    config = family_config(args.family)
    V = config.vocab_size
    bandwidth = read_bandwidth(args.threads)
    print(f"{args.family} shape ({config.n_layer} layers, width {config.n_embd}), random weights; prompt "
          f"{args.prompt_len}, {args.new_tokens} new tokens, greedy, {args.threads} threads, torch {torch.__version__}"
          f"\nCPU {cpu_name()} ({cpu_flags()}; torch's capability {torch.backends.cpu.get_cpu_capability()}); "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s; each contender in its own process")
    ctx = multiprocessing.get_context("spawn")
    contenders = []
    for name in ["gptlab", *args.names]:
        remote = Remote(ctx, name, args)
        if remote.missing:
            print(f"skipping peer {name}: {remote.missing}")
            remote.close()
        else:
            contenders.append(remote)
    peers = [c.name for c in contenders[1:]]
    if peers and args.check_tokens:
        try:
            check_tokens(contenders, V, args)
        except ContenderDied as e:
            print(f"greedy tokens not compared: {e}")
    with torch.device("meta"):  # sizes only, for weight_bytes
        shape = GPT(config)
    rows = []
    for setting in args.settings.split(","):
        B, dtype = int(setting.split(":")[0]), setting.split(":")[1]
        rows.append((B, dtype, time_setting(contenders, B, dtype, V, args)))
    for c in contenders:
        c.close()
    print(f"\nmedians of {args.rounds} rounds, tokens/s (ratio gptlab / peer; at batch 1 [share of the bandwidth "
          f"limit: weights read per token at {bandwidth / 1e9:.1f} GB/s])")
    print("| batch | dtype | gptlab | " + " | ".join(peers) + " |")
    print("|---|---|---|" + "---|" * len(peers))
    for B, dtype, r in rows:
        def share(name: str, rate: float, B: int = B, dtype: str = dtype) -> str:
            limit = bandwidth / weight_bytes(shape, name, dtype)
            return f" [{100 * rate / limit:.0f}%]" if B == 1 else ""

        if "gptlab" not in r:
            print(f"| {B} | {dtype} | - | " + " | ".join("-" for _ in peers) + " |")
            continue
        cells = [f"{r[n]:.1f} ({r['gptlab'] / r[n]:.2f}x){share(n, r[n])}" if n in r else "-" for n in peers]
        print(f"| {B} | {dtype} | {r['gptlab']:.1f}{share('gptlab', r['gptlab'])} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
