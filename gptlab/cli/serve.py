"""`gptlab serve RUN_OR_CHECKPOINT_OR_HF_DIR`: the OpenAI-compatible server (gptlab.serve) on uvicorn."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from gptlab.cli.collector import freeze_heap
from gptlab.cli.options import (
    add_device,
    add_dtype,
    add_prefix_cache,
    add_quantize,
    add_speculation,
    check_speculation,
    prefix_cache_options,
    quantize_options,
    speculation_options,
    torch_dtype,
)
from gptlab.errors import GptlabError

STREAM_INTERVAL_MS = 0.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server: POST /v1/completions, /v1/chat/completions, GET /v1/models, "
        "/health. Concurrent requests share decoding steps (continuous batching over --max-batch rows).",
    )
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT_OR_HF_DIR",
                   help="a run (its best checkpoint), a checkpoint or a Hugging Face directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: env GPTLAB_API_KEY, else none)")
    p.add_argument("--max-batch", type=int, default=8, help="rows decoded together (default 8)")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS",
                   help="the context a request's prompt and completion share (default: the model's); each of the "
                   "--max-batch rows keeps a KV cache of this many positions, so a long-context model at a large "
                   "batch needs a shorter one to fit memory")
    p.add_argument("--max-queue", type=int, default=64,
                   help="generations allowed to wait for a row; more are answered 429 (default 64)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens prefilled per step, between other rows' decoding steps, so a long prompt "
                   "does not stall them (default 256; 0: whole prompts at once)")
    p.add_argument("--stream-interval", type=float, default=STREAM_INTERVAL_MS, metavar="MS",
                   help="milliseconds a stream waits after each write but the first, its tokens meanwhile sent in "
                   f"one chunk: fewer wake-ups of the HTTP thread, which shares the cores with the engine (default "
                   f"{STREAM_INTERVAL_MS:g}; 0: a write per decoding step)")
    p.add_argument("--model-name", help="the model id clients use (default: the name of the run, checkpoint or "
                   "directory given, e.g. `run` for out/run)")
    p.add_argument("--max-body-mb", type=float, default=8.0,
                   help="the largest request body in MB; larger ones are answered 413 (default 8)")
    add_device(p)
    add_dtype(p)  # default auto: bf16 on a GPU; on a CPU float32 (bfloat16 is ~2x faster on recent CPUs)
    add_quantize(p)
    add_prefix_cache(p)
    add_speculation(p)
    p.add_argument("--allow-steering", metavar="NAME=FILE", action="append", default=[],
                   help="let requests steer with this direction (a safetensors file, as `gptlab sample --steer` "
                   "reads) by NAME: {\"steering\": [{\"vector\": NAME, \"layer\": L, \"scale\": S}]}; repeatable. "
                   "Without it a request asking for steering is refused")
    p.add_argument("--no-ui", action="store_true",
                   help="do not serve the web page (chat playground, attention explorer) at /")
    p.set_defaults(run=run, retain_memory=RETAIN_FREED_UP_TO)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from gptlab.hardware import resolve_device
    from gptlab.loading import load_model
    from gptlab.serve import create_app

    # the flags are checked before the (slow) model load; the engine would reject these too, but only after it
    if args.max_batch < 1 or args.max_queue < 1:
        raise GptlabError("--max-batch and --max-queue must be at least 1")
    if args.prefill_chunk < 0:
        raise GptlabError(f"--prefill-chunk must be 0 (off) or a number of tokens, got {args.prefill_chunk}")
    if not 0 <= args.stream_interval <= 1000:  # (also refuses nan)
        raise GptlabError(f"--stream-interval must be in 0..1000 milliseconds, got {args.stream_interval}")
    if not 0 <= args.port <= 65535:
        raise GptlabError(f"--port must be in 0..65535, got {args.port}")
    if not 0 < args.max_body_mb <= 2**20:  # (also refuses nan)
        raise GptlabError(f"--max-body-mb must be a size in MB, more than 0, got {args.max_body_mb}")
    check_can_listen(args.host, args.port)
    if args.api_key == "":
        raise GptlabError("--api-key is empty: give a key, or leave the flag out to serve without one")
    prefix_cache = prefix_cache_options(args)
    steering = steering_files(args.allow_steering)
    draft = check_speculation(args)
    device = resolve_device(args.device)
    dtype = torch_dtype(args.dtype, device)
    model, tokenizer = load_model(args.checkpoint, device=device, dtype=dtype, **quantize_options(args))
    context = model.config.block_size
    if args.max_model_len is not None and not 2 <= args.max_model_len <= context:
        raise GptlabError(f"--max-model-len must be in 2..{context} (this model's context), got {args.max_model_len}")
    speculation = speculation_options(args, draft, device, dtype)
    if tokenizer is None:
        raise GptlabError(f"{args.checkpoint} has no tokenizer: the server needs one to read prompts")
    name = args.model_name or served_name(args.checkpoint)
    api_key = args.api_key or os.environ.get("GPTLAB_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"warning: serving on {args.host} without an API key: anyone who can reach it can use it")
    app = create_app(
        model, tokenizer, model_name=name, max_batch=args.max_batch, max_queue=args.max_queue, api_key=api_key,
        prefill_chunk=args.prefill_chunk or None, max_body_bytes=int(args.max_body_mb * 2**20), ui=not args.no_ui,
        steering=steering, scheduler_thread=False, stream_interval=args.stream_interval / 1000, **prefix_cache,
        **speculation, max_len=args.max_model_len,
    )
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (max batch {args.max_batch})", flush=True)
    serve_on_main_thread(uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info")),
                         app.state.server.scheduler)
    return 0


def served_name(path: str) -> str:
    """The model id a server answers to by default: the name the user gave, so `gptlab serve runs/shakespeare` is
    "shakespeare" (not the name of the checkpoint picked inside the run, "best" for every run)."""
    from gptlab.checkpoint import MODEL_FILE

    given = Path(path).resolve()
    return (given.parent if given.name == MODEL_FILE else given).name


# freed memory a server keeps for reuse before glibc trims its heap: a decoding step's logits-sized tensors reuse
# it instead of faulting in fresh pages each step (`gptlab.hardware.retain_freed_memory`: GPT-2's vocabulary at 64
# rows, 563 -> 658 tokens/s served), and a burst's memory goes back once it is done
RETAIN_FREED_UP_TO = 1 << 30

SWITCH_INTERVAL = 0.001  # seconds a thread holds the GIL before another waiting one gets it (Python's default: 0.005)


def serve_on_main_thread(http: Any, scheduler: Any) -> None:
    """HTTP (uvicorn's `http`) on a thread of its own, the engine's loop on this one, the thread that loaded the
    model (why: `gptlab.serve.scheduler`). Ctrl-C or SIGTERM shuts HTTP down (a second one at once), whose shutdown
    ends the loop; the loop ending any other way shuts HTTP down too."""

    def serve_http() -> None:
        try:
            http.run()
        finally:
            scheduler.request_stop()

    def on_signal(signum: int, frame: Any) -> None:
        http.force_exit = http.should_exit
        http.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    # the engine's thread holds the GIL between its steps' native calls; at Python's default 5 ms switch interval
    # the HTTP thread waited that long for each turn, and a new request's first token waited for many turns
    # (first-token p99 1.4 s against 86 ms at 1 ms, at no cost in tokens/s: benchmarks/serve_load.py)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL)
    freeze_heap()  # the model, the app and their libraries out of the collector's full passes while serving
    thread = threading.Thread(target=serve_http, name="gptlab-http")
    thread.start()
    try:
        scheduler.run()
    finally:
        http.should_exit = True
        thread.join()
        sys.setswitchinterval(interval)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not http.started:  # (uvicorn logged why: it could not listen, or its startup failed)
        raise GptlabError("the HTTP server did not start")


def steering_files(specs: list[str]) -> dict[str, str] | None:
    """--allow-steering NAME=FILE values as {name: file} (None: none given, steering refused), each file present
    (its contents are checked against the model once it is loaded)."""
    if not specs:
        return None
    files: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise GptlabError(f"--allow-steering {spec!r}: expected NAME=FILE, e.g. happy=happy.safetensors")
        if name in files:
            raise GptlabError(f"--allow-steering names {name!r} twice")
        if not os.path.isfile(path):
            raise GptlabError(f"--allow-steering {spec!r}: {path} is missing")
        files[name] = path
    return files


def check_can_listen(host: str, port: int) -> None:
    """Say in one line, before the (slow) model load, that the address cannot be listened on; uvicorn would only
    log it after. An empty host would silently mean every interface."""
    if not host:
        raise GptlabError("--host is empty: give an address (0.0.0.0 for every interface)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise GptlabError(f"--host {host}: not an address of this machine ({e})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise GptlabError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
