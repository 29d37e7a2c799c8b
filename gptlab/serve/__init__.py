"""The OpenAI-compatible server, one module per job, each importing only those listed before it:

    schemas        protocol: request bodies, error bodies, logprobs objects
    limits         request bodies too large (413) or too slow (408)
    access         the API key (401), a pure ASGI middleware
    metrics        GET /metrics: Prometheus counters, histograms and gauges; requests counted by route and status
    scheduler      the thread that runs the engine (continuous batching), a step's events delivered together
    steering       a request's steering entries -> vectors, over the directions named at start-up
    state          ServedModel: what the routes share; a request -> generations
    streaming      server-sent events
    completions    POST /v1/completions
    chat           POST /v1/chat/completions: messages -> prompt text (the chat template), where replies stop
    app            create_app: the FastAPI app, its middleware (all pure ASGI), error handlers
    thread         ServerThread: uvicorn in a background thread (tests, benchmarks)

The names below load on first use, so importing one module (e.g. the schemas) does not import them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gptlab.lazy import lazy_exports

if TYPE_CHECKING:
    from gptlab.serve.app import create_app
    from gptlab.serve.chat import DEFAULT_CHAT_STOP, render_chat
    from gptlab.serve.thread import ServerThread

_LAZY = {
    "create_app": "gptlab.serve.app",
    "ServerThread": "gptlab.serve.thread",
    "render_chat": "gptlab.serve.chat",
    "DEFAULT_CHAT_STOP": "gptlab.serve.chat",
}
__all__ = ["create_app", "ServerThread", "render_chat", "DEFAULT_CHAT_STOP"]  # = _LAZY's names

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
