"""Per-tenant request rates and token quotas, counted with the ``limits`` package.

Every request of a principal is one hit on its ``rate_limit`` (a moving window: exact, no
burst at a window's edge), checked by the authentication dependency before its body is read
(``caller.py``), so a tenant flooding the sidecar costs it a header parse per request and
never delays the others' work. Requests that spend tokens (chat, completions, responses) are
refused too while the principal's ``token_quota`` is used up; tokens are spent when the
usage is known (``usage.py``: client answers, a stream cut short, background work), in a
fixed window that counts a request past the quota whole (its size is not known before it
runs). A refusal is an OpenAI-shaped 429 (``rate_limit_exceeded``) with ``Retry-After``
(seconds until the window frees room), counted in
``cwm_sidecar_rate_limited_total{tenant,limit}``. The counts live in ``rate_limits.storage``
(this process, or a Redis shared by every sidecar); a storage that fails lets requests
through (logged once, counted as ``limit="storage_error"``): the limits protect the service,
they never take it down.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable

from limits import RateLimitItem, parse_many
from limits.storage import storage_from_string
from limits.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter
from prometheus_client import Counter

from cwm_plugin.errors import CWMError
from cwm_plugin.sidecar.settings import TenantConfig
from cwm_plugin.sidecar.settings.limits import NO_LIMIT, RateLimitSettings

log = logging.getLogger(__name__)


class RateLimited(CWMError):
    """A principal over its request rate or token quota (HTTP 429, ``Retry-After``)."""

    code = "rate_limit_exceeded"
    http_status = 429

    def __init__(self, message: str, *, retry_after: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.headers = {"Retry-After": str(retry_after)}


def _items(value: str | None) -> list[RateLimitItem]:
    return [] if value is None or value == NO_LIMIT else parse_many(value)


class TenantLimits:
    """The limits of every principal of one app (see the module docstring)."""

    def __init__(self, settings: RateLimitSettings, principals: Iterable[TenantConfig],
                 counter: Counter) -> None:
        storage = storage_from_string(settings.storage)
        self._requests = MovingWindowRateLimiter(storage)
        self._tokens = FixedWindowRateLimiter(storage)
        self._counter = counter
        self._warned = False
        self._rates = {p.name: _items(p.rate_limit or settings.rate_limit) for p in principals}
        self._quotas = {p.name: _items(p.token_quota or settings.token_quota)
                        for p in principals}

    def admit(self, principal: str, *, metered: bool) -> None:
        """Count one request of ``principal``; :class:`RateLimited` when it is over its rate
        or, for a request that spends tokens (``metered``), its token quota."""
        try:
            for item in self._rates.get(principal, ()):
                if not self._requests.hit(item, principal):
                    self._refuse(principal, "requests", item,
                                 self._requests.get_window_stats(item, principal).reset_time)
            if metered:
                for item in self._quotas.get(principal, ()):
                    if not self._tokens.test(item, principal):
                        self._refuse(principal, "tokens", item,
                                     self._tokens.get_window_stats(item, principal).reset_time)
        except RateLimited:
            raise
        except Exception as exc:  # the storage (a Redis outage): let the request through
            self._storage_failed(principal, exc)

    def spend(self, principal: str, tokens: int) -> None:
        """``tokens`` used by ``principal`` (its answers' usage, background work included)."""
        if tokens <= 0:
            return
        try:
            for item in self._quotas.get(principal, ()):
                self._tokens.hit(item, principal, cost=tokens)
        except Exception as exc:
            self._storage_failed(principal, exc)

    def _refuse(self, principal: str, limit: str, item: RateLimitItem, reset: float) -> None:
        self._counter.labels(principal, limit).inc()
        wait = max(1, math.ceil(reset - time.time()))
        what = "requests" if limit == "requests" else "tokens"
        raise RateLimited(f"principal `{principal}` is over its {what} limit ({item}); "
                          f"retry in {wait} s", retry_after=wait,
                          hint="wait for Retry-After seconds, or ask the operator for a "
                               "higher rate_limit / token_quota")

    def _storage_failed(self, principal: str, exc: Exception) -> None:
        self._counter.labels(principal, "storage_error").inc()
        (log.debug if self._warned else log.error)(
            "rate limits are not enforced: their storage failed (%s: %s); requests pass "
            "(counted in cwm_sidecar_rate_limited_total{limit=storage_error})",
            type(exc).__name__, exc)
        self._warned = True
