"""The API key: `ApiKeyCheck`, a pure ASGI middleware answering 401 to a guarded path without the right key.

Pure ASGI, not Starlette's `BaseHTTPMiddleware` (`@app.middleware("http")`): that one runs the route in a task of
its own and passes every message of the answer through a memory stream, a cost paid per streamed chunk; this one
looks at the request's headers once and then hands the connection's own `send` to the app.

The key is compared as UTF-8 bytes in constant time (a non-ASCII key works when the client sends it as UTF-8, as
HTTP clients do): the header's raw bytes, not a decoded string.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from gptlab.serve.limits import answer
from gptlab.serve.schemas import ApiError


class ApiKeyCheck:
    """401 for a request to a path under `prefixes` without 'Authorization: Bearer KEY'."""

    def __init__(self, app: ASGIApp, key: bytes, prefixes: tuple[str, ...]) -> None:
        self.app, self.key, self.prefixes = app, key, prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefixes) and not self._allowed(scope):
            err = ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'.",
                           code="invalid_api_key")
            await answer(send, 401, err.body(), close=False)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        header = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        given = header[7:] if header[:7].lower() == b"bearer " else b""
        return hmac.compare_digest(given, self.key)  # constant time: no timing oracle
