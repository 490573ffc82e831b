"""The write path of :class:`~cwm_plugin.store.tiered.KVStore`: one blob to the tiers.

Encoding happens here (on the store's pool); then the blob goes to memory at once, and to disk
and Redis "through" (before the save's future resolves) or "behind" (queued after, bounded in
bytes: a full write-behind queue holds the save worker, so backpressure reaches ``put``). Each
tier records the blob and its key in one step (one SQLite transaction, one Redis script), so
``gc`` never sees a fresh blob unreferenced. A tier that refuses or fails is counted and logged
once; the save fails only when no tier took the block. Tier gauges are refreshed after every
write (cheap: counters, one SQLite row, the Redis script's reply).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from cwm_plugin.errors import StorageFull, TierUnavailable
from cwm_plugin.store import codec
from cwm_plugin.store.hashing import blob_id_of

if TYPE_CHECKING:
    from cwm_plugin.store.config import StoreConfig
    from cwm_plugin.store.index import BlobIndex
    from cwm_plugin.store.metrics import StoreMetrics
    from cwm_plugin.store.queue import SaveQueue
    from cwm_plugin.store.tiers.disk import DiskTier
    from cwm_plugin.store.tiers.memory import MemoryTier
    from cwm_plugin.store.tiers.redis import RedisTier

log = logging.getLogger(__name__)
Write = Callable[[bytes, str, bytes], bool]


class WritePath:
    """Mixin of KVStore: the attributes below are set by ``KVStore.__init__``."""

    config: StoreConfig
    metrics: StoreMetrics
    memory: MemoryTier | None
    disk: DiskTier | None
    index: BlobIndex | None
    redis: RedisTier | None
    _lock: threading.RLock
    _keys: dict[bytes, str]
    _by_blob: dict[str, set[bytes]]
    _pinned: set[bytes]
    _saves: SaveQueue

    def _log_once(self, tag: str, msg: str, *args: object) -> None:
        raise NotImplementedError

    def _present(self, key: bytes) -> bool:
        if key in self._keys:
            return True
        if self.index is not None and self.index.lookup(key) is not None:
            return True
        if self.redis is not None and self.index is None and self.memory is None:
            try:
                return self.redis.exists_many([key])[0]
            except TierUnavailable:
                return False
        return False

    def _save_tensor(self, key: bytes, tensor: torch.Tensor, num_tokens: int, layout: str) -> None:
        cfg = self.config
        t0 = time.perf_counter()
        blob = codec.encode(tensor, key=key, fingerprint=cfg.fingerprint, num_tokens=num_tokens,
                            layout=layout, level=cfg.zstd_level, shuffle=cfg.shuffle,
                            checksum=cfg.checksum)
        self.metrics.encoded(tensor.numel() * tensor.element_size(), len(blob),
                             time.perf_counter() - t0)
        self._store_blob(key, blob)

    def _store_blob(self, key: bytes, blob: bytes) -> None:
        blob_id = blob_id_of(blob)
        stored = self._to_memory(key, blob_id, blob)
        for tier, mode, write in ((self.disk, self.config.disk_write, self._to_disk),
                                  (self.redis, self.config.redis_write, self._to_redis)):
            if tier is None:
                continue
            if mode == "through":
                stored = write(key, blob_id, blob) or stored
            else:
                stored = self._behind(write, key, blob_id, blob) or stored
        if not stored:
            raise StorageFull(f"no tier could store block {key.hex()[:16]} ({len(blob)} bytes)",
                              hint="raise memory_bytes/disk_bytes or check the disk and Redis")
        self.metrics.puts.inc()

    def _behind(self, write: Write, key: bytes, blob_id: str, blob: bytes, *,
                wait: bool = True) -> bool:
        """Queue ``write`` after the current work. ``wait`` False (promotions on the read
        path): drop it, counted and logged once, when the write-behind queue is full."""
        def run() -> None:
            try:
                write(key, blob_id, blob)
            except Exception as exc:   # nobody waits on a write-behind: count and log it
                self.metrics.errors.labels("write_failed").inc()
                self._log_once(f"behind-{type(exc).__name__}", "write-behind failed: %s", exc)
        queued = self._saves.behind(run, key=key, nbytes=len(blob), wait=wait)
        if not queued:
            self.metrics.errors.labels("behind_dropped").inc()
            self._log_once("behind-full", "store: write-behind queue full (%d bytes); "
                           "dropping promotions until it drains", self._saves.behind_limit)
        return queued

    def _to_memory(self, key: bytes, blob_id: str, blob: bytes, *, pinned: bool = False) -> bool:
        if self.memory is None:
            return False
        with self._lock:                  # blob and key land together (gc holds this lock)
            if not self.memory.put(blob_id, blob):
                return False
            self._keys[key] = blob_id
            self._by_blob.setdefault(blob_id, set()).add(key)
            if pinned:
                self._pinned.add(key)
            if key in self._pinned:
                self.memory.pin(blob_id, True)
        self._gauge_memory()
        return True

    def _to_disk(self, key: bytes, blob_id: str, blob: bytes) -> bool:
        assert self.disk is not None and self.index is not None
        try:
            ok = self.disk.put(blob_id, blob, key=key)
            if not ok:
                self.metrics.errors.labels("storage_full").inc()
            return ok
        except StorageFull as exc:
            self.metrics.errors.labels("storage_full").inc()
            self._log_once("disk-full", "disk tier refused a write: %s", exc)
        except (OSError, sqlite3.Error) as exc:
            self.metrics.errors.labels("write_failed").inc()
            self._log_once(f"disk-w-{type(exc).__name__}", "disk tier write failed: %s", exc)
        finally:
            self._gauge_disk()
        return False

    def _to_redis(self, key: bytes, blob_id: str, blob: bytes) -> bool:
        assert self.redis is not None
        try:
            self.redis.put(blob_id, blob, key=key)
        except TierUnavailable as exc:
            self.metrics.errors.labels("tier_unavailable").inc()
            if self.redis.available:       # refused, not down (the tier logs outages once)
                self._log_once("redis-write", "redis tier write failed: %s", exc)
            return False
        self._gauge_redis()
        return True

    def _promote_from_redis(self, key: bytes, blob_id: str, blob: bytes) -> bool:
        """Write-behind job of a Redis hit: to disk, with the key's pin if it has one there."""
        assert self.redis is not None
        try:
            pinned = self.redis.is_pinned(key, blob_id)
        except TierUnavailable:
            pinned = False
        if pinned:
            with self._lock:
                self._pinned.add(key)
                if self.memory is not None:
                    self.memory.pin(blob_id, True)
        if self.disk is None:
            return True
        ok = self._to_disk(key, blob_id, blob)
        if pinned and self.index is not None:
            self.index.pin_key(key, True)
        return ok

    # --- gauges -------------------------------------------------------------------------------

    def _gauge_memory(self) -> None:
        if self.memory is not None:
            u = self.memory.usage()
            self.metrics.tier_usage("memory", u.bytes, u.blobs)

    def _gauge_disk(self) -> None:
        if self.index is not None:
            with contextlib.suppress(sqlite3.Error):
                self.metrics.tier_usage("disk", *self.index.totals())

    def _gauge_redis(self) -> None:
        if self.redis is not None and self.redis.totals is not None:
            self.metrics.tier_usage("redis", *self.redis.totals)

    def _gauges(self) -> None:
        self._gauge_memory()
        self._gauge_disk()
        self._gauge_redis()
