"""Saving blocks: encoded (and sealed) on the save pool, written to every tier by its policy.

:class:`WritePath`, a part of :class:`~cwm_plugin.store.kv_store.KVStore`. ``put`` encodes
on the save queue's pool and returns a future; memory is written at once, disk and Redis
"through" (before the future resolves) or "behind" (queued after it, bounded in bytes:
backpressure). A key the first durable tier already holds is not saved again, unless the save
replaces it (a rewritten record: the key is re-pointed, the old blob freed, and the record gets
a newer revision, :mod:`.binding`). ``claim`` saves now, and only if no other writer holds the
key on the primary tier. A hit read from a slower tier is promoted to the faster ones
(:meth:`WritePath.promote`: memory at once, the others behind, dropped rather than waited for
when the write-behind queue is full). A write a tier refuses (full) or fails is counted and
logged once; a save no tier takes raises :class:`~cwm_plugin.errors.StorageFull`.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable

import torch

from cwm_plugin.errors import StorageFull
from cwm_plugin.store import binding
from cwm_plugin.store.blob import codec, container
from cwm_plugin.store.blob.address import blob_id_of, twin_id_of
from cwm_plugin.store.save_queue import SaveQueue
from cwm_plugin.store.tier_set import TierSet
from cwm_plugin.store.tiers.base import TIER_ERRORS, Tier


class WritePath:
    """Writes to ``tier_set`` through ``saves``, blobs sealed and revised by ``binding``."""

    def __init__(self, tier_set: TierSet, saves: SaveQueue, binding: binding.Binding) -> None:
        self.tier_set = tier_set
        self.config = tier_set.config
        self.metrics = tier_set.metrics
        self.saves = saves
        self.binding = binding
        self.closed = False       # no more promotions (the store is closing)

    def put(self, key: bytes, tensor: torch.Tensor, *, num_tokens: int = 0, layout: str = "",
            salt: str | None = None, replace: bool = False, wait: float | None = None,
            unless: Callable[[], bool] | None = None,
            content: bytes | None = None) -> cf.Future:
        """Save a block in the background; the future resolves when the "through" tiers hold
        it. ``salt``: the request's cache_salt (the blob is sealed under it when encryption at
        rest is on). A key already stored is skipped, unless ``replace`` (records that are
        rewritten: the key is re-pointed and its old blob freed, and the record gets a newer
        revision). ``content``: a KV block's content identity (:mod:`.binding`). ``wait``: while
        ``queue_depth`` saves are pending, the longest to wait for one to finish (None: as long
        as it takes), then :class:`~cwm_plugin.store.save_queue.QueueFull` (callers on vLLM's step
        drop the save). ``unless``: asked on the saving thread right before the write (the
        saves of one key run one at a time); True skips it (a record that must not replace a
        newer one)."""
        revisions = self.binding.revisions

        def job(k: bytes) -> None:
            if unless is not None and unless():
                self.metrics.put_skips.inc()
                return
            revision = revisions.next(k) if replace else None
            blob, plain = self._blobs(k, tensor, num_tokens, layout, salt, content=content,
                                      revision=revision)
            self._store_blob(k, blob, replace=replace, memory_blob=plain)
            if revision is not None:
                revisions.saw(k, revision)
        return self._submit(bytes(key), job, replace=replace, wait=wait)

    def _blobs(self, key: bytes, tensor: torch.Tensor, num_tokens: int, layout: str,
               salt: str | None, *, content: bytes | None = None,
               revision: int | None = None) -> tuple[bytes, bytes | None]:
        """``key``'s blob for the tiers, and the memory tier's own uncompressed one where it
        keeps blocks so (``memory_compress`` off; None: it takes the same blob). A store of a
        memory tier alone encodes only that one."""
        cfg, ts = self.config, self.tier_set

        def encode(level: int | None = None, count: bool = True) -> bytes:
            return self._encode(key, tensor, num_tokens, layout, salt, content=content,
                                revision=revision, level=level, count=count)

        if ts.memory is None or cfg.memory_compress or cfg.zstd_level == 0:
            return encode(), None
        if all(t is ts.memory for t in ts.tiers):
            return encode(level=0), None
        return encode(), encode(level=0, count=False)

    def _encode(self, key: bytes, tensor: torch.Tensor, num_tokens: int, layout: str,
               salt: str | None, *, content: bytes | None = None,
               revision: int | None = None, level: int | None = None,
               count: bool = True) -> bytes:
        """``key``'s blob of ``tensor``, sealed for ``salt`` when the store encrypts;
        ``revision``: of a record that replaces an older one (:mod:`.binding`); ``level``:
        zstd's (default: the config's; 0, the raw tensor); ``count``: in the encoded bytes
        and the compression ratio (not an uncompressed twin, which the tiers' blob stands for)."""
        cfg = self.config
        t0 = time.perf_counter()
        level = cfg.zstd_level if level is None else level
        blob = codec.encode(tensor, key=key, fingerprint=cfg.fingerprint, num_tokens=num_tokens,
                            layout=layout, level=level, shuffle=cfg.shuffle,
                            checksum=cfg.checksum, sign_planes=cfg.sign_planes,
                            content=content or b"", revision=revision)
        cipher = self.binding.cipher(salt)
        if cipher is not None:
            blob = cipher.seal(blob)
        if count:
            self.metrics.encoded(tensor.numel() * tensor.element_size(), len(blob),
                                 time.perf_counter() - t0)
        return blob

    def claim(self, key: bytes, tensor: torch.Tensor, *, layout: str = "",
              salt: str | None = None) -> bool:
        """Save ``tensor`` under ``key`` unless someone did first, now (not in the background):
        the *primary* tier decides (Redis when configured, so servers sharing it agree; else
        disk; else memory), then the other tiers follow. False: another writer holds it."""
        key = bytes(key)
        revisions = self.binding.revisions
        revision = revisions.next(key)
        blob, plain = self._blobs(key, tensor, 0, layout, salt, revision=revision)
        blob_id = blob_id_of(blob)
        primary = self.tier_set.primary
        if primary is None:
            raise StorageFull("the store has no tier", hint="configure memory, disk or Redis")
        if not primary.put(blob_id, blob, key) or primary.lookup_many([key])[0] != blob_id:
            return False
        revisions.saw(key, revision)
        for tier in self.tier_set.tiers:
            if tier is not primary:
                mine = plain if plain is not None and tier is self.tier_set.memory else blob
                self._write(tier, key, blob_id if mine is blob else twin_id_of(blob_id), mine,
                            replace=True)
        return True

    def put_blob(self, key: bytes, blob: bytes, *, replace: bool = False,
                 content: bytes | None = None) -> cf.Future:
        """Save an already encoded (or sealed) blob, not decoded, checked to be ours and one
        that a read of ``key`` (expecting ``content``) accepts (:func:`.binding.check`; else
        :class:`RefusedBlob`)."""
        binding.check(container.peek(blob), bytes(key), encrypted=self.binding.encrypted,
                      content=content)
        return self._submit(bytes(key), lambda k: self._store_blob(k, bytes(blob),
                                                                   replace=replace),
                            replace=replace)

    def _submit(self, key: bytes, job, *, replace: bool = False, wait: float | None = None
                ) -> cf.Future:
        if self.saves.closed:
            raise RuntimeError("the KV store is closed")
        return self.saves.submit(key, lambda: self._run_save(key, job, replace),
                                 replace=replace, wait=wait)

    def _run_save(self, key: bytes, job, replace: bool = False) -> None:
        ts = self.tier_set
        target = (ts.durable or ts.tiers or [None])[0]
        if not replace and target is not None and self._exists_in(target, key):
            self.metrics.put_skips.inc()
            return
        job(key)

    @staticmethod
    def _exists_in(tier: Tier, key: bytes) -> bool:
        try:
            return tier.exists_many([key])[0]
        except TIER_ERRORS:
            return False

    def _store_blob(self, key: bytes, blob: bytes, *, replace: bool = False,
                    memory_blob: bytes | None = None) -> None:
        """``blob`` to every tier (``memory_blob`` instead to the memory tier when given)."""
        blob_id = blob_id_of(blob)
        stored = False
        for tier in self.tier_set.tiers:
            data, data_id = blob, blob_id
            if memory_blob is not None and tier is self.tier_set.memory:
                data, data_id = memory_blob, twin_id_of(blob_id)
            mode = {"disk": self.config.disk_write, "redis": self.config.redis_write}.get(
                tier.name, "through")
            if mode == "through" or replace:
                stored = self._write(tier, key, data_id, data, replace=replace) or stored
            else:
                stored = self._behind(tier, key, data_id, data) or stored
        if not stored:
            raise StorageFull(f"no tier could store block {key.hex()[:16]} ({len(blob)} bytes)",
                              hint="raise memory_bytes/disk_bytes or check the disk and Redis")
        self.metrics.puts.inc()

    def promote(self, key: bytes, blob_id: str, data: bytes | memoryview, *,
                found_in: Tier) -> None:
        """Copy a hit to the tiers faster than the one it was ``found_in``: memory at once,
        the others behind (``data`` a lent read buffer: copied)."""
        tiers = self.tier_set.tiers
        if self.closed or not tiers or tiers[0] is found_in:
            return
        if not isinstance(data, bytes):
            data = bytes(data)
        for tier in tiers:
            if tier is found_in:
                break
            if tier.name == "memory":
                self._write(tier, key, blob_id, data)
            else:
                self._behind(tier, key, blob_id, data, wait=False)

    def _write(self, tier: Tier, key: bytes, blob_id: str, blob: bytes, *,
               replace: bool = False) -> bool:
        try:
            ok = tier.put(blob_id, blob, key, replace=replace)
            if not ok:
                self.metrics.errors.labels("storage_full").inc()
            return ok
        except StorageFull as exc:
            self.metrics.errors.labels("storage_full").inc()
            self.tier_set.log_once(f"full-{tier.name}", "%s tier refused a write: %s",
                                   tier.name, exc)
        except TIER_ERRORS as exc:
            self.tier_set.tier_failed(tier, "write", exc, "write_failed")
        finally:
            self.tier_set.gauge(tier)
        return False

    def _behind(self, tier: Tier, key: bytes, blob_id: str, blob: bytes, *,
                wait: bool = True) -> bool:
        """Queue a write after the current work. ``wait`` False (promotions on the read path):
        drop it, counted and logged once, when the write-behind queue is full."""
        queued = self.saves.behind(lambda: self._write(tier, key, blob_id, blob), key=key,
                                   nbytes=len(blob), wait=wait)
        if not queued:
            self.metrics.errors.labels("behind_dropped").inc()
            self.tier_set.log_once("behind-full", "store: write-behind queue full (%d bytes); "
                                   "dropping promotions until it drains", self.saves.behind_limit)
        return queued
