"""The HTTP server's bounds against careless or hostile clients (``server:`` in the sidecar's
config), the same for ``cwm serve`` and the in-process server of the tests
(:func:`uvicorn_config`).

uvicorn serves with its h11 protocol, whose settings give

- connections: at most ``max_connections`` (uvicorn's ``limit_concurrency``); a request
  arriving past it gets a 503;
- an idle connection between two requests is closed after ``keep_alive_s``;
- h11 buffers at most ``max_header_bytes`` of an incomplete request head
  (``max_incomplete_event_size``; past it a 400 and the connection closed) -- but a head that
  arrives whole in one read is not measured.

What uvicorn has no bound for is added here, each the smallest mechanism that holds it:

- :class:`BoundedH11` (the protocol): a request's line and headers are at most
  ``max_header_bytes`` however they arrive (past it a 431 and the connection closed), and
  complete within ``header_timeout_s`` of the connection opening, or of the first byte after
  the previous answer, else the connection is closed. Headers sent a few bytes at a time, or
  never ended, and a body nobody reads sent after the answer, hold a connection that long at
  most.
- :class:`BodyDeadline` (ASGI middleware): a route reading a body waits for its bytes at most
  ``body_timeout_s`` plus a second for every ``body_min_rate`` bytes received; past that a
  408 (``request_timeout``) and the connection closed. A body sent a byte at a time is cut
  off; a large upload at a sane rate never is.

Uploads (``/v1/windows/import``) are bounded by their size (``windows.max_import_bytes``), their
duration (``windows.import_timeout_s``), how many of a tenant's are under way and the bytes all
of them spool at once (``api/window_files.py``). How many requests one principal has in flight
(and so how many connections it holds past their headers): ``identity/in_flight.py``.
"""

from __future__ import annotations

import asyncio
import re
import time
from functools import partial
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from cwm_plugin.errors import CWMError
from cwm_plugin.sidecar.settings.limits import ServerSettings


class ClientTooSlow(CWMError):
    """A request's body came slower than the server waits for (HTTP 408, then closed)."""

    code = "request_timeout"
    http_status = 408

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.headers = {"Connection": "close"}


HEAD_END = re.compile(rb"\n\r?\n")  # the blank line that ends a request head (h11's)
_WHY = b"the request line and headers are too large"
TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; "
             b"charset=utf-8\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
             % (len(_WHY), _WHY))


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a size and a deadline for a request's headers (module
    docstring)."""

    def __init__(self, *args: Any, header_timeout_s: float, max_header_bytes: int,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.max_header_bytes = max_header_bytes
        self._deadline: asyncio.TimerHandle | None = None
        self._head = 0  # bytes of the request head being received ...
        self._tail = b""  # ... and its last few (its blank line may span two reads)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._arm()  # the first bytes of a next request (or of a body nobody reads)
        if self.conn.their_state is h11.IDLE and self._head_too_large(data):
            self.transport.write(TOO_LARGE)
            self.transport.close()
            return
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers are in: its route runs now
            self._disarm()

    def _head_too_large(self, data: bytes) -> bool:
        """Count ``data`` into the request head being received, up to its blank line."""
        seen = self._tail + data
        end = HEAD_END.search(seen)
        size = self._head + (len(data) if end is None else end.end() - len(self._tail))
        self._head, self._tail = (size, seen[-3:]) if end is None else (0, b"")
        return size > self.max_header_bytes

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


class BodyDeadline:
    """ASGI middleware: how long a route waits for a request's body (module docstring)."""

    def __init__(self, app: Any, *, timeout_s: float, min_rate: int) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.min_rate = min_rate

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        waited, got, done = 0.0, 0, False

        async def bounded() -> dict[str, Any]:
            nonlocal waited, got, done
            if done:  # the body is in: listening for a disconnect waits as long as it likes
                return await receive()
            budget = self.timeout_s + got / self.min_rate - waited
            started = time.monotonic()
            try:
                async with asyncio.timeout(max(0.0, budget)):
                    message = await receive()
            except TimeoutError:
                raise ClientTooSlow(
                    f"the request body came too slowly ({got} bytes in {waited:.0f} s)",
                    hint=f"send it faster than {self.min_rate} bytes a second") from None
            finally:
                waited += time.monotonic() - started
            if message["type"] == "http.request":
                got += len(message.get("body", b""))
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        await self.app(scope, bounded, send)


def limits_of(app: Any) -> ServerSettings | None:
    """The server settings of a sidecar app (None: another app)."""
    sidecar = getattr(getattr(app, "state", None), "sidecar", None)
    return sidecar.settings.server if sidecar is not None else None


def uvicorn_config(app: Any, *, host: str, port: int, limits: ServerSettings | None,
                   **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` with ``limits`` (None: uvicorn's defaults)."""
    if limits is None:
        return uvicorn.Config(app, host=host, port=port, **kwargs)
    return uvicorn.Config(
        app, host=host, port=port,
        http=partial(BoundedH11, header_timeout_s=limits.header_timeout_s,
                     max_header_bytes=limits.max_header_bytes),
        h11_max_incomplete_event_size=limits.max_header_bytes,
        limit_concurrency=limits.max_connections, timeout_keep_alive=limits.keep_alive_s,
        **kwargs)
