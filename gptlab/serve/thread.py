"""`ServerThread`: uvicorn serving an app from a background thread of this process, for tests and benchmarks
that want a real HTTP server without a subprocess."""

from __future__ import annotations

import threading
import time

from fastapi import FastAPI


class ServerThread:
    """uvicorn serving `app` from a background thread.

    `with ServerThread(app) as s: ...` starts it on a free loopback port (s.url) and stops it on exit."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0) -> None:
        import uvicorn

        self.server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        )
        self.thread = threading.Thread(target=self.server.run, name="gptlab-uvicorn", daemon=True)
        self.host, self.port, self.timeout = host, port, timeout

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + self.timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]  # the port the OS picked for port=0
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=self.timeout)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
