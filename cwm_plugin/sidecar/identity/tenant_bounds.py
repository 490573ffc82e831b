"""Per-tenant bounds on work under way: at most so many of a principal's things running and so
many waiting for their turn; past that, 429 at once (:class:`RateLimited`, ``Retry-After``),
counted in ``cwm_sidecar_rate_limited_total{tenant,limit}``.

:class:`TenantBound` is the one mechanism. What it bounds:

- requests in flight (``rate_limits.max_in_flight``, per principal
  ``tenants[].max_in_flight``; none wait): taken by the authentication step and given back when
  the response is finished (``in_flight.py``);
- window imports under way (``windows.imports_per_tenant``; none wait:
  ``api/window_files.py``);
- blocking work on threads (:class:`TenantPool`): every window-engine and store call of the
  sidecar (``windows.tenant_threads`` running, ``windows.tenant_waiting`` waiting), and the
  prompt-state reads of continuing sessions (a pool of their own, ``turn/records.py``).

A waiter holds no thread: it waits in the event loop, behind its own principal's work only, and
a slot it is handed as it goes away is passed on. A :class:`TenantPool` gives a principal's
slot back when the call on its thread returns, not when the request that waited for it goes
away, so a principal never holds more threads than its share (a hung store holds at most that
many), and the pool has room for every principal's share at once (threads are started as they
are needed): no principal's work queues behind another's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client import Counter

from cwm_plugin import pg_scope
from cwm_plugin.sidecar.identity.ratelimit import RateLimited

T = TypeVar("T")
Release = Callable[[], None]  # gives a slot back; idempotent


def nothing() -> None:
    """The release of a slot that was never counted (a principal without a bound)."""


@dataclass
class _Lane:
    """One principal's slots: how many are running, who waits for one (oldest first)."""

    running: int = 0
    waiting: deque[asyncio.Future[None]] = field(default_factory=deque)


class TenantBound:
    """At most ``running`` of a principal's ``what`` at once (``own``: a principal's own
    number; None: no bound) and ``waiting`` more waiting for one; past that, 429 counted as
    ``limit``. Used on the event loop's thread only."""

    def __init__(self, limit: str, what: str, running: int | None, waiting: int,
                 counter: Counter, own: Mapping[str, int | None] | None = None) -> None:
        self.limit = limit
        self.what = what
        self.running = running
        self.waiting = waiting
        self._own = dict(own or {})
        self._counter = counter
        self._lanes: dict[str, _Lane] = {}

    def bound(self, principal: str) -> int | None:
        """How many of ``principal``'s may run at once (None: any number)."""
        return self._own.get(principal, self.running)

    def held(self, principal: str) -> int:
        """How many of ``principal``'s run now."""
        lane = self._lanes.get(principal)
        return lane.running if lane else 0

    async def take(self, principal: str) -> Release:
        """A slot of ``principal``'s: at once, or after waiting for one when fewer than
        ``waiting`` wait; else :class:`RateLimited`. Give it back by calling what this
        returns."""
        most = self.bound(principal)
        if most is None:
            return nothing
        lane = self._lanes.setdefault(principal, _Lane())
        if lane.running < most and not lane.waiting:
            lane.running += 1
            return self._release(principal)
        if len(lane.waiting) >= self.waiting:
            self._refuse(principal, most)
        turn = asyncio.get_running_loop().create_future()
        lane.waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed a slot as it went away
                self._give(principal)
            else:
                with contextlib.suppress(ValueError):
                    lane.waiting.remove(turn)
                self._tidy(principal)
            raise
        return self._release(principal)

    @contextlib.asynccontextmanager
    async def hold(self, principal: str) -> AsyncIterator[None]:
        """A slot of ``principal``'s while the block runs (see :meth:`take`)."""
        release = await self.take(principal)
        try:
            yield
        finally:
            release()

    def _release(self, principal: str) -> Release:
        given = False

        def release() -> None:
            nonlocal given
            if not given:
                given = True
                self._give(principal)
        return release

    def _give(self, principal: str) -> None:
        lane = self._lanes.get(principal)
        if lane is None:
            return
        while lane.waiting:
            turn = lane.waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes to the oldest waiter
                return
        lane.running -= 1
        self._tidy(principal)

    def _tidy(self, principal: str) -> None:
        lane = self._lanes.get(principal)
        if lane is not None and lane.running <= 0 and not lane.waiting:
            del self._lanes[principal]

    def _refuse(self, principal: str, most: int) -> None:
        self._counter.labels(principal, self.limit).inc()
        queue = f" and {self.waiting} waiting" if self.waiting else ""
        raise RateLimited(f"principal `{principal}` has {most} {self.what} under way{queue}, "
                          "the most at once", retry_after=1,
                          hint="retry when one of them has finished, or ask the operator for "
                               "a higher bound")


class TenantPool:
    """Threads for blocking calls, each principal's within its :class:`TenantBound` (see the
    module docstring); ``principals``: how many there are, ``name`` names the threads."""

    def __init__(self, name: str, bound: TenantBound, principals: int) -> None:
        if bound.running is None:
            raise ValueError("a pool's share of threads is a number")
        self.bound = bound
        self._pool = ThreadPoolExecutor(max(1, principals) * bound.running,
                                        thread_name_prefix=name)

    async def run(self, principal: str, fn: Callable[[], T]) -> T:
        """``fn()`` on a thread, within ``principal``'s share."""
        release = await self.bound.take(principal)
        loop = asyncio.get_running_loop()
        try:
            call = self._pool.submit(pg_scope.carried(fn))  # (the caller's scope along)
        except BaseException:
            release()
            raise
        try:
            return await asyncio.wrap_future(call)
        finally:
            if call.done():  # the usual way: given back here, with no second loop wake-up
                release()
            else:  # the waiter went away first: the slot is the thread's until it returns
                call.add_done_callback(lambda _: _on_loop(loop, release))

    def close(self) -> None:
        """Start nothing more; calls not started are dropped, running ones run out."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _on_loop(loop: asyncio.AbstractEventLoop, release: Release) -> None:
    """``release()`` on ``loop``'s thread (a pool's call finished on its own thread)."""
    with contextlib.suppress(RuntimeError):  # the loop is closed: nothing is counted any more
        loop.call_soon_threadsafe(release)

