"""Everything a request can make large, at and past its bound: tools (how many, how big and how deeply nested
their schemas), response_format's schema (size, nesting, a structure too wide for the grammar engine), stop
strings, logit_bias entries, messages and their content parts, n, and the names echoed back (`model`). Each is a 200
or a 4xx naming the field in OpenAI's error shape: never a 500, a plain-text error, a hang (the client's timeout)
or an error body that repeats the request back (a message is one line of bounded length).

The same bounds hold in the Python API (`SamplingParams`), which the CLI's flags reach too.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from helpers import templated_byte_tokenizer, tiny_model  # noqa: E402

from gptlab.generation.params import (  # noqa: E402
    MAX_LOGIT_BIAS,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    InvalidSamplingParam,
    SamplingParams,
)
from gptlab.serve import ServerThread, create_app  # noqa: E402
from gptlab.serve.schemas import MAX_MESSAGES, MAX_N, MAX_NAME_CHARS, MAX_TOOLS, SERVER_MAX_STOPS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TIMEOUT = 120.0  # a hang's bound, not a performance target
MAX_MESSAGE_CHARS = 400  # an error message names the field and the bound; it never repeats a large value back
ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    # a context that holds 128 tools' descriptions and a 1000-property schema (a byte per token)
    app = create_app(tiny_model(vocab_size=257, block_size=32768), templated_byte_tokenizer("qwen_tools"),
                     model_name="m", max_batch=2, max_queue=64, ui=False)
    with ServerThread(app) as s:
        yield s


def nested(levels: int) -> dict:
    """An object schema `levels` objects deep (each level is two levels of JSON: the object, its properties)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def wide(properties: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}


def tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": function}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# (id, request fields besides the messages, the field a refusal must name, or None: it must be answered)
CHAT_CASES = [
    ("tools-at-bound", {"tools": [tool(f"f{i}") for i in range(MAX_TOOLS)]}, None),
    ("tools-past-bound", {"tools": [tool(f"f{i}") for i in range(MAX_TOOLS + 1)]}, "tools"),
    ("tool-schema-at-depth", {"tools": [tool("f", nested(MAX_SCHEMA_DEPTH // 2 - 1))], "max_tokens": 2}, None),
    ("tool-schema-too-deep", {"tools": [tool("f", nested(150))]}, "tools"),
    ("tool-schema-too-wide", {"tools": [tool("f", wide(1000))], "tool_choice": "required"}, "tools"),
    ("format-at-depth", {"response_format": response_format(nested(MAX_SCHEMA_DEPTH // 2 - 1)), "max_tokens": 2},
     None),
    ("format-too-deep", {"response_format": response_format(nested(150))}, "response_format"),
    ("format-far-too-deep", {"response_format": response_format(nested(400))}, "response_format"),
    ("format-past-size", {"response_format": response_format(wide(MAX_SCHEMA_CHARS // 20))}, "response_format"),
    ("format-too-wide", {"response_format": response_format(wide(1000))}, "response_format"),
    ("format-too-wide-streamed", {"response_format": response_format(wide(1000)), "stream": True},
     "response_format"),
    ("stops-past-bound", {"stop": ["x"] * (SERVER_MAX_STOPS + 1)}, "stop"),
    ("logit-bias-past-bound", {"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ("messages-past-bound", {"messages": [{"role": "user", "content": ""}] * (MAX_MESSAGES + 1)}, "messages"),
    ("content-parts-past-bound", {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] *
                                                (MAX_MESSAGES + 1)}]}, "messages"),
    ("n-past-bound", {"n": MAX_N + 1}, "n"),
    ("model-name-huge", {"model": "m" * 1_000_000}, "model"),
    ("model-name-past-bound", {"model": "m" * (MAX_NAME_CHARS + 1)}, "model"),
]


@pytest.mark.parametrize(("case", "fields", "param"), CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_every_size_a_chat_request_can_grow_is_bounded_with_a_4xx_naming_it(server, case: str, fields: dict,
                                                                           param: str | None) -> None:
    body = {"messages": ASK, "max_tokens": 4, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)  # (streamed too: refused
    # before the answer begins, its grammar walked through its forced start when the row is made)
    if param is None:
        assert r.status_code == 200, r.text[:500]
        return
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["param"] == param, err
    assert "\n" not in err["message"] and len(err["message"]) <= MAX_MESSAGE_CHARS, err["message"][:500]
    assert httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2},
                      timeout=TIMEOUT).status_code == 200  # and the server goes on


def test_the_bounds_are_in_the_openapi_schema(server) -> None:
    schema = httpx.get(server.url + "/openapi.json", timeout=TIMEOUT).json()["components"]["schemas"]
    assert schema["ChatRequest"]["properties"]["messages"]["maxItems"] == MAX_MESSAGES
    assert str(MAX_SCHEMA_DEPTH) in str(schema["JsonSchemaSpec"]["properties"]["schema"])


@pytest.mark.parametrize("schema", [nested(MAX_SCHEMA_DEPTH), nested(400)], ids=["past-depth", "far-past-depth"])
def test_the_python_api_refuses_a_schema_nested_too_deeply_naming_it(schema: dict) -> None:
    for value in (schema, json.dumps(schema)):
        with pytest.raises(InvalidSamplingParam) as e:
            SamplingParams(json_schema=value)
        assert e.value.field == "json_schema" and "levels deep" in str(e.value), e.value
