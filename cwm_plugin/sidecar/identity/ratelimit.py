"""Per-tenant request rates, token quotas and concurrent uploads, counted with the ``limits``
package's asyncio API: nothing here blocks the event loop.

Requests: every request of a principal is one hit on its ``rate_limit`` (a moving window:
exact, no burst at a window's edge), checked by the authentication dependency before its body
is read (``caller.py``), so a tenant flooding the sidecar costs it a header parse per request
and never delays the others' work.

Tokens (a fixed window per ``token_quota`` item): a request that spends tokens (chat,
completions, responses) is refused at once while its principal's quota has nothing left; once
its body is read it reserves its estimate (:meth:`TenantLimits.reserve`: its prompt's, plus the
most it may answer; refused when that would go past the quota), and when it is over the
reservation is settled to what it used (:meth:`TenantLimits.settle`, from ``usage.py``).
Requests running at once never take more than the quota together; one goes past it only by
what its prompt was underestimated. What is given back after its window ended is dropped (it
would be a gift to the next window). Background work (summaries, facts) and warm-ups spend
what they used afterwards (:meth:`TenantLimits.spend`).

Work under way (requests in flight, imports, window operations): ``tenant_bounds.py``.

A refusal is an OpenAI-shaped 429 (``rate_limit_exceeded``) with ``Retry-After`` (seconds
until the window frees room), counted in ``cwm_sidecar_rate_limited_total{tenant,limit}``.
A request refused for its rate or quota is answered ``refusal_delay_s`` later (at most when
its window frees room): it waits holding one of its principal's requests in flight and no
work (a principal with no bound on those is answered at once: its held refusals could take
the connections every principal shares), so a client that sends as fast as it is answered
sends a few requests a second instead of the thousands a second of refusals that would keep
the event loop from everyone else's.

The counts live in ``rate_limits.storage``: this process (``memory://``) or a Redis every
sidecar shares. A Redis call that fails or takes longer than ``storage_timeout_s`` is counted
(``limit="storage_error"``) and logged once an outage, and the counts move to this process's
own until Redis is tried again ``storage_retry_s`` later: a hung or down Redis costs a request
at most ``storage_timeout_s`` and never stalls the others, and the limits keep holding (per
process) -- neither failing open nor taking the sidecar down. Tokens an operation had already
added to Redis's counts when it failed are given back there (in the background, within
``storage_timeout_s``; best effort), since the operation is counted again in this process. (A
request's hit on a moving window cannot be taken back: one that failed midway may count once
more in Redis.)
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from limits import RateLimitItem, parse_many
from limits.aio.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter
from limits.storage import storage_from_string
from prometheus_client import Counter

from cwm_plugin.errors import CWMError
from cwm_plugin.sidecar.settings import TenantConfig
from cwm_plugin.sidecar.settings.limits import NO_LIMIT, RateLimitSettings

log = logging.getLogger(__name__)
T = TypeVar("T")
Added = list[tuple[str, int, int]]  # what an op added to token counts: key, expiry, amount


class RateLimited(CWMError):
    """A principal over its request rate, token quota or work under way at once (HTTP 429,
    ``Retry-After``)."""

    code = "rate_limit_exceeded"
    http_status = 429

    def __init__(self, message: str, *, retry_after: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.headers = {"Retry-After": str(retry_after)}


def _items(value: str | None) -> list[RateLimitItem]:
    return [] if value is None or value == NO_LIMIT else parse_many(value)


@dataclass
class _Counts:
    """One storage and the two strategies over it."""

    storage: Any
    requests: MovingWindowRateLimiter
    tokens: FixedWindowRateLimiter


async def _add(c: _Counts, item: RateLimitItem, principal: str, amount: int,
               added: Added) -> int:
    """Add ``amount`` tokens to ``principal``'s count of ``item`` in ``c``, noted in ``added``;
    the count now."""
    key, expiry = item.key_for(principal), item.get_expiry()
    value = await c.storage.incr(key, expiry, amount=amount)
    added.append((key, expiry, amount))
    return value


def _counts(uri: str, timeout_s: float) -> _Counts:
    opts: dict[str, Any] = {} if uri.startswith("memory://") else {
        "implementation": "redispy", "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s}
    storage = storage_from_string(f"async+{uri}", **opts)
    return _Counts(storage, MovingWindowRateLimiter(storage), FixedWindowRateLimiter(storage))


@dataclass
class Reservation:
    """Tokens one request took from its principal's quota before it went upstream."""

    principal: str
    tokens: int
    counts: _Counts | None = None  # where they were taken (None: nothing was)
    until: float = 0.0  # the earliest end of the windows they were taken from (epoch s)


class TenantLimits:
    """The limits of every principal of one app (see the module docstring)."""

    def __init__(self, settings: RateLimitSettings, principals: Iterable[TenantConfig],
                 counter: Counter) -> None:
        self._shared = _counts(settings.storage, settings.storage_timeout_s)
        self._local = self._shared if settings.storage.startswith("memory://") \
            else _counts("memory://", 0)
        self._timeout_s = settings.storage_timeout_s
        self._refusal_delay_s = settings.refusal_delay_s
        self._retry_s = settings.storage_retry_s
        self._down_until = -math.inf  # monotonic: the shared counts are not asked before
        self._outage = False
        self._counter = counter
        self._tasks: set[asyncio.Task] = set()
        principals = list(principals)
        self._rates = {p.name: _items(settings.rate_of(p.rate_limit, len(principals)))
                       for p in principals}
        self._quotas = {p.name: _items(p.token_quota or settings.token_quota)
                        for p in principals}

    async def admit(self, principal: str, *, metered: bool, hold: bool = True) -> None:
        """Count one request of ``principal``; :class:`RateLimited` when it is over its rate
        or, for a request that spends tokens (``metered``), its token quota has nothing left,
        answered ``refusal_delay_s`` later when ``hold`` (the caller bounds what it may hold:
        its requests in flight)."""
        rates = self._rates.get(principal, [])
        quotas = self._quotas.get(principal, []) if metered else []
        if not rates and not quotas:
            return

        async def check(c: _Counts, _: Added) -> tuple[str, RateLimitItem, float] | None:
            for item in rates:
                if not await c.requests.hit(item, principal):
                    stats = await c.requests.get_window_stats(item, principal)
                    return "requests", item, stats.reset_time
            for item in quotas:
                if not await c.tokens.test(item, principal):
                    stats = await c.tokens.get_window_stats(item, principal)
                    return "tokens", item, stats.reset_time
            return None

        refused, _ = await self._on_counts(principal, check)
        if refused is not None:
            if hold and self._refusal_delay_s:  # held, not worked on: a flooder waits
                await asyncio.sleep(min(self._refusal_delay_s,
                                        max(0.0, refused[2] - time.time())))
            self._refuse(principal, *refused)

    async def reserve(self, principal: str, tokens: int) -> Reservation:
        """Take ``tokens`` (a request's estimate) from ``principal``'s quota before the request
        goes upstream; :class:`RateLimited` when that would go past it (nothing is taken)."""
        quotas = self._quotas.get(principal, [])
        if not quotas or tokens <= 0:
            return Reservation(principal, 0)

        async def take(c: _Counts, added: Added) -> tuple[RateLimitItem | None, float]:
            taken: list[RateLimitItem] = []
            for item in quotas:
                taken.append(item)
                if await _add(c, item, principal, tokens, added) > item.amount:
                    for it in taken:  # a refused hit counted too: give it all back
                        await _add(c, it, principal, -tokens, added)
                    return item, (await c.tokens.get_window_stats(item, principal)).reset_time
            return None, min([await c.storage.get_expiry(it.key_for(principal))
                              for it in quotas])

        (refused, when), counts = await self._on_counts(principal, take)
        if refused is not None:
            self._refuse(principal, "tokens", refused, when, asked=tokens)
        return Reservation(principal, tokens, counts, when)

    async def settle(self, res: Reservation, used: int) -> None:
        """``res``'s request is over and used ``used`` tokens: the quota counts those instead
        of the reservation (see the module docstring)."""
        quotas = self._quotas.get(res.principal, [])
        if res.counts is None:
            await self.spend(res.principal, used)
            return
        delta = max(0, used) - res.tokens
        if not quotas or delta == 0 or (delta < 0 and time.time() >= res.until):
            return

        async def adjust(c: _Counts, added: Added) -> None:
            if delta < 0 and c is not res.counts:  # taken where it cannot be given back now
                return
            for item in quotas:
                await _add(c, item, res.principal, delta, added)

        await self._on_counts(res.principal, adjust)

    async def spend(self, principal: str, tokens: int) -> None:
        """``tokens`` used by ``principal`` without a reservation (background work)."""
        quotas = self._quotas.get(principal, [])
        if not quotas or tokens <= 0:
            return

        async def hit(c: _Counts, added: Added) -> None:
            for item in quotas:
                await _add(c, item, principal, tokens, added)

        await self._on_counts(principal, hit)

    def later(self, work: Awaitable[None]) -> None:
        """Run ``work`` (a spend, a settlement) in the background: for callers that cannot
        wait for it (a sync one, a request being cancelled)."""
        try:
            task = asyncio.get_running_loop().create_task(work)  # type: ignore[arg-type]
        except RuntimeError:  # no event loop: nothing to count on
            getattr(work, "close", lambda: None)()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_counts(self, principal: str,
                         op: Callable[[_Counts, Added], Awaitable[T]]) -> tuple[T, _Counts]:
        """``op`` on the shared counts, or on this process's own while those fail (what it had
        added to the shared ones is given back: see the module docstring)."""
        if self._shared is self._local or time.monotonic() < self._down_until:
            return await op(self._local, []), self._local
        added: Added = []
        try:
            async with asyncio.timeout(self._timeout_s):
                result = await op(self._shared, added)
        except Exception as exc:  # Redis down, hung, refusing: this process counts for now
            self._storage_failed(principal, exc)
            if added:
                self.later(self._give_back(added))
            return await op(self._local, []), self._local
        if self._outage:
            self._outage = False
            log.warning("rate limit storage is back: counting there again")
        return result, self._shared

    async def _give_back(self, added: Added) -> None:
        """Take back from the shared counts what a failed op had added there, newest first,
        within ``storage_timeout_s`` (best effort: Redis may still be failing)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                while added:
                    key, expiry, amount = added[-1]
                    await self._shared.storage.incr(key, expiry, amount=-amount)
                    added.pop()
        except Exception as exc:
            log.info("rate limit storage: %d token counts of a failed operation were not "
                     "given back (%s: %s)", len(added), type(exc).__name__, exc)

    def _refuse(self, principal: str, limit: str, item: RateLimitItem, reset: float,
                asked: int | None = None) -> None:
        self._counter.labels(principal, limit).inc()
        wait = max(1, math.ceil(reset - time.time()))
        if asked is not None and asked > item.amount:
            raise RateLimited(f"principal `{principal}`: this request may use up to {asked} "
                              f"tokens, more than its whole tokens limit ({item})",
                              retry_after=wait,
                              hint="ask for fewer (max_tokens), send less, or ask the operator "
                                   "for a higher token_quota")
        what = "requests" if limit == "requests" else "tokens"
        extra = f" (this request may use up to {asked})" if asked is not None else ""
        raise RateLimited(f"principal `{principal}` is over its {what} limit ({item}){extra}; "
                          f"retry in {wait} s", retry_after=wait,
                          hint="wait for Retry-After seconds, or ask the operator for a "
                               "higher rate_limit / token_quota")

    def _storage_failed(self, principal: str, exc: Exception) -> None:
        self._counter.labels(principal, "storage_error").inc()
        self._down_until = time.monotonic() + self._retry_s
        if not self._outage:
            self._outage = True
            log.error("rate limit storage failed (%s: %s): this process counts on its own, "
                      "asking it again every %.0f s (cwm_sidecar_rate_limited_total"
                      "{limit=storage_error})", type(exc).__name__, exc, self._retry_s)

