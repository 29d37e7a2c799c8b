"""The web page `gptlab serve` shows at `/`: a chat playground, an attention explorer and activation patching.

The page is three static files shipped in the package (static/: index.html, gptlab.js, gptlab.css), with no build
step and no request outside this server. The playground streams through the server's own
/v1/chat/completions; the explorer reads the JSON endpoints here:

- GET /ui/info: the model's name and shape (layers, heads, context) and the token bound of the endpoints below;
- POST /ui/attention {"text", "layer", "head"}: the prompt's tokens and the (T, T) weights of that layer and head
  (head null: the heads' average), row t = what token t attends to; "heads": true adds every head's (T, T) of the
  layer (the per-head grid);
- POST /ui/lens {"text", "top_k"}: the logit lens, each stage's top_k next-token guesses per position;
- POST /ui/patch {"clean", "corrupt", "point", "answer", "wrong"}: `gptlab patch`'s activation patching
  (`patch_prompts`), the metric per layer and position (or head): one forward per site, so the prompts are bounded to
  MAX_PATCH_TOKENS tokens and the sites to MAX_PATCH_SITES.

The /ui/ endpoints answer under the same API key rule as /v1 (the app's middleware checks both prefixes), so the
page asks for the key when one is set and sends it as a Bearer header; the static files hold no model data and
load without it. Bodies are validated (strict types, bounded text, layer and head in range) and errors are
OpenAI-shaped bodies like the rest of the server. A forward for the page runs in a worker thread beside the
scheduler's, on at most MAX_TOKENS tokens.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from gptlab.errors import GptlabError
from gptlab.inspection.attention import attention_map, check_index
from gptlab.inspection.lens import logit_lens
from gptlab.inspection.patching import PATCH_POINTS, patch_prompts
from gptlab.serve.schemas import ApiError
from gptlab.serve.state import ServedModel

STATIC = Path(__file__).parent / "static"
FILES = {"gptlab.js": "text/javascript", "gptlab.css": "text/css"}  # what /static/ serves, nothing else
GUARDED_PREFIX = "/ui/"  # checked for the API key like /v1
MAX_TOKENS = 256  # tokens a page request may look at: weights are T x T per head, the lens k x T per layer
MAX_CHARS = 16_384
MAX_PATCH_TOKENS = 64  # patching runs one forward per (layer, position): the work grows with both
MAX_PATCH_SITES = 2_048
PatchPoint = Literal[tuple(PATCH_POINTS)]  # type: ignore[valid-type]


def Index(lo: int, hi: int) -> Any:  # noqa: N802 - a type
    """An integer in [lo, hi], a JSON integer only: the page's own protocol has no OpenAI clients to humour, so
    `"layer": 1.0` is refused (unlike the /v1 routes' whole floats)."""
    return Annotated[int, Field(ge=lo, le=hi, strict=True)]


class TextRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")  # a misspelt field is an error, not a default
    text: Annotated[str, Field(min_length=1, max_length=MAX_CHARS)]


class AttentionRequest(TextRequest):
    layer: Index(0, 10_000) = 0
    head: Index(0, 10_000) | None = None
    heads: bool = False  # every head's weights too (the grid)


class LensRequest(TextRequest):
    top_k: Index(1, 20) = 5


Text = Annotated[str, Field(min_length=1, max_length=MAX_CHARS)]
Token = Annotated[str, Field(min_length=1, max_length=64)]


class PatchRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    clean: Text
    corrupt: Text
    point: PatchPoint = "resid_pre"
    answer: Token | None = None
    wrong: Token | None = None


def _bounded(server: ServedModel) -> int:
    return min(MAX_TOKENS, server.context_length)


def _attention(server: ServedModel, req: AttentionRequest) -> dict[str, Any]:
    model = server.engine.model
    for kind, value, count in (("layer", req.layer, model.config.n_layer), ("head", req.head, model.config.n_head)):
        try:
            check_index(kind, value, count)
        except GptlabError:
            raise ApiError(400, f"'{kind}' {value} is out of range: this model has {kind}s 0..{count - 1}",
                           param=kind, code="invalid_value") from None
    amap = _run(lambda: attention_map(model, server.tokenizer, req.text, _bounded(server)))
    weights = amap.select(req.layer, req.head)
    if req.head is None:
        weights = weights.mean(dim=0)
    body = {"tokens": amap.tokens, "token_ids": amap.token_ids, "layer": req.layer, "head": req.head,
            "n_layer": amap.n_layer, "n_head": amap.n_head, "weights": _rounded(weights)}
    if req.heads:
        body["heads"] = [_rounded(w) for w in amap.select(req.layer, None)]
    return body


def _rounded(weights: Any) -> list[list[float]]:
    return [[round(w, 6) for w in row] for row in weights.tolist()]


def _patch(server: ServedModel, req: PatchRequest) -> dict[str, Any]:
    model = server.engine.model
    limit = min(MAX_PATCH_TOKENS, _bounded(server))
    sites = model.config.n_layer * (model.config.n_head if req.point == "z" else limit)
    if sites > MAX_PATCH_SITES:
        limit = MAX_PATCH_SITES // model.config.n_layer
        if req.point == "z" or limit < 1:
            raise ApiError(400, f"patching this model ({model.config.n_layer} layers) is too much work for the page: "
                           "use `gptlab patch`", param="point", code="invalid_value")
    try:
        pmap = patch_prompts(model, server.tokenizer, req.clean, req.corrupt, req.point, req.answer, req.wrong, limit)
    except GptlabError as e:  # each message begins with the flag it is about: --clean, --corrupt, --answer, --wrong
        field = re.match(r"--(\w+)", str(e))
        raise ApiError(400, str(e), param=field.group(1) if field else "clean", code="invalid_value") from None
    return pmap.to_json()


def _lens(server: ServedModel, req: LensRequest) -> dict[str, Any]:
    result = _run(lambda: logit_lens(server.engine.model, server.tokenizer, req.text, req.top_k, _bounded(server)))
    return result.to_json(server.tokenizer)


def _run(work: Any) -> Any:
    """`work()`, its GptlabError (an unknown character, a text too long) a 400 naming the text."""
    try:
        return work()
    except GptlabError as e:
        raise ApiError(400, str(e), param="text", code="invalid_value") from None


def mount_ui(app: FastAPI, server: ServedModel) -> None:
    """Add the page and its endpoints to `app`."""

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> FileResponse:
        if name not in FILES:
            raise ApiError(404, f"no such file: /static/{name}", type="not_found_error")
        return FileResponse(STATIC / name, media_type=FILES[name])

    @app.get("/ui/info", include_in_schema=False)
    async def info() -> dict[str, Any]:
        cfg = server.engine.model.config
        return {"model": server.model_name, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                "n_kv_head": cfg.n_kv_head, "block_size": cfg.block_size, "max_tokens": _bounded(server),
                "chat_template": getattr(server.tokenizer, "chat_template", None) is not None}

    @app.post("/ui/attention", include_in_schema=False)
    async def attention(req: AttentionRequest) -> dict[str, Any]:
        return await run_in_threadpool(_attention, server, req)

    @app.post("/ui/lens", include_in_schema=False)
    async def lens(req: LensRequest) -> dict[str, Any]:
        return await run_in_threadpool(_lens, server, req)

    @app.post("/ui/patch", include_in_schema=False)
    async def patch(req: PatchRequest) -> dict[str, Any]:
        return await run_in_threadpool(_patch, server, req)
