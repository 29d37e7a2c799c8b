"""The load generator of `serve_load.py`: N streaming clients on one event loop, each on one kept-alive connection.

On a 2-core machine the load generator shares the cores with the server it measures, so every CPU millisecond it
spends is one the server's engine does not get. httpx's sync client in 16 threads took ~0.3 cores to read ~4,400
streamed tokens/s (h11's pure-Python parsing, one thread switch per line, the GIL passed between 16 threads). Here
the responses are parsed by httptools (C: the parser uvicorn uses, chunked transfer decoding included) on one uvloop
event loop, and only a stream's `data:` lines are decoded as JSON: 0.10 cores at ~5,000 tokens/s, while still
measuring what the clients get (time to first token, the longest pause, tokens from each stream's `usage`).

A request on a kept-alive connection that the server closed before answering any of it is sent again once on a new
connection, as HTTP clients do (llama-server closes its connection after each stream, a close that can cross the
next request); a new connection that fails, or an answer cut short, is an error.

    load = run_load("http://127.0.0.1:8000", 16, 20.0, lambda i, n: "ROMEO:", 64, 0.8)  # a `Load`
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import urlsplit

import httptools

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 300.0  # a whole streamed answer; a server that stalls past it is an error, not a hang


class _Response(asyncio.Protocol):
    """One HTTP/1.1 connection; parses the current response's status, body lines and end as they arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False  # the connection closed (by either side)
        self._begin(None)

    def _begin(self, on_line) -> None:  # noqa: ANN001 - on_line(bytes) for each body line, or None
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.keep_alive, self._on_line, self._partial = 0, True, on_line, b""
        self.done = asyncio.get_running_loop().create_future()
        self.error_body, self.answered = b"", False

    def request(self, raw: bytes, on_line) -> asyncio.Future:  # noqa: ANN001
        """Send `raw` (a whole request); `on_line` gets each line of a 200 answer's body; the future ends with it."""
        self._begin(on_line)
        self.transport.write(raw)
        return self.done

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(RuntimeError(f"unparsable response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(RuntimeError("server disconnected without sending a complete response"))

    # httptools' callbacks
    def on_headers_complete(self) -> None:
        self.status, self.keep_alive = self.parser.get_status_code(), self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.error_body += body
            return
        lines = (self._partial + body).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            self._on_line(line.rstrip(b"\r"))

    def on_message_complete(self) -> None:
        if self._partial:
            self._on_line(self._partial.rstrip(b"\r"))
        if not self.done.done():
            self.done.set_result(self.status)

    def _fail(self, error: Exception) -> None:
        if self._on_line is not None and not self.done.done():  # (an idle connection's close fails nothing)
            self.done.set_exception(error)


@dataclass
class _Stream:
    """What one streamed answer delivered, filled line by line."""

    t0: float
    ttft: float | None = None
    last: float | None = None
    pause: float = 0.0
    chunks: int = 0
    usage_tokens: int | None = None
    error: str | None = None

    def line(self, line: bytes) -> None:
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if "error" in chunk:
            self.error = self.error or str(chunk["error"].get("message", chunk["error"]))
            return
        choices = chunk.get("choices")
        if choices and choices[0].get("text"):
            now = time.perf_counter()
            self.chunks += 1
            self.ttft = now - self.t0 if self.ttft is None else self.ttft
            self.pause, self.last = (max(self.pause, now - self.last) if self.last is not None else 0.0), now
        if chunk.get("usage"):
            self.usage_tokens = chunk["usage"]["completion_tokens"]


@dataclass
class _Client:
    host: str
    port: int
    conn: _Response | None = None
    results: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    resent: int = 0

    async def completion(self, prompt: str, max_tokens: int, temperature: float) -> dict:
        """One streamed /v1/completions (usage included): latency, time to first token, tokens, longest pause."""
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        raw = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
               f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        stream = _Stream(time.perf_counter())
        for attempt in (0, 1):
            reused = self.conn is not None and not self.conn.lost
            if not reused:
                self.close()
                loop = asyncio.get_running_loop()
                _, self.conn = await asyncio.wait_for(loop.create_connection(_Response, self.host, self.port),
                                                      CONNECT_TIMEOUT_S)
            conn = self.conn
            try:
                status = await asyncio.wait_for(conn.request(raw, stream.line), READ_TIMEOUT_S)
                break
            except Exception:
                self.close()  # a half-read answer leaves the connection unusable
                # a kept-alive connection the server closed before answering (llama-server closes after each
                # stream, and its close can cross our next request): sent again once on a new connection, as
                # HTTP clients do; a fresh connection that fails, or any answer cut short, is an error
                if not (reused and not conn.answered and attempt == 0):
                    raise
                self.resent += 1
            except BaseException:
                self.close()
                raise
        if not conn.keep_alive:
            self.close()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {conn.error_body[:200]!r}")
        if stream.error is not None:
            raise RuntimeError(stream.error)
        latency = time.perf_counter() - stream.t0
        return {"latency": latency, "ttft": stream.ttft if stream.ttft is not None else latency,
                "tokens": stream.usage_tokens if stream.usage_tokens is not None else stream.chunks,
                "pause": stream.pause, "long": len(prompt) > 100}

    def close(self) -> None:
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.close()
        self.conn = None


class Load(NamedTuple):
    """What the clients got."""

    results: list[dict]  # one per answered request: latency, ttft, tokens, pause (seconds), long (its prompt's)
    errors: list[str]  # one per failed request
    wall_s: float
    cpu_s: float  # this process's CPU time meanwhile
    resent: int  # requests sent again on a new connection: their kept-alive one closed before answering


async def _run(url: str, clients: int, seconds: float, prompt_for, max_tokens: int,  # noqa: ANN001
               temperature: float) -> Load:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    warm = _Client(host, port)
    await warm.completion(prompt_for(0, 0), 4, 0.0)  # the first request's allocations out of the timing
    warm.close()
    stop_at = time.monotonic() + seconds
    pool = [_Client(host, port) for _ in range(clients)]

    async def client(i: int, c: _Client) -> None:
        n = 0
        while time.monotonic() < stop_at:
            try:
                c.results.append(await c.completion(prompt_for(i, n), max_tokens, temperature))
            except Exception as e:  # noqa: BLE001 - counted and reported
                c.errors.append(repr(e))
            n += 1
        c.close()

    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client(i, c) for i, c in enumerate(pool)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return Load([r for c in pool for r in c.results], [e for c in pool for e in c.errors], wall, cpu,
                sum(c.resent for c in pool))


def run_load(url: str, clients: int, seconds: float, prompt_for, max_tokens: int,  # noqa: ANN001
             temperature: float) -> Load:
    """`clients` streaming clients sending /v1/completions back to back for `seconds`; client i's n-th prompt is
    prompt_for(i, n)."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # plain asyncio parses the same way, with a little more CPU per event
        runner = asyncio.run
    return runner(_run(url, clients, seconds, prompt_for, max_tokens, temperature))
