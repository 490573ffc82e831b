"""CPU memory tier: blobs in an LRU within a byte budget; pinned blobs are never evicted."""

from __future__ import annotations

import threading
from collections import OrderedDict

from cwm_plugin.store.tiers.base import EvictCallback, Tier, TierUsage


class MemoryTier(Tier):
    name = "memory"

    def __init__(self, budget: int, *, on_evict: EvictCallback | None = None) -> None:
        self.budget = budget
        self._blobs: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._pinned: set[str] = set()
        self._lock = threading.Lock()
        self._on_evict = on_evict
        self.evictions = 0

    def get(self, blob_id: str) -> bytes | None:
        with self._lock:
            data = self._blobs.get(blob_id)
            if data is not None:
                self._blobs.move_to_end(blob_id)
            return data

    def put(self, blob_id: str, data: bytes) -> bool:
        evicted: list[str] = []
        with self._lock:
            if blob_id in self._blobs:
                self._blobs.move_to_end(blob_id)
                return True
            if len(data) > self.budget:
                return False
            need = self._bytes + len(data) - self.budget
            if need > 0:
                for old in list(self._blobs):
                    if need <= 0:
                        break
                    if old in self._pinned:
                        continue
                    size = len(self._blobs.pop(old))
                    self._bytes -= size
                    need -= size
                    evicted.append(old)
                if need > 0:   # everything left is pinned
                    return False
            self._blobs[blob_id] = data
            self._bytes += len(data)
            self.evictions += len(evicted)
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)
        return True

    def contains(self, blob_id: str) -> bool:
        with self._lock:
            return blob_id in self._blobs

    def delete(self, blob_id: str) -> bool:
        with self._lock:
            data = self._blobs.pop(blob_id, None)
            self._pinned.discard(blob_id)
            if data is None:
                return False
            self._bytes -= len(data)
            return True

    def pin(self, blob_id: str, pinned: bool = True) -> None:
        with self._lock:
            if pinned:
                self._pinned.add(blob_id)
            else:
                self._pinned.discard(blob_id)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._blobs)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self.name, self._bytes, len(self._blobs), self.budget)

    def close(self) -> None:
        with self._lock:
            self._blobs.clear()
            self._bytes = 0
