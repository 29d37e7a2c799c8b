"""Load test for `gptlab serve`: N concurrent streaming clients for a fixed time against a real server process.

Starts `gptlab serve` on 127.0.0.1 (a free port) in a subprocess, either on --checkpoint or on a freshly made
random model (--preset; a character vocabulary, or GPT-2's with --tokenizer gpt2), waits for /health, then runs
--clients clients (one event loop: `load_client`, light on the CPU it shares with the server) that each send
streamed /v1/completions requests back to back until --seconds have passed. Prints requests/s, generated tokens/s,
latency and time-to-first-token percentiles, and the error count (which should be 0). Everything is bounded:
per-request timeouts, a deadline, and the server is stopped at the end.

    python benchmarks/serve_load.py                          # 16 clients, 20 s, preset char-5min
    python benchmarks/serve_load.py --preset gpt2 --dtype bfloat16 --max-tokens 32
    python benchmarks/serve_load.py --preset gpt2 --dtype bfloat16 --clients 4 --long-prompt 900 --prefill-chunk 0

With --long-prompt N, client 0 sends N-character prompts while the others send short ones: compare the short
requests' longest pause between two streamed chunks with --prefill-chunk 0 (whole prompts) and the default.

A peer serves the same weights, exported with `gptlab convert ... --to gguf` (f32 for --dtype float32, bf16 for
bfloat16, q8_0 for int8, where gptlab serves `--quantize int8`), under the same load: `--peer llama-server
--llama-server BIN` is llama.cpp's own C++ server (parallel slots, continuous batching: the server llama.cpp users
run), started with `-np` the max batch, `-t` the threads and `--ignore-eos`; `--peer llamacpp` is llama-cpp-python's
Python server (`bench` extra), which serves one request at a time. The servers take turns over --rounds and the
medians and ratios gptlab / peer are printed (tokens/s: higher is better; first-token p99: lower is better). Tokens
are counted from each stream's `usage` where the server sends it, else one per streamed chunk. Each round also
prints the CPU the load generator (this process) and the server used, the server's as CPU milliseconds per token: a
figure other work on a shared machine moves far less than tokens/s; gptlab's is split into its main thread's (the
engine's loop, `gptlab serve` runs it there) and the rest (HTTP's thread, the kernels' other OpenMP threads), and
gptlab's decoding steps a second with their mean rows (its /metrics' `gptlab_decode_steps_total` and
`gptlab_decode_rows_total`: does the batch stay full?), its admissions a step and the share of the wall its
engine spent prefilling admitted rows and decoding (`gptlab_admissions_total`, `gptlab_engine_seconds_total`).
Beside the served figure: the engine's own tokens/s at the same batch without a server (`generate_batch` of
max-batch prompts, the clients' prompts, max-tokens each at the same temperature, in a process of its own, once per
round), and served / offline. Both prefill one prompt per max-tokens generated; offline prefills its max-batch
prompts in one call, the server each admission's as it comes (the prompts waiting at a step together). With
llama-server, where `llama-batched-bench` was built beside it, llama.cpp's engine alone too (its generation phase at
the same batch and tokens after an 8-token prompt) and llama-server's served / offline: what the peer's own HTTP
side costs it on the same machine.

    python benchmarks/serve_load.py --peer llama-server --llama-server LLAMA_CPP/build/bin/llama-server --rounds 3

`--profile FILE` samples the gptlab server with py-spy during the last round's load and prints where each of its
threads spent its busy time (`pyspy.summarize`). On a shared machine run it in a session of its own at raised
priority (see benchmarks/timing.py): `setsid sh -c 'echo -20 > /proc/self/autogroup; exec python ...'`.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import httpx
from load_client import run_load
from pyspy import Recording, summarize  # benchmarks/ is on sys.path when a benchmark runs as a script
from timing import loadavg, priority_available, raise_priority, run_timed

PROMPTS = ["ROMEO:\n", "JULIET:\nO ", "First Citizen:\nWe are ", "KING HENRY:\n", "To be, or not ",
           "HAMLET:\nThe ", "Enter a Messenger.\n", "MENENIUS:\nWhat "]
VOCAB = "".join(sorted(set("".join(PROMPTS) + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'-\n")))


def make_checkpoint(preset: str, directory: Path, tokenizer: str = "char") -> Path:
    """A random `preset` model saved with a character vocabulary (a few dozen tokens: sampling costs next to
    nothing) or GPT-2's 50,257 tokens (a real model's: the head and sampling cost what they cost a user)."""
    import torch

    from gptlab import GPT, GPTConfig
    from gptlab.checkpoint import save_model
    from gptlab.tokenizer import CharTokenizer, GPT2Tokenizer

    tok = GPT2Tokenizer() if tokenizer == "gpt2" else CharTokenizer.from_text(VOCAB)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset, vocab_size=max(tok.vocab_size, 65)))
    return save_model(directory / preset, model, tok)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def wait_for_server(server: subprocess.Popen, url: str, health: str, log: Path) -> None:
    deadline = time.monotonic() + 180
    while True:
        if server.poll() is not None:
            sys.exit(f"the server exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            if httpx.get(url + health, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            sys.exit("the server did not come up within 180 s")
        time.sleep(0.2)


def load(url: str, args: argparse.Namespace) -> dict:
    """--clients streaming clients sending completions back to back for --seconds (`load_client`: one event loop,
    httptools' parser); the summary of what they got."""

    def prompt_for(i: int, n: int) -> str:
        prompt = PROMPTS[(i + n) % len(PROMPTS)]
        if i == 0 and args.long_prompt:
            prompt = (prompt * (args.long_prompt // len(prompt) + 1))[: args.long_prompt]
        return prompt

    results, errors, wall, client_cpu, resent = run_load(url, args.clients, args.seconds, prompt_for, args.max_tokens,
                                                         args.temperature)
    ttft = [r["ttft"] for r in results]
    lat = [r["latency"] for r in results]
    return {"requests": len(results), "wall": wall, "tokens": sum(r["tokens"] for r in results),
            "tokens_per_s": sum(r["tokens"] for r in results) / wall, "req_per_s": len(results) / wall,
            "lat50": percentile(lat, 0.5), "lat99": percentile(lat, 0.99),
            "ttft50": percentile(ttft, 0.5), "ttft99": percentile(ttft, 0.99),
            "pauses": [r["pause"] for r in results if not r["long"]], "errors": errors,
            "mean_tokens": statistics.mean(r["tokens"] for r in results) if results else 0.0,
            "client_cores": client_cpu / wall, "resent": resent}


def serve_gptlab(ckpt: str, port: int, args: argparse.Namespace, log: IO) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env.pop("GPTLAB_API_KEY", None)
    cmd = [sys.executable, "-m", "gptlab.cli", "serve", ckpt, "--port", str(port), "--max-batch",
           str(args.max_batch), "--max-queue", str(4 * args.clients), *dtype_flags(args.dtype),
           "--prefill-chunk", str(args.prefill_chunk), "--stream-interval", str(args.stream_interval), "--no-ui"]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
                            preexec_fn=server_priority)


def dtype_flags(dtype: str) -> list[str]:
    """gptlab's flags for a --dtype of this benchmark (int8: weight-only int8 Linears, the rest fp32)."""
    return ["--quantize", "int8", "--dtype", "float32"] if dtype == "int8" else ["--dtype", dtype]


def serve_llamacpp(gguf: Path, context: int, port: int, args: argparse.Namespace, log: IO) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port), "--host", "127.0.0.1",
           "--n_ctx", str(context), "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
           "--interrupt_requests", "False"]  # its default ends a running stream when the next request comes
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,  # a file: a full pipe would stall it
                            start_new_session=True, preexec_fn=server_priority)


def serve_llama_server(gguf: Path, context: int, port: int, args: argparse.Namespace, log: IO) -> subprocess.Popen:
    """llama.cpp's C++ server: max-batch parallel slots of a full context each (-c is shared by the slots)."""
    cmd = [args.llama_server, "--model", str(gguf), "--port", str(port), "--host", "127.0.0.1",
           "--parallel", str(args.max_batch), "--ctx-size", str(context * args.max_batch),
           "--threads", str(args.threads), "--threads-batch", str(args.threads), "--ignore-eos"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
                            preexec_fn=server_priority)


def export_gguf(ckpt: str, directory: Path, dtype: str, args: argparse.Namespace) -> tuple[Path, int]:
    """The served checkpoint as a GGUF file for llama.cpp, and the context length it serves (the model's, or
    --max-model-len)."""
    from gptlab.loading import load_model

    out = directory / "model.gguf"
    subprocess.run([sys.executable, "-m", "gptlab.cli", "convert", ckpt, str(out), "--to", "gguf", "--dtype",
                    {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0"}[dtype]], check=True,
                   stdout=subprocess.DEVNULL)
    model, _ = load_model(ckpt)
    return out, min(args.max_model_len or model.config.block_size, model.config.block_size)


def clients_raised() -> bool:
    """Whether this process (the clients) runs at raised priority (its session's autogroup at -20). The servers are
    raised only then: with the clients at normal priority and the servers at -20, 16 clients on 2 cores kept ~4 rows
    a step busy of 16 (first-token p50 ~0.9 s) in both servers, against ~15.5 with both raised."""
    autogroup = Path("/proc/self/autogroup")
    return priority_available() and autogroup.read_text().split()[-1] == "-20"


RAISE_SERVERS = False  # set by main from clients_raised() (a server's preexec_fn runs after its own setsid)


def server_priority() -> None:
    """preexec_fn of a server: the clients' priority (raised only where they are: neither side starves the other)."""
    if RAISE_SERVERS:
        raise_priority()


def offline_tokens_per_s(ckpt: str, args: argparse.Namespace) -> float:
    """The engine's own tokens/s at the served batch, no server: `generate_batch` over max-batch prompts of
    max-tokens each at the benchmark's temperature, the median of 3 calls after a warm-up, in a process of its own
    (at raised priority, as the servers)."""
    code = f"""
import statistics, time
from gptlab.generation import SamplingParams, generate_batch
from gptlab.hardware import retain_freed_memory
from gptlab.loading import load_model
retain_freed_memory()  # as gptlab sample (and, bounded, gptlab serve) do
quantize = "int8" if {args.dtype!r} == "int8" else None
dtype = None if quantize else getattr(__import__("torch"), {args.dtype!r})
model, tok = load_model({ckpt!r}, dtype=dtype, quantize=quantize)
prompts = [tok.encode(p) for p in ({PROMPTS!r} * {args.max_batch})[:{args.max_batch}]]
params = SamplingParams(max_new_tokens={args.max_tokens}, temperature={args.temperature}, ignore_eot=True)
generate_batch(model, prompts, params, tokenizer=tok)
rates = []
for _ in range(3):
    t0 = time.perf_counter()
    gens = generate_batch(model, prompts, params, tokenizer=tok)
    rates.append(sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0))
print(statistics.median(rates))
"""
    _, done = run_timed([sys.executable, "-c", code], env={"OMP_NUM_THREADS": str(args.threads)})
    return float(done.stdout.split()[-1])


def llama_offline_tokens_per_s(bench: Path, gguf: Path, context: int, args: argparse.Namespace) -> float:
    """llama.cpp's own decoding tokens/s at the served batch, no server: `llama-batched-bench` (built beside
    llama-server) with max-batch sequences of max-tokens new tokens after a prompt of 8, its generation phase
    (S_TG), at raised priority as the servers."""
    ctx = max(context, 8 + args.max_tokens) * args.max_batch  # room for every sequence
    _, done = run_timed([str(bench), "--model", str(gguf), "--ctx-size", str(ctx), "-npp", "8",
                         "-ntg", str(args.max_tokens), "-npl", str(args.max_batch),
                         "--threads", str(args.threads), "--threads-batch", str(args.threads)])
    # the table's header, its |---| rule, then a row per batch size: a run that failed after the header has none
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("|") and not line.startswith("|-")]
    if len(rows) < 2:
        tail = (done.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"no result row (exit {done.returncode}: {tail[0][:200]})")
    header = [c.strip() for c in rows[0]]
    return float(rows[-1][header.index("S_TG t/s")])


def process_cpu_seconds(pid: int, thread: int | None = None) -> float:
    """CPU time (user + system) process `pid` has used, every thread's or only `thread`'s (a thread id; the main
    thread's is `pid`), from /proc (Linux); nan elsewhere. Unlike tokens/s, CPU time per token is little moved by
    other work on a shared machine."""
    stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
    try:
        fields = stat.read_text().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def run_round(name: str, start, args: argparse.Namespace, log: Path,  # noqa: ANN001 - start(port, log)
              profile: Path | None = None) -> dict:
    """One contender under the load; with `profile`, its server sampled by py-spy while the load runs."""
    port = free_port()
    with open(log, "w") as log_file:
        server = start(port, log_file)
    try:
        wait_for_server(server, f"http://127.0.0.1:{port}", "/v1/models" if name == "llama.cpp" else "/health", log)
        recording = Recording(server.pid, profile) if profile else None
        try:
            url = f"http://127.0.0.1:{port}"
            steps0 = decode_counts(url) if name == "gptlab" else None
            cpu0, main0 = process_cpu_seconds(server.pid), process_cpu_seconds(server.pid, server.pid)
            summary = load(url, args)
            cpu = process_cpu_seconds(server.pid) - cpu0
            main = process_cpu_seconds(server.pid, server.pid) - main0
            summary["server_cores"] = cpu / summary["wall"]
            summary["cpu_ms_per_token"] = 1000 * cpu / max(summary["tokens"], 1)
            # gptlab's main thread runs the engine's loop (`serve_on_main_thread`); the rest, HTTP's and OpenMP's
            summary["main_cpu_ms_per_token"] = 1000 * main / max(summary["tokens"], 1)
            if steps0 is not None:  # (the load's first warm-up request and last requests' tails included)
                steps, rows, admissions, admit_s, decode_s = (
                    b - a for a, b in zip(steps0, decode_counts(url), strict=True))
                summary["steps_per_s"], summary["rows_per_step"] = steps / summary["wall"], rows / max(steps, 1)
                summary["admissions_per_step"] = admissions / max(steps, 1)
                summary["admit_share"], summary["decode_share"] = admit_s / summary["wall"], decode_s / summary["wall"]
            return summary
        finally:
            if recording is not None:
                recording.stop()
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()


def decode_counts(url: str) -> tuple[float, ...]:
    """From gptlab's /metrics, so far: its decoding steps, their rows summed, its admissions (prefill calls of
    newly admitted rows), and the engine's seconds in those admissions and in decoding steps."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    values = {(s.name, s.labels.get("phase")): s.value
              for family in text_string_to_metric_families(text) for s in family.samples}
    return (values["gptlab_decode_steps_total", None], values["gptlab_decode_rows_total", None],
            values["gptlab_admissions_total", None], values.get(("gptlab_engine_seconds_total", "admit"), 0.0),
            values.get(("gptlab_engine_seconds_total", "decode"), 0.0))


def report(name: str, s: dict, args: argparse.Namespace) -> None:
    print(f"  {name}: {s['requests']} requests in {s['wall']:.1f} s = {s['req_per_s']:.2f} req/s, "
          f"{s['tokens']} tokens = {s['tokens_per_s']:.1f} tokens/s, latency p50 {s['lat50'] * 1000:.0f} ms "
          f"p99 {s['lat99'] * 1000:.0f} ms, first token p50 {s['ttft50'] * 1000:.0f} ms p99 "
          f"{s['ttft99'] * 1000:.0f} ms, {s['mean_tokens']:.1f} tokens per request, load generator's CPU "
          f"{s['client_cores']:.2f} cores, server's CPU {s['server_cores']:.2f} cores = "
          f"{s['cpu_ms_per_token']:.2f} CPU ms per token"
          + (f" ({s['main_cpu_ms_per_token']:.3f} on its main thread, the engine's loop)" if name == "gptlab" else "")
          + f", errors {len(s['errors'])}"
          + (f" (first: {s['errors'][0]})" if s["errors"] else "")
          # a request whose kept-alive connection the server closed before answering, sent once more on a new one
          + (f", {s['resent']} sent again on a new connection" if s["resent"] else ""))
    if "steps_per_s" in s:
        print(f"  gptlab's decoding steps: {s['steps_per_s']:.1f} a second, {s['rows_per_step']:.2f} rows a step on "
              f"average (max batch {args.max_batch}); {s['admissions_per_step']:.2f} admissions (a prefill call "
              f"each) a step; the engine's loop spent {100 * s['admit_share']:.0f}% of the wall prefilling admitted "
              f"rows and {100 * s['decode_share']:.0f}% in decoding steps")
    if name == "gptlab" and args.long_prompt:
        p = s["pauses"]
        print(f"  longest pause between chunks of a short request: p50 {percentile(p, 0.5) * 1000:.0f} ms   "
              f"p99 {percentile(p, 0.99) * 1000:.0f} ms   max {max(p, default=0) * 1000:.0f} ms "
              f"(prefill chunk {args.prefill_chunk or 'off'}, client 0's prompts {args.long_prompt} characters)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="serve this run / checkpoint / HF dir instead of a random model")
    ap.add_argument("--preset", help="random model to serve when no --checkpoint (default char-5min; with --peer "
                    "pocket-swiglu, a Llama-shaped model GGUF can hold)")
    ap.add_argument("--tokenizer", choices=["char", "gpt2"], default="char",
                    help="the random model's vocabulary: characters (default) or GPT-2's 50,257 BPE tokens, a real "
                    "model's head and sampling (TIKTOKEN_CACHE_DIR offline)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-batch", type=int, help="gptlab's rows and llama-server's slots (default: --clients)")
    ap.add_argument("--max-model-len", type=int, metavar="TOKENS",
                    help="each row's (slot's) context for both servers, as gptlab serve --max-model-len (default: "
                    "the model's; SmolLM2's 8,192 positions in 64 rows need 22.5 GiB of fp32 KV cache)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"],
                    help="the weights (int8: gptlab's --quantize int8 against llama.cpp's q8_0)")
    ap.add_argument("--threads", type=int, default=2, help="threads of each server")
    ap.add_argument("--long-prompt", type=int, default=0, help="client 0 sends prompts of this many characters")
    ap.add_argument("--prefill-chunk", type=int, default=256, help="the server's --prefill-chunk (0: off)")
    ap.add_argument("--stream-interval", type=float, default=0.0, metavar="MS",
                    help="the gptlab server's --stream-interval (default 0: a write per decoding step)")
    ap.add_argument("--peer", choices=["llama-server", "llamacpp"], help="also load a llama.cpp server on the same "
                    "weights: llama.cpp's own llama-server (--llama-server BIN), or llama-cpp-python's")
    ap.add_argument("--llama-server", metavar="BIN", help="llama.cpp's llama-server program (with --peer llama-server)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds, the servers taking turns (medians reported)")
    ap.add_argument("--no-offline", action="store_true", help="skip the engine's offline tokens/s")
    ap.add_argument("--profile", type=Path, metavar="FILE", help="sample the gptlab server with py-spy during the "
                    "last round (raw collapsed stacks to FILE) and print where its threads spent their time")
    args = ap.parse_args()
    args.preset = args.preset or ("pocket-swiglu" if args.peer else "char-5min")
    args.max_batch = args.max_batch or args.clients
    if args.peer == "llama-server" and not (args.llama_server and os.access(args.llama_server, os.X_OK)):
        ap.error("--peer llama-server needs --llama-server BIN, an executable llama-server (cmake --build build "
                 "--target llama-server in a llama.cpp tree)")
    global RAISE_SERVERS
    RAISE_SERVERS = clients_raised()
    if not priority_available():
        print("note: not root, the clients and servers run at normal priority (expect more noise)")
    elif not RAISE_SERVERS:
        print("note: the clients and servers run at normal priority, the clients' (expect more noise; for less run "
              "this in a session of its own at raised priority: setsid sh -c 'echo -20 > /proc/self/autogroup; exec "
              "python benchmarks/serve_load.py ...')")

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or str(make_checkpoint(args.preset, Path(tmp), args.tokenizer))
        contenders = {"gptlab": lambda port, log: serve_gptlab(ckpt, port, args, log)}
        if args.peer == "llamacpp":
            try:
                import llama_cpp.server.app  # noqa: F401 - only to see that the server's extras are there
            except ImportError as e:
                print(f"skipping llama.cpp: {e} (pip install 'llama-cpp-python[server]', the `bench` extra)")
            else:
                gguf, context = export_gguf(ckpt, Path(tmp), args.dtype, args)
                contenders["llama.cpp"] = lambda port, log: serve_llamacpp(gguf, context, port, args, log)
        elif args.peer == "llama-server":
            gguf, context = export_gguf(ckpt, Path(tmp), args.dtype, args)
            contenders["llama-server"] = lambda port, log: serve_llama_server(gguf, context, port, args, log)
        vocab = " (GPT-2's vocabulary)" if args.tokenizer == "gpt2" else ""
        print(f"served {ckpt if args.checkpoint else 'random ' + args.preset + vocab} ({args.dtype}), {args.clients} "
              f"clients, {args.seconds:.0f} s, max_tokens {args.max_tokens}, temperature {args.temperature}, "
              f"max batch {args.max_batch}, {args.threads} threads")
        # llama.cpp's engine alone, beside its server, where its batched bench was built with it
        bench = Path(args.llama_server).with_name("llama-batched-bench") if "llama-server" in contenders else None
        bench = bench if bench is not None and os.access(bench, os.X_OK) and not args.no_offline else None
        rounds: dict[str, list[dict]] = {name: [] for name in contenders}
        offline: list[float] = []
        peer_offline: list[float] = []
        for r in range(args.rounds):
            print(f"round {r + 1} (load {loadavg()})")
            for name, start in contenders.items():
                profile = args.profile if name == "gptlab" and r == args.rounds - 1 else None
                rounds[name].append(run_round(name, start, args, Path(tmp) / f"{name}.log", profile))
                report(name, rounds[name][-1], args)
            if not args.no_offline:  # each round: a busy spell of a shared machine hits it as it hits the servers
                offline.append(offline_tokens_per_s(ckpt, args))
                print(f"  gptlab's engine offline: {offline[-1]:.1f} tokens/s = {offline[-1] / args.max_batch:.1f} "
                      f"steps a second of {args.max_batch} rows")
            if bench is not None:
                try:
                    peer_offline.append(llama_offline_tokens_per_s(bench, gguf, context, args))
                    print(f"  llama.cpp's engine offline (llama-batched-bench): {peer_offline[-1]:.1f} tokens/s")
                except (RuntimeError, ValueError, IndexError) as e:  # the served figures stand without it
                    print(f"  llama.cpp's engine offline: llama-batched-bench gave no figure ({e}); skipped")
                    bench = None

    keys = ("tokens_per_s", "req_per_s", "ttft50", "ttft99", "cpu_ms_per_token", "client_cores")
    med = {name: {k: statistics.median(s[k] for s in runs) for k in keys} for name, runs in rounds.items()}
    for name, m in med.items():
        print(f"median {name}: {m['tokens_per_s']:.1f} tokens/s, {m['req_per_s']:.2f} req/s, first token p50 "
              f"{m['ttft50'] * 1000:.0f} ms p99 {m['ttft99'] * 1000:.0f} ms, {m['cpu_ms_per_token']:.2f} server CPU ms "
              f"per token, load generator {m['client_cores']:.2f} cores, errors "
              f"{sum(len(s['errors']) for s in rounds[name])}, sent again {sum(s['resent'] for s in rounds[name])}")
    g = med["gptlab"]
    if offline:
        engine = statistics.median(offline)
        print(f"gptlab's engine offline at batch {args.max_batch} (generate_batch, no server): median {engine:.1f} "
              f"tokens/s; served / offline {g['tokens_per_s'] / engine:.2f}x")
    if peer_offline and med["llama-server"]["tokens_per_s"] > 0:
        engine = statistics.median(peer_offline)
        print(f"llama.cpp's engine offline at batch {args.max_batch} (llama-batched-bench's generation, no server): "
              f"median {engine:.1f} tokens/s; llama-server's served / offline "
              f"{med['llama-server']['tokens_per_s'] / engine:.2f}x")
    for peer in contenders.keys() - {"gptlab"}:
        p = med[peer]
        if p["tokens_per_s"] > 0:
            print(f"gptlab / {peer}: tokens/s {g['tokens_per_s'] / p['tokens_per_s']:.2f}x, first-token p99 "
                  f"{g['ttft99'] / p['ttft99']:.2f}x, server CPU per token "
                  f"{g['cpu_ms_per_token'] / p['cpu_ms_per_token']:.2f}x (below 1 is better)")
    if args.profile:
        print(f"py-spy profile of the gptlab server (last round; {args.profile}):")
        print(summarize(args.profile))


if __name__ == "__main__":
    main()
