"""The server's protocol: request bodies (pydantic, strict types), OpenAI-style error bodies, and the logprobs
objects of its answers.

Strict: a string where a number belongs is an error, not coerced. No field is silently ignored: an OpenAI field
this server does not implement (`UNSUPPORTED`: suffix, audio, ...) is a 400 naming it and why, and any
other unknown field a 400 as OpenAI answers one ("Unrecognized request argument supplied"). `user` (the caller's
own tag for its end user) is accepted and has no effect on the answer, as with OpenAI. Besides OpenAI's fields,
requests accept vLLM-style extras: top_k, min_p, repetition_penalty, ignore_eos, and gptlab's `steering`.

Every field is bounded here, so that the OpenAPI schema (/openapi.json) states each bound and a request out of
range is a 400 before any work: the server's own policy limits (OpenAI's temperature <= 2, penalties in [-2, 2],
n <= 16, at most 4 stop strings, MAX_PROMPTS prompts, MAX_MESSAGES messages, schemas nested MAX_SCHEMA_DEPTH
levels) and the ranges `SamplingParams` requires, with its
constants (int64 seeds, top_k, logprobs <= 20, stop string length). SamplingParams still checks its own ranges
(every caller goes through it); the routes turn its `InvalidSamplingParam` into a 400 naming the request's field.

An integer field takes a whole float too ("n": 1.0): JSON Schema's "integer" is any number with no fraction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from gptlab.generation.params import (  # torch-free
    INT64_MAX,
    INT64_MIN,
    JSON_OBJECT,
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    MAX_STOP_CHARS,
    schema_depth_problem,
)

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

MAX_N = 16
SERVER_MAX_STOPS = 4  # OpenAI's limit; the engine takes more (generation.params.MAX_STOPS)
MAX_PROMPTS = 64  # prompts in one completions request (each is n generations, bounded by the queue too)
MAX_MESSAGES = 4096  # a chat's messages, and one message's content parts (each is rendered by the template)
MAX_NAME_CHARS = 256  # `model`, ids and the caller's tags


def _whole_number(value: Any) -> Any:
    """1.0 -> 1 (a JSON Schema integer); anything else is left for strict validation."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(lo: int, hi: int, **field: Any) -> Any:  # noqa: N802 - a type
    """An integer in [lo, hi] that also takes a whole float; the bounds go into the OpenAPI schema."""
    return Annotated[int, Field(ge=lo, le=hi, **field), BeforeValidator(_whole_number)]


Count = Int(0, INT64_MAX)  # token counts, top_k: int64, not negative
Seed = Int(INT64_MIN, INT64_MAX)
Choices = Int(1, MAX_N)
NTop = Int(0, MAX_LOGPROBS, description=f"alternatives reported per token, 0..{MAX_LOGPROBS}")
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def _shallow(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema nested at most MAX_SCHEMA_DEPTH levels (deeper ones fail in the grammar's reader and the
    template's tojson, each recursing per level)."""
    if (problem := schema_depth_problem(schema)) is not None:
        raise ValueError(f"the schema {problem}")
    return schema


SchemaObject = Annotated[dict[str, Any], AfterValidator(_shallow),
                         Field(description=f"a JSON schema nested at most {MAX_SCHEMA_DEPTH} levels")]


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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error answer (documents `error_body` in the OpenAPI schema)."""

    error: ErrorDetail


def validation_error(errors: list[dict[str, Any]], content_type: str | None = None) -> ApiError:
    """FastAPI's validation errors as one OpenAI-style 400 whose `param` is the first bad field (`content_type`:
    the request's header, named when the body as a whole is not an object)."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "model_attributes_type":
        # FastAPI reads a body as JSON only when it is sent as JSON (or with no content type): `curl -d` sends
        # application/x-www-form-urlencoded, and the body arrives here as bytes
        sent = "" if content_type is None else f" (it was sent as Content-Type: {content_type[:100]})"
        return ApiError(400, f"The request body must be a JSON object sent as Content-Type: application/json{sent}.",
                        code="invalid_json")
    if first.get("type") == "json_invalid":
        return ApiError(
            400,
            "We could not parse the JSON body of your request: it is not valid JSON.",
            code="invalid_json",
        )
    if first.get("type") == "extra_forbidden":  # a field this server does not take: never ignored silently
        name = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        why = UNSUPPORTED.get(name)
        message = (f"'{name}' is not supported by this server: {why}" if why
                   else f"Unrecognized request argument supplied: {name}")
        return ApiError(400, message, param=name, code="unsupported_parameter" if why else "unknown_parameter")
    # a union field (stop: a string or a list) reports one error per member: the one that says what is wrong
    # is a broken bound (a list too long), not "not a string"
    same_field = [e for e in errors if e.get("loc", ())[:2] == first.get("loc", ())[:2]]
    first = next((e for e in same_field if not str(e.get("type", "")).endswith("_type")), first)
    # pydantic names union members as extra path parts (prompt.str, stop.list[constrained-str]): keep the
    # field path, names and list indices
    path = [str(x) for x in first.get("loc", ()) if x != "body" and (isinstance(x, int) or str(x).isidentifier())]
    path = [x for x in path if x not in ("str", "int", "float", "bool")]
    where = f" for '{'.'.join(path)}'" if path else ""
    return ApiError(
        400, f"Invalid value{where}: {first.get('msg', 'invalid')}", param=path[0] if path else None,
        code="invalid_value",
    )


# OpenAI request fields this server does not implement, with why: a request naming one is refused (400), never
# answered as if the field were not there (free text where JSON or a tool call was asked for)
UNSUPPORTED = {
    "functions": "the deprecated function calls are not implemented: use tools",
    "function_call": "the deprecated function calls are not implemented: use tool_choice",
    "suffix": "insertion (a suffix) is not implemented",
    "best_of": "best_of is not implemented (n is)", "audio": "only text is generated",
    "modalities": "only text is generated", "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "the model has no reasoning settings", "web_search_options": "there is no web search",
    "store": "nothing is stored", "metadata": "nothing is stored", "service_tier": "there is one tier",
    "verbosity": "the model has no verbosity setting", "moderation": "there is no moderation",
    "prompt_cache_key": "prompt caching is not implemented", "prompt_cache_retention": "prompt caching is not "
    "implemented", "prompt_cache_options": "prompt caching is not implemented",
}
TokenKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # a token id, as JSON object keys are strings
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    """OpenAI's json_schema: the schema is always enforced (`strict` false too: the mask costs no quality)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    json_schema: SchemaObject = Field(alias="schema")  # (`schema` is a name pydantic's BaseModel uses)
    description: str | None = Field(None, max_length=4096)
    strict: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]

MAX_STEERING = 8  # steering entries in one request
MAX_STEERING_SCALE = 1e4


class SteeringEntry(BaseModel):
    """gptlab's extra: `scale` times the direction the server was started with under the name `vector`, added to
    the residual stream entering block `layer` (`gptlab.serve.steering`; refused unless the server allows it)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    vector: str = Field(min_length=1, max_length=128)
    layer: Int(0, 10_000)
    scale: float = Field(1.0, ge=-MAX_STEERING_SCALE, le=MAX_STEERING_SCALE)


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions. Only policy limits here; see the module docstring."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: Choices = 1
    stop: StopText | Annotated[list[StopText], Field(max_length=SERVER_MAX_STOPS)] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # extras (vLLM-style)
    top_k: Count = 0
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)  # a cap of this server's, as OpenAI caps its penalties
    ignore_eos: bool = False
    logit_bias: Annotated[dict[TokenKey, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # the caller's tags for its end user (abuse monitoring on OpenAI's side): no effect on the answer, as there
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    safety_identifier: str | None = Field(None, max_length=MAX_NAME_CHARS)

    response_format: ResponseFormat | None = None
    steering: Annotated[list[SteeringEntry], Field(max_length=MAX_STEERING)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An optional field sent as null takes its default, as OpenAI's API does (its spec marks them nullable,
        and clients that spell out every field send null for unset ones)."""
        if not isinstance(data, dict):
            return data
        defaulted = {name for name, f in cls.model_fields.items()
                     if not f.is_required() and type(None) not in get_args(f.annotation)}
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def json_schema(self) -> dict[str, Any] | None:
        """The schema the output must satisfy (SamplingParams.json_schema): None for free text."""
        if isinstance(self.response_format, JsonObjectFormat):
            return JSON_OBJECT
        if isinstance(self.response_format, JsonSchemaFormat):
            return self.response_format.json_schema.json_schema
        return None


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | list[Count]
    max_tokens: Count | None = 16
    echo: bool = False
    logprobs: NTop | None = None

    def texts(self) -> list[str] | None:
        """The prompt texts, or None when the prompt is token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return None
        return list(self.prompt)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


MAX_TOOLS = 128  # OpenAI's limit
ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule for a function's name


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: ToolName


class FunctionSpec(FunctionName):
    """A function the model may call: its arguments are constrained to `parameters` (an object's JSON schema)."""

    description: str | None = Field(None, max_length=4096)
    parameters: SchemaObject | None = None
    strict: bool | None = None  # the schema is always enforced, as response_format's


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ToolSpec(NamedToolChoice):
    function: FunctionSpec


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: ToolName
    arguments: str = Field(max_length=MAX_SCHEMA_CHARS)  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    """A call in an earlier assistant message, fed back to the template."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str = Field(max_length=MAX_NAME_CHARS)
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)] | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's
    tool_call_id: str | None = Field(None, max_length=MAX_NAME_CHARS)  # a tool message's: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(SamplingFields):
    # the schema states the rule `logprobs_count` enforces, so that a client (or a schema-driven fuzzer) reading
    # /openapi.json knows top_logprobs needs logprobs: true
    model_config = ConfigDict(json_schema_extra={
        "dependentSchemas": {"top_logprobs": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
    })
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: NTop | None = None
    tools: Annotated[list[ToolSpec], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def logprobs_count(self) -> int | None:
        """SamplingParams.logprobs for this request: None when not asked."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------------------------------------------------
# Logprobs in answers (entries are gptlab.generation.TokenLogprob, or None for a first prompt token)
# ---------------------------------------------------------------------------------------------------------
def _token(tokenizer: TextTokenizer, token_id: int) -> tuple[str, bytes]:
    """A token's text (a token holding part of a UTF-8 character shows U+FFFD) and its exact bytes."""
    raw = tokenizer.decode_bytes([token_id])
    return raw.decode("utf-8", errors="replace"), raw


def completion_logprobs(tokenizer: TextTokenizer, token_ids: list[int], entries: list[Any],
                        offset: int = 0) -> dict[str, list]:
    """The legacy completions object: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset (from
    `offset`: a streamed chunk's tokens are placed in the whole text); `entries` align with `token_ids` (None: not
    scored, e.g. the first token of an echoed prompt)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, e in zip(token_ids, entries, strict=True):
        text, _ = _token(tokenizer, token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob if e is not None else None)
        out["top_logprobs"].append({_token(tokenizer, t)[0]: lp for t, lp in e.top} if e is not None else None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokenizer: TextTokenizer, entries: list[Any]) -> dict[str, Any]:
    """The chat object: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = _token(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    content = [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}
