"""Requests in flight per principal: at most ``rate_limits.max_in_flight`` of one principal's at
once (its own ``tenants[].max_in_flight``; ``none``: no bound), so one principal cannot hold
every connection the server takes (``server.max_connections``) with requests that wait.

The authentication step (``caller.py``) takes a slot of the principal's
(:class:`~cwm_plugin.sidecar.identity.tenant_bounds.TenantBound`; past the bound a 429 at once,
``limit="in_flight"``) and hands its release to :func:`on_finish`. :class:`Finish` (ASGI
middleware, around the app) calls what was handed to it once the response is finished, however
it finishes: at the last body message (before it is sent: a client that has the whole answer
finds the slot free), when the client disconnects, or when the app returns or raises without
answering. A streamed answer holds its slot while it streams; the work it leaves in the
background does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request

KEY = "cwm.finish"  # the scope's list of what to call when the response is finished


def on_finish(request: Request, release: Callable[[], None]) -> None:
    """Call ``release()`` once ``request``'s response is finished (:class:`Finish`)."""
    hooks = request.scope.get(KEY)
    if hooks is None:  # a programming error: the bound would never be given back
        release()
        raise RuntimeError("the app has no in_flight.Finish middleware")
    hooks.append(release)


class Finish:
    """ASGI middleware: runs what :func:`on_finish` was given when the response is finished
    (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        hooks: list[Callable[[], None]] = []
        scope[KEY] = hooks

        def finish() -> None:
            while hooks:
                hooks.pop()()

        async def receiving() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect":
                finish()
            return message

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finish()
            await send(message)

        try:
            await self.app(scope, receiving, sending)
        finally:
            finish()
