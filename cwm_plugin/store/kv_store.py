"""The KV block store: keys -> content-addressed blobs, composed over tiers.

:class:`KVStore` composes :class:`~cwm_plugin.store.tiers.base.Tier` objects, each of which
owns its blobs *and* its key index (memory: this process; disk: SQLite; Redis: Redis), with
the parts that work over them:

* :class:`~cwm_plugin.store.tier_set.TierSet` (``tier_set``): the opened tiers in lookup order
  (memory -> disk -> Redis), the primary tier, failure counting, quarantine, usage and gc;
* :class:`~cwm_plugin.store.write_path.WritePath` (``writes``): ``put`` encodes on a small
  pool and returns a future; memory is written at once, disk and Redis "through" or "behind"
  (bounded in bytes: backpressure). A key the durable tiers already hold is not saved again;
* :class:`~cwm_plugin.store.read_path.ReadPath` (``reads``): lookups in tier order, a hit
  promoted to the faster tiers, blobs fetched in chunks and decoded on a pool;
* :class:`~cwm_plugin.store.key_ops.KeySpace` (``key_space``): batch key operations
  (``link_many``, ``pin_many``, ``unpin_many``, ``delete_many``, leases), one atomic step per
  tier (one SQLite transaction, one Lua script per key group).

The store's methods are those parts' methods, each a call through one attribute. What a tier
drops by itself (eviction, expiry, dangling, quarantine) reaches :meth:`take_dropped`, so the
connector's scheduler stops promising those blocks.

A tier that cannot be opened (unwritable directory, ...) is logged once and left out; a tier
failing at run time is counted and the store goes on with the others. A damaged blob is a
counted miss, quarantined; a blob that is not the key's (of another key group; of another key
and content; with encryption another key's, another salt's, or not sealed; an older revision of
a rewritten record) a refused miss (:mod:`.binding`); a blob of another model or layout an
incompatible miss. With ``encryption_key`` every blob is sealed under its request's salt, for
its key (:mod:`.blob.crypto`).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable, Sequence

import torch

from cwm_plugin.store.binding import Binding
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.key_ops import KeySpace, Lease
from cwm_plugin.store.maintenance import GCReport, VerifyReport
from cwm_plugin.store.read_path import ReadPath, Sink
from cwm_plugin.store.save_queue import SaveQueue
from cwm_plugin.store.tier_set import TierSet
from cwm_plugin.store.tiers.base import KeyInfo, Tier
from cwm_plugin.store.write_path import WritePath
from cwm_plugin.timing import Stages

DROPS_KEPT = 200_000


class KVStore:
    """Tiered, content-addressed KV block store; see the module docstring."""

    def __init__(self, config: StoreConfig, *, registry=None) -> None:
        self.config = config
        self.tier_set = TierSet(config, registry=registry)
        self.metrics = self.tier_set.metrics
        self.tiers = self.tier_set.tiers
        self.memory = self.tier_set.memory
        self.disk = self.tier_set.disk
        self.redis = self.tier_set.redis
        self.durable = self.tier_set.durable
        for tier in self.tiers:
            tier.set_drop_listener(lambda keys, why, t=tier.name: self._on_drop(t, keys, why))
        self._saves = SaveQueue(config.io_workers, config.queue_depth,
                                behind_bytes=config.behind_bytes)
        binding = Binding(config.encryption_key)
        self.writes = WritePath(self.tier_set, self._saves, binding)
        self.reads = ReadPath(self.tier_set, binding, self.writes)
        self.key_space = KeySpace(self.tier_set, self._saves)
        self._lock = threading.Lock()
        self._dropped: set[bytes] = set()
        self._drops_overflow = False
        self._closed = False
        self.tier_set.gauges()

    @property
    def primary(self) -> Tier | None:
        """:attr:`TierSet.primary <cwm_plugin.store.tier_set.TierSet.primary>`."""
        return self.tier_set.primary

    # --- saving (WritePath) -------------------------------------------------------------------

    def put(self, key: bytes, tensor: torch.Tensor, *, num_tokens: int = 0, layout: str = "",
            salt: str | None = None, replace: bool = False, wait: float | None = None,
            unless: Callable[[], bool] | None = None,
            content: bytes | None = None) -> cf.Future:
        return self.writes.put(key, tensor, num_tokens=num_tokens, layout=layout, salt=salt,
                               replace=replace, wait=wait, unless=unless, content=content)

    def claim(self, key: bytes, tensor: torch.Tensor, *, layout: str = "",
              salt: str | None = None) -> bool:
        return self.writes.claim(key, tensor, layout=layout, salt=salt)

    def put_blob(self, key: bytes, blob: bytes, *, replace: bool = False,
                 content: bytes | None = None) -> cf.Future:
        return self.writes.put_blob(key, blob, replace=replace, content=content)

    # --- loading (ReadPath) -------------------------------------------------------------------

    def get(self, key: bytes, *, salt: str | None = None, primary: bool = False,
            content: bytes | None = None) -> torch.Tensor | None:
        return self.reads.get(key, salt=salt, primary=primary, content=content)

    def get_many(self, keys: Sequence[bytes], *, out: torch.Tensor | None = None,
                 layout: str | None = None, salt: str | None = None, primary: bool = False,
                 stages: Stages | None = None, contents: Sequence[bytes] | None = None
                 ) -> list[torch.Tensor | None]:
        return self.reads.get_many(keys, out=out, layout=layout, salt=salt, primary=primary,
                                   stages=stages, contents=contents)

    def read_into(self, keys: Sequence[bytes], sink: Sink, *, shape: tuple[int, ...],
                  dtype: torch.dtype, into: Callable[[int], torch.Tensor] | None = None,
                  layout: str | None = None, salt: str | None = None,
                  stages: Stages | None = None, contents: Sequence[bytes] | None = None,
                  tiers: Sequence[Tier] | None = None) -> list[str | None]:
        return self.reads.read_into(keys, sink, shape=shape, dtype=dtype, into=into,
                                    layout=layout, salt=salt, stages=stages, contents=contents,
                                    tiers=tiers)

    def get_blob(self, key: bytes) -> bytes | None:
        return self.reads.get_blob(key)

    def get_plain(self, key: bytes, *, salt: str | None = None,
                  content: bytes | None = None) -> bytes | None:
        return self.reads.get_plain(key, salt=salt, content=content)

    # --- keys (KeySpace) ----------------------------------------------------------------------

    def where_many(self, keys: Sequence[bytes]) -> list[str | None]:
        return self.key_space.where_many(keys)

    def held_by(self, keys: Sequence[bytes], tiers: Sequence[Tier] | None = None
                ) -> dict[str, list[bool]]:
        return self.key_space.held_by(keys, tiers)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.key_space.contains_many(keys)

    def link_many(self, pairs: Sequence[tuple[bytes, bytes]]) -> dict[str, list[bytes]]:
        return self.key_space.link_many(pairs)

    def link(self, new_key: bytes, existing_key: bytes) -> None:
        self.key_space.link(new_key, existing_key)

    def pin_tiers(self) -> list[Tier]:
        return self.key_space.pin_tiers()

    def pin_quota(self) -> int | None:
        return self.key_space.pin_quota()

    def pin_many(self, keys: Sequence[bytes], *, ttl_s: float | None = None
                 ) -> dict[str, list[bytes]]:
        return self.key_space.pin_many(keys, ttl_s=ttl_s)

    def unpin_many(self, keys: Sequence[bytes]) -> dict[str, list[bytes]]:
        return self.key_space.unpin_many(keys)

    def delete_many(self, keys: Sequence[bytes]) -> dict[str, list[bytes]]:
        return self.key_space.delete_many(keys)

    def lease_many(self, keys: Sequence[bytes], *, ttl_s: float,
                   tiers: Sequence[Tier] | None = None) -> Lease:
        return self.key_space.lease_many(keys, ttl_s=ttl_s, tiers=tiers)

    def release(self, lease: Lease) -> int:
        return self.key_space.release(lease)

    def pin(self, key: bytes) -> None:
        self.key_space.pin(key)

    def unpin(self, key: bytes) -> None:
        self.key_space.unpin(key)

    def delete(self, key: bytes) -> bool:
        return self.key_space.delete(key)

    def pinned(self, key: bytes) -> bool:
        return self.key_space.pinned(key)

    def key_info(self, key: bytes) -> dict[str, KeyInfo]:
        return self.key_space.key_info(key)

    def info_many(self, keys: Sequence[bytes]) -> dict[str, list[KeyInfo | None]]:
        return self.key_space.info_many(keys)

    def list_keys(self, prefix: bytes = b"", *, after: bytes | None = None, limit: int = 1000
                  ) -> dict[str, list[KeyInfo]]:
        return self.key_space.list_keys(prefix, after=after, limit=limit)

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

    def settle_memory(self, step: int, seen: int) -> None:
        """A worker's step end, its memory tier's evictions acknowledged
        (:meth:`~cwm_plugin.store.tiers.ram.tier.RamTier.defer_evictions`): free what was
        retired at step ``seen`` or before (the scheduler has seen it reported dropped), then
        retire what is over the budget, reported as dropped at ``step``."""
        if self.memory is not None:
            self.memory.free_retired(seen)
            self.memory.evict(step)
            self.tier_set.gauge(self.memory)

    def reset_memory(self) -> None:
        """Drop this process's memory tier (unpinned blobs); the keys are reported dropped."""
        if self.memory is not None:
            self.memory.reset()
            self.tier_set.gauges()

    # --- housekeeping -------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for pending saves (including write-behind) for up to ``timeout`` seconds."""
        return self._saves.flush(timeout)

    def wait_keys(self, keys: Sequence[bytes], timeout: float | None = None) -> None:
        for k in keys:
            self._saves.wait_key(bytes(k), timeout)

    def usage(self) -> dict[str, dict[str, int | None]]:
        return self.tier_set.usage()

    def verify(self, progress: bool = True) -> VerifyReport:
        return self.tier_set.verify(progress)

    def gc(self, min_age_s: float | None = None) -> GCReport:
        return self.tier_set.gc(min_age_s)

    def close(self, timeout: float | None = None) -> bool:
        """Finish pending saves, then close the tiers. With ``timeout``, saves not started
        after that many seconds are dropped (logged; a dropped block is recomputed later,
        never half-written). True if every save finished."""
        if self._closed:
            return True
        done = self._saves.flush(timeout)
        self._closed = self.writes.closed = True
        self._saves.shutdown(drop_queued=not done)
        self.reads.close()
        self.tier_set.close()
        return done

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
