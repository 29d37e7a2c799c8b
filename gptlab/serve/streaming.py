"""Server-sent events, shared by completions and chat completions.

A streamed answer is one `data: {chunk}` event per text delta of a choice (a route shapes the chunk), then, if the
client asked for `stream_options.include_usage`, a chunk with no choices and the usage, then `data: [DONE]`. The
events that arrived since the stream last looked (a step's, or several if the client reads slowly) go out in one
write. With the server's `stream_interval`, a stream waits that long after each write (the first token goes out at
once): the steps meanwhile go out together, so the event loop's thread, which shares the GIL and the cores with the
engine, wakes, encodes and sends once per interval rather than once per step. A client that hangs up is noticed
within a second and its rows are freed for other requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from gptlab.serve.scheduler import Event, Job
from gptlab.serve.schemas import SamplingFields
from gptlab.serve.state import ServedModel, job_failure, usage

# chunk(index, text, finish_reason, tokens): one choice's chunk; `tokens` is how many tokens that choice had
# produced when the text was taken (where the chunk's logprobs end)
ChunkFn = Callable[[int, str, str | None, int], dict[str, Any]]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _events(
    server: ServedModel, job: Job, prompts: list[list[int]], chunk: ChunkFn, include_usage: bool, request: Request
) -> AsyncIterator[str]:
    done = 0
    try:
        while done < len(job.gens):
            events = await job.next_events(timeout=1.0)
            if not events:
                if await request.is_disconnected():
                    return
                continue
            out = []
            for index, delta, finish, tokens in _per_choice(events):
                done += finish is not None
                if finish == "error":
                    out.append(sse(job_failure(job).body()))
                    done = len(job.gens)  # nothing more comes
                    break
                out.append(sse(chunk(index, delta, finish, tokens)))
            yield "".join(out)
            if server.stream_interval > 0 and done < len(job.gens):
                await asyncio.sleep(server.stream_interval)
        if include_usage and job.error is None:
            yield sse({**chunk(0, "", None, 0), "choices": [], "usage": usage(job, prompts)})
        yield "data: [DONE]\n\n"
    finally:
        if done < len(job.gens) or job.error is not None:
            server.scheduler.cancel(job)


def _per_choice(events: list[Event]) -> list[Event]:
    """A choice's events joined into one (its deltas in order, the last one's finish and token count), so it
    writes one chunk however many steps it waited for."""
    joined: dict[int, Event] = {}
    for index, delta, finish, tokens in events:
        before = joined.get(index)
        joined[index] = (index, delta if before is None else before[1] + delta, finish, tokens)
    return list(joined.values())


def event_stream(
    server: ServedModel, job: Job, prompts: list[list[int]], chunk: ChunkFn, req: SamplingFields, request: Request
) -> StreamingResponse:
    """The streamed answer to `req`, its chunks shaped by `chunk`."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return StreamingResponse(
        _events(server, job, prompts, chunk, include_usage, request),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )
