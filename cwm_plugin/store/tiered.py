"""The KV block store: keys -> content-addressed blobs over CPU memory, local disk and Redis.

* ``put`` hands the tensor to a small thread pool (encoding happens there) and returns a
  future at once; it blocks only when ``queue_depth`` saves are pending, or the write-behind
  queue holds ``behind_bytes`` (backpressure). Keys already present are skipped. Disk and Redis
  writes are "through" (the future waits for them) or "behind" (queued after the future
  completes), per tier.
* ``get``/``get_many`` resolve keys (this process' map, the SQLite index, Redis), fetch blobs in
  the order memory -> disk -> Redis, decode, count a tier's hit only for a blob that decoded,
  and promote hits to the faster tiers. A damaged blob is a counted miss: it is moved to the
  quarantine folder (or dropped) and logged once; a blob of another model or KV layout is an
  incompatible miss.
* ``contains_many``, ``link``, ``pin``/``unpin``, ``delete``: :mod:`.keyops` (pins are per key;
  link re-points an existing key). ``gc`` drops blobs no key points to (older than
  ``gc_min_age_s``), ``verify`` checks every blob: :mod:`.maintenance`.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from cwm_plugin.errors import CorruptBlob, IncompatibleBlob, TierUnavailable
from cwm_plugin.store import codec
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.index import BlobIndex
from cwm_plugin.store.keyops import KeyOps
from cwm_plugin.store.maintenance import GCReport, VerifyReport, collect_garbage, verify_all
from cwm_plugin.store.metrics import StoreMetrics
from cwm_plugin.store.queue import SaveQueue
from cwm_plugin.store.tiers.disk import DiskTier
from cwm_plugin.store.tiers.memory import MemoryTier
from cwm_plugin.store.tiers.redis import RedisTier
from cwm_plugin.store.writes import WritePath

log = logging.getLogger(__name__)
_LOGGED_MAX = 4096


def _done(value: object = None) -> cf.Future:
    fut: cf.Future = cf.Future()
    fut.set_result(value)
    return fut


class KVStore(KeyOps, WritePath):
    """Tiered, content-addressed KV block store; see the module docstring."""

    def __init__(self, config: StoreConfig, *, registry=None) -> None:
        self.config = config
        self.metrics = StoreMetrics.for_registry(registry)
        self._lock = threading.RLock()
        self._keys: dict[bytes, str] = {}            # memory tier: key -> blob (this process)
        self._by_blob: dict[str, set[bytes]] = {}
        self._pinned: set[bytes] = set()             # pinned keys known to this process
        self.memory = (MemoryTier(config.memory_bytes, on_evict=self._memory_evicted)
                       if config.memory_bytes > 0 else None)
        self.index: BlobIndex | None = None
        self.disk: DiskTier | None = None
        if config.disk_path:
            root = Path(config.disk_path)
            self.index = BlobIndex(root / "index.sqlite")
            self.disk = DiskTier(root, config.disk_bytes, index=self.index,
                                 on_evict=lambda ids: self.metrics.evictions.labels("disk")
                                 .inc(len(ids)))
            self.metrics.tier_usage("disk", *self.index.totals())
        self.redis = (RedisTier(config.redis_url, prefix=config.redis_prefix,
                                ttl_s=config.redis_ttl_s,
                                max_value_bytes=config.redis_max_value_bytes)
                      if config.redis_url else None)
        if self.redis is not None:
            with contextlib.suppress(TierUnavailable):      # down now: gauges after a write
                self.metrics.tier_usage("redis", *self.redis.stats())
        self._saves = SaveQueue(config.io_workers, config.queue_depth,
                                behind_bytes=config.behind_bytes)
        self._decoder = (cf.ThreadPoolExecutor(config.io_workers, thread_name_prefix="cwm-decode")
                         if config.io_workers > 1 else None)
        self._logged: set[str] = set()
        self._closed = False

    # --- saving -------------------------------------------------------------------------------

    def put(self, key: bytes, tensor: torch.Tensor, *, num_tokens: int = 0,
            layout: str = "") -> cf.Future:
        """Save a block in the background; the future resolves when the "through" tiers hold it."""
        return self._submit(bytes(key), lambda k: self._save_tensor(k, tensor, num_tokens, layout))

    def put_blob(self, key: bytes, blob: bytes) -> cf.Future:
        """Save an already encoded blob (checked to be ours, not decoded)."""
        codec.peek(blob)
        return self._submit(bytes(key), lambda k: self._store_blob(k, bytes(blob)))

    def _submit(self, key: bytes, job) -> cf.Future:
        if self._saves.closed:
            raise RuntimeError("the KV store is closed")
        if key in self._keys:
            self.metrics.put_skips.inc()
            return _done()
        return self._saves.submit(key, lambda: self._run_save(key, job))

    def _run_save(self, key: bytes, job) -> None:
        if self._present(key):
            self.metrics.put_skips.inc()
            return
        job(key)

    # --- loading ------------------------------------------------------------------------------

    def _resolve(self, keys: Sequence[bytes]) -> list[str | None]:
        out: list[str | None] = [self._keys.get(k) for k in keys]
        rest = [k for k, b in zip(keys, out, strict=True) if b is None]
        if rest and self.index is not None:
            found = self._index_lookup(rest)
            out = [b if b is not None else found.get(k) for k, b in zip(keys, out, strict=True)]
            rest = [k for k, b in zip(keys, out, strict=True) if b is None]
        if rest and self.redis is not None:
            try:
                found_r = dict(zip(rest, self.redis.lookup_many(rest), strict=True))
            except TierUnavailable:
                found_r = {}
            out = [b if b is not None else found_r.get(k) for k, b in zip(keys, out, strict=True)]
        return out

    def _index_lookup(self, keys: Sequence[bytes]) -> dict[bytes, str]:
        assert self.index is not None
        try:
            return self.index.lookup_many(keys)
        except sqlite3.Error as exc:      # locked for too long, damaged: a miss, not a crash
            self.metrics.errors.labels("index").inc()
            self._log_once("index-read", "store index lookup failed: %s", exc)
            return {}

    def _fetch(self, blob_ids: list[str]) -> dict[str, tuple[bytes, str]]:
        """blob id -> (bytes, tier it came from), looking memory -> disk -> redis."""
        got: dict[str, tuple[bytes, str]] = {}
        want = list(dict.fromkeys(blob_ids))
        tiers = [t for t in (self.memory, self.disk, self.redis) if t is not None]
        for tier in tiers:
            if not want:
                break
            try:
                datas = tier.get_many(want)
            except TierUnavailable:
                self.metrics.errors.labels("tier_unavailable").inc()
                continue
            except (OSError, sqlite3.Error) as exc:
                self.metrics.errors.labels("read_failed").inc()
                self._log_once(f"read-{tier.name}", "%s tier read failed: %s", tier.name, exc)
                continue
            missing = []
            for b, d in zip(want, datas, strict=True):
                if d is None:
                    missing.append(b)
                else:
                    got[b] = (d, tier.name)     # a hit is counted once it decodes
            self.metrics.misses.labels(tier.name).inc(len(missing))
            want = missing
        return got

    def get(self, key: bytes) -> torch.Tensor | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes], *, out: torch.Tensor | None = None,
                 layout: str | None = None) -> list[torch.Tensor | None]:
        """Decoded tensors (None for a miss) for ``keys``, in order. Several blocks are decoded
        in parallel on the store's decode threads (zstd and numpy release the GIL).

        ``out`` (optional, ``[len(keys), *block]``, contiguous CPU): hits whose dtype and shape
        match are decoded straight into ``out[i]`` and returned as that view (no extra copy);
        rows of misses are left unspecified. ``layout`` (optional): the KV layout string the
        blobs must carry (the connector's worker layout); another layout is an incompatible,
        counted miss."""
        keys = [bytes(k) for k in keys]
        ids = self._resolve(keys)
        blobs = self._fetch([b for b in ids if b is not None])
        work = [(i, key, blob_id, *blobs[blob_id]) for i, (key, blob_id)
                in enumerate(zip(keys, ids, strict=True)) if blob_id in blobs]
        if out is not None and (out.dim() == 0 or out.shape[0] != len(keys)):
            raise ValueError(f"out has {tuple(out.shape)[:1]} rows for {len(keys)} keys")

        def one(w: tuple) -> torch.Tensor | None:
            return self._decode(*w[1:], into=None if out is None else out[w[0]], layout=layout)

        if len(work) > 1 and self._decoder is not None:
            results = list(self._decoder.map(one, work))
        else:
            results = [one(w) for w in work]
        found: list[torch.Tensor | None] = [None] * len(keys)
        for (i, *_), tensor in zip(work, results, strict=True):
            found[i] = tensor
        self.metrics.misses.labels("all").inc(sum(t is None for t in found))
        return found

    def _decode(self, key: bytes, blob_id: str, data: bytes, tier: str, *,
                into: torch.Tensor | None = None, layout: str | None = None
                ) -> torch.Tensor | None:
        t0 = time.perf_counter()
        try:
            decoded = codec.decode(data, fingerprint=self.config.fingerprint or None,
                                   layout=layout, verify=self.config.checksum, into=into)
        except (CorruptBlob, IncompatibleBlob) as exc:
            self.metrics.misses.labels(tier).inc()
            self._bad_blob(key, blob_id, data, tier, exc)
            return None
        self.metrics.decode_seconds.observe(time.perf_counter() - t0)
        self.metrics.hits.labels(tier).inc()
        self._promote(key, blob_id, data, tier)
        return decoded.tensor

    def get_blob(self, key: bytes) -> bytes | None:
        blob_id = self._resolve([bytes(key)])[0]
        if blob_id is None:
            return None
        hit = self._fetch([blob_id]).get(blob_id)
        if hit is None:
            return None
        self.metrics.hits.labels(hit[1]).inc()           # raw bytes: nothing to decode
        return hit[0]

    def _promote(self, key: bytes, blob_id: str, data: bytes, tier: str) -> None:
        if tier == "memory":
            return
        pinned = False
        if tier == "disk" and self.index is not None and key not in self._pinned:
            with contextlib.suppress(sqlite3.Error):
                pinned = self.index.is_key_pinned(key)
        self._to_memory(key, blob_id, data, pinned=pinned)
        if tier == "redis" and not self._closed:
            self._behind(self._promote_from_redis, key, blob_id, data, wait=False)

    def _bad_blob(self, key: bytes, blob_id: str, data: bytes, tier: str,
                  exc: CorruptBlob | IncompatibleBlob) -> None:
        kind = "corrupt" if isinstance(exc, CorruptBlob) else "incompatible"
        self.metrics.errors.labels(kind).inc()
        self._log_once(f"bad-{blob_id}", "store: %s blob %s for key %s in %s tier: %s; "
                       "treated as a miss%s", kind, blob_id, key.hex()[:16], tier, exc,
                       ", quarantined" if kind == "corrupt" else "")
        if kind == "corrupt":
            self.quarantine(blob_id, data, tier, reason=str(exc))

    def quarantine(self, blob_id: str, data: bytes | None, tier: str, *, reason: str) -> None:
        """Take a damaged blob out of service everywhere; keep its bytes under quarantine/."""
        with self._lock:
            for k in self._by_blob.pop(blob_id, set()):
                self._keys.pop(k, None)
        if self.memory is not None:
            self.memory.delete(blob_id)
        if self.disk is not None:
            try:
                moved = self.disk.quarantine(blob_id, reason) if tier == "disk" else None
                if moved is None and data is not None:
                    dst = self.disk.quarantine_dir / f"{blob_id}.{tier}.{int(time.time())}"
                    dst.write_bytes(data)
            except (OSError, sqlite3.Error) as exc:   # full or read-only disk: still out of use
                self.metrics.errors.labels("quarantine_failed").inc()
                self._log_once("quarantine", "store: could not keep a damaged blob under "
                               "quarantine/: %s", exc)
        if self.redis is not None and tier == "redis":
            with contextlib.suppress(TierUnavailable):
                self.redis.delete(blob_id)
        self._gauges()

    # --- housekeeping -------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> None:
        """Wait for pending saves (including write-behind) for up to ``timeout`` seconds."""
        self._saves.flush(timeout)

    def usage(self) -> dict[str, dict[str, int | None]]:
        """Bytes and blobs per tier; Redis is recounted (SCAN), so this is for the CLI."""
        out: dict[str, dict[str, int | None]] = {}
        for tier in (self.memory, self.disk, self.redis):
            if tier is not None:
                u = tier.usage()
                out[u.name] = {"bytes": u.bytes, "blobs": u.blobs, "budget": u.budget}
                self.metrics.tier_usage(u.name, u.bytes, u.blobs)
        return out

    def verify(self, progress: bool = True) -> VerifyReport:
        return verify_all(self, progress=progress)

    def gc(self, min_age_s: float | None = None) -> GCReport:
        """Drop unreferenced blobs older than ``min_age_s`` (default: ``gc_min_age_s``)."""
        return collect_garbage(self, self.config.gc_min_age_s if min_age_s is None
                               else min_age_s)

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
        for tier in (self.memory, self.disk, self.redis):
            if tier is not None:
                tier.close()
        return done

    def _log_once(self, tag: str, msg: str, *args: object) -> None:
        with self._lock:
            if tag in self._logged:
                return
            if len(self._logged) > _LOGGED_MAX:
                self._logged.clear()
            self._logged.add(tag)
        log.warning(msg, *args)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
