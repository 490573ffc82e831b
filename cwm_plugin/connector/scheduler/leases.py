"""Leases on promised blocks, per request, at the scheduler: taken when a lookup promises
blocks, released when their load is done (or the request ends), else they expire.

A lease (:meth:`~cwm_plugin.store.key_ops.KeySpace.lease_many`) protects the promised keys
of every worker in the durable tiers for ``lease_ttl_s`` seconds: a pin on disk that no quota
counts (a window's pin stays a pin, never shortened), a TTL renewed in Redis; so the disk's
LRU eviction (this process's or another's), ``cwm store gc`` and Redis' TTL leave them alone
until the load has read them. Taking and releasing one is store I/O, so both run on a thread
of their own, never on vLLM's step; a stuck store only delays them, and past a bounded backlog
a promise goes without a lease (counted). The protection is best-effort: a delete, Redis'
maxmemory eviction or a lease that expired can still lose a block; its load then fails and the
request is recomputed.

Counted as ``cwm:connector_leases{event}``: ``taken``; ``released`` (after the load, or when
the request ended); ``expired`` (released after its TTL had passed: the load or the request
outlived it); ``failed`` (no lease taken: the store raised, or the backlog was full).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.warn_once import WarnOnce
from cwm_plugin.store.key_ops import Lease
from cwm_plugin.store.threads import unpin

log = logging.getLogger(__name__)
BACKLOG = 256          # lease jobs waiting for a stuck store at most


class Leases:
    """Per-request leases; :meth:`take` and :meth:`release` are called on vLLM's scheduler
    thread and return at once."""

    def __init__(self, store: Any, stats: StatsCollector, *, ttl_s: float,
                 backlog: int = BACKLOG) -> None:
        self.store = store
        self.stats = stats
        self.ttl_s = ttl_s
        self.enabled = ttl_s > 0 and bool(store.durable)
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="cwm-lease", initializer=unpin) \
            if self.enabled else None
        self._room = threading.BoundedSemaphore(backlog)
        self._held: dict[str, tuple[frozenset[bytes], cf.Future]] = {}
        self._lock = threading.Lock()
        self._warn = WarnOnce(log)

    def take(self, req_id: str, keys: Sequence[bytes]) -> None:
        """Lease ``keys`` for request ``req_id`` (in the background). A request whose keys are
        leased already keeps its lease; other keys replace it."""
        if not self.enabled or not keys:
            return
        wanted = frozenset(bytes(k) for k in keys)
        held = self._held.get(req_id)
        if held is not None:
            if wanted <= held[0]:
                return
            self.release(req_id)
        fut = self._submit(lambda: self._lease(list(wanted)))
        if fut is None:
            self.stats.add("leases", event="failed")
            self._warn("backlog", "the store is too slow to take leases (%d waiting); promised "
                       "blocks go unprotected until it catches up", BACKLOG)
            return
        self._held[req_id] = (wanted, fut)

    def release(self, req_id: str) -> None:
        """Release ``req_id``'s lease (in the background, once it is taken)."""
        held = self._held.pop(req_id, None)
        if held is None:
            return
        if held[1].cancel():     # never started: nothing was pinned; its room is free again
            self._room.release()
            return
        held[1].add_done_callback(self._release_later)

    def holding(self, req_id: str) -> bool:
        return req_id in self._held

    def _release_later(self, fut: cf.Future) -> None:
        lease = None if fut.cancelled() or fut.exception() is not None else fut.result()
        if lease is not None and lease.size:
            self._submit(lambda: self._release(lease))   # if not queued: it expires

    def _submit(self, job: Callable[[], Any]) -> cf.Future | None:
        if self._pool is None or not self._room.acquire(blocking=False):
            return None

        def run() -> Any:
            try:
                return job()
            finally:
                self._room.release()
        try:
            return self._pool.submit(run)
        except RuntimeError:                # shut down
            self._room.release()
            return None

    def _lease(self, keys: list[bytes]) -> Lease | None:
        try:
            lease = self.store.lease_many(keys, ttl_s=self.ttl_s)
        except Exception as exc:      # a closed store, a bug: the promise goes unprotected
            self.stats.add("leases", event="failed")
            self._warn("lease", "could not lease promised blocks: %s", exc)
            return None
        if lease.size:
            self.stats.add("leases", event="taken")
        return lease

    def _release(self, lease: Lease) -> None:
        expired = lease.expired()
        try:
            self.store.release(lease)
        except Exception as exc:      # it expires on its own
            self._warn("release", "could not release a lease: %s", exc)
        self.stats.add("leases", event="expired" if expired else "released")

    def shutdown(self) -> None:
        """Stop without waiting for a stuck store (leases not released expire)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
