"""The KV block store: keys -> content-addressed blobs, composed over tiers.

:class:`KVStore` only composes :class:`~cwm_plugin.store.tiers.base.Tier` objects, each of
which owns its blobs *and* its key index (memory: this process; disk: SQLite; Redis: Redis):

* order: lookups go memory -> disk -> Redis; a hit is promoted to the faster tiers;
* writes: ``put`` encodes on a small pool and returns a future; memory is written at once,
  disk and Redis "through" (before the future resolves) or "behind" (queued after it, bounded
  in bytes: backpressure). A key the durable tiers already hold is not saved again;
* batch key operations (``link_many``, ``pin_many``, ``unpin_many``, ``delete_many``) are one
  atomic step per tier (one SQLite transaction, one Lua script per key group);
* what a tier drops by itself (eviction, expiry, dangling, quarantine) reaches
  :meth:`take_dropped`, so the connector's scheduler stops promising those blocks.

A tier that cannot be opened (unwritable directory, ...) is logged once and left out; a tier
failing at run time is counted and the store goes on with the others. A damaged blob is a
counted miss, quarantined; a blob that is not the key's (of another key group; with encryption
another key's, another salt's, or not sealed) a refused miss (:mod:`.binding`); a blob of another
model or layout an incompatible miss. With ``encryption_key`` every blob is sealed under its
request's salt, for its key (:mod:`.blob.crypto`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import time
from collections.abc import Sequence

import torch

from cwm_plugin.errors import StorageFull
from cwm_plugin.store import binding
from cwm_plugin.store.blob import codec, container, crypto
from cwm_plugin.store.blob.address import blob_id_of
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.key_ops import TIER_ERRORS, KeySpace
from cwm_plugin.store.maintenance import (
    GCReport,
    VerifyReport,
    collect_garbage,
    tier_usage,
    update_gauge,
    verify_all,
)
from cwm_plugin.store.metrics import StoreMetrics
from cwm_plugin.store.opening import open_tiers
from cwm_plugin.store.read_path import ReadPath
from cwm_plugin.store.save_queue import SaveQueue
from cwm_plugin.store.threads import unpin
from cwm_plugin.store.tiers.base import Tier

log = logging.getLogger(__name__)
DROPS_KEPT = 200_000


def _done(value: object = None) -> cf.Future:
    fut: cf.Future = cf.Future()
    fut.set_result(value)
    return fut


class KVStore(ReadPath, KeySpace):
    """Tiered, content-addressed KV block store; see the module docstring (reads come from
    :class:`~cwm_plugin.store.read_path.ReadPath`, the batch key operations from
    :class:`~cwm_plugin.store.key_ops.KeySpace`)."""

    def __init__(self, config: StoreConfig, *, registry=None) -> None:
        metrics = StoreMetrics.for_registry(registry)
        saves = SaveQueue(config.io_workers, config.queue_depth,
                          behind_bytes=config.behind_bytes)
        super().__init__(config, metrics, saves)
        self.tiers = open_tiers(config, self.metrics, self._log_once)
        for tier in self.tiers:
            tier.set_drop_listener(lambda keys, why, t=tier.name: self._on_drop(t, keys, why))
        self.memory = self._tier("memory")
        self.disk = self._tier("disk")
        self.redis = self._tier("redis")
        self.durable = [t for t in self.tiers if t.durable]
        self._ciphers = (crypto.Ciphers(crypto.parse_master_key(config.encryption_key))
                         if config.encryption_key else None)
        self._dropped: set[bytes] = set()
        self._drops_overflow = False
        self._decoder = (cf.ThreadPoolExecutor(config.io_workers, thread_name_prefix="cwm-decode",
                                               initializer=unpin)
                         if config.io_workers > 1 else None)
        self._closed = False
        self._gauges()

    def _tier(self, name: str):
        return next((t for t in self.tiers if t.name == name), None)

    def _cipher(self, salt: str | None) -> crypto.BlobCipher | None:
        return self._ciphers.for_salt(salt) if self._ciphers is not None else None

    # --- saving -------------------------------------------------------------------------------

    def put(self, key: bytes, tensor: torch.Tensor, *, num_tokens: int = 0, layout: str = "",
            salt: str | None = None, replace: bool = False, wait: float | None = None
            ) -> cf.Future:
        """Save a block in the background; the future resolves when the "through" tiers hold
        it. ``salt``: the request's cache_salt (the blob is sealed under it when encryption at
        rest is on). A key already stored is skipped, unless ``replace`` (records that are
        rewritten: the key is re-pointed and its old blob freed). ``wait``: while
        ``queue_depth`` saves are pending, the longest to wait for one to finish (None: as long
        as it takes), then :class:`~cwm_plugin.store.save_queue.QueueFull` (callers on vLLM's step
        drop the save)."""
        def job(k: bytes) -> None:
            self._store_blob(k, self._encode(k, tensor, num_tokens, layout, salt),
                             replace=replace)
        return self._submit(bytes(key), job, replace=replace, wait=wait)

    def _encode(self, key: bytes, tensor: torch.Tensor, num_tokens: int, layout: str,
                salt: str | None) -> bytes:
        cfg = self.config
        t0 = time.perf_counter()
        blob = codec.encode(tensor, key=key, fingerprint=cfg.fingerprint, num_tokens=num_tokens,
                            layout=layout, level=cfg.zstd_level, shuffle=cfg.shuffle,
                            checksum=cfg.checksum, sign_planes=cfg.sign_planes)
        cipher = self._cipher(salt)
        if cipher is not None:
            blob = cipher.seal(blob)
        self.metrics.encoded(tensor.numel() * tensor.element_size(), len(blob),
                             time.perf_counter() - t0)
        return blob

    def claim(self, key: bytes, tensor: torch.Tensor, *, layout: str = "",
              salt: str | None = None) -> bool:
        """Save ``tensor`` under ``key`` unless someone did first, now (not in the background):
        the *primary* tier decides (Redis when configured, so servers sharing it agree; else
        disk; else memory), then the other tiers follow. False: another writer holds it."""
        key = bytes(key)
        blob = self._encode(key, tensor, 0, layout, salt)
        blob_id = blob_id_of(blob)
        primary = self.primary
        if primary is None:
            raise StorageFull("the store has no tier", hint="configure memory, disk or Redis")
        if not primary.put(blob_id, blob, key) or primary.lookup_many([key])[0] != blob_id:
            return False
        for tier in self.tiers:
            if tier is not primary:
                self._write(tier, key, blob_id, blob, replace=True)
        return True

    def put_blob(self, key: bytes, blob: bytes, *, replace: bool = False) -> cf.Future:
        """Save an already encoded (or sealed) blob, not decoded, checked to be ours and one
        that a read of ``key`` accepts (:func:`.binding.check`; else :class:`RefusedBlob`)."""
        binding.check(container.peek(blob), bytes(key), encrypted=self._ciphers is not None)
        return self._submit(bytes(key), lambda k: self._store_blob(k, bytes(blob),
                                                                   replace=replace),
                            replace=replace)

    def _submit(self, key: bytes, job, *, replace: bool = False, wait: float | None = None
                ) -> cf.Future:
        if self._saves.closed:
            raise RuntimeError("the KV store is closed")
        return self._saves.submit(key, lambda: self._run_save(key, job, replace),
                                  replace=replace, wait=wait)

    def _run_save(self, key: bytes, job, replace: bool = False) -> None:
        target = (self.durable or self.tiers or [None])[0]
        if not replace and target is not None and self._exists_in(target, key):
            self.metrics.put_skips.inc()
            return
        job(key)

    def _store_blob(self, key: bytes, blob: bytes, *, replace: bool = False) -> None:
        blob_id = blob_id_of(blob)
        stored = False
        for tier in self.tiers:
            mode = {"disk": self.config.disk_write, "redis": self.config.redis_write}.get(
                tier.name, "through")
            if mode == "through" or replace:
                stored = self._write(tier, key, blob_id, blob, replace=replace) or stored
            else:
                stored = self._behind(tier, key, blob_id, blob) or stored
        if not stored:
            raise StorageFull(f"no tier could store block {key.hex()[:16]} ({len(blob)} bytes)",
                              hint="raise memory_bytes/disk_bytes or check the disk and Redis")
        self.metrics.puts.inc()

    def _write(self, tier: Tier, key: bytes, blob_id: str, blob: bytes, *,
               replace: bool = False) -> bool:
        try:
            ok = tier.put(blob_id, blob, key, replace=replace)
            if not ok:
                self.metrics.errors.labels("storage_full").inc()
            return ok
        except StorageFull as exc:
            self.metrics.errors.labels("storage_full").inc()
            self._log_once(f"full-{tier.name}", "%s tier refused a write: %s", tier.name, exc)
        except TIER_ERRORS as exc:
            self._tier_failed(tier, "write", exc, "write_failed")
        finally:
            self._gauge(tier)
        return False

    def _behind(self, tier: Tier, key: bytes, blob_id: str, blob: bytes, *,
                wait: bool = True) -> bool:
        """Queue a write after the current work. ``wait`` False (promotions on the read path):
        drop it, counted and logged once, when the write-behind queue is full."""
        queued = self._saves.behind(lambda: self._write(tier, key, blob_id, blob), key=key,
                                    nbytes=len(blob), wait=wait)
        if not queued:
            self.metrics.errors.labels("behind_dropped").inc()
            self._log_once("behind-full", "store: write-behind queue full (%d bytes); "
                           "dropping promotions until it drains", self._saves.behind_limit)
        return queued

    # --- loading ------------------------------------------------------------------------------

    def _exists_in(self, tier: Tier, key: bytes) -> bool:
        try:
            return tier.exists_many([key])[0]
        except TIER_ERRORS:
            return False

    @property
    def primary(self) -> Tier | None:
        """The tier that decides for records every server rewrites (window manifests, context
        records): Redis when configured (shared), else disk, else memory."""
        return self.redis or self.disk or self.memory

    def quarantine(self, tier: Tier, blob_id: str, data: bytes | None, *, key: bytes = b"",
                   reason: str) -> None:
        """Take a damaged blob out of ``tier``; keep its bytes under the disk's quarantine/."""
        try:
            if tier is self.disk:
                self.disk.quarantine(blob_id, reason)
                return
            if self.disk is not None and data is not None:
                (self.disk.quarantine_dir / f"{blob_id}.{tier.name}.{int(time.time())}"
                 ).write_bytes(data)
        except TIER_ERRORS as exc:     # full or read-only disk: still out of use
            self.metrics.errors.labels("quarantine_failed").inc()
            self._log_once("quarantine", "store: could not keep a damaged blob under "
                           "quarantine/: %s", exc)
        with contextlib.suppress(*TIER_ERRORS):
            tier.forget_blobs([blob_id], "quarantined", keys=[key] if key else ())
        self._gauges()

    # --- drops --------------------------------------------------------------------------------

    def _on_drop(self, tier: str, keys: list[bytes], reason: str) -> None:
        self.metrics.drops.labels(tier, reason).inc(len(keys))
        if reason == "evicted":
            self.metrics.evictions.labels(tier).inc(len(keys))
        with self._lock:
            if len(self._dropped) + len(keys) > DROPS_KEPT:
                self._drops_overflow = True
                self._dropped.clear()
            else:
                self._dropped.update(keys)

    def take_dropped(self) -> tuple[set[bytes], bool]:
        """Keys any tier dropped since the last call, and whether some were not kept (too
        many: the caller should forget everything it believed stored)."""
        with self._lock:
            dropped, overflow = self._dropped, self._drops_overflow
            self._dropped, self._drops_overflow = set(), False
        return dropped, overflow

    def reset_memory(self) -> None:
        """Drop this process's memory tier (unpinned blobs); the keys are reported dropped."""
        if self.memory is not None:
            self.memory.reset()
            self._gauges()

    # --- housekeeping -------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for pending saves (including write-behind) for up to ``timeout`` seconds."""
        return self._saves.flush(timeout)

    def wait_keys(self, keys: Sequence[bytes], timeout: float | None = None) -> None:
        for k in keys:
            self._saves.wait_key(bytes(k), timeout)

    def usage(self) -> dict[str, dict[str, int | None]]:
        """Bytes, blobs, keys and pinned bytes per tier (Redis is recounted: for the CLI)."""
        return tier_usage(self.tiers, self.metrics)

    def verify(self, progress: bool = True) -> VerifyReport:
        return verify_all(self, progress=progress)

    def gc(self, min_age_s: float | None = None) -> GCReport:
        """Drop unreferenced blobs older than ``min_age_s`` (default: ``gc_min_age_s``),
        dangling keys and orphan files."""
        return collect_garbage(self, min_age_s)

    def _gauge(self, tier: Tier) -> None:
        update_gauge(tier, self.metrics)

    def _gauges(self) -> None:
        for tier in self.tiers:
            update_gauge(tier, self.metrics)

    def close(self, timeout: float | None = None) -> bool:
        """Finish pending saves, then close the tiers. With ``timeout``, saves not started
        after that many seconds are dropped (logged; a dropped block is recomputed later,
        never half-written). True if every save finished."""
        if self._closed:
            return True
        done = self._saves.flush(timeout)
        self._closed = True
        self._saves.shutdown(drop_queued=not done)
        if self._decoder is not None:
            self._decoder.shutdown(wait=True)
        for tier in self.tiers:
            with contextlib.suppress(Exception):
                tier.close()
        return done

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
