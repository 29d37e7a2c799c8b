"""Request bodies a hostile or broken client can send: too large, or too slow.

`BodyLimits` is an ASGI middleware in front of the whole app. A body over `max_bytes` is answered 413 before
it is stored: at once when its Content-Length says so, else as soon as the bytes received pass the limit (a
chunked upload); without a limit a 50 MB JSON body held the server at 3.7 GB while it was parsed. A body that
does not arrive in full within `timeout` seconds of the request's start is answered 408, so a client that sends
half a body and waits holds a connection for that long at most; it never holds a generation row, since a
request reaches the scheduler only once its body has been read and validated.

Both answers are OpenAI-shaped error bodies: raised as HTTPException from inside the body read, they reach the
app's error handler like any other.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gptlab.serve.schemas import error_body


class BodyLimits:
    """413 for bodies over `max_bytes`, 408 for bodies not received within `timeout` seconds."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    def _too_large(self) -> str:
        return f"The request body is larger than this server's limit of {self.max_bytes} bytes."

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await answer(send, 413, error_body(self._too_large(), code="request_too_large"))
            return
        deadline = time.monotonic() + self.timeout
        received, complete = 0, False

        async def limited() -> Message:
            nonlocal received, complete
            if complete:  # after the body: a wait for the client to hang up, which has no deadline
                return await receive()
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    complete = not message.get("more_body", False)
                    if received > self.max_bytes:
                        raise HTTPException(413, self._too_large())
                return message
            raise HTTPException(408, f"The request body did not arrive within {self.timeout:g} s.")

        await self.app(scope, limited, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def answer(send: Send, status: int, body: dict[str, Any], close: bool = True) -> None:
    """A JSON answer sent by a middleware, before the app runs (`close`: the connection closes after it)."""
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if close:  # (a body we refuse to read must not be taken for the next request)
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
