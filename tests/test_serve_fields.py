"""No request field silently ignored, and logit_bias: every field of OpenAI's request types (as the installed
openai package lists them) is either in the server's schema (implemented) or refused with a 400 naming it and
why; any other field is refused as OpenAI refuses one; logit_bias moves tokens in the engine, the CLI and the
server alike."""

from __future__ import annotations

import httpx
import pytest
import torch
from helpers import ByteTokenizer, tiny_model

from gptlab.generation import SamplingParams, generate_batch
from gptlab.generation.params import InvalidSamplingParam
from gptlab.generation.sampling import sample_next

pytest.importorskip("fastapi")
from gptlab.serve import ServerThread, create_app  # noqa: E402
from gptlab.serve.schemas import UNSUPPORTED  # noqa: E402


class Bytes(ByteTokenizer):
    eot_id = None


@pytest.fixture(scope="module")
def served():
    model = tiny_model(vocab_size=256, block_size=32)
    with ServerThread(create_app(model, Bytes(), model_name="m", max_batch=2, ui=False)) as server:
        yield server, model


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "m", **body}, timeout=60)


ROUTES = {"/v1/completions": {"prompt": "ab", "max_tokens": 2},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}}


def _openai_fields() -> dict[str, set[str]]:
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat

    return {"/v1/completions": set(completions.CompletionCreateParamsBase.__annotations__),
            "/v1/chat/completions": set(chat.CompletionCreateParamsBase.__annotations__)}


def test_every_openai_field_is_implemented_or_refused_by_name(served) -> None:
    server, _ = served
    schema = httpx.get(server.url + "/openapi.json", timeout=60).json()["components"]["schemas"]
    implemented = {"/v1/completions": set(schema["CompletionRequest"]["properties"]),
                   "/v1/chat/completions": set(schema["ChatRequest"]["properties"])}
    for route, fields in _openai_fields().items():
        for field in sorted(fields):
            assert (field in implemented[route]) != (field in UNSUPPORTED), (route, field)
            if field in UNSUPPORTED:
                r = _post(server, route, {**ROUTES[route], field: None})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == field, (route, field, r.text)
                assert err["message"] == f"'{field}' is not supported by this server: {UNSUPPORTED[field]}"
    # tool calls are implemented on chat (tests/test_serve_tools.py); the legacy completions API has no such field
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= implemented["/v1/chat/completions"]
    r = _post(server, "/v1/completions", {**ROUTES["/v1/completions"], "tools": []})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"


def test_an_unknown_field_is_refused_as_openai_refuses_it_and_user_tags_are_taken(served) -> None:
    server, _ = served
    for route, body in ROUTES.items():
        r = _post(server, route, {**body, "temprature": 0.5})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "Unrecognized request argument supplied: temprature", "type": "invalid_request_error",
            "param": "temprature", "code": "unknown_parameter"}
        assert _post(server, route, {**body, "user": "u-1", "safety_identifier": "s"}).status_code == 200


def test_null_is_a_fields_default_as_openai_takes_it(served) -> None:
    # OpenAI's spec marks its optional fields nullable; clients that spell every field send null for "unset"
    server, _ = served
    nulls = ["temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "stream", "seed", "stop",
             "logit_bias", "stream_options", "user", "top_k", "min_p", "repetition_penalty", "ignore_eos"]
    for route, body in ROUTES.items():
        extra = ["echo"] if route == "/v1/completions" else ["logprobs", "top_logprobs", "tools", "tool_choice"]
        want = _post(server, route, {**body, "seed": 3})
        got = _post(server, route, {**body, **dict.fromkeys(nulls + extra), "seed": 3})
        assert got.status_code == 200, got.text
        assert got.json()["choices"] == want.json()["choices"]
    r = _post(server, "/v1/completions", {"prompt": None})  # a required field is still required
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_stream_options_without_stream_is_refused_as_openai_refuses_it(served) -> None:
    server, _ = served
    for route, body in ROUTES.items():
        r = _post(server, route, {**body, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        assert _post(server, route, streamed).status_code == 200


def test_logit_bias_params_are_checked_and_normalized() -> None:
    assert SamplingParams(logit_bias={5: -100, 2: 1.5}).logit_bias == ((2, 1.5), (5, -100))
    assert SamplingParams(logit_bias=[(3, 2)]).logit_bias == ((3, 2),)
    for bad in ({-1: 1.0}, {1: 101.0}, {1: float("nan")}, {"a": 1.0}, [(1, 1.0), (1, 2.0)], [(1,)], 7):
        with pytest.raises(InvalidSamplingParam, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(InvalidSamplingParam, match="must map token ids"):
        SamplingParams(logit_bias={"a": 1.0})
    with pytest.raises(InvalidSamplingParam, match="each token once"):
        SamplingParams(logit_bias=[(1, 1.0), (1, 2.0)])


def test_logit_bias_bans_and_forces_tokens_row_by_row() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)
    before = logits.clone()
    rows = [SamplingParams(temperature=0, logit_bias={1: -100}), SamplingParams(temperature=0),
            SamplingParams(temperature=0.7, seed=1, logit_bias={0: 100})]
    gens = [None, None, torch.Generator().manual_seed(1)]
    assert sample_next(logits, rows, gens) == [3, 1, 0]
    assert torch.equal(logits, before)  # the caller's logits (logprobs read them) are left alone


def test_the_server_and_the_engine_bias_alike(served) -> None:
    server, model = served
    (plain,) = generate_batch(model, [list(b"ab")], SamplingParams(max_new_tokens=6, temperature=0))
    banned = plain.token_ids[0]
    r = _post(server, "/v1/completions", {"prompt": "ab", "max_tokens": 6, "temperature": 0,
                                          "logit_bias": {str(banned): -100}})
    params = SamplingParams(max_new_tokens=6, temperature=0, logit_bias={banned: -100})
    (want,) = generate_batch(model, [list(b"ab")], params, tokenizer=Bytes())
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text and banned not in want.token_ids
    r = _post(server, "/v1/completions", {"prompt": "ab", "max_tokens": 2, "logit_bias": {"256": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    r = _post(server, "/v1/completions", {"prompt": "ab", "max_tokens": 2, "logit_bias": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
