"""GET /metrics (Prometheus' text format, parsed with prometheus_client's own parser) and the scheduler's events:
counts move by exactly what the requests served, under the API key's rule; one step's events reach the event loop
in one call."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("fastapi")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from helpers import tiny_model  # noqa: E402

from gptlab.serve import ServerThread, create_app  # noqa: E402
from gptlab.serve.metrics import ServerMetrics  # noqa: E402
from gptlab.serve.scheduler import Job, Scheduler  # noqa: E402
from gptlab.tokenizer import CharTokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "metrics-key"
VOCAB = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz .,:;!?'\n"
AUTH = {"Authorization": f"Bearer {KEY}"}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text page."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in prometheus_parser.text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    r = httpx.get(url + "/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return samples(r.text)


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def served():
    tok = CharTokenizer.from_text(VOCAB)
    app = create_app(tiny_model(vocab_size=tok.vocab_size), tok, max_batch=4, api_key=KEY, ui=False)
    with ServerThread(app) as server:
        yield server.url, tok


def test_metrics_need_the_api_key(served):
    url, _ = served
    assert httpx.get(url + "/metrics", timeout=30).status_code == 401
    assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401


def test_counts_move_by_what_was_served(served):
    url, tok = served
    before = scrape(url)
    prompts, max_tokens = ["Hello there", "ROMEO: wait"], 5
    for i, prompt in enumerate(prompts):  # one plain, one streamed
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": i == 1}
        r = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=30).status_code == 401
    assert httpx.get(url + "/nowhere", headers=AUTH, timeout=30).status_code == 404
    after = scrape(url)

    assert moved(before, after, "gptlab_requests_total", route="/v1/completions", status="200") == 2
    assert moved(before, after, "gptlab_requests_total", route="/v1/completions", status="401") == 1
    assert moved(before, after, "gptlab_requests_total", route="other", status="404") == 1  # no label per path
    assert moved(before, after, "gptlab_requests_total", route="/metrics", status="200") == 1  # the first scrape
    assert moved(before, after, "gptlab_prompt_tokens_total") == sum(len(tok.encode(p)) for p in prompts)
    assert moved(before, after, "gptlab_generation_tokens_total") == len(prompts) * max_tokens
    # one first token per generation; then one observation per row per step: max_tokens - 1 each
    assert moved(before, after, "gptlab_time_to_first_token_seconds_count") == len(prompts)
    assert moved(before, after, "gptlab_time_per_output_token_seconds_count") == len(prompts) * (max_tokens - 1)
    assert moved(before, after, "gptlab_time_per_output_token_seconds_sum") > 0
    # one request after the other: the first token from the prefill, then a step of that one row per token
    assert moved(before, after, "gptlab_decode_steps_total") == len(prompts) * (max_tokens - 1)
    assert moved(before, after, "gptlab_decode_rows_total") == len(prompts) * (max_tokens - 1)
    # each request admitted alone: one prefill call each; the engine's time split by phase moved in both
    assert moved(before, after, "gptlab_admissions_total") == len(prompts)
    assert moved(before, after, "gptlab_engine_seconds_total", phase="admit") > 0
    assert moved(before, after, "gptlab_engine_seconds_total", phase="decode") > 0
    assert after[("gptlab_queue_length", ())] == 0 and after[("gptlab_running_rows", ())] == 0
    # the server keeps a prefix cache by default: every admitted prompt was looked up in it, whole
    queried = sum(len(tok.encode(p)) for p in prompts)
    assert moved(before, after, "gptlab_prefix_cache_query_tokens_total") == queried
    assert 0 <= moved(before, after, "gptlab_prefix_cache_hit_tokens_total") <= queried
    assert 0.0 <= after[("gptlab_prefix_cache_hit_rate", ())] <= 1.0


def test_a_server_without_a_prefix_cache_writes_none_of_its_metrics():
    tok = CharTokenizer.from_text(VOCAB)
    app = create_app(tiny_model(vocab_size=tok.vocab_size), tok, max_batch=2, ui=False, prefix_cache_mb=0)
    with ServerThread(app) as server:
        page = scrape(server.url)
    assert ("gptlab_queue_length", ()) in page
    assert not any(name.startswith("gptlab_prefix_cache") for name, _ in page)


def test_live_values_and_the_prefix_cache_are_read_when_scraped():
    stats = SimpleNamespace(query_tokens=0, hit_tokens=0, bytes=0)
    state = {"queue": 3, "rows": 2, "cache": SimpleNamespace(stats=lambda: stats)}
    metrics = ServerMetrics(lambda: state["queue"], lambda: state["rows"], lambda: state["cache"])
    page = samples(metrics.render().decode())
    assert page[("gptlab_queue_length", ())] == 3 and page[("gptlab_running_rows", ())] == 2
    assert page[("gptlab_prefix_cache_hit_rate", ())] == 0.0  # no lookup yet: 0, not a division by zero
    stats.query_tokens, stats.hit_tokens, stats.bytes, state["queue"] = 40, 30, 4096, 0
    page = samples(metrics.render().decode())
    assert page[("gptlab_prefix_cache_query_tokens_total", ())] == 40
    assert page[("gptlab_prefix_cache_hit_tokens_total", ())] == 30
    assert page[("gptlab_prefix_cache_hit_rate", ())] == 0.75
    assert page[("gptlab_prefix_cache_bytes", ())] == 4096 and page[("gptlab_queue_length", ())] == 0
    assert not any(name.startswith("gptlab_speculative") for name, _ in page)  # no speculation: none written


def test_speculation_counts_are_read_when_scraped():
    spec = SimpleNamespace(proposed=0, accepted=0, forwards=0)
    metrics = ServerMetrics(lambda: 0, lambda: 0, lambda: None, lambda: spec)
    page = samples(metrics.render().decode())
    assert page[("gptlab_speculative_acceptance_rate", ())] == 0.0  # no guess yet: 0, not a division by zero
    spec.proposed, spec.accepted, spec.forwards = 40, 26, 10
    page = samples(metrics.render().decode())
    assert page[("gptlab_speculative_guesses_total", ())] == 40
    assert page[("gptlab_speculative_accepted_total", ())] == 26
    assert page[("gptlab_speculative_checks_total", ())] == 10
    assert page[("gptlab_speculative_acceptance_rate", ())] == 0.65


def test_one_steps_events_reach_the_loop_in_one_call():
    loop = asyncio.new_event_loop()
    try:
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a), real(*a))[1]  # type: ignore[method-assign]
        jobs = [Job([None, None], loop=loop), Job([None], loop=loop)]  # type: ignore[list-item]
        scheduler = Scheduler(engine=None, max_queue=4)  # type: ignore[arg-type]
        events = [(jobs[0], (0, "a", None, 1)), (jobs[1], (0, "b", "length", 1)), (jobs[0], (1, "c", None, 1)),
                  (jobs[0], (0, "d", "stop", 2))]
        scheduler._outbox.extend(events)
        scheduler._flush()
        assert len(calls) == 1
        loop.run_until_complete(asyncio.sleep(0))  # run the delivery
        got = [loop.run_until_complete(job.next_events(timeout=0.01)) for job in jobs]
        assert got == [[(0, "a", None, 1), (1, "c", None, 1), (0, "d", "stop", 2)], [(0, "b", "length", 1)]]
        assert jobs[1].done.done() and not jobs[0].done.done()  # job 0's second generation has not finished
        assert loop.run_until_complete(jobs[0].next_events(timeout=0.01)) == []  # nothing new: [] after the wait
    finally:
        loop.close()
