"""The serving benchmark's load generator (benchmarks/load_client.py) counts what clients got: tokens from each
stream's usage, time to first token, the errors; a kept-alive connection the server closed before answering is sent
again once, and an answer cut short or refused is an error, never a count."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import sys
import threading
from pathlib import Path

import pytest
from helpers import tiny_model

from gptlab.tokenizer import CharTokenizer

pytest.importorskip("fastapi")
pytest.importorskip("httptools")
# benchmarks/ is not a package, nor put on sys.path here (its scripts' names must not shadow anything else)
_SPEC = importlib.util.spec_from_file_location("benchmarks_load_client",
                                               Path(__file__).resolve().parents[1] / "benchmarks" / "load_client.py")
load_client = sys.modules[_SPEC.name] = importlib.util.module_from_spec(_SPEC)  # (dataclasses look it up there)
_SPEC.loader.exec_module(load_client)
run_load = load_client.run_load


def test_clients_count_every_streamed_token_of_a_real_server() -> None:
    from gptlab.serve import ServerThread, create_app

    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")
    app = create_app(tiny_model(vocab_size=tok.vocab_size), tok, model_name="t", max_batch=4, ui=False)
    with ServerThread(app) as server:
        load = run_load(server.url, 3, 1.0, lambda i, n: "ab c"[: 1 + (i + n) % 4], 7, 0.8)
    assert load.errors == [] and load.resent == 0  # uvicorn keeps its connections
    assert len(load.results) >= 3 and load.wall_s >= 1.0 and load.cpu_s >= 0
    for r in load.results:
        assert r["tokens"] == 7  # the usage's completion tokens: sampling ignores no stop here (no end token)
        assert 0 < r["ttft"] <= r["latency"] and r["pause"] <= r["latency"]


class _Scripted:
    """A loopback HTTP server answering the n-th request (n from 1: the load's warm-up), the k-th on its connection
    (k from 1), with `answer(n, k)` (None: it closes the connection without answering), then closing the connection
    where `close_after(n)`: enough to play a server's misbehaviours."""

    def __init__(self, answer, close_after) -> None:  # noqa: ANN001
        self.answer, self.close_after, self.count = answer, close_after, 0
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        async with server:
            await self.stop.wait()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for k in itertools.count(1):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                self.count += 1
                answer = self.answer(self.count, k)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if self.close_after(self.count):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    def __enter__(self) -> str:
        self.thread.start()
        assert self.ready.wait(10)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


def _text(t: str) -> str:
    return f'{{"choices":[{{"text":"{t}","index":0}}]}}'


def _stream(events: list[str], end: bool = True) -> bytes:
    """A 200 event stream of `events` (JSON texts) then [DONE], chunked an event a chunk; `end=False`: no last
    chunk (the answer is cut short)."""
    lines = [f"data: {e}\n\n".encode() for e in [*events, "[DONE]"]]
    body = b"".join(b"%x\r\n%s\r\n" % (len(line), line) for line in lines)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + body + (b"0\r\n\r\n" if end else b"")


USAGE_5 = '{"choices":[],"usage":{"completion_tokens":5}}'
GOOD = _stream([_text("a"), _text("b"), USAGE_5])


@pytest.mark.parametrize("close", ["after answering", "on the next request"])
def test_a_server_closing_each_kept_alive_connection_costs_no_error(close: str) -> None:
    """llama-server closes its connection after each stream; the close may cross the client's next request on it,
    which is then sent again once on a new connection."""
    if close == "after answering":
        server = _Scripted(lambda n, k: GOOD, close_after=lambda n: True)
    else:
        server = _Scripted(lambda n, k: GOOD if k == 1 else None, close_after=lambda n: False)
    with server as url:
        load = run_load(url, 2, 0.3, lambda i, n: "x", 5, 0.8)
    assert load.errors == [] and len(load.results) >= 2
    assert all(r["tokens"] == 5 for r in load.results)  # the usage's count, not the 2 text chunks
    if close == "on the next request":  # each client's every request after its first met a closing connection
        assert load.resent == len(load.results) - 2


def test_a_new_connection_closed_unanswered_is_an_error() -> None:
    with _Scripted(lambda n, k: GOOD if n == 1 else None, close_after=lambda n: False) as url:
        results, errors, *_ = run_load(url, 1, 0.2, lambda i, n: "x", 5, 0.8)
    assert results == [] and errors and all("disconnected" in e for e in errors)


def test_without_usage_the_chunks_with_text_are_counted() -> None:
    with _Scripted(lambda n, k: _stream([_text("a"), _text(""), _text("b"), _text("c")]),
                   close_after=lambda n: False) as url:
        results, errors, *_ = run_load(url, 1, 0.2, lambda i, n: "x", 5, 0.8)
    assert errors == [] and results and all(r["tokens"] == 3 for r in results)


@pytest.mark.parametrize(("bad", "close", "message"), [
    (_stream([_text("a")], end=False), True, "disconnected"),  # the connection closes inside the chunked body
    (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: 26\r\n\r\n"
     b'{"error":{"message":"no"}}', False, "HTTP 429"),
    (_stream([_text("a"), '{"error":{"message":"boom"}}']), False, "boom"),  # an error event inside a 200 stream
])
def test_an_answer_cut_short_refused_or_failed_is_an_error_never_a_count(bad: bytes, close: bool,
                                                                          message: str) -> None:
    with _Scripted(lambda n, k: GOOD if n == 1 else bad, close_after=lambda n: close and n > 1) as url:
        results, errors, *_ = run_load(url, 1, 0.2, lambda i, n: "x", 5, 0.8)
    assert results == [] and errors and all(message in e for e in errors)
