"""One connection to Redis (a single node, or a cluster through any seed node) that never
stalls its caller: bounded socket timeouts, fail fast while down, reconnect with backoff.

The client is made on first use, so a Redis that is down at start is simply unavailable until
it answers. A refused or reset connection, a cluster without its slots, or ``timeouts_to_down``
timeouts in a row mark the connection down: calls raise :class:`TierUnavailable` at once until
the backoff (doubling up to ``max_backoff_s``) has passed, then one call tries again. A single
slow answer (a busy 2-core machine, Redis writing a large blob) fails that call only: marking
the tier down on one timeout would cost seconds of backoff in which every restore recomputes.
The outage and the reconnection are logged once each. The URL's password never reaches a log
line.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from cwm_plugin.errors import TierUnavailable
from cwm_plugin.store.config import redact

log = logging.getLogger(__name__)
T = TypeVar("T")


class RedisConnection:
    def __init__(self, url: str, *, timeout_s: float = 5.0, cluster: bool = False,
                 scripts: dict[str, str] | None = None, backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, timeouts_to_down: int = 3) -> None:
        self.url = url
        self.safe_url = redact(url)
        self.timeout_s = timeout_s
        self.cluster = cluster
        self.backoff0 = backoff_s
        self.max_backoff = max_backoff_s
        self.failures = 0
        self.timeouts_to_down = max(1, timeouts_to_down)
        self._timeouts = 0  # in a row
        self._sources = dict(scripts or {})
        self._client: Any = None
        self.scripts: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._backoff = backoff_s
        self._down_until = 0.0
        self._down = False

    @property
    def available(self) -> bool:
        return not self._down

    def client(self) -> Any:
        if self._client is None:
            kw = dict(socket_timeout=self.timeout_s,
                      socket_connect_timeout=min(self.timeout_s, 2.0))
            if self.cluster:
                from redis.cluster import RedisCluster
                conn = RedisCluster.from_url(self.url, retry=Retry(NoBackoff(), 1), **kw)
            else:
                conn = redis.Redis.from_url(self.url, retry=Retry(NoBackoff(), 0),
                                            health_check_interval=30, **kw)
            self.scripts = {n: conn.register_script(src) for n, src in self._sources.items()}
            self._client = conn
        return self._client

    def call(self, fn: Callable[[Any], T]) -> T:
        """``fn(client)``, or :class:`TierUnavailable` (at once while down)."""
        with self._lock:
            if self._down and time.monotonic() < self._down_until:
                raise TierUnavailable(f"redis at {self.safe_url} is unreachable",
                                      hint="serving from local tiers; retrying with backoff")
        try:
            out = fn(self.client())
        except ValueError as exc:  # from_url: a URL it cannot use (config validates the form)
            self._mark_down(exc)
            raise TierUnavailable(f"redis at {self.safe_url} cannot be used: {exc}",
                                  hint="check the store's redis_url") from exc
        except redis.TimeoutError as exc:
            with self._lock:
                self._timeouts += 1
                down = self._timeouts >= self.timeouts_to_down
            if down:
                self._mark_down(exc)
            raise TierUnavailable(f"redis at {self.safe_url} did not answer in time: {exc}",
                                  hint="serving from local tiers; a busy Redis or machine, or "
                                       "raise redis_timeout_ms / redis_lookup_timeout_ms") from exc
        except (redis.ConnectionError, OSError, RedisClusterException) as exc:
            # (a cluster no node of which answers, or one without cluster mode, raises
            # RedisClusterException, which is no RedisError: uncaught, it would take vLLM's
            # scheduler down)
            self._mark_down(exc)
            raise TierUnavailable(f"redis at {self.safe_url} is unreachable: {exc}",
                                  hint="serving from local tiers; retrying with backoff") from exc
        except redis.RedisError as exc:     # reachable but refused (OOM, READONLY, ...)
            if "cluster" in str(exc).lower() or "slots" in str(exc).lower():
                self._mark_down(exc)
            raise TierUnavailable(f"redis at {self.safe_url} refused the request: {exc}",
                                  hint="check Redis' maxmemory, role and cluster state") from exc
        self._timeouts = 0
        if self._down:
            with self._lock:
                self._down, self._backoff = False, self.backoff0
            log.warning("redis tier: reconnected to %s", self.safe_url)
        return out

    def _mark_down(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            first = not self._down
            if not first:
                self._backoff = min(self._backoff * 2, self.max_backoff)
            self._down = True
            self._down_until = time.monotonic() + self._backoff
        if first:
            log.warning("redis tier: %s unreachable (%s); serving from local tiers, retrying "
                        "with backoff up to %.0fs", self.safe_url, exc, self.max_backoff)

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(redis.RedisError):
                self._client.close()

