"""The server as a hostile (or merely careless) client would use it: values at and past every bound, bodies too
large or too slow, clients that hang up, a request that fails mid-batch, 200 clients at once, and schemathesis
against the server's own OpenAPI schema.

Each test drives a real uvicorn server on a loopback port (`ServerThread`) over a tiny random model with a
byte-level tokenizer (any text is a valid prompt). Where a test needs requests to overlap, the engine's decoding
step is slowed down (`slow_steps`), which changes no answer.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("fastapi")

from helpers import ByteTokenizer, one_line_error, tiny_model  # noqa: E402

from gptlab.generation import SamplingParams, generate_batch  # noqa: E402
from gptlab.generation.params import INT64_MAX, INT64_MIN, MAX_STOP_CHARS, InvalidSamplingParam  # noqa: E402
from gptlab.generation.prompts import MAX_CHARS_PER_TOKEN  # noqa: E402
from gptlab.serve import ServerThread, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TIMEOUT = 30.0
BLOCK = 256  # long enough that a generation run to the end of the context outlasts the steps of a test


class BytesWithEot(ByteTokenizer):
    """One token per byte, and 0 as end-of-text (so an empty prompt is valid)."""

    eot_id = 0


@pytest.fixture(scope="module")
def hostile():
    """(server thread, ServedModel state) over a tiny model: 4 rows, at most 16 generations waiting."""
    app = create_app(tiny_model(vocab_size=256, block_size=BLOCK), BytesWithEot(), model_name="tiny", max_batch=4,
                     max_queue=16, prefill_chunk=16, max_body_bytes=2**20, body_timeout=2.0)
    with ServerThread(app) as server:
        yield server, app.state.server


@pytest.fixture
def slow_steps(hostile, monkeypatch):
    """Every decoding step takes at least 20 ms more, so that requests overlap in the batch."""
    engine = hostile[1].engine
    step = engine.step

    def slow():  # noqa: ANN202
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine, "step", slow)


def post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT, **kw)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def raw_request(server, head: bytes, body: bytes = b"", read: bool = True) -> tuple[socket.socket, bytes]:
    """Send `head` + `body` on a new socket; with `read`, the whole answer (the server closes or it is done)."""
    sock = socket.create_connection((server.host, server.port), timeout=TIMEOUT)
    sock.sendall(head + body)
    if not read:
        return sock, b""
    data = b""
    while b"\r\n\r\n" not in data or len(data) < _answer_length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return sock, data


def _answer_length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(head) + 4 + int(line.split(b":")[1])
    return 1 << 62  # no length: read until the server closes


def parse_answer(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def reference(prompt: str, max_tokens: int, state) -> str:
    params = SamplingParams(temperature=0, max_new_tokens=max_tokens)
    (gen,) = generate_batch(state.engine.model, [list(prompt.encode())], params, tokenizer=state.tokenizer)
    return gen.text


# ---------------------------------------------------------------------------------------------------------
# Bounds at the door
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value", "requirement"),
    [("top_k", 2**70, "int64"), ("top_k", INT64_MAX + 1, "int64"), ("max_new_tokens", 2**63, "int64"),
     ("top_k", -1, "in [0, "),
     ("seed", 2**64, "int64"), ("seed", INT64_MIN - 1, "int64"), ("stop", ["x"] * 65, "at most 64"),
     ("stop", ["x" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS} characters"), ("logprobs", 21, "[0, 20]")],
)
def test_sampling_params_bound_every_integer(field, value, requirement):
    with pytest.raises(InvalidSamplingParam) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field and requirement in e.value.requirement


def test_sampling_params_extremes_decode():
    """The largest values the bounds let through work in a batch (torch holds them)."""
    model = tiny_model(vocab_size=256, block_size=BLOCK)
    prompts = [[1, 2, 3]] * 3
    params = [SamplingParams(top_k=INT64_MAX, seed=INT64_MAX, max_new_tokens=5),
              SamplingParams(top_k=1, seed=INT64_MIN, max_new_tokens=5),
              SamplingParams(temperature=0, max_new_tokens=5)]
    from gptlab.generation import Engine

    engine = Engine(model, max_batch=3)
    gens = engine.run([engine.prepare(p, sp) for p, sp in zip(prompts, params, strict=True)])
    assert all(len(g.token_ids) == 5 for g in gens)
    assert gens[1].token_ids == gens[2].token_ids  # top_k 1 is greedy


def test_sample_command_names_the_flag_of_an_unbounded_value(capsys, tmp_path):
    from gptlab.cli import main

    for flags, words in [(["--top-k", str(2**70)], "--top-k"), (["--seed", str(2**64)], "--seed")]:
        rc = main(["sample", str(tmp_path / "unused"), *flags])  # checked before any model is loaded
        assert words in one_line_error(rc, capsys.readouterr().err)


def test_values_out_of_bounds_get_a_400_naming_the_field(hostile):
    server, state = hostile
    ok = {"prompt": "Hi", "max_tokens": 2}
    cases = [("top_k", 2**70), ("top_k", -1), ("seed", 2**64), ("seed", INT64_MIN - 1), ("n", 17), ("n", 0),
             ("n", 1.5), ("n", "1"), ("n", True), ("max_tokens", 2**70), ("max_tokens", -1), ("logprobs", 21),
             ("temperature", 2.5), ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("min_p", 1.5),
             ("stop", ["a"] * 5), ("stop", "s" * (MAX_STOP_CHARS + 1)), ("stop", [""]), ("prompt", ["a"] * 65),
             ("prompt", [1, -2]), ("prompt", [1, 2**70]), ("repetition_penalty", 0)]
    for field, value in cases:
        assert_openai_error(post(server, "/v1/completions", {**ok, field: value}), 400, param=field)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for field, value in [("top_logprobs", 21), ("max_completion_tokens", 2**64), ("seed", 2**63)]:
        assert_openai_error(post(server, "/v1/chat/completions", {**chat, "logprobs": True, field: value}), 400,
                            param=field)
    # the bounds themselves are served, and a whole float is an integer (JSON Schema's "integer")
    ok = {"prompt": "a" * (BLOCK - 6), "max_tokens": 2}  # (max_tokens INT64_MAX: 6 tokens, the room left)
    for extra in [{"n": 1.0}, {"top_k": INT64_MAX, "seed": INT64_MAX}, {"seed": INT64_MIN}, {"max_tokens": 2.0},
                  {"max_tokens": INT64_MAX}, {"stop": ["s" * MAX_STOP_CHARS] * 4}, {"logprobs": 20}]:
        r = post(server, "/v1/completions", {**ok, "temperature": 1.0, **extra})
        assert r.status_code == 200, (extra, r.text)
    assert state.scheduler.steps > 0 and len(state.engine.running) == 0


def test_a_prompt_over_the_context_is_refused_before_it_is_tokenized(hostile, monkeypatch):
    server, state = hostile
    calls = []
    encode = state.tokenizer.encode
    monkeypatch.setattr(state.tokenizer, "encode", lambda text, **kw: calls.append(len(text)) or encode(text, **kw),
                        raising=False)
    too_long = "a" * (BLOCK * MAX_CHARS_PER_TOKEN + 1)
    err = assert_openai_error(post(server, "/v1/completions", {"prompt": too_long}), 400, param="prompt")
    assert err["code"] == "context_length_exceeded" and calls == []
    err = assert_openai_error(post(server, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": too_long[:-10]}, {"role": "user", "content": "b" * 10}]}), 400, param="messages")
    assert err["code"] == "context_length_exceeded" and calls == []
    # tokenized, and then too long for the context: the token count is what decides
    err = assert_openai_error(post(server, "/v1/completions", {"prompt": "a" * BLOCK}), 400, param="prompt")
    assert err["code"] == "context_length_exceeded" and calls == [BLOCK]
    lone_surrogate = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "a\\ud800"}', timeout=TIMEOUT,
                                headers={"Content-Type": "application/json"})
    assert_openai_error(lone_surrogate, 400, param="prompt")


def test_an_empty_prompt_counts_the_end_of_text_it_starts_from(hostile):
    server, _ = hostile
    for prompt in ["", [], [""]]:
        body = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 0}).json()
        # the prompt the model read, as echo shows it
        assert body["usage"]["prompt_tokens"] == 1 == len(body["choices"][0]["logprobs"]["tokens"]) - 2, body


def test_openapi_documents_400_and_the_bounds_and_there_is_no_cdn_page(hostile):
    server, _ = hostile
    schema = httpx.get(server.url + "/openapi.json", timeout=TIMEOUT).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"400", "413", "429"} <= set(responses)
    assert "HTTPValidationError" not in json.dumps(schema)
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["n"]["maximum"] == 16 and fields["top_k"]["maximum"] == INT64_MAX
    assert fields["seed"]["anyOf"][0].items() >= {"minimum": INT64_MIN, "maximum": INT64_MAX}.items()
    assert any(m.get("maxItems") == 4 for m in fields["stop"]["anyOf"])
    ids = [m for m in fields["prompt"]["anyOf"] if m.get("type") == "array" and m["items"].get("type") == "integer"]
    assert ids[0]["items"]["maximum"] == 255  # the model's vocabulary: an id past it is outside the schema too
    chat = schema["components"]["schemas"]["ChatRequest"]  # the rule a 400 enforces is stated, not only enforced
    assert chat["dependentSchemas"]["top_logprobs"] == {"required": ["logprobs"],
                                                        "properties": {"logprobs": {"const": True}}}
    for page in ("/docs", "/redoc"):  # FastAPI's pages load their scripts from a CDN: there are none
        assert httpx.get(server.url + page, timeout=TIMEOUT).status_code == 404


# ---------------------------------------------------------------------------------------------------------
# API key, device, binding
# ---------------------------------------------------------------------------------------------------------
def test_a_non_ascii_api_key_is_compared_as_utf8_bytes(monkeypatch):
    import hmac

    key = "clé-🔑"
    compared = []
    compare = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append((a, b)) or compare(a, b))
    app = create_app(tiny_model(vocab_size=256), ByteTokenizer(), api_key=key, max_batch=1)
    with ServerThread(app) as server:
        def ask(header: bytes) -> int:
            return post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1},
                        headers={"Authorization": header}).status_code

        assert ask(b"Bearer " + key.encode()) == 200
        assert ask(b"Bearer " + key.encode("latin-1", errors="replace")) == 401
        assert ask(b"Bearer cl\xe9-") == 401
    assert all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in compared) and len(compared) == 3


@pytest.mark.parametrize("device", ["foo", "meta", "cuda"])
def test_serve_with_a_device_this_machine_lacks_is_one_line(device, capsys, tmp_path):
    import torch

    from gptlab.cli import main

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    rc = main(["serve", str(tmp_path / "unused"), "--device", device])  # before the checkpoint is looked at
    assert "--device" in one_line_error(rc, capsys.readouterr().err)


def test_serve_binds_to_loopback_unless_told(capsys):
    from gptlab.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "ckpt"]).host == "127.0.0.1"
    assert ServerThread.__init__.__defaults__[0] == "127.0.0.1"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert "127.0.0.1: this machine only" in " ".join(capsys.readouterr().out.split())


# ---------------------------------------------------------------------------------------------------------
# Bodies: too large, too slow, and tokenizing off the event loop
# ---------------------------------------------------------------------------------------------------------
def test_bodies_over_the_limit_get_413_without_being_read(hostile):
    server, _ = hostile
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\n\r\n")
    sock, data = raw_request(server, head, b'{"prompt": "' + b"a" * 1000)
    sock.close()
    status, body = parse_answer(data)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    # no Content-Length: counted as it arrives
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"a" * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(17))  # 1.06 MB > 1 MB
    sock, data = raw_request(server, head, b'c\r\n{"prompt": "\r\n' + body)
    sock.close()
    status, answer = parse_answer(data)
    assert status == 413 and set(answer["error"]) == {"message", "type", "param", "code"}
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_a_slow_partial_body_holds_no_row_and_times_out(hostile):
    server, state = hostile
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    sock, _ = raw_request(server, head, b'{"prompt": "Hi", ', read=False)
    try:
        # four rows' worth of requests are served while the partial body waits
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: post(server, "/v1/completions", {"prompt": f"Hi {i}", "max_tokens": 3}),
                                    range(4)))
        assert [r.status_code for r in answers] == [200] * 4
        data = b""
        while b"\r\n\r\n" not in data or len(data) < _answer_length(data):
            data += sock.recv(65536)  # the server answers 408 once body_timeout (2 s) has passed
        status, body = parse_answer(data)
        assert status == 408 and body["error"]["message"]
    finally:
        sock.close()


def test_tokenizing_does_not_block_the_event_loop(monkeypatch):
    """A prompt whose tokenization does not end until /health has answered: on the event loop, it never would."""
    entered, release = threading.Event(), threading.Event()

    class Blocking(ByteTokenizer):
        def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
            if text.startswith("block"):
                entered.set()
                assert release.wait(TIMEOUT)
            return super().encode(text)

    app = create_app(tiny_model(vocab_size=256), Blocking(), max_batch=1)
    with ServerThread(app) as server, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, server, "/v1/completions", {"prompt": "block me", "max_tokens": 2})
        assert entered.wait(TIMEOUT)
        health = httpx.get(server.url + "/health", timeout=TIMEOUT / 3)
        assert health.status_code == 200 and not pending.done()
        release.set()
        assert pending.result().status_code == 200


def test_a_runaway_chat_template_is_an_error_in_seconds_and_blocks_no_one(monkeypatch):
    """A model whose template loops 1e10 times: its chat requests get a 400 naming the template's file when the
    rendering's time bound runs out, and a completion sent meanwhile is answered."""
    from gptlab.tokenizer import template_sandbox

    monkeypatch.setattr(template_sandbox, "MAX_RENDER_SECONDS", 2.0)

    class Runaway(BytesWithEot):
        chat_template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        chat_template_file = "/models/m/tokenizer_config.json"

    app = create_app(tiny_model(vocab_size=256), Runaway(), max_batch=2)
    with ServerThread(app) as server, ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        chat = pool.submit(post, server, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        other = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert other.status_code == 200 and not chat.done()
        error = assert_openai_error(chat.result(), 400, "messages")
        assert time.monotonic() - start < TIMEOUT
        assert error["message"] == ("the chat template in /models/m/tokenizer_config.json takes more than 2 s to "
                                    "render (a runaway loop?)")


def test_a_chat_template_that_builds_gigabytes_in_one_step_is_a_400_and_the_server_keeps_its_memory(monkeypatch):
    """One Jinja step (expandtabs) that the sandbox cannot stop between steps: the worker process rendering it runs
    out of its memory, the request gets a 400 naming the template's file, and the server answers the next ones."""
    import resource

    from gptlab.tokenizer import template_worker

    monkeypatch.setattr(template_worker, "MAX_RENDER_BYTES", 128 << 20)

    class Bomb(BytesWithEot):
        chat_template = "{{ ('\\t' * 3000000).expandtabs(1000) }}"
        chat_template_file = "/models/m/chat_template.jinja"

    app = create_app(tiny_model(vocab_size=256), Bomb(), max_batch=2)
    held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with ServerThread(app) as server:
        for _ in range(2):
            chat = post(server, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            error = assert_openai_error(chat, 400, "messages")
            assert error["message"] == ("the chat template in /models/m/chat_template.jinja needs more than 128 MiB "
                                        "of memory to render")
        assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - held < 64 << 10  # KiB: the bomb went off elsewhere


# ---------------------------------------------------------------------------------------------------------
# Clients that hang up, and a request that fails mid-batch
# ---------------------------------------------------------------------------------------------------------
def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_non_streaming_request_whose_client_left_stops_generating(hostile, slow_steps):
    server, state = hostile
    engine = state.engine
    body = json.dumps({"prompt": "Hi", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    sock, _ = raw_request(server, head, body, read=False)
    wait_until(lambda: engine.running, "the request to start")
    (gen,) = engine.running
    wait_until(lambda: len(gen.token_ids) >= 3, "a few tokens")
    sock.close()
    wait_until(lambda: not engine.running, "its row to be freed")
    assert len(gen.token_ids) < BLOCK - 3  # it would have run to the end of the context (eos ignored)
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_clients_that_leave_mid_stream_free_their_rows_for_the_next(hostile, slow_steps):
    server, state = hostile
    engine = state.engine
    streams = []
    for i in range(engine.max_batch):  # every row taken by a client that reads one event and leaves
        cm = httpx.stream("POST", server.url + "/v1/completions", timeout=TIMEOUT,
                          json={"prompt": f"Go {i}", "max_tokens": 1000, "stream": True, "ignore_eos": True})
        lines = cm.__enter__().iter_lines()  # (kept: a dropped iterator closes the response)
        next(lines)
        streams.append((cm, lines))
    assert engine.free_slots() == 0
    for cm, _ in streams:
        cm.__exit__(None, None, None)
    wait_until(lambda: engine.free_slots() == engine.max_batch, "the rows to be freed")
    with ThreadPoolExecutor(engine.max_batch) as pool:
        answers = list(pool.map(lambda i: post(server, "/v1/completions", {"prompt": f"Hi {i}", "max_tokens": 3}),
                                range(engine.max_batch)))
    assert [r.json()["usage"]["completion_tokens"] for r in answers] == [3] * engine.max_batch


def test_a_failure_in_one_row_fails_its_request_alone(hostile, slow_steps, monkeypatch):
    """The issue's case: one request's sampling fails once it is in a running batch; its client gets an
    OpenAI-shaped 500, and the others get the answers they would get alone."""
    import gptlab.generation.accept as accept_module  # where the engine samples each step's tokens

    server, state = hostile
    sample_next = accept_module.sample_next
    poisoned_calls = []

    def failing(logits, params, *args, **kw):  # noqa: ANN001, ANN202
        if any(sp.top_k == 13 for sp in params):  # the marked request
            poisoned_calls.append(len(params))
            if len(poisoned_calls) > 2:  # past its first tokens: inside the running batch
                raise OverflowError("Overflow when unpacking long long")
        return sample_next(logits, params, *args, **kw)

    monkeypatch.setattr(accept_module, "sample_next", failing)
    prompts = ["Alpha", "Beta", "Gamma"]
    alone = [reference(p, 30, state) for p in prompts]
    state.scheduler.max_rows_seen = 0
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(post, server, "/v1/completions", {"prompt": p, "max_tokens": 30, "temperature": 0})
                  for p in prompts]
        wait_until(lambda: len(state.engine.running) == 3, "the others to be running")
        bad = post(server, "/v1/completions", {"prompt": "Bad", "max_tokens": 30, "temperature": 0.5, "top_k": 13})
        answers = [f.result() for f in others]
    err = assert_openai_error(bad, 500)
    assert err["type"] == "server_error" and "Overflow" in err["message"]
    assert max(poisoned_calls) > 1  # it failed in a batch with others
    assert [r.json()["choices"][0]["text"] for r in answers] == alone
    # streamed: the failure is an error event, and the stream ends
    poisoned_calls.clear()
    with httpx.stream("POST", server.url + "/v1/completions", timeout=TIMEOUT,
                      json={"prompt": "Bad", "max_tokens": 30, "top_k": 13, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["type"] == "server_error" and events[-1] == "[DONE]"
    wait_until(lambda: not state.engine.running, "the rows to be freed")


def test_engine_isolates_a_failing_row(monkeypatch):
    """At the engine: the batch's other rows decode exactly what they decode alone; the run raises the error."""
    import gptlab.generation.accept as accept_module  # where the engine samples each step's tokens
    from gptlab.generation import Engine

    sample_next = accept_module.sample_next

    def failing(logits, params, *args, **kw):  # noqa: ANN001, ANN202
        if any(sp.top_k == 13 for sp in params):  # the marked row, alone or not
            raise RuntimeError("boom")
        return sample_next(logits, params, *args, **kw)

    model = tiny_model(vocab_size=256)
    params = [SamplingParams(temperature=0, max_new_tokens=8), SamplingParams(top_k=13, max_new_tokens=8),
              SamplingParams(temperature=0.7, seed=3, max_new_tokens=8)]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    alone = [Engine(model).run([Engine(model).prepare(p, sp)])[0] for p, sp in zip(prompts, params, strict=True)
             if sp.top_k != 13]
    monkeypatch.setattr(accept_module, "sample_next", failing)
    engine = Engine(model, max_batch=3)
    gens = [engine.prepare(p, sp) for p, sp in zip(prompts, params, strict=True)]
    with pytest.raises(RuntimeError, match="boom"):
        engine.run(gens)
    assert gens[1].finish_reason == "error" and gens[1].token_ids == []
    assert [g.token_ids for g in (gens[0], gens[2])] == [a.token_ids for a in alone]
    assert engine.free_slots() == 3


# ---------------------------------------------------------------------------------------------------------
# Overload
# ---------------------------------------------------------------------------------------------------------
def test_200_concurrent_requests_get_answers_or_429(hostile):
    server, state = hostile

    async def flood() -> list[int]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT * 4, limits=limits) as client:
            bodies = [{"prompt": f"Hello {i}", "max_tokens": 2 + i % 3} for i in range(200)]
            answers = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        for r in answers:
            if r.status_code == 429:
                assert_openai_error(r, 429)
        return [r.status_code for r in answers]

    statuses = asyncio.run(flood())
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 16  # the queue's worth at least
    wait_until(lambda: not state.engine.running and state.scheduler.waiting == 0, "the server to drain")
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


# ---------------------------------------------------------------------------------------------------------
# schemathesis: requests drawn from the server's own OpenAPI schema, valid and not
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_gets_no_5xx_and_openai_shaped_errors(mode):
    """Requests drawn from the server's own /openapi.json (a fixed set: derandomized), of every operation:
    valid ones ("positive") and ones that break the schema ("negative", for the operations that take a body).
    A short context and queue keep each answer quick."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis import checks

    app = create_app(tiny_model(vocab_size=256, block_size=16), BytesWithEot(), max_batch=4, max_queue=8)
    statuses: list[int] = []
    with ServerThread(app) as server:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        for operation in schema.get_all_operations():
            operation = operation.ok()
            if mode == "negative" and operation.method.upper() != "POST":
                continue

            @settings(max_examples=12, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
            def check(case) -> None:  # noqa: ANN001
                response = case.call(base_url=server.url, timeout=TIMEOUT)
                statuses.append(response.status_code)
                assert response.status_code < 500, (response.status_code, response.text, case.body)
                case.validate_response(response, checks=[  # a status, content type and body the schema documents
                    checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
                    checks.response_schema_conformance])
                if response.status_code >= 400:
                    err = response.json()["error"]
                    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]

            check()
    assert len(statuses) >= 20
    if mode == "positive":
        assert 200 in statuses
    else:
        assert any(400 <= s < 500 for s in statuses)
