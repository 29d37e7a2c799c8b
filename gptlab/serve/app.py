"""`gptlab serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the generation engine.

Endpoints: POST /v1/completions (`completions`), POST /v1/chat/completions (`chat`), GET /v1/models, GET
/health. Streaming answers are server-sent events in OpenAI's chunk format, ending with `data: [DONE]`
(`streaming`). Concurrent requests share decoding steps (continuous batching, `scheduler`).

Behaviour worth knowing:
* Errors are OpenAI-style bodies {"error": {"message", "type", "param", "code"}}: 400 for malformed JSON,
  wrong types and out-of-range values (FastAPI's 422 is turned into 400, as OpenAI answers), 400 with code
  "context_length_exceeded" for a prompt that leaves no room in the context, 401 for a missing or wrong API
  key, 404 for an unknown model or route, 429 when more than max_queue generations wait, 500 if generation
  fails.
* A prompt longer than prefill_chunk tokens is prefilled that many tokens per step, interleaved with the
  running rows' decoding steps, so a long prompt delays the others by one chunk at a time, not a whole prefill.
* max_tokens is capped so that prompt + completion fit the context (block_size); finish_reason is then
  "length". Without max_tokens, chat completions run to the end of the context (completions default to 16).
* The tokenizer's end-of-text token ends a completion (finish_reason "stop") unless ignore_eos is set.
* logprobs are the model's own distribution (log-softmax of the raw logits, before penalties, temperature and
  filters), one entry per generated token, streamed chunks carrying those of their own tokens.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gptlab.serve.chat import create_chat_completion
from gptlab.serve.completions import create_completion
from gptlab.serve.schemas import ApiError, ChatRequest, CompletionRequest, error_body, validation_error
from gptlab.serve.state import Server


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
    `prefill_chunk`: prompt tokens prefilled per step (None: whole prompts), see `gptlab.generation.Engine`."""
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
            if not hmac.compare_digest(given.encode(), api_key.encode()):  # constant time: no timing oracle
                err = ApiError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'.", code="invalid_api_key"
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
        return await create_completion(server, req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        return await create_chat_completion(server, req, request)

    return app
