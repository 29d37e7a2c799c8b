"""GET /metrics: the server's counters in Prometheus' text format, through `prometheus_client`.

* `gptlab_requests_total{route, status}`: HTTP requests answered, counted by `RequestMetrics`, a pure ASGI
  middleware around the whole app (so 401, 404, 408 and 413 answers count too). `route` is the route's path, or
  "other" for a path the app does not serve: a client must not be able to mint label values.
* `gptlab_prompt_tokens_total`, `gptlab_generation_tokens_total`: prompt tokens admitted to a row, tokens
  generated; `gptlab_time_to_first_token_seconds` (from the request's submission to its first token leaving the
  engine) and `gptlab_time_per_output_token_seconds` (one observation per row per step: the time since that row's
  previous token), histograms fed by the scheduler thread (`ServerMetrics.tokens`).
* `gptlab_decode_steps_total` and `gptlab_decode_rows_total` (the rows of those steps, summed): their ratio is
  how full the batch stayed, rows over steps. `gptlab_admissions_total`: the engine calls that prefilled newly
  admitted rows (the requests waiting at a step go in together: admitted rows over admissions is how many each
  prefill took); `gptlab_engine_seconds_total{phase}`: the scheduler thread's time in those calls ("admit") and in
  decoding steps ("decode"), over the server's uptime the share of its time each took (where a served engine's
  tokens/s goes, beside the offline engine's).
* `gptlab_queue_length` (generations waiting for a row) and `gptlab_running_rows`, read when scraped.
* The prefix cache, where the engine has one (`engine.prefix_cache.stats()`, read when scraped):
  `gptlab_prefix_cache_query_tokens_total`, `gptlab_prefix_cache_hit_tokens_total`, `gptlab_prefix_cache_hit_rate`
  (hit / query tokens), `gptlab_prefix_cache_bytes`. Without one, none of these is written.
* Speculative decoding, where the engine speculates (`engine.speculator.stats`, read when scraped):
  `gptlab_speculative_guesses_total` (guessed tokens checked), `gptlab_speculative_accepted_total` (those the model
  kept), `gptlab_speculative_checks_total` (verify forwards), `gptlab_speculative_acceptance_rate` (accepted /
  guesses: what to watch when choosing a draft or --draft-tokens). Without speculation, none of these is written.

Each app has its own registry (tests make many apps in one process). prometheus_client's metrics are safe to update
from the scheduler thread while the event loop reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format
# seconds: from a fast CPU step of a small model (~1 ms) to a long queue (a minute)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The registry of one server and the metrics the scheduler and the middleware feed."""

    def __init__(self, queue_length: Callable[[], int], running_rows: Callable[[], int],
                 prefix_cache: Callable[[], Any], speculation: Callable[[], Any] = lambda: None) -> None:
        """The callables are read at each scrape: waiting generations, running rows, the engine's prefix cache
        (None: no cache), its speculation's counts (`SpeculationStats`; None: no speculation)."""
        self.registry = CollectorRegistry()
        self.requests = Counter("gptlab_requests", "HTTP requests answered, by route and status code",
                                ["route", "status"], registry=self.registry)
        self.prompt_tokens = Counter("gptlab_prompt_tokens", "prompt tokens admitted to a row",
                                     registry=self.registry)
        self.generation_tokens = Counter("gptlab_generation_tokens", "tokens generated", registry=self.registry)
        self.time_to_first_token = Histogram(
            "gptlab_time_to_first_token_seconds", "from a generation's submission to its first token",
            buckets=TTFT_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram(
            "gptlab_time_per_output_token_seconds", "time between two tokens of a generation",
            buckets=TOKEN_BUCKETS, registry=self.registry)
        self.decode_steps = Counter("gptlab_decode_steps", "decoding steps run", registry=self.registry)
        self.decode_rows = Counter("gptlab_decode_rows", "rows decoded, summed over the decoding steps",
                                   registry=self.registry)
        self.admissions = Counter("gptlab_admissions", "engine calls prefilling newly admitted rows",
                                  registry=self.registry)
        self.engine_seconds = Counter("gptlab_engine_seconds", "the scheduler thread's time in the engine, by phase "
                                      "(admit: prefilling admitted rows; decode: decoding steps)", ["phase"],
                                      registry=self.registry)
        self.registry.register(_Live(queue_length, running_rows, prefix_cache, speculation))

    def tokens(self, n: int, seconds: float, *, first: bool) -> None:
        """A row published `n` new tokens `seconds` after its previous ones (or, if `first`, after submission)."""
        self.generation_tokens.inc(n)
        (self.time_to_first_token if first else self.time_per_output_token).observe(seconds)

    def decode_step(self, rows: int) -> None:
        """A decoding step ran `rows` rows."""
        self.decode_steps.inc()
        self.decode_rows.inc(rows)

    def engine_call(self, phase: str, seconds: float) -> None:
        """An engine call of `phase` ("admit" or "decode") took `seconds`."""
        if phase == "admit":
            self.admissions.inc()
        self.engine_seconds.labels(phase).inc(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Live(Collector):
    """Values read when scraped: the queue, the running rows, the prefix cache's and speculation's counts."""

    def __init__(self, queue_length: Callable[[], int], running_rows: Callable[[], int],
                 prefix_cache: Callable[[], Any], speculation: Callable[[], Any]) -> None:
        self.queue_length, self.running_rows, self.prefix_cache = queue_length, running_rows, prefix_cache
        self.speculation = speculation

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily("gptlab_queue_length", "generations waiting for a row", value=self.queue_length())
        yield GaugeMetricFamily("gptlab_running_rows", "rows of the batch generating now", value=self.running_rows())
        yield from self._speculation()
        cache = self.prefix_cache()
        if cache is None:
            return
        stats = cache.stats()
        query, hit = stats.query_tokens, stats.hit_tokens
        yield CounterMetricFamily("gptlab_prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache",
                                  value=query)
        yield CounterMetricFamily("gptlab_prefix_cache_hit_tokens", "prompt tokens found there (not prefilled)",
                                  value=hit)
        yield GaugeMetricFamily("gptlab_prefix_cache_hit_rate", "hit tokens / query tokens (0 before any lookup)",
                                value=hit / query if query else 0.0)
        yield GaugeMetricFamily("gptlab_prefix_cache_bytes", "bytes of keys and values the cache holds",
                                value=stats.bytes)

    def _speculation(self) -> Iterator[Any]:
        stats = self.speculation()
        if stats is None:
            return
        guesses, accepted = stats.proposed, stats.accepted
        yield CounterMetricFamily("gptlab_speculative_guesses", "guessed tokens the model checked", value=guesses)
        yield CounterMetricFamily("gptlab_speculative_accepted", "guessed tokens the model kept", value=accepted)
        yield CounterMetricFamily("gptlab_speculative_checks", "verify forwards (one per check of a row's guesses)",
                                  value=stats.forwards)
        yield GaugeMetricFamily("gptlab_speculative_acceptance_rate", "accepted / guesses (0 before any guess)",
                                value=accepted / guesses if guesses else 0.0)


class RequestMetrics:
    """Pure ASGI middleware counting every HTTP answer by route and status (nothing per streamed chunk: it reads
    only the response's start message)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: Callable[[], set[str]]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an app that raised before answering: the server answers 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope["path"] if scope["path"] in self.routes() else "other"
            self.metrics.requests.labels(route, str(status)).inc()
