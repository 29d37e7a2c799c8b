"""Every request field at its extremes, read off the server's own pydantic schemas (a new field is swept without
editing this file), through /v1/completions, /v1/chat/completions and the web page's /ui/* JSON routes: a 200,
or a 4xx in OpenAI's error shape whose `param` names the field; never a 5xx, never a hang (every request has a
timeout). A sweep of bad requests does not disturb a good request decoding beside it. The Python API's
`generate` / `generate_batch` keyword arguments get the same sweep: a ValueError naming the argument, or a result."""

from __future__ import annotations

import inspect
import math
import threading

import httpx
import pytest
import torch
from helpers import ByteTokenizer, tiny_model

from gptlab.errors import GptlabError
from gptlab.generation import SamplingParams, generate, generate_batch

pytest.importorskip("fastapi")
from gptlab.serve import ServerThread, create_app  # noqa: E402
from gptlab.serve.schemas import ChatRequest, CompletionRequest  # noqa: E402
from gptlab.serve.ui import AttentionRequest, LensRequest  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TIMEOUT = 30.0
# JSON can carry no nan/inf: a float past float64 ("1e999") is what a client sends to mean it
EXTREMES = {"zero": 0, "minus-one": -1, "huge": 2**70, "float": 0.5, "text": "x", "empty": "", "null": None,
            "true": True, "list": [1], "empty-list": [], "table": {"a": 1}, "long-text": "x" * 100_000,
            "long-list": ["x"] * 10_000}


class BytesWithEot(ByteTokenizer):
    eot_id = 0


@pytest.fixture(scope="module")
def server():
    app = create_app(tiny_model(vocab_size=256, block_size=32), BytesWithEot(), model_name="m", max_batch=4,
                     max_queue=64, prefill_chunk=16)
    with ServerThread(app) as thread:
        yield thread


# route -> (schema, a valid body every swept field is added to)
ROUTES = {
    "/v1/completions": (CompletionRequest, {"prompt": "ab", "max_tokens": 2}),
    "/v1/chat/completions": (ChatRequest, {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}),
    "/ui/attention": (AttentionRequest, {"text": "ab"}),
    "/ui/lens": (LensRequest, {"text": "ab"}),
}
CASES = [(route, field) for route, (schema, _) in ROUTES.items() for field in sorted(schema.model_fields)]


def _answered_honestly(r: httpx.Response, field: str, label: str) -> None:
    assert r.status_code < 500, f"{field}={label}: {r.status_code} {r.text[:300]}"
    if r.status_code == 200:
        return
    assert 400 <= r.status_code < 500, (field, label, r.status_code)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    # the field itself, or (for a field that needs another, as top_logprobs needs logprobs) the rule naming it
    named = str(err["param"] or "").split(".")[0] == field or field in err["message"]
    assert named, f"{field}={label}: {err}"
    assert "\n" not in err["message"], err


@pytest.mark.parametrize(("route", "field"), CASES, ids=[f"{r}:{f}" for r, f in CASES])
def test_every_request_field_at_its_extremes_is_a_200_or_a_4xx_naming_it(server, route: str, field: str) -> None:
    _, body = ROUTES[route]
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        for label, value in EXTREMES.items():
            r = client.post(route, json={**body, field: value})
            _answered_honestly(r, field, label)
        # a float past float64 written as raw JSON (no Python float can say it)
        raw = httpx.Request("POST", server.url + route, headers={"content-type": "application/json"},
                            content=f'{{"{field}": 1e999, ' + str(body).replace("'", '"')[1:])
        _answered_honestly(client.send(raw), field, "1e999")


def test_bad_requests_beside_a_good_one_leave_its_answer_alone(server) -> None:
    good = {"prompt": "ab", "max_tokens": 24, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        alone = client.post("/v1/completions", json=good).json()["choices"][0]["text"]
        answers: list[httpx.Response] = []
        runner = threading.Thread(target=lambda: answers.append(client.post("/v1/completions", json=good)))
        runner.start()
        for field in sorted(CompletionRequest.model_fields):
            for value in (-1, 2**70, "x" * 100_000, {"a": 1}):
                assert client.post("/v1/completions", json={**good, field: value}).status_code < 500
        runner.join(TIMEOUT)
    assert not runner.is_alive() and answers[0].status_code == 200
    assert answers[0].json()["choices"][0]["text"] == alone


# --- the Python API: generate / generate_batch keyword arguments -------------------------------------------------
API_VALUES = {**EXTREMES, "nan": math.nan, "inf": math.inf, "minus-inf": -math.inf}
del API_VALUES["long-list"], API_VALUES["long-text"]  # lengths are SamplingParams' (swept in test_recipe_extremes)


def _keywords(fn) -> list[str]:  # noqa: ANN001
    skip = {"model", "idx", "prompts", "params", "controls"}
    return [name for name in inspect.signature(fn).parameters if name not in skip]


def _ends_honestly(call, name: str, label: str) -> None:  # noqa: ANN001
    try:
        call()
    except (ValueError, TypeError, GptlabError) as e:
        message = str(e)
        assert name in message and "\n" not in message, f"{name}={label}: {type(e).__name__}: {message}"


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab_size=256, block_size=16)


@pytest.mark.parametrize("name", _keywords(generate))
def test_every_generate_keyword_at_its_extremes_is_a_result_or_an_error_naming_it(model, name: str) -> None:
    idx = torch.tensor([[1, 2]])
    for label, value in API_VALUES.items():
        kw = {"max_new_tokens": 2, name: value}
        _ends_honestly(lambda kw=kw: generate(model, idx, **kw), name, label)


@pytest.mark.parametrize("name", _keywords(generate_batch))
def test_every_generate_batch_keyword_at_its_extremes_is_a_result_or_an_error_naming_it(model, name: str) -> None:
    for label, value in API_VALUES.items():
        call = lambda value=value: generate_batch(model, [[1, 2]], SamplingParams(max_new_tokens=2),  # noqa: E731
                                                  **{name: value})
        _ends_honestly(call, name, label)
