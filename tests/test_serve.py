"""The OpenAI-compatible server, started for real (uvicorn on a free loopback port) with a tiny saved model.

Answers are checked against the engine run directly in this process (greedy), errors against OpenAI's error
shape, and 16 concurrent clients against the same requests made one at a time.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from helpers import tiny_model  # noqa: E402

from gptlab.checkpoint import save_model  # noqa: E402
from gptlab.generation import SamplingParams, generate_batch  # noqa: E402
from gptlab.loading import load_model  # noqa: E402
from gptlab.serve import DEFAULT_CHAT_STOP, ServerThread, create_app, render_chat  # noqa: E402
from gptlab.tokenizer import CharTokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "test-key"
NAME = "tiny-char"
VOCAB = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz .,:;!?'\n"
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = CharTokenizer.from_text(VOCAB)
    path = save_model(tmp_path_factory.mktemp("serve") / "ckpt", tiny_model(vocab_size=tok.vocab_size), tok)
    model, tokenizer = load_model(path)
    # prompts over 8 tokens are prefilled in chunks, interleaved with the other rows' decoding
    app = create_app(model, tokenizer, model_name=NAME, max_batch=6, max_queue=64, api_key=KEY, prefill_chunk=8)
    with ServerThread(app) as server:
        yield server, model, tokenizer, app.state.server


@pytest.fixture(scope="module")
def client(served):
    server = served[0]
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


def reference(model, tokenizer, prompt: str, max_tokens: int, stop=()) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) from the engine itself, greedy."""
    params = SamplingParams(temperature=0, max_new_tokens=max_tokens, stop=stop)
    (gen,) = generate_batch(model, [tokenizer.encode(prompt)], params, tokenizer=tokenizer)
    return gen.text, gen.finish_reason, len(gen.token_ids)


def post(server, path: str, body, key: str | None = KEY, raw: bytes | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(server.url + path, content=raw, headers=headers, timeout=TIMEOUT)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=TIMEOUT)


# ---------------------------------------------------------------------------------------------------------
# The happy paths, through the official client
# ---------------------------------------------------------------------------------------------------------
def test_models_and_health(served, client):
    server = served[0]
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    other = httpx.get(server.url + "/v1/models/org/other", headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT)
    _assert_error(other, 404, param="model", code="model_not_found")
    health = httpx.get(server.url + "/health", timeout=TIMEOUT)  # no key needed
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_equals_the_engine_and_counts_usage(served, client):
    _, model, tok, _ = served
    out = client.completions.create(model=NAME, prompt="Hello there", max_tokens=20, temperature=0)
    text, finish, n = reference(model, tok, "Hello there", 20)
    assert out.choices[0].text == text and out.choices[0].finish_reason == finish == "length"
    assert out.usage.prompt_tokens == len("Hello there") and out.usage.completion_tokens == n == 20
    assert out.usage.total_tokens == len("Hello there") + 20


def test_streamed_completion_equals_the_plain_one(served, client):
    plain = client.completions.create(model=NAME, prompt="Once upon", max_tokens=25, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt="Once upon", max_tokens=25, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 25


def test_prompt_list_n_seed_and_stop(served, client):
    _, model, tok, _ = served
    out = client.completions.create(model=NAME, prompt=["Ab", "Cd"], max_tokens=10, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [reference(model, tok, p, 10)[0] for p in ("Ab", "Cd")]
    assert out.usage.prompt_tokens == 4
    a = client.completions.create(model=NAME, prompt="Hi", max_tokens=15, temperature=1.0, n=2, seed=5)
    b = client.completions.create(model=NAME, prompt="Hi", max_tokens=15, temperature=1.0, n=2, seed=5)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    full = reference(model, tok, "Hi", 15)[0]
    stop = full[3:5]
    out = client.completions.create(model=NAME, prompt="Hi", max_tokens=15, temperature=0, stop=[stop])
    assert out.choices[0].text == full.split(stop)[0] and out.choices[0].finish_reason == "stop"


def test_requests_sharing_a_prefix_reuse_its_keys_and_answer_as_without(served, client):
    """The prefix cache is on by default: a second request starting as the first prefills only what is new (in
    chunks, as this server prefills), and answers as the engine does without it."""
    _, model, tokenizer, state = served
    cache = state.engine.prefix_cache
    prefix = "The quick brown fox jumps over the lazy dog. "  # 45 characters: 2 whole blocks of 16
    before = cache.stats().hit_tokens
    for end in ("Then", "And so"):
        out = client.completions.create(model=NAME, prompt=prefix + end, max_tokens=6, temperature=0)
        assert out.choices[0].text == reference(model, tokenizer, prefix + end, 6)[0]
    assert cache.stats().hit_tokens - before == 32


def test_max_tokens_is_capped_by_the_context(served, client):
    prompt = "abcdefghij" * 6  # 60 of the 64 positions
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=100, temperature=0)
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"


def test_a_served_context_shorter_than_the_models_bounds_prompts_and_completions(served):
    """create_app(max_len=24) (`gptlab serve --max-model-len 24`) on a model of 64 positions: the KV cache holds 24
    positions a row, a prompt of 24 tokens or more is refused naming 24, and max_tokens is capped at what the 24
    leave; the tokens that fit are the model's own."""
    _, model, tokenizer, _ = served
    app = create_app(model, tokenizer, model_name=NAME, max_batch=2, max_queue=8, api_key=KEY, ui=False, max_len=24)
    assert app.state.server.engine.cache.k.shape[-2] == 24
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
        prompt = "abcdefghij" * 2  # 20 of the 24 positions
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=100, temperature=0)
        assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
        assert out.choices[0].text == reference(model, tokenizer, prompt, 4)[0]
        err = post(server, "/v1/completions", {"prompt": "x" * 24, "max_tokens": 1})
        assert err.status_code == 400 and err.json()["error"]["code"] == "context_length_exceeded"
        assert "maximum context length is 24 tokens" in err.json()["error"]["message"]


def test_chat_plain_and_streamed(served, client):
    _, model, tok, _ = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    prompt, templated = render_chat(tok, messages)
    assert not templated and prompt == "System: Be brief.\nUser: Hi!\nAssistant:"
    text, finish, _ = reference(model, tok, prompt, 12, stop=[DEFAULT_CHAT_STOP])
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == text
    assert out.choices[0].finish_reason == finish and out.usage.prompt_tokens == len(prompt)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish


def test_completion_logprobs_and_echo_equal_the_engine(served, client):
    _, model, tok, _ = served
    prompt = "To be"
    params = SamplingParams(temperature=0, max_new_tokens=10, logprobs=2, prompt_logprobs=True)
    (ref,) = generate_batch(model, [tok.encode(prompt)], params, tokenizer=tok)
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, logprobs=2, echo=True)
    choice = out.choices[0]
    assert choice.text == prompt + ref.text
    lp = choice.logprobs
    assert "".join(lp.tokens) == prompt + ref.text and len(lp.tokens) == len(prompt) + 10
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    expected = [e.logprob for e in ref.prompt_logprobs[1:] + ref.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # streamed: the chunks' logprobs add up to the same lists
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert sum((c.choices[0].logprobs.tokens for c in chunks), []) == lp.tokens
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == lp.token_logprobs
    assert sum((c.choices[0].logprobs.text_offset for c in chunks), []) == lp.text_offset  # into the whole text
    # echo without logprobs: the prompt comes back, nothing is scored
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None
    # max_tokens 0: the prompt alone, scored (how a client scores a text with the legacy API)
    scored = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, logprobs=2, echo=True)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(prompt)]


def test_chat_logprobs_equal_the_engine(served, client):
    _, model, tok, _ = served
    messages = [{"role": "user", "content": "Hi!"}]
    prompt, _ = render_chat(tok, messages)
    params = SamplingParams(temperature=0, max_new_tokens=8, stop=[DEFAULT_CHAT_STOP], logprobs=3)
    (ref,) = generate_batch(model, [tok.encode(prompt)], params, tokenizer=tok)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in ref.token_ids]
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)  # greedy
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)
    assert all(c.top_logprobs == [] for c in streamed)
    assert client.chat.completions.create(model=NAME, messages=messages, max_tokens=2).choices[0].logprobs is None


def test_chat_template_is_rendered_with_jinja():
    class Tok:
        chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}" \
                        "{% if add_generation_prompt %}<assistant>{% endif %}"
        eot_id = None

    text, templated = render_chat(Tok(), [{"role": "user", "content": "yo"}])
    assert templated and text == "<user>yo<assistant>"


def test_raw_stream_is_sse_ending_with_done(served):
    server = served[0]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=TIMEOUT,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "Ab", "max_tokens": 3, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[0][6:])["object"] == "text_completion"


# ---------------------------------------------------------------------------------------------------------
# Errors: OpenAI-style bodies, and the server keeps serving
# ---------------------------------------------------------------------------------------------------------
def _assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


def test_bad_requests_get_openai_errors(served, client):
    server = served[0]
    ok = {"prompt": "Hi", "max_tokens": 2}
    _assert_error(post(server, "/v1/completions", None, raw=b'{"prompt": "Hi", '), 400, code="invalid_json")
    form = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "Hi"}', timeout=TIMEOUT,  # as `curl -d`
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/x-www-form-urlencoded"})
    _assert_error(form, 400, code="invalid_json")
    assert "application/x-www-form-urlencoded" in form.json()["error"]["message"]
    _assert_error(post(server, "/v1/completions", [ok]), 400, code="invalid_json")  # JSON, not an object
    _assert_error(post(server, "/v1/completions", {**ok, "max_tokens": "ten"}), 400, param="max_tokens")
    _assert_error(post(server, "/v1/completions", {**ok, "max_tokens": -1}), 400, param="max_tokens")
    _assert_error(post(server, "/v1/completions", {**ok, "temperature": 2.5}), 400, param="temperature")
    _assert_error(post(server, "/v1/completions", {**ok, "temperature": "hot"}), 400, param="temperature")
    _assert_error(post(server, "/v1/completions", {"max_tokens": 2}), 400, param="prompt")
    _assert_error(post(server, "/v1/completions", {**ok, "model": "gpt-9"}), 404, code="model_not_found")
    _assert_error(post(server, "/v1/completions", {**ok, "prompt": "x" * 64}), 400,
                  code="context_length_exceeded")
    unknown = post(server, "/v1/completions", {**ok, "prompt": "caf\u00e9"})
    _assert_error(unknown, 400, param="prompt")  # said of the prompt, without the advice to prepare other data
    message = unknown.json()["error"]["message"]
    assert "'prompt' has 1 character(s) not in the model's char vocabulary" in message and "prepare" not in message
    _assert_error(post(server, "/v1/completions", {**ok, "stop": ["a", "b", "c", "d", "e"]}), 400, param="stop")
    _assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, param="messages")
    _assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}), 400)
    _assert_error(post(server, "/v1/nothing", ok), 404)
    _assert_error(post(server, "/v1/completions", {**ok, "logprobs": 21}), 400, param="logprobs")
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    _assert_error(post(server, "/v1/chat/completions", {**chat, "top_logprobs": 2}), 400, param="top_logprobs")
    # ranges SamplingParams checks: a 400 that names the request's own field
    for field, value in [("top_p", 1.5), ("top_p", 0), ("top_k", -1), ("min_p", 2.0), ("temperature", -0.5),
                         ("repetition_penalty", 0.0), ("stop", [""])]:
        _assert_error(post(server, "/v1/completions", {**ok, field: value}), 400, param=field, code="invalid_value")
    _assert_error(post(server, "/v1/chat/completions", {**chat, "max_completion_tokens": -1}), 400,
                  param="max_completion_tokens")
    _assert_error(post(server, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}), 400,
                  param="top_logprobs")
    # a chat's rendered prompt, refused: the request's field is messages (it has no prompt)
    for content, code in [("caf\u00e9", None), ("x" * 60, "context_length_exceeded")]:
        body = {**chat, "messages": [{"role": "user", "content": content}]}
        refused = post(server, "/v1/chat/completions", body)
        _assert_error(refused, 400, param="messages", code=code)
        assert code or "'messages' has 1 character(s)" in refused.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="Hi", max_tokens=-5)
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_api_key_is_required(served):
    server = served[0]
    body = {"prompt": "Hi", "max_tokens": 1}
    _assert_error(post(server, "/v1/completions", body, key=None), 401, code="invalid_api_key")
    _assert_error(post(server, "/v1/completions", body, key="wrong"), 401, code="invalid_api_key")
    r = httpx.get(server.url + "/v1/models", timeout=TIMEOUT)
    _assert_error(r, 401)
    assert post(server, "/v1/completions", body).status_code == 200


def test_a_client_that_leaves_mid_stream_frees_its_row(served, client):
    server, _, _, state = served
    with httpx.stream("POST", server.url + "/v1/completions", timeout=TIMEOUT,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "Ab", "max_tokens": 50, "temperature": 0, "stream": True}) as r:
        next(r.iter_lines())  # read one event, then hang up
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=3).usage.completion_tokens == 3


def test_too_many_waiting_generations_get_429(tmp_path):
    tok = CharTokenizer.from_text(VOCAB)
    app = create_app(tiny_model(vocab_size=tok.vocab_size), tok, model_name=NAME, max_batch=1, max_queue=2)
    with ServerThread(app) as server:
        r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": 3}, key=None)
        _assert_error(r, 429, code="rate_limit_exceeded")
        assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": 2}, key=None).status_code \
            == 200


# ---------------------------------------------------------------------------------------------------------
# Continuous batching
# ---------------------------------------------------------------------------------------------------------
def test_16_concurrent_clients_get_what_each_gets_alone(served, client):
    state = served[3]
    prompts = [f"{w} {i}" for i, w in enumerate("Alpha Beta Gamma Delta Eps Zeta Eta Theta".split() * 2)]
    prompts = [p.replace(str(i), "abcdefghijklmnop"[i]) for i, p in enumerate(prompts)]
    lengths = [8 + 3 * (i % 5) for i in range(16)]  # rows finish at different steps, so others join mid-run

    def ask(i: int) -> str:
        kind = i % 2
        if kind == 0:
            out = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=lengths[i], temperature=0)
            return out.choices[0].text
        out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompts[i]}],
                                             max_tokens=lengths[i], temperature=0)
        return out.choices[0].message.content

    alone = [ask(i) for i in range(16)]
    state.scheduler.max_rows_seen = 0
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, range(16), timeout=120))
    assert together == alone
    assert state.scheduler.max_rows_seen > 1  # requests really shared decoding steps


def test_serve_command_rejects_bad_flags_in_one_line(capsys, tmp_path):
    from gptlab.cli import main

    ckpt = str(tmp_path / "unused")  # the flags are checked before any model is loaded
    for flags, words in [(["--max-batch", "0"], "--max-batch"), (["--prefill-chunk", "-1"], "--prefill-chunk"),
                         (["--port", "70000"], "--port"), (["--prefix-cache-mb", "nan"], "--prefix-cache-mb"),
                         (["--stream-interval", "-1"], "--stream-interval"),
                         (["--stream-interval", "nan"], "--stream-interval")]:
        assert main(["serve", ckpt, *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and err.count("\n") == 1


def test_a_stream_interval_sends_the_steps_meanwhile_in_one_chunk(served, monkeypatch):
    """With stream_interval, a stream writes at most once an interval after its first token, each choice's tokens
    since the last write in one chunk: the same text and logprobs as the plain answer, in fewer chunks."""
    _, model, tokenizer, _ = served
    interval, tokens = 0.2, 30
    app = create_app(model, tokenizer, model_name=NAME, max_batch=2, ui=False, prefix_cache_mb=0,
                     stream_interval=interval)
    engine = app.state.server.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.02), step())[1])  # several steps an interval
    with ServerThread(app) as server:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        ask = dict(model=NAME, prompt="Once upon", max_tokens=tokens, temperature=0, logprobs=1)
        plain = api.completions.create(**ask)
        start = time.perf_counter()
        chunks = [c for c in api.completions.create(**ask, stream=True) if c.choices]
        elapsed = time.perf_counter() - start
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed == plain.choices[0].logprobs.tokens and len(streamed) == tokens
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(chunks) <= 2 + elapsed / interval  # the first at once, then one write an interval
