"""The write path of :class:`~cwm_plugin.store.tiered.KVStore`: one blob to the tiers.

Encoding happens here (on the store's pool); then the blob goes to memory at once, and to disk
and Redis "through" (before the save's future resolves) or "behind" (queued after), per the
config. A tier that refuses or fails is counted and logged once; the save fails only when no
tier took the block.
"""

from __future__ import annotations

import logging
import sqlite3
import time
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


class WritePath:
    """Mixin of KVStore: the attributes below are set by ``KVStore.__init__``."""

    config: StoreConfig
    metrics: StoreMetrics
    memory: MemoryTier | None
    disk: DiskTier | None
    index: BlobIndex | None
    redis: RedisTier | None
    _keys: dict[bytes, str]
    _by_blob: dict[str, set[bytes]]
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
                self._behind(write, key, blob_id, blob)
                stored = True
        if not stored:
            raise StorageFull(f"no tier could store block {key.hex()[:16]} ({len(blob)} bytes)",
                              hint="raise memory_bytes/disk_bytes or check the disk and Redis")
        self.metrics.puts.inc()

    def _behind(self, write, key: bytes, blob_id: str, blob: bytes) -> None:
        def run() -> None:
            try:
                write(key, blob_id, blob)
            except Exception as exc:   # nobody waits on a write-behind: count and log it
                self.metrics.errors.labels("write_failed").inc()
                self._log_once(f"behind-{type(exc).__name__}", "write-behind failed: %s", exc)
        self._saves.behind(run)

    def _to_memory(self, key: bytes, blob_id: str, blob: bytes) -> bool:
        if self.memory is None or not self.memory.put(blob_id, blob):
            return False
        with self._lock:
            self._keys[key] = blob_id
            self._by_blob.setdefault(blob_id, set()).add(key)
        usage = self.memory.usage()
        self.metrics.tier_usage("memory", usage.bytes, usage.blobs)
        return True

    def _to_disk(self, key: bytes, blob_id: str, blob: bytes) -> bool:
        assert self.disk is not None and self.index is not None
        try:
            if not self.disk.put(blob_id, blob):
                self.metrics.errors.labels("storage_full").inc()
                return False
            return self.index.map_key(key, blob_id)
        except StorageFull as exc:
            self.metrics.errors.labels("storage_full").inc()
            self._log_once("disk-full", "disk tier refused a write: %s", exc)
        except (OSError, sqlite3.Error) as exc:
            self.metrics.errors.labels("write_failed").inc()
            self._log_once(f"disk-w-{type(exc).__name__}", "disk tier write failed: %s", exc)
        return False

    def _to_redis(self, key: bytes, blob_id: str, blob: bytes) -> bool:
        assert self.redis is not None
        try:
            self.redis.put(blob_id, blob)
            self.redis.map_key(key, blob_id)
            return True
        except TierUnavailable as exc:
            self.metrics.errors.labels("tier_unavailable").inc()
            if self.redis.available:       # refused, not down (the tier logs outages once)
                self._log_once("redis-write", "redis tier write failed: %s", exc)
            return False
