"""Steering through the server: a request's `steering` entries name directions the server was started with; the
answer equals `generate_batch(steering=...)` of the same request, steered and unsteered requests running together
each answer as alone, steered ones never reuse an unsteered prompt's kept keys, and a server started without
directions refuses the field with a 400 naming it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from helpers import ByteTokenizer, one_line_error, tiny_model

from gptlab.generation import SamplingParams, generate_batch
from gptlab.steering import SteeringVector

pytest.importorskip("fastapi")
from gptlab.serve import ServerThread, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class Bytes(ByteTokenizer):
    eot_id = None


ROUTES = {"/v1/completions": {"prompt": "ab", "max_tokens": 2},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}}


@pytest.fixture(scope="module")
def served():
    model = tiny_model(vocab_size=256, block_size=64)
    up = 4.0 * torch.randn(model.config.n_embd, generator=torch.Generator().manual_seed(3))
    app = create_app(model, Bytes(), model_name="m", max_batch=4, ui=False, prefill_chunk=8, steering={"up": up})
    with ServerThread(app) as server:
        yield server, model, up, app.state.server


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "m", **body}, timeout=60)


def _expected(model, prompt: str, steering: list[SteeringVector], n: int = 12) -> str:
    params = SamplingParams(temperature=0, max_new_tokens=n)
    (gen,) = generate_batch(model, [list(prompt.encode())], params, tokenizer=Bytes(), steering=steering)
    return gen.text


def test_steered_completions_equal_generate_and_share_batches_with_unsteered_ones(served) -> None:
    server, model, up, state = served
    prompt = "The quick brown fox jumps over it. "  # 35 bytes: blocks of 16 kept by the prefix cache
    cache = state.engine.prefix_cache
    plain = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
    assert plain["choices"][0]["text"] == _expected(model, prompt, [])
    hits = cache.stats().hit_tokens
    entry = {"vector": "up", "layer": 1, "scale": 1.5}
    steered_text = _expected(model, prompt, [SteeringVector(up, 1, 1.5)])
    assert steered_text != plain["choices"][0]["text"]

    def ask(i: int) -> str:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, **({"steering": [entry]} if i % 2 else {})}
        return _post(server, "/v1/completions", body).json()["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert answers == [plain["choices"][0]["text"], steered_text] * 4
    # the unsteered repeats reused the first request's blocks (32 tokens each); the steered ones none
    assert cache.stats().hit_tokens - hits == 4 * 32


def test_steered_chat_differs_and_bad_entries_are_400s_naming_the_field(served) -> None:
    server, *_ = served
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0}
    plain = _post(server, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    steered = _post(server, "/v1/chat/completions", {**chat, "steering": [{"vector": "up", "layer": 0, "scale": 3.0}]})
    assert steered.status_code == 200 and steered.json()["choices"][0]["message"]["content"] != plain
    for entry, words in [({"vector": "down", "layer": 0}, "'down' is not a direction"),
                         ({"vector": "up", "layer": 9}, "out of range"), ({"vector": "up", "layer": 0, "scale": 1e9},
                                                                         "steering"),
                         ({"vector": "up", "layer": 0, "file": "/etc/passwd"}, "steering")]:
        r = _post(server, "/v1/completions", {"prompt": "ab", "steering": [entry]})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("steering"), r.text
        assert words in r.json()["error"]["message"], r.text


def test_a_server_without_directions_refuses_steering() -> None:
    model = tiny_model(vocab_size=256, block_size=32)
    with ServerThread(create_app(model, Bytes(), model_name="m", max_batch=2, ui=False)) as server:
        for route, body in ROUTES.items():
            r = _post(server, route, {**body, "steering": [{"vector": "up", "layer": 0}]})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "steering" and "not allowed" in err["message"], r.text
        assert _post(server, "/v1/completions", {**ROUTES["/v1/completions"], "steering": []}).status_code == 200


def test_directions_are_checked_at_start_and_the_flag_in_one_line(tmp_path, capsys) -> None:
    from gptlab.cli import main
    from gptlab.errors import GptlabError

    model = tiny_model(vocab_size=256, block_size=32)
    with pytest.raises(GptlabError, match="'up'.*width"):
        create_app(model, Bytes(), steering={"up": torch.zeros(3)})
    ckpt = str(tmp_path / "unused")  # the flag is checked before any model is loaded
    for spec, words in [("noequals", "NAME=FILE"), ("a=" + str(tmp_path / "none.safetensors"), "missing")]:
        assert main(["serve", ckpt, "--port", "0", "--allow-steering", spec]) == 2  # 8000 may be taken
        assert words in one_line_error(2, capsys.readouterr().err)
