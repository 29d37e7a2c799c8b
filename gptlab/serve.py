"""`gptlab serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the generation engine.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health. Streaming answers are
server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. Concurrent requests share decoding
steps (continuous batching, `gptlab.serve_scheduler`).

Behaviour worth knowing:
* Errors are OpenAI-style bodies {"error": {"message", "type", "param", "code"}}: 400 for malformed JSON,
  wrong types and out-of-range values (FastAPI's 422 is turned into 400, as OpenAI answers), 400 with code
  "context_length_exceeded" for a prompt that leaves no room in the context, 401 for a missing or wrong API
  key, 404 for an unknown model or route, 429 when more than --max-queue generations wait, 500 if generation
  fails.
* A prompt longer than --prefill-chunk tokens is prefilled that many tokens per step, interleaved with the
  running rows' decoding steps, so a long prompt delays the others by one chunk at a time, not a whole prefill.
* max_tokens is capped so that prompt + completion fit the context (block_size); finish_reason is then
  "length". Without max_tokens, chat completions run to the end of the context (completions default to 16).
* Chat messages go through the tokenizer's chat template (Jinja, rendered sandboxed, with
  add_generation_prompt). Without one (base models) the prompt is "System: ...\\n" (if any), then "User:
  ...\\n" / "Assistant: ...\\n" per message, then "Assistant:", and generation also stops at "\\nUser:".
* The tokenizer's end-of-text token ends a completion (finish_reason "stop") unless ignore_eos is set.
* logprobs (completions: `logprobs` = 0..20 alternatives; chat: `logprobs: true` and `top_logprobs` 0..20) are
  the model's own distribution (log-softmax of the raw logits, before penalties, temperature and filters),
  one entry per generated token, streamed chunks carrying those of their own tokens. Completions' `echo`
  returns the prompt before the completion; with logprobs the prompt tokens are scored too (the first: null).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gptlab.errors import GptlabError
from gptlab.generate import Engine, SamplingParams
from gptlab.serve_scheduler import Job, QueueFull, Scheduler
from gptlab.serve_schemas import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    chat_logprobs,
    completion_logprobs,
    error_body,
    validation_error,
)

DEFAULT_CHAT_STOP = "\nUser:"


# ---------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------
def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, bool]:
    """The prompt text for `messages`, and whether it came from the tokenizer's own template."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        lines = [f"{m['role'].capitalize()}: {m['content']}\n" for m in messages]
        return "".join(lines) + "Assistant:", False
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def token(i: int | None) -> str:
        return tokenizer.decode([i]) if i is not None else ""

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: time.strftime(fmt))
    try:
        text = env.from_string(template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=token(getattr(tokenizer, "bos_id", None)),
            eos_token=token(getattr(tokenizer, "eot_id", None)),
        )
    except TemplateError as e:
        raise ApiError(
            400, f"the chat template could not render these messages: {e}", param="messages"
        ) from e
    return text, True


# ---------------------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------------------
class Server:
    """What the routes share: model, tokenizer, engine and scheduler."""

    def __init__(
        self, model: Any, tokenizer: Any, model_name: str, max_batch: int, max_queue: int, prefill_chunk: int | None
    ) -> None:
        self.tokenizer, self.model_name = tokenizer, model_name
        self.block_size = model.config.block_size
        self.engine = Engine(model, max_batch=max_batch, tokenizer=tokenizer, prefill_chunk=prefill_chunk)
        self.scheduler = Scheduler(self.engine, max_queue=max_queue)
        self.created = int(time.time())

    # --- request -> generations -----------------------------------------------------------------------------
    def encode(self, text: str, *, special: bool = False) -> list[int]:
        try:
            return self.tokenizer.encode(text, allow_special=special)
        except GptlabError as e:  # e.g. characters outside a char vocabulary
            raise ApiError(400, str(e), param="prompt") from e

    def start(
        self,
        prompts: list[list[int]],
        req: SamplingFields,
        max_tokens: int | None,
        stops: list[str],
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
    ) -> Job:
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )
        gens = []
        for ids in prompts:
            if not ids:
                if self.tokenizer.eot_id is None:
                    raise ApiError(
                        400, "the prompt is empty and the tokenizer has no end-of-text token", param="prompt"
                    )
                ids = [self.tokenizer.eot_id]
            if any(not 0 <= t < self.engine.config.vocab_size for t in ids):
                raise ApiError(400, "prompt token ids must be in [0, vocab_size)", param="prompt")
            room = self.block_size - len(ids)
            if room < 1:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {self.block_size} tokens; the prompt "
                    f"has {len(ids)} tokens, leaving no room for a completion.",
                    param="prompt",
                    code="context_length_exceeded",
                )
            params = SamplingParams(
                max_new_tokens=room if max_tokens is None else min(max_tokens, room),
                temperature=req.temperature,
                top_k=req.top_k or None,
                top_p=req.top_p,
                min_p=req.min_p or None,
                repetition_penalty=req.repetition_penalty,
                frequency_penalty=req.frequency_penalty,
                presence_penalty=req.presence_penalty,
                seed=req.seed,
                stop=stops,
                ignore_eot=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
            gens += [self.engine.prepare(ids, params, sample_index=j) for j in range(req.n)]
        job = Job(gens, loop=asyncio.get_running_loop())
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(
                429,
                f"The server is busy ({e}); retry later.",
                type="rate_limit_error",
                code="rate_limit_exceeded",
            ) from e
        return job


def _usage(job: Job, prompts: list[list[int]]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(g.token_ids) for g in job.gens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


async def _wait(server: Server, job: Job) -> None:
    """Until every generation of the job has finished (cancelling it if the handler is cancelled)."""
    done = 0
    try:
        while done < len(job.gens):
            _, _, finish, _ = await job.events.get()
            done += finish is not None
    finally:
        if done < len(job.gens):
            server.scheduler.cancel(job)
    if job.error is not None:
        raise ApiError(500, f"generation failed: {job.error}", type="server_error")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(
    server: Server, job: Job, prompts: list[list[int]], chunk: Any, include_usage: bool, request: Request
) -> AsyncIterator[str]:
    """SSE lines: one chunk per delta (per choice), then usage if asked, then [DONE].

    `chunk(index, text, finish_reason, tokens)` builds a chunk; `tokens` is how many tokens that choice had
    produced when the text was taken (where the chunk's logprobs end)."""
    done = 0
    try:
        while done < len(job.gens):
            try:
                index, delta, finish, tokens = await asyncio.wait_for(job.events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            done += finish is not None
            if finish == "error":
                yield _sse(error_body(f"generation failed: {job.error}", "server_error"))
                break
            yield _sse(chunk(index, delta, finish, tokens))
        if include_usage and job.error is None:
            yield _sse({**chunk(0, "", None, 0), "choices": [], "usage": _usage(job, prompts)})
        yield "data: [DONE]\n\n"
    finally:
        if done < len(job.gens):
            server.scheduler.cancel(job)


def _event_stream(server, job, prompts, chunk, req, request) -> StreamingResponse:  # noqa: ANN001
    """The server-sent-event answer shared by completions and chat (chunks shaped by `chunk`)."""
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(
        _stream(server, job, prompts, chunk, usage, request),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


def create_app(
    model: Any,
    tokenizer: Any,
    *,
    model_name: str = "gptlab",
    max_batch: int = 8,
    max_queue: int = 64,
    api_key: str | None = None,
    prefill_chunk: int | None = 256,
) -> FastAPI:
    """The FastAPI app serving `model`; its scheduler thread starts and stops with the app's lifespan.
    `prefill_chunk`: prompt tokens prefilled per step (None: whole prompts), see `gptlab.generate.Engine`."""
    server = Server(model, tokenizer, model_name, max_batch, max_queue, prefill_chunk)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.scheduler.start()
        yield
        server.scheduler.stop()

    app = FastAPI(title="gptlab", lifespan=lifespan)
    app.state.server = server

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):  # noqa: ANN001, ANN202
        if api_key and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            given = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                err = ApiError(
                    401,
                    "Incorrect or missing API key: send 'Authorization: Bearer KEY'.",
                    code="invalid_api_key",
                )
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": model_name,
            "running": len(server.engine.running),
            "waiting": server.scheduler.waiting,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": server.created, "owned_by": "gptlab"}],
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if texts and isinstance(texts[0], int):
            prompts = [list(texts)]
        else:
            prompts = [server.encode(t) for t in texts] or [[]]
        scored = req.logprobs is not None
        job = server.start(prompts, req, req.max_tokens, req.stop_list(), req.logprobs, req.echo and scored)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        sent = [0] * len(job.gens)  # tokens of each choice whose logprobs went out
        started: set[int] = set()  # choices whose first chunk (which carries the echoed prompt) went out

        def choice(i: int, text: str, finish: str | None, tokens: int) -> dict[str, Any]:
            g, prefix, ids, entries = job.gens[i], "", [], []
            if i not in started:
                started.add(i)
                if req.echo:  # the prompt as the engine saw it, and its logprobs (none for the first token)
                    prefix, ids = tokenizer.decode(g.prompt_ids), list(g.prompt_ids)
                    entries = g.prompt_logprobs or [None] * len(ids)
            logprobs = None
            if scored:
                ids, entries = ids + g.token_ids[sent[i] : tokens], entries + g.logprobs[sent[i] : tokens]
                logprobs, sent[i] = completion_logprobs(tokenizer, ids, entries), max(sent[i], tokens)
            return {"index": i, "text": prefix + text, "logprobs": logprobs, "finish_reason": finish}

        def chunk(i: int, text: str, finish: str | None, tokens: int) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [choice(i, text, finish, tokens)],
            }

        if req.stream:
            return _event_stream(server, job, prompts, chunk, req, request)
        await _wait(server, job)
        choices = [choice(i, g.text, g.finish_reason, len(g.token_ids)) for i, g in enumerate(job.gens)]
        return {**chunk(0, "", None, 0), "choices": choices, "usage": _usage(job, prompts)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        n_top = req.logprobs_count()
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text, templated = render_chat(tokenizer, messages)
        stops = req.stop_list() + ([] if templated or req.stop else [DEFAULT_CHAT_STOP])
        prompts = [server.encode(text, special=templated)]
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = server.start(prompts, req, max_tokens, stops, n_top)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        started: set[int] = set()
        sent = [0] * len(job.gens)

        def logprobs(i: int, tokens: int) -> dict[str, Any] | None:
            if n_top is None:
                return None
            entries, sent[i] = job.gens[i].logprobs[sent[i] : tokens], max(sent[i], tokens)
            return chat_logprobs(tokenizer, entries)

        def chunk(i: int, text: str, finish: str | None, tokens: int) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": text} if text or finish is None else {}
            if i not in started:  # the first chunk of each choice names the role
                started.add(i)
                delta = {"role": "assistant", **delta}
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs(i, tokens), "finish_reason": finish}],
            }

        if req.stream:
            return _event_stream(server, job, prompts, chunk, req, request)
        await _wait(server, job)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": g.text},
                "logprobs": logprobs(i, len(g.token_ids)),
                "finish_reason": g.finish_reason,
            }
            for i, g in enumerate(job.gens)
        ]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": _usage(job, prompts),
        }

    return app


# ---------------------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------------------
class ServerThread:
    """uvicorn serving `app` from a background thread (tests, benchmarks).

    `with ServerThread(app) as s: ...` starts it on a free loopback port (s.url) and stops it on exit."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0) -> None:
        import uvicorn

        self.server = uvicorn.Server(
            uvicorn.Config(
                app, host=host, port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=2
            )
        )
        self.thread = threading.Thread(target=self.server.run, name="gptlab-uvicorn", daemon=True)
        self.host, self.timeout = host, timeout
        self.port = port

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + self.timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]  # the port the OS picked for port=0
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=self.timeout)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def run_serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from gptlab.checkpoint import load_model, resolve_checkpoint

    if args.max_batch < 1 or args.max_queue < 1:
        raise GptlabError("--max-batch and --max-queue must be at least 1")
    if args.prefill_chunk < 0:
        raise GptlabError(f"--prefill-chunk must be 0 (off) or a number of tokens, got {args.prefill_chunk}")
    if not 0 <= args.port <= 65535:
        raise GptlabError(f"--port must be in 0..65535, got {args.port}")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.checkpoint, device=device, dtype=getattr(torch, args.dtype))
    if tokenizer is None:
        raise GptlabError(f"{args.checkpoint} has no tokenizer: the server needs one to read prompts")
    name = args.model_name or resolve_checkpoint(args.checkpoint).resolve().name
    api_key = args.api_key or os.environ.get("GPTLAB_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"warning: serving on {args.host} without an API key: anyone who can reach it can use it")
    app = create_app(
        model, tokenizer, model_name=name, max_batch=args.max_batch, max_queue=args.max_queue, api_key=api_key,
        prefill_chunk=args.prefill_chunk or None,
    )
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (max batch {args.max_batch})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
