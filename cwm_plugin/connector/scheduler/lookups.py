"""Lookups of the durable tiers off vLLM's step: started in the background, answered when done.

vLLM asks the scheduler side how many of a request's tokens it can load
(``get_num_new_matched_tokens``) inside its scheduling step, while every decoding request
waits. Blocks :class:`~cwm_plugin.connector.scheduler.known.KnownBlocks` knows are answered
from memory; the others need the store (SQLite, Redis), so for each request:

1. the first ask starts a lookup on a small thread pool and waits for it ``lookup_wait_ms`` at
   most (one budget a step, shared by all requests): a fast store costs no extra step;
2. while it runs, an ask answers ``None``: vLLM skips the request this step and asks again
   next step, the other requests go on (counted as ``lookups_deferred``);
3. once it is done, the answer is what it found (fed to KnownBlocks by the caller);
4. if it is not done ``lookup_deadline_ms`` after the first ask, it is abandoned: the blocks
   not known are misses and the request is computed (``lookup_timeouts``, logged once).

An ask for blocks the running lookup does not cover (the request's local prefix changed)
starts another with the same deadline. A store without durable tiers is asked inline (its
memory tier needs no I/O). Every tier call inside a lookup has its own timeout (Redis:
``redis_lookup_timeout_ms``, SQLite reads: 0.25 s), so abandoned lookups end too.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from cwm_plugin.connector.keys import KeyNamespace
from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.warn_once import WarnOnce
from cwm_plugin.store.threads import unpin

log = logging.getLogger(__name__)

SOURCE_OF_TIER = {"memory": CacheHitSource.HOST, "disk": CacheHitSource.DISK,
                  "redis": CacheHitSource.EXTERNAL_UNSPECIFIED}
_RANK = {CacheHitSource.HOST: 0, CacheHitSource.DISK: 1, CacheHitSource.EXTERNAL_UNSPECIFIED: 2}
THREADS = 2

Found = dict[bytes, CacheHitSource]


@dataclass
class _Pending:
    future: cf.Future
    hashes: frozenset[bytes]
    deadline: float          # time.monotonic()


class Lookups:
    """Background lookups by request id. Every method but the jobs runs on vLLM's scheduler
    thread."""

    def __init__(self, store: Any, workers: Sequence[tuple[KeyNamespace, int]],
                 stats: StatsCollector, *, wait_s: float, deadline_s: float,
                 threads: int = THREADS) -> None:
        self.store = store
        self.workers = list(workers)
        self.stats = stats
        self.wait_s = wait_s
        self.deadline_s = deadline_s
        self.needs_io = bool(store.durable)
        self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="cwm-lookup",
                                           initializer=unpin) if self.needs_io else None
        self._pending: dict[str, _Pending] = {}
        self._budget = wait_s
        self._lock = threading.Lock()
        self._prelude: Callable[[], None] | None = None
        self._warn = WarnOnce(log)

    def new_step(self) -> None:
        """A new scheduler step: its waiting budget is whole again."""
        self._budget = self.wait_s

    def before_next(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (store I/O: the hashing self-check) at the start of the next lookup job,
        so that lookup answers after it; inline when the store needs no I/O."""
        if self._pool is None:
            fn()
            return
        with self._lock:
            self._prelude = fn

    def resolve(self, req_id: str, hashes: list[bytes], extra: bytes = b"") -> Found | None:
        """Where ``hashes`` can be loaded from (hash -> source; absent: not on every worker),
        or None while the lookup still runs (ask again next step)."""
        if self._pool is None:
            return self.where(hashes, extra)
        p = self._pending.get(req_id)
        if p is not None and not p.hashes.issuperset(hashes):
            p.future.cancel()
            p = self._start(req_id, hashes, extra, p.deadline)
        elif p is None:
            p = self._start(req_id, hashes, extra, time.monotonic() + self.deadline_s)
        if not p.future.done() and self._budget > 0:
            t0 = time.monotonic()
            cf.wait([p.future], timeout=self._budget)
            self._budget -= time.monotonic() - t0
        if p.future.done():
            del self._pending[req_id]
            return self._result(p.future)
        if time.monotonic() < p.deadline:
            return None
        del self._pending[req_id]
        p.future.cancel()
        self.stats.add("lookup_timeouts")
        self._warn("deadline", "a store lookup took longer than lookup_deadline_ms (%.0f ms); "
                   "its blocks were computed instead (counted as cwm:connector_lookup_timeouts)",
                   self.deadline_s * 1000)
        return {}

    def forget(self, req_id: str) -> None:
        """The request needs no lookup any more (finished, or nothing left to look up)."""
        p = self._pending.pop(req_id, None)
        if p is not None:
            p.future.cancel()

    def pending(self, req_id: str) -> bool:
        return req_id in self._pending

    def _start(self, req_id: str, hashes: list[bytes], extra: bytes,
               deadline: float) -> _Pending:
        p = _Pending(self._pool.submit(self._job, list(hashes), extra), frozenset(hashes),
                     deadline)
        self._pending[req_id] = p
        return p

    def _job(self, hashes: list[bytes], extra: bytes) -> Found:
        with self._lock:
            prelude, self._prelude = self._prelude, None
        if prelude is not None:
            prelude()
        t0 = time.perf_counter()
        try:
            return self.where(hashes, extra)
        finally:
            self.stats.add("lookup_store_seconds", time.perf_counter() - t0)

    def _result(self, fut: cf.Future) -> Found:
        try:
            return fut.result()
        except Exception as exc:       # a bug or a closed store: misses, never a crash
            self._warn("failed", "a store lookup failed (%r); its blocks are computed", exc)
            return {}

    def where(self, hashes: list[bytes], extra: bytes = b"") -> Found:
        """The hashes every worker's key of which some tier holds, with the slowest tier
        among them (store I/O: called on the pool)."""
        n = len(hashes)
        where = self.store.where_many([k for ns, rank in self.workers
                                       for k in ns.keys(hashes, rank, extra)])
        found: Found = {}
        for j, h in enumerate(hashes):
            tiers = [where[w * n + j] for w in range(len(self.workers))]
            if all(tiers):
                found[h] = max((SOURCE_OF_TIER.get(t, CacheHitSource.EXTERNAL_UNSPECIFIED)
                                for t in tiers), key=lambda s: _RANK.get(s, 2))
        return found

    def shutdown(self) -> None:
        """Stop without waiting for a stuck store."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
