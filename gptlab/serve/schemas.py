"""The server's protocol: request bodies (pydantic, strict types), OpenAI-style error bodies, and the logprobs
objects of its answers.

Strict: a string where a number belongs is an error, not coerced. Unknown fields are ignored (clients send
`user`, `logit_bias`, ... that gptlab does not act on). Besides OpenAI's fields, requests accept vLLM-style
extras: top_k, min_p, repetition_penalty, ignore_eos.

Ranges are checked in two places, each range once: here only the server's policy limits that the engine does
not care about (OpenAI's temperature <= 2, penalties in [-2, 2], n <= 16, at most 4 stop strings), and in
`SamplingParams` everything that makes a setting meaningless (top_p in (0, 1], top_k >= 0, ...); the routes
turn its `InvalidSamplingParam` into a 400 naming the request's field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gptlab.generation.params import MAX_LOGPROBS  # torch-free

MAX_N = 16
MAX_STOPS = 4


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """FastAPI's validation errors as one OpenAI-style 400, naming the first bad field."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return ApiError(
            400,
            "We could not parse the JSON body of your request: it is not valid JSON.",
            code="invalid_json",
        )
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # pydantic reports union members as extra path parts (e.g. prompt.str); keep the field path
    loc = [x for x in loc if x not in ("str", "int", "list[str]", "list[int]", "float", "bool")]
    param = ".".join(loc) or None
    where = f" for '{param}'" if param else ""
    return ApiError(
        400, f"Invalid value{where}: {first.get('msg', 'invalid')}", param=param, code="invalid_value"
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions. Only policy limits here; see the module docstring."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, le=2)
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # extras (vLLM-style)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = Field(1.0, le=10)  # a cap of this server's, as OpenAI caps its penalties
    ignore_eos: bool = False

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"at most {MAX_STOPS} stop sequences are allowed", param="stop")
        return stops


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, description=f"alternatives reported per token, 0..{MAX_LOGPROBS}")


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, description=f"alternatives reported per token, 0..{MAX_LOGPROBS}")

    def logprobs_count(self) -> int | None:
        """SamplingParams.logprobs for this request: None when not asked."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------------------------------------------------
# Logprobs in answers (entries are gptlab.generation.TokenLogprob, or None for a first prompt token)
# ---------------------------------------------------------------------------------------------------------
def _token(tokenizer: Any, token_id: int) -> tuple[str, bytes]:
    """A token's text (a token holding part of a UTF-8 character shows U+FFFD) and its exact bytes."""
    raw = tokenizer.decode_bytes([token_id])
    return raw.decode("utf-8", errors="replace"), raw


def completion_logprobs(tokenizer: Any, token_ids: list[int], entries: list[Any]) -> dict[str, list]:
    """The legacy completions object: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset;
    `entries` align with `token_ids` (None: not scored, e.g. the first token of an echoed prompt)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token_id, e in zip(token_ids, entries, strict=True):
        text, _ = _token(tokenizer, token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob if e is not None else None)
        out["top_logprobs"].append({_token(tokenizer, t)[0]: lp for t, lp in e.top} if e is not None else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokenizer: Any, entries: list[Any]) -> dict[str, Any]:
    """The chat object: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = _token(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    content = [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}
