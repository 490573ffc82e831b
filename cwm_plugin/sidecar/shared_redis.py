"""The one Redis client a replica's shared parts use (``sessions.shared_url``): session state,
background jobs and usage share its connection pool and its timeouts instead of opening a pool
each. A part given a URL instead (a tool, a test) opens and closes a client of its own."""

from __future__ import annotations

from typing import Any


def open_shared(url: str, timeout_s: float) -> Any:
    """A ``redis.asyncio`` client for ``url`` whose every call and connect is bounded by
    ``timeout_s`` (imported only here: Redis is needed only with a shared URL)."""
    import redis.asyncio as aioredis

    return aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


def client_of(redis: Any, timeout_s: float) -> tuple[Any, bool]:
    """``(client, owned)``: the client given, or one opened for the URL given (owned: the
    part closes it)."""
    return (open_shared(redis, timeout_s), True) if isinstance(redis, str) else (redis, False)
