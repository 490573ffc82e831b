"""The scheduler's short-lived belief of which blocks are stored, so it never promises one that
is gone.

A block hash is *known* (loadable, from a given tier) when

* every worker (TP rank x pipeline stage) reported saving it (``report_stored``): kept until
  a worker reports it dropped or failed (its store evicted it, found it dangling, could not
  load it) -- this is how blocks that live only in the workers' memory tiers are found -- and
  for ``stored_ttl_s`` at most where a durable tier holds it too: another process (a second
  server's eviction, ``cwm store gc``, Redis' TTL or maxmemory) may remove it there unseen, so
  after that the scheduler asks the store again;
* or a lookup of the durable tiers found every worker's key: kept for ``lookup_ttl_s`` only,
  since another process (a second server, ``gc``, Redis' TTL) may remove it meanwhile.

Saves that were planned but not reported yet are *planned*, not known: they are not saved a
second time, and they are not promised either. Everything is bounded (LRU); ``clear`` forgets
it all (vLLM's ``reset_cache``, a worker whose drop list overflowed).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Iterable

from vllm.v1.metrics.cache_hit_source import CacheHitSource

LIMIT = 1_000_000
PLANNED_TTL_S = 600.0     # a save never reported (lost at shutdown) stops blocking re-saves


class KnownBlocks:
    def __init__(self, n_workers: int, *, lookup_ttl_s: float = 2.0,
                 stored_ttl_s: float = math.inf,
                 stored_source: CacheHitSource = CacheHitSource.HOST,
                 limit: int = LIMIT) -> None:
        self.n_workers = max(1, n_workers)
        self.lookup_ttl_s = lookup_ttl_s
        self.stored_ttl_s = stored_ttl_s
        self.stored_source = stored_source
        self.limit = limit
        self._known: OrderedDict[bytes, tuple[CacheHitSource, float]] = OrderedDict()
        self._partial: OrderedDict[bytes, set[int]] = OrderedDict()
        self._planned: OrderedDict[bytes, float] = OrderedDict()

    def get(self, h: bytes) -> CacheHitSource | None:
        entry = self._known.get(h)
        if entry is None:
            return None
        if entry[1] < time.monotonic():
            del self._known[h]
            return None
        return entry[0]

    def found(self, found: dict[bytes, CacheHitSource]) -> None:
        """Blocks a lookup of the durable tiers found (for ``lookup_ttl_s``)."""
        until = time.monotonic() + self.lookup_ttl_s
        for h, source in found.items():
            if self._known.get(h, (None, 0.0))[1] < until:   # a report of a save lasts longer
                self._put(self._known, h, (source, until))

    def plan(self, hashes: Iterable[bytes]) -> None:
        now = time.monotonic()
        for h in hashes:
            self._put(self._planned, h, now)

    def planned(self, h: bytes) -> bool:
        t = self._planned.get(h)
        if t is None:
            return False
        if time.monotonic() - t > PLANNED_TTL_S:
            del self._planned[h]
            return False
        return True

    def report_stored(self, pairs: Iterable[tuple[bytes, int]]) -> list[bytes]:
        """Take in the workers' reports of saved blocks; the blocks every worker holds now."""
        complete = []
        for h, worker in pairs:
            seen = self._partial.get(h)
            if seen is None:
                seen = set()
                self._put(self._partial, h, seen)
            seen.add(worker)
            if len(seen) >= self.n_workers:
                del self._partial[h]
                self._planned.pop(h, None)
                self._put(self._known, h, (self.stored_source,
                                           time.monotonic() + self.stored_ttl_s))
                complete.append(h)
        return complete

    def forget(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self._known.pop(h, None)
            self._partial.pop(h, None)
            self._planned.pop(h, None)

    def clear(self) -> None:
        self._known.clear()
        self._partial.clear()
        self._planned.clear()

    def __len__(self) -> int:
        return len(self._known)

    def _put(self, d: OrderedDict, h: bytes, value: object) -> None:
        d[h] = value
        d.move_to_end(h)
        while len(d) > self.limit:
            d.popitem(last=False)
