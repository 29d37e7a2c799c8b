"""Continuous batching for the server: one background thread owns the model and an `Engine` of max_batch rows.

Request handlers (on the asyncio event loop) submit a `Job` (one or more `Generation`s, e.g. n > 1) and await
its events. The scheduler thread loops: admit waiting generations into free rows (each prefilled on its own
row), run one decode step for every running row, and hand each job the text its rows produced. A finished row
frees its slot before the next step, so a new request joins the running batch without waiting for the others.

A failure ends only the generations it belongs to: one while admitting a row fails that row's request, one the
engine pins on a row of a decoding step (`Generation.error`) fails that row's request, whose other rows are
dropped; the other requests in the batch go on. (Before this, one request whose top_k did not fit an int64 made
every concurrent generation end in a 500.)

Waiting generations are bounded by max_queue: `submit` raises `QueueFull` (the server answers 429) beyond it.
Because every row has its own position, cache row and generator, a greedy (or seeded) answer is the one the
request would get alone.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from gptlab.generation.engine import Engine
from gptlab.generation.rows import FINISH_ERROR, Generation

log = logging.getLogger("gptlab.serve")


class QueueFull(Exception):
    """More generations are waiting than max_queue allows."""


@dataclass(eq=False)
class Job:
    """The generations of one request and the asyncio queue its handler reads: (index, delta, finish_reason,
    tokens), `tokens` being how many tokens that generation had produced when its delta was taken."""

    gens: list[Generation]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    error: BaseException | None = None
    cancelled: bool = False

    def emit(self, index: int, delta: str, finish: str | None, tokens: int) -> None:
        """Thread-safe: called by the scheduler thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (index, delta, finish, tokens))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True


class Scheduler:
    """The thread that runs the engine; see the module docstring."""

    def __init__(self, engine: Engine, max_queue: int = 64) -> None:
        self.engine, self.max_queue = engine, max_queue
        self._waiting: collections.deque[tuple[Job, int]] = collections.deque()  # (job, generation index)
        self._owner: dict[int, tuple[Job, int]] = {}  # id(generation) -> (job, index) while it runs
        self._cancel: list[Job] = []
        self._cond = threading.Condition()
        self._stop = False
        self.steps = 0  # decode steps run (for tests and stats)
        self.max_rows_seen = 0  # the largest number of rows decoded together
        self._thread = threading.Thread(target=self._loop, name="gptlab-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
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
                self._run([job.gens[i]], lambda g=job.gens[i]: engine.add([g]), owner=(job, i))
            if engine.running:
                running = engine.running
                self.max_rows_seen = max(self.max_rows_seen, len(running))
                self._run(running, engine.step)
                self.steps += 1

    def _run(
        self, gens: list[Generation], work: Callable[[], object], owner: tuple[Job, int] | None = None
    ) -> None:
        """Run an engine call and publish what its rows produced; a failure fails only the jobs it touches."""
        if owner is not None:
            self._owner[id(gens[0])] = owner
        try:
            work()
        except Exception as e:  # noqa: BLE001 - a failing request must not take the server down
            log.exception("generation failed")
            for gen in gens:
                self._fail(gen, e)
            return
        for gen in gens:
            target = self._owner.get(id(gen))
            if target is None:
                continue
            if gen.finish_reason == FINISH_ERROR:
                log.error("generation failed: %r", gen.error)
                self._fail(gen, gen.error)
                continue
            delta = gen.pop_delta()
            if delta or gen.finished:
                target[0].emit(target[1], delta, gen.finish_reason, len(gen.token_ids))
            if gen.finished:
                self._owner.pop(id(gen), None)

    def _fail(self, gen: Generation, error: BaseException | None) -> None:
        """End the job `gen` belongs to with `error`: its client is told, and its other rows are freed."""
        self.engine.release(gen)
        failed = self._owner.pop(id(gen), None)
        if failed is None:
            return
        job, index = failed
        job.error, job.cancelled = error, True
        job.emit(index, "", "error", len(gen.token_ids))
        for other in job.gens:
            if self._owner.pop(id(other), None) is not None:
                self.engine.release(other)
