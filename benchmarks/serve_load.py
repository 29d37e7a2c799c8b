"""Load test for `gptlab serve`: N concurrent streaming clients for a fixed time against a real server process.

Starts `gptlab serve` on 127.0.0.1 (a free port) in a subprocess, either on --checkpoint or on a freshly made
random model (--preset, character vocabulary), waits for /health, then runs --clients threads that each send
streamed /v1/completions requests back to back until --seconds have passed. Prints requests/s, generated
tokens/s, latency and time-to-first-token percentiles, and the error count (which should be 0). Everything is
bounded: per-request timeouts, a deadline, and the server is stopped at the end.

    python benchmarks/serve_load.py                          # 16 clients, 20 s, preset char-5min
    python benchmarks/serve_load.py --preset gpt2 --dtype bfloat16 --max-tokens 32
    python benchmarks/serve_load.py --preset gpt2 --dtype bfloat16 --clients 4 --long-prompt 900 --prefill-chunk 0

With --long-prompt N, client 0 sends N-character prompts while the others send short ones: compare the short
requests' longest pause between two streamed chunks with --prefill-chunk 0 (whole prompts) and the default.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PROMPTS = ["ROMEO:\n", "JULIET:\nO ", "First Citizen:\nWe are ", "KING HENRY:\n", "To be, or not ",
           "HAMLET:\nThe ", "Enter a Messenger.\n", "MENENIUS:\nWhat "]
VOCAB = "".join(sorted(set("".join(PROMPTS) + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'-\n")))


def make_checkpoint(preset: str, directory: Path) -> Path:
    import torch

    from gptlab import GPT, GPTConfig
    from gptlab.checkpoint import save_model
    from gptlab.tokenizer import CharTokenizer

    tok = CharTokenizer.from_text(VOCAB)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset, vocab_size=max(tok.vocab_size, 65)))
    return save_model(directory / preset, model, tok)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(client: httpx.Client, url: str, prompt: str, max_tokens: int, temperature: float) -> dict:
    """Send one streamed completion; latency, time to first token and generated tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens, last, pause = None, 0, None, 0.0
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                now = time.perf_counter()
                ttft = now - t0 if ttft is None else ttft
                pause, last = max(pause, now - last) if last is not None else 0.0, now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - t0
    return {"latency": latency, "ttft": ttft if ttft is not None else latency, "tokens": tokens, "pause": pause,
            "long": len(prompt) > 100}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="serve this run / checkpoint / HF dir instead of a random model")
    ap.add_argument("--preset", default="char-5min", help="random model to serve when no --checkpoint")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--long-prompt", type=int, default=0, help="client 0 sends prompts of this many characters")
    ap.add_argument("--prefill-chunk", type=int, default=256, help="the server's --prefill-chunk (0: off)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or str(make_checkpoint(args.preset, Path(tmp)))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        env.pop("GPTLAB_API_KEY", None)
        cmd = [sys.executable, "-m", "gptlab.cli", "serve", ckpt, "--port", str(port), "--max-batch",
               str(args.max_batch), "--max-queue", str(4 * args.clients), "--dtype", args.dtype,
               "--prefill-chunk", str(args.prefill_chunk)]
        server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while True:
                if server.poll() is not None:
                    sys.exit(f"the server exited: {server.stderr.read().decode()[-2000:]}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    sys.exit("the server did not come up within 120 s")
                time.sleep(0.2)
            results, errors, lock = [], [], threading.Lock()
            with httpx.Client(timeout=httpx.Timeout(10.0, read=120.0)) as warm:
                one_request(warm, url, PROMPTS[0], 4, 0.0)  # first-request allocations out of the timing

            stop_at = time.monotonic() + args.seconds

            def client(i: int) -> None:
                with httpx.Client(timeout=httpx.Timeout(10.0, read=120.0)) as c:
                    n = 0
                    while time.monotonic() < stop_at:
                        prompt = PROMPTS[(i + n) % len(PROMPTS)]
                        if i == 0 and args.long_prompt:
                            prompt = (prompt * (args.long_prompt // len(prompt) + 1))[: args.long_prompt]
                        try:
                            r = one_request(c, url, prompt, args.max_tokens, args.temperature)
                            with lock:
                                results.append(r)
                        except Exception as e:  # noqa: BLE001 - counted and reported
                            with lock:
                                errors.append(repr(e))
                        n += 1

            t0 = time.perf_counter()
            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=args.seconds + 180)
            wall = time.perf_counter() - t0
        finally:
            server.terminate()
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()

    lat = [r["latency"] for r in results]
    ttft = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    print(f"served {ckpt if args.checkpoint else 'random ' + args.preset} ({args.dtype}), {args.clients} clients, "
          f"{args.seconds:.0f} s, max_tokens {args.max_tokens}, temperature {args.temperature}, "
          f"max batch {args.max_batch}")
    print(f"requests: {len(results)} in {wall:.1f} s = {len(results) / wall:.2f} req/s")
    print(f"generated tokens: {tokens} = {tokens / wall:.1f} tokens/s")
    print(f"latency   p50 {percentile(lat, 0.5) * 1000:.0f} ms   p99 {percentile(lat, 0.99) * 1000:.0f} ms")
    print(f"first tok p50 {percentile(ttft, 0.5) * 1000:.0f} ms   p99 {percentile(ttft, 0.99) * 1000:.0f} ms")
    if results:
        print(f"mean tokens per request: {statistics.mean(r['tokens'] for r in results):.1f}")
    pauses = [r["pause"] for r in results if not r["long"]]
    long = f", client 0's prompts {args.long_prompt} characters" if args.long_prompt else ""
    print(f"longest pause between chunks of a short request: p50 {percentile(pauses, 0.5) * 1000:.0f} ms   "
          f"p99 {percentile(pauses, 0.99) * 1000:.0f} ms   max {max(pauses, default=0) * 1000:.0f} ms "
          f"(prefill chunk {args.prefill_chunk or 'off'}{long})")
    print(f"errors: {len(errors)}" + (f" (first: {errors[0]})" if errors else ""))


if __name__ == "__main__":
    main()
