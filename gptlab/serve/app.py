"""`gptlab serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the generation engine.

Endpoints: POST /v1/completions (`completions`), POST /v1/chat/completions (`chat`), GET /v1/models and
/v1/models/{name}, GET /health, GET /metrics (Prometheus' text format, `metrics`). Streaming answers are server-sent
events in OpenAI's chunk format, ending with `data: [DONE]` (`streaming`). Concurrent requests share decoding steps
(continuous batching, `scheduler`).

Behaviour worth knowing:
* Errors are OpenAI-style bodies {"error": {"message", "type", "param", "code"}}: 400 for malformed JSON,
  wrong types and out-of-range values (FastAPI's 422 is turned into 400, as OpenAI answers, and the OpenAPI
  schema says so), 400 with code "context_length_exceeded" for a prompt that leaves no room in the context, 401
  for a missing or wrong API key, 404 for an unknown model or route, 408 / 413 for a body too slow / too large
  (`limits`), 429 when more than max_queue generations wait, 500 if generation fails (for that request alone:
  the others in the batch go on).
* Every bound of a request is in its schema (/openapi.json). There is no /docs page: FastAPI's loads Swagger UI
  from a CDN, and no page of a local server should make an external request.
* The API key guards /v1, /metrics and the web page's JSON endpoints (`access`); it is compared as UTF-8 bytes
  in constant time.
* Every middleware is pure ASGI (`access`, `limits`, `metrics`): none touches a streamed chunk.
* A prompt longer than prefill_chunk tokens is prefilled that many tokens per step, interleaved with the
  running rows' decoding steps, so a long prompt delays the others by one chunk at a time, not a whole prefill.
* max_tokens is capped so that prompt + completion fit the context (block_size, or `max_len`); finish_reason is
  then "length". Without max_tokens, chat completions run to the end of the context (completions default to 16).
* The tokenizer's end-of-text token ends a completion (finish_reason "stop") unless ignore_eos is set.
* `steering` (gptlab's extra field) adds named directions to the residual stream, per row; refused (400) unless
  the server was started with directions (`steering`).
* logprobs are the model's own distribution (log-softmax of the raw logits, before penalties, temperature and
  filters), one entry per generated token, streamed chunks carrying those of their own tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from gptlab.generation.prefix_cache import DEFAULT_PREFIX_CACHE_MB
from gptlab.generation.speculative import DRAFT_TOKENS
from gptlab.serve.access import ApiKeyCheck
from gptlab.serve.chat import create_chat_completion
from gptlab.serve.completions import create_completion
from gptlab.serve.limits import BodyLimits
from gptlab.serve.metrics import CONTENT_TYPE, RequestMetrics
from gptlab.serve.schemas import ApiError, ChatRequest, CompletionRequest, ErrorResponse, error_body, validation_error
from gptlab.serve.state import ServedModel
from gptlab.serve.steering import Direction
from gptlab.serve.ui import GUARDED_PREFIX, mount_ui

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

# what a generation route answers, as the OpenAPI schema documents it: 200 (JSON, or server-sent events when
# streamed) or an error body
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "the answer, or its events when streamed"},
    **{
        status: {"model": ErrorResponse, "description": why}
        for status, why in [
            (400, "invalid request: bad JSON, a wrong type or a value out of range, a prompt too long"),
            (401, "missing or wrong API key"), (404, "unknown model"), (408, "the body did not arrive in time"),
            (413, "the body is too large"), (429, "too many generations waiting"), (500, "generation failed"),
        ]
    },
}


def create_app(
    model: Any,
    tokenizer: TextTokenizer,
    *,
    model_name: str = "gptlab",
    max_batch: int = 8,
    max_queue: int = 64,
    api_key: str | None = None,
    prefill_chunk: int | None = 256,
    max_body_bytes: int = 8 * 2**20,
    body_timeout: float = 30.0,
    ui: bool = True,
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
    speculate: Any = None,
    draft_tokens: int = DRAFT_TOKENS,
    steering: Mapping[str, Direction] | None = None,
    scheduler_thread: bool = True,
    stream_interval: float = 0.0,
    max_len: int | None = None,
) -> FastAPI:
    """The FastAPI app serving `model`; its scheduler thread starts and stops with the app's lifespan.
    `prefill_chunk`: prompt tokens prefilled per step (None: whole prompts), see `gptlab.generation.Engine`.
    `max_body_bytes`, `body_timeout`: the largest request body, and how long it may take to arrive. `ui`: the
    web page at / (`gptlab.serve.ui`). `prefix_cache_mb`: the budget of the keys and values of prompts' beginnings
    kept for later requests (0: none; `gptlab.generation.prefix_cache`). `speculate`, `draft_tokens`: speculative
    decoding while one request decodes alone (a draft model or "ngram"; `gptlab.generation.speculative`).
    `steering`: the directions (name -> a (n_embd,) tensor or a safetensors file) a request's `steering` field
    may name (`gptlab.serve.steering`); None: a request asking for steering is refused (400). `scheduler_thread`:
    the engine's loop runs on a thread of its own, started with the app; False: the caller runs
    `app.state.server.scheduler.run()` on its own thread (the app's shutdown ends it), as `gptlab serve` does on its
    main thread (`gptlab.serve.scheduler`). `stream_interval`: seconds a stream waits after each write but the
    first, so that the tokens of the steps meanwhile go out in one write (`gptlab.serve.streaming`; 0: each write
    as soon as a step produced something). `max_len`: the served context, prompt and completion, in tokens (at
    most and by default the model's block_size): each of the max_batch rows' KV cache holds this many positions."""
    server = ServedModel(model, tokenizer, model_name, max_batch, max_queue, prefill_chunk, prefix_cache_mb,
                         speculate, draft_tokens, steering, stream_interval, max_len)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if scheduler_thread:
            server.scheduler.start()
        yield
        server.scheduler.stop()

    app = FastAPI(title="gptlab", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    app.openapi = lambda: _openapi(app, model.config.vocab_size)  # type: ignore[method-assign]
    # the last added runs first: requests are counted (whatever the answer), then the key, then the body's bounds
    app.add_middleware(BodyLimits, max_bytes=max_body_bytes, timeout=body_timeout)
    if api_key:
        app.add_middleware(ApiKeyCheck, key=api_key.encode(), prefixes=("/v1", "/metrics", GUARDED_PREFIX))
    routes: set[str] = set()  # the app's paths, known once every route is added
    app.add_middleware(RequestMetrics, metrics=server.metrics, routes=lambda: routes)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(list(exc.errors()), request.headers.get("content-type"))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # (its headers too: a 405 names the allowed methods)
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": model_name,
            "running": len(server.engine.running),
            "waiting": server.scheduler.waiting,
        }

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    card = {"id": model_name, "object": "model", "created": server.created, "owned_by": "gptlab"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}", responses={404: RESPONSES[404]})  # (`:path`: a name may hold a slash)
    async def model_card(model: str) -> dict[str, Any]:
        if model != model_name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return card

    @app.post("/v1/completions", responses=RESPONSES)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await create_completion(server, req, request)

    @app.post("/v1/chat/completions", responses=RESPONSES)
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        return await create_chat_completion(server, req, request)

    if ui:  # the web page at / and its JSON endpoints (gptlab.serve.ui)
        mount_ui(app, server)
    routes.update(path for route in app.routes if (path := getattr(route, "path", None)))
    return app


def _openapi(app: FastAPI, vocab_size: int) -> dict[str, Any]:
    """FastAPI's schema without its 422 answers (this server answers a bad request 400, `RESPONSES`), and with
    pydantic's own schemas of the bodies: FastAPI's pass through its models writes every bound as a float, and
    INT64_MAX as a float is 2**63, out of range. A prompt of token ids is bounded by this model's vocabulary."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        bodies = [(model, "validation") for model in (CompletionRequest, ChatRequest)]
        _, defs = models_json_schema(bodies, ref_template="#/components/schemas/{model}")
        for form in defs["$defs"]["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
            if form.get("type") == "array" and form["items"].get("type") == "integer":
                form["items"]["maximum"] = vocab_size - 1
        schema["components"]["schemas"].update(defs["$defs"])
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
