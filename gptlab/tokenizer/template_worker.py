"""Chat templates from a model directory rendered in a worker process, under bounds that cannot be talked around.

The sandbox (`template_sandbox`) checks time and size between a template's steps, but one step is Python code
that runs to its end: `indent` over a few megabytes of lines, `expandtabs`, a recursive macro holding a large
value in every frame, hundreds of megabyte-sized variables. A worker process makes the bounds hard:

- time: the caller waits `seconds` plus a grace for the reply, then kills the worker;
- memory: the worker's address space may grow by `MAX_RENDER_BYTES` past what it holds at start, so a template
  that builds too much fails there (MemoryError) instead of swapping or OOM-killing a server;
- a crash (a C stack overflow in the parser) ends the worker only.

Workers are long-lived and reused (a pool of idle ones, at most `max_workers()` at a time), so a render costs one
round trip of JSON lines: the messages out, the texts back (`benchmarks/template_render.py` measures it against
rendering in process). A conversation's renders (`ChatTemplate.segments` needs one per prefix) go in one request.
A worker compiles each template once; the caller sends its source only to workers that have not seen it. Only
JSON crosses the pipe, never pickles: the worker runs untrusted code.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import select
import subprocess
import sys
import threading
from collections import OrderedDict
from typing import Any

from gptlab.tokenizer import template_sandbox
from gptlab.tokenizer.template_sandbox import TemplateFault

MAX_RENDER_BYTES = 512 << 20  # memory a rendering may take beyond the worker's own; a real template needs a few MB
GRACE_SECONDS = 2.0  # past the sandbox's own deadline (which names the runaway loop), the kill
_COMPILED_KEPT = 16  # templates a worker keeps compiled


def max_workers() -> int:
    """Renders at once: each may hold MAX_RENDER_BYTES, so a burst of requests to a hostile template is bounded."""
    return max(2, os.cpu_count() or 2)


def template_key(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()


class _Worker:
    """One worker process and the templates it has compiled."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gptlab.tokenizer.template_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self.known: set[str] = set()

    def ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one request and read its reply; TemplateFault when the worker runs past `timeout` or dies."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            raise TemplateFault(f"takes more than {request['seconds']:g} s to render (a runaway loop?)", broken=True)
        line = self.proc.stdout.readline()
        if not line.endswith(b"\n"):
            raise self._died()
        return json.loads(line)

    def _died(self) -> TemplateFault:
        code = self.proc.wait()
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        return TemplateFault(f"stopped the process rendering it ({how}): it is not a template gptlab runs",
                             broken=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class _Pool:
    """Idle workers, handed out one per rendering, at most `max_workers()` busy at once."""

    def __init__(self) -> None:
        self.idle: list[_Worker] = []
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(max_workers())

    def render(self, source: str, contexts: list[dict[str, Any]], seconds: float, max_chars: int) -> list[str]:
        key = template_key(source)
        request: dict[str, Any] = {"key": key, "contexts": contexts, "seconds": seconds, "max_chars": max_chars,
                                   "max_bytes": MAX_RENDER_BYTES}
        with self.slots:
            worker = self._take()
            try:
                reply = worker.ask({**request, "source": None if key in worker.known else source},
                                   seconds + GRACE_SECONDS)
                if reply.get("unknown"):  # the worker let it go from its cache
                    reply = worker.ask({**request, "source": source}, seconds + GRACE_SECONDS)
                worker.known.add(key)
                if reply.get("spent"):  # it ran out of memory and exits: start afresh
                    worker.close()
            finally:
                self._give(worker)
        if "error" in reply:
            raise TemplateFault(reply["error"], broken=reply["broken"])
        return reply["texts"]

    def _take(self) -> _Worker:
        with self.lock:
            while self.idle:
                worker = self.idle.pop()
                if worker.alive():
                    return worker
                worker.close()
        return _Worker()

    def _give(self, worker: _Worker) -> None:
        if worker.alive():
            with self.lock:
                self.idle.append(worker)
        else:
            worker.close()

    def close(self) -> None:
        with self.lock:
            workers, self.idle = self.idle, []
        for worker in workers:
            worker.close()


_pool = _Pool()
atexit.register(_pool.close)


def render_isolated(source: str, contexts: list[dict[str, Any]], seconds: float | None = None,
                    max_chars: int | None = None) -> list[str]:
    """`source` rendered with each of `contexts` in a worker process (no contexts: only compiled there), or
    TemplateFault. The bounds default to the sandbox's, read at the call (tests lower them)."""
    return _pool.render(source, contexts,
                        template_sandbox.MAX_RENDER_SECONDS if seconds is None else seconds,
                        template_sandbox.MAX_RENDER_CHARS if max_chars is None else max_chars)


# --- the worker's side ----------------------------------------------------------------------------------------
def _held_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _limit_memory(held: int | None, extra: int) -> None:
    """Let the address space grow by `extra` past `held` (a soft limit: the next request may raise it again)."""
    try:
        import resource
    except ImportError:  # no rlimits: the time bound still holds
        return
    if held is not None:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        soft = held + extra if hard == resource.RLIM_INFINITY else min(held + extra, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _answer(request: dict[str, Any], compiled: OrderedDict[str, Any]) -> dict[str, Any]:
    key, source = request["key"], request["source"]
    if key not in compiled:
        if source is None:
            return {"unknown": True}
        compiled[key] = template_sandbox.compile_template(source)
        if len(compiled) > _COMPILED_KEPT:
            compiled.popitem(last=False)
    compiled.move_to_end(key)
    texts = template_sandbox.render_all(compiled[key], request["contexts"], request["seconds"], request["max_chars"])
    return {"texts": texts}


def main() -> None:
    """Answer one JSON request per line on stdin until it closes; exit after running out of memory."""
    import jinja2.sandbox  # noqa: F401  (counted in what the worker holds before any template runs)

    held = _held_bytes()
    compiled: OrderedDict[str, Any] = OrderedDict()
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        request = json.loads(line)
        _limit_memory(held, request["max_bytes"])
        try:
            reply = _answer(request, compiled)
        except TemplateFault as e:
            reply = {"error": str(e), "broken": e.broken}
        except MemoryError:
            reply = {"error": f"needs more than {request['max_bytes'] >> 20:,} MiB of memory to render",
                     "broken": True, "spent": True}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()
        if reply.get("spent"):  # what ran out of memory may have left the interpreter short: start afresh
            return


if __name__ == "__main__":
    main()
