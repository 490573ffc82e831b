"""Running an ASGI app with uvicorn in a background thread (tests and the benchmark).

``cwm serve`` runs uvicorn in the foreground instead; this is for callers that need the app
object at hand (e.g. to wait for its background tasks) while talking to it over real HTTP. A
sidecar app is served with its ``server:`` bounds, as ``cwm serve`` serves it
(``cwm_plugin/sidecar/server_limits.py``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import uvicorn

from cwm_plugin.sidecar.server_limits import limits_of, uvicorn_config
from cwm_plugin.testing.procs import free_port


class ServerThread:
    """``with ServerThread(app) as srv: httpx.get(srv.url + "/health")``."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout: float = 30.0) -> None:
        self.app = app
        self.host = host
        self.port = port or free_port()
        self.startup_timeout = startup_timeout
        config = uvicorn_config(app, host=host, port=self.port, limits=limits_of(app),
                                log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def start(self) -> ServerThread:
        self._thread = threading.Thread(target=self._run, name=f"uvicorn-{self.port}",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server on port {self.port} exited while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def call(self, coro: Any, timeout: float = 120.0) -> Any:
        """Run a coroutine on the server's event loop and wait for its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def kill(self) -> None:
        """As SIGKILL would leave it: no longer listening, every open connection reset at once
        (a client mid-answer sees its stream cut; a pooled keep-alive connection is dead too).
        ``stop()`` then ends the thread."""

        async def die() -> None:
            for listener in self.server.servers:
                listener.close()
            for connection in list(self.server.server_state.connections):
                if connection.transport is not None:
                    connection.transport.abort()

        self.call(die(), timeout=10)

    def stop(self) -> None:
        if self._thread is not None:
            self.server.should_exit = True
            self._thread.join(timeout=15)
            self._thread = None

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
