"""Continuous batching for the server: one background thread owns the model and an `Engine` of max_batch rows.

Request handlers (on the asyncio event loop) submit a `Job` (one or more `Generation`s, e.g. n > 1) and await
its events. The scheduler thread loops: admit waiting generations into free rows (their prompts prefilled
together, `Engine.add`), run one decode step for every running row, and hand each job the text its rows
produced. A finished row frees its slot before the next step, so a new request joins the running batch without
waiting for the others.

A failure ends only the generations it belongs to: one while admitting a row fails that row's request, one the
engine pins on a row of a decoding step (`Generation.error`) fails that row's request, whose other rows are
dropped; the other requests in the batch go on: a bad request never ends another one's generation.

What a step produced reaches the event loop in one call per step (`Job.deliver` for every job it touched, by one
`call_soon_threadsafe`; an admission whose prefill sampled first tokens hands them over at once, before the step
that follows), not one per row: each cross-thread call wakes the loop through a write to its pipe, 16 per
step at 16 rows. A handler takes every event that arrived since it last looked (`Job.next_events`), so a stream
writes them in one send however far it fell behind. With `metrics`, each step also reports its rows' new tokens,
their time to first token and per-token latency (`gptlab.serve.metrics.ServerMetrics`).

Which thread runs the loop matters on a CPU: the engine's kernels split each product over torch's OpenMP threads,
and libgomp, once it manages more threads than the machine has cores, makes its idle threads sleep almost at once,
so every parallel region waits to wake them. A thread other than the one that loaded the model brings a second
OpenMP team (2 + 2 threads on 2 cores): its decode steps took 2.5x as long with about one core busy. So `gptlab
serve` runs the loop on its main thread (`run`), where the model was loaded, and HTTP on a thread of its own;
`start` runs it on a thread of its own, for servers inside another program.

Waiting generations are bounded by max_queue: `submit` raises `QueueFull` (the server answers 429) beyond it.
Because every row has its own position, cache row and generator, a greedy (or seeded) answer is the one the
request would get alone.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gptlab.generation.engine import Engine
from gptlab.generation.request import FINISH_ERROR, Generation

if TYPE_CHECKING:
    from gptlab.serve.metrics import ServerMetrics

log = logging.getLogger("gptlab.serve")

# (index, delta, finish_reason, tokens): `tokens` is how many tokens that generation had produced when its delta
# was taken (where the delta's logprobs end)
Event = tuple[int, str, "str | None", int]


class QueueFull(Exception):
    """More generations are waiting than max_queue allows."""


@dataclass(eq=False)
class Job:
    """The generations of one request and the events its handler reads (made on the event loop `loop`)."""

    gens: list[Generation]
    loop: asyncio.AbstractEventLoop
    error: BaseException | None = None
    # SamplingParams' field names -> the request's, for an error of a row's own settings found while it ran
    param_names: dict[str, str] = field(default_factory=dict)
    cancelled: bool = False
    created: float = field(default_factory=time.perf_counter)  # when it was submitted: time to first token
    _inbox: list[Event] = field(default_factory=list)
    _waiter: asyncio.Future | None = None
    _finished: int = 0  # generations whose last event arrived
    done: asyncio.Future = field(init=False)  # set when every generation has finished, or one failed

    def __post_init__(self) -> None:
        self.done = self.loop.create_future()

    def deliver(self, events: list[Event]) -> None:
        """On the event loop: take the scheduler's events for this job."""
        self._inbox.extend(events)
        self._finished += sum(e[2] is not None for e in events)
        if not self.done.done() and (self._finished >= len(self.gens) or any(e[2] == FINISH_ERROR for e in events)):
            self.done.set_result(None)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_events(self, timeout: float) -> list[Event]:
        """Every event that arrived since the last call, waiting up to `timeout` seconds for one ([] if none came).
        (A future and a timer: asyncio.wait_for would make a task per wait, one per stream per step.)"""
        if not self._inbox:
            waiter = self._waiter = self.loop.create_future()
            timer = self.loop.call_later(timeout, _settle, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        events, self._inbox = self._inbox, []
        return events


def _settle(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _deliver(outbox: list[tuple[Job, Event]]) -> None:
    """On the event loop: one step's events, handed to their jobs (a job's several events together)."""
    by_job: dict[Job, list[Event]] = {}
    for job, event in outbox:
        by_job.setdefault(job, []).append(event)
    for job, events in by_job.items():
        job.deliver(events)


@dataclass(eq=False)
class _Owner:
    """A running generation's job, its index there, and what the metrics need: its tokens seen, and when."""

    job: Job
    index: int
    tokens: int = 0
    last: float | None = None  # when its newest token was published


class Scheduler:
    """The thread that runs the engine; see the module docstring."""

    def __init__(self, engine: Engine, max_queue: int = 64, metrics: ServerMetrics | None = None) -> None:
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self._waiting: collections.deque[tuple[Job, int]] = collections.deque()  # (job, generation index)
        self._owner: dict[int, _Owner] = {}  # id(generation) -> its owner while it runs
        self._cancel: list[Job] = []
        self._outbox: list[tuple[Job, Event]] = []  # this step's events, delivered together (`_flush`)
        self._cond = threading.Condition()
        self._stop = False
        self.steps = 0  # decode steps run (for tests and stats)
        self.max_rows_seen = 0  # the largest number of rows decoded together
        self._thread = threading.Thread(target=self._loop, name="gptlab-scheduler", daemon=True)

    def start(self) -> None:
        """The loop on a thread of its own (a server inside another program: tests, `ServerThread`)."""
        self._thread.start()

    def run(self) -> None:
        """The loop on the calling thread until `request_stop` (`gptlab serve`'s main thread, see the module
        docstring)."""
        self._loop()

    def request_stop(self) -> None:
        """End the loop after its current step (callable from any thread)."""
        with self._cond:
            self._stop = True
            self._cond.notify()

    def stop(self) -> None:
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # --- called from request handlers -----------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cond:
            if len(self._waiting) + len(job.gens) > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} generations are waiting (max {self.max_queue})")
            self._waiting.extend((job, i) for i in range(len(job.gens)))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Drop a job's rows (e.g. its client went away); takes effect before the next step."""
        with self._cond:
            job.cancelled = True
            self._cancel.append(job)
            self._cond.notify()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # --- the thread -----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._stop and not self._waiting and not engine.running and not self._cancel:
                    self._cond.wait()
                if self._stop:
                    return
                cancelled, self._cancel = self._cancel, []
                admitted = []
                while self._waiting and engine.free_slots() > len(admitted):
                    job, i = self._waiting.popleft()
                    if not job.cancelled:
                        admitted.append((job, i))
            for job in cancelled:
                for gen in job.gens:
                    self._owner.pop(id(gen), None)
                    engine.release(gen)
            for job, i in admitted:
                self._owner[id(job.gens[i])] = _Owner(job, i)
                if self.metrics is not None:
                    self.metrics.prompt_tokens.inc(len(job.gens[i].prompt_ids))
            if admitted:  # prefilled together (the engine isolates a row whose prefill fails)
                new = [job.gens[i] for job, i in admitted]
                self._run(new, lambda new=new: engine.add(new), "admit")
                self._flush()  # first tokens a prefill sampled (rows that joined no running step) go out now
            if engine.running:
                running = engine.running
                self.max_rows_seen = max(self.max_rows_seen, len(running))
                self._run(running, engine.step, "decode")
                self.steps += 1
                if self.metrics is not None:
                    self.metrics.decode_step(len(running))
            self._flush()

    def _run(self, gens: list[Generation], work: Callable[[], object], phase: str) -> None:
        """Run an engine call of `phase` (for the metrics: "admit" or "decode") and publish what its rows produced;
        a failure fails only the jobs it touches."""
        start = time.perf_counter()
        try:
            work()
        except Exception as e:  # noqa: BLE001 - a failing request must not take the server down
            log.exception("generation failed")
            for gen in gens:
                self._fail(gen, e)
            return
        finally:
            now = time.perf_counter()
            if self.metrics is not None:
                self.metrics.engine_call(phase, now - start)
        for gen in gens:
            owner = self._owner.get(id(gen))
            if owner is None:
                continue
            if gen.finish_reason == FINISH_ERROR:
                log.error("generation failed: %r", gen.error)
                self._fail(gen, gen.error)
                continue
            tokens = len(gen.token_ids)
            if self.metrics is not None and tokens > owner.tokens:
                self.metrics.tokens(tokens - owner.tokens, now - (owner.job.created if owner.last is None
                                                                  else owner.last), first=owner.last is None)
                owner.last = now
            owner.tokens = tokens
            delta = gen.pop_delta()
            if delta or gen.finished:
                self._outbox.append((owner.job, (owner.index, delta, gen.finish_reason, tokens)))
            if gen.finished:
                self._owner.pop(id(gen), None)

    def _flush(self) -> None:
        """Hand this step's events to the event loop in one call (per loop: in practice the server's one)."""
        outbox, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event]]] = {}
        for job, event in outbox:
            by_loop.setdefault(job.loop, []).append((job, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is closed: nobody is listening any more, so its rows are freed
                for job in {id(job): job for job, _ in items}.values():
                    if not job.cancelled:
                        self.cancel(job)

    def _fail(self, gen: Generation, error: BaseException | None) -> None:
        """End the job `gen` belongs to with `error`: its client is told, and its other rows are freed."""
        self.engine.release(gen)
        failed = self._owner.pop(id(gen), None)
        if failed is None:
            return
        job = failed.job
        job.error, job.cancelled = error, True
        self._outbox.append((job, (failed.index, "", FINISH_ERROR, len(gen.token_ids))))
        for other in job.gens:
            if self._owner.pop(id(other), None) is not None:
                self.engine.release(other)
