"""Shared Redis tier (single node, Redis Cluster or Valkey): blobs and their key index.

Redis is this tier's own index, so a second server with empty local tiers that shares the Redis
finds and loads the blocks. Names (format 3, :mod:`.layout`) spread a model's keys over
every slot: a key lives in one of 256 shards by a checksum of the key, a blob with its
reference and pin counts in its own slot, a key group's pinned bytes (the pin quota) in the
group's slot, the approximate totals in 16 stats hashes. Batch key operations are one Lua
script per shard and per blob changed (:mod:`.key_index`, :mod:`.scripts`): atomic
within a slot, counts never too low across slots. Format 2's names (one slot a model) are
never read; ``gc`` deletes them.

A key whose bytes are gone (TTL expiry, ``maxmemory`` eviction) answers present in the index;
reads find it *dangling*, remove it and report it dropped (``exists_many`` checks the bytes
too), and ``gc`` removes the rest. Reads fetch blobs in chunks of at most ``read_chunk_bytes``
and look keys up with one pipelined round trip per node. Every call is bounded by
``timeout_s``; while Redis is unreachable calls fail fast with :class:`TierUnavailable` (the
store then serves from local tiers), reconnection is retried with exponential backoff, and
the outage is logged once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cwm_plugin.errors import TierUnavailable
from cwm_plugin.store.tiers.base import KeyInfo, Tier, TierUsage
from cwm_plugin.store.tiers.redis.blobs import RedisBlobs
from cwm_plugin.store.tiers.redis.blobs import as_str as _s
from cwm_plugin.store.tiers.redis.conn import RedisConnection
from cwm_plugin.store.tiers.redis.key_index import RedisKeyIndex
from cwm_plugin.store.tiers.redis.layout import SHARDS, shard_of
from cwm_plugin.store.tiers.redis.scripts import SCRIPTS

if TYPE_CHECKING:
    from cwm_plugin.store.config import StoreConfig

log = logging.getLogger(__name__)
SCAN_BATCH = 1000


def open_tier(config: StoreConfig) -> RedisTier | None:
    """The Redis tier of ``config`` (None: no ``redis_url``); it connects on first use."""
    if not config.redis_url:
        return None
    return RedisTier(config.redis_url, prefix=config.redis_prefix, ttl_s=config.redis_ttl_s,
                     max_value_bytes=config.redis_max_value_bytes,
                     timeout_s=config.redis_timeout_ms / 1000, cluster=config.redis_cluster,
                     read_chunk_bytes=config.redis_read_chunk_bytes)


class RedisTier(Tier):
    name = "redis"
    durable = True

    def __init__(self, url: str, *, prefix: str = "cwm", ttl_s: int | None = None,
                 max_value_bytes: int = 8 << 20, timeout_s: float = 5.0,
                 cluster: bool = False, read_chunk_bytes: int = 64 << 20,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0) -> None:
        super().__init__()
        self.prefix = prefix
        self.ttl_s = ttl_s
        # A restore (store/read_path.py) asks for one blob a round trip and decodes the last
        # one meanwhile: one blob a GET arrives faster than two or more (redis-py with
        # hiredis); get_many still batches up to read_chunk.
        self.read_batch = 1
        self.conn = RedisConnection(url, timeout_s=timeout_s, cluster=cluster, scripts=SCRIPTS,
                                    backoff_s=backoff_s, max_backoff_s=max_backoff_s)
        self._call = self.conn.call
        self.blobs = RedisBlobs(self._call, prefix, ttl_s, max_value_bytes,
                                max(1, read_chunk_bytes // max_value_bytes))
        self.names = self.blobs.layout
        self.index = RedisKeyIndex(self.conn, self.blobs, ttl_s)
        self.totals: tuple[int, int] | None = None     # (bytes, blobs), approximate

    @property
    def available(self) -> bool:
        return self.conn.available

    # --- blobs --------------------------------------------------------------------------------

    def get_many(self, blob_ids: Sequence[str]) -> list[bytes | None]:
        return self.blobs.get_many(blob_ids)

    def has_blob(self, blob_id: str) -> bool:
        return self.blobs.has(blob_id)

    def put(self, blob_id: str, data: bytes, key: bytes, *, replace: bool = False) -> bool:
        """Write the blob's bytes (kept if present, TTL renewed) and map ``key`` to it."""
        return self.index.put(blob_id, data, key, replace=replace)

    def forget_blobs(self, blob_ids: Sequence[str], reason: str,
                     keys: Sequence[bytes] = ()) -> list[bytes]:
        """Delete blobs' bytes and the given keys if they still point to them (other keys of
        a blob are found dangling later)."""
        dropped: list[bytes] = []
        if keys:
            found = self.lookup_many(keys)
            dropped = self.index.unmap([(k, b) for k, b in zip(keys, found, strict=True)
                                        if b is not None and b in set(blob_ids)])
        self.blobs.delete(list(blob_ids))
        self._dropped(dropped, reason)
        return dropped

    # --- keys ---------------------------------------------------------------------------------

    def lookup_many(self, keys: Sequence[bytes]) -> list[str | None]:
        return self.index.lookup(keys)

    def _with_bytes(self, keys: Sequence[bytes]) -> tuple[list[str | None], list[bool]]:
        """(the blob of each key, whether that blob's bytes are there)."""
        blobs = self.lookup_many(keys)
        there = self.blobs.present([b for b in dict.fromkeys(blobs) if b is not None])
        return blobs, [b is not None and there.get(b, False) for b in blobs]

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is mapped *and* its blob's bytes are there; dangling keys found
        on the way are removed and reported dropped."""
        blobs, ok = self._with_bytes(keys)
        dangling = [(bytes(k), b) for k, b, good in zip(keys, blobs, ok, strict=True)
                    if b is not None and not good]
        if dangling:
            self.forget_dangling(dangling)
        return ok

    def forget_dangling(self, pairs: Sequence[tuple[bytes, str]]) -> None:
        """Keys a read found pointing to missing bytes: remove and report them."""
        self._dropped(self.index.unmap(pairs), "dangling")

    def link_many(self, links: Sequence[tuple[bytes, str]]) -> list[bytes]:
        return self.index.link(links)

    def delete_many(self, keys: Sequence[bytes]) -> list[bytes]:
        return self.index.unmap([(bytes(k), None) for k in keys])

    def pin_many(self, keys: Sequence[bytes], *, ttl_s: float | None = None,
                 quota_bytes: int | None = None) -> list[bytes]:
        return self.index.pin(keys, 0 if ttl_s is None else time.time() + ttl_s, quota_bytes)

    leases_released = False

    def lease_many(self, keys: Sequence[bytes], *, ttl_s: float) -> list[bytes]:
        """Nothing of ours evicts Redis keys, only their TTL expires them: a lease renews the
        TTL of the keys and of their blobs' names to at least ``ttl_s`` (``EXPIRE GT``: a
        longer TTL, or none, is kept) and takes no pin, so it has nothing to release. Without
        a TTL (the shipped config) there is nothing to renew and it costs nothing. Returns the
        keys whose TTL it renewed (those present)."""
        if not self.ttl_s:
            return []
        keys = list(dict.fromkeys(bytes(k) for k in keys))
        present = [(k, b) for k, b in zip(keys, self.lookup_many(keys), strict=True)
                   if b is not None]
        if present:
            secs = max(1, math.ceil(ttl_s))

            def run(c: Any) -> None:
                names = [self.names.key(k) for k, _ in present]
                names += self.blobs.names(c, sorted({b for _, b in present}))
                pipe = c.pipeline(transaction=False)
                for n in names:
                    pipe.expire(n, secs, gt=True)
                pipe.execute()
            self._call(run)
        return [k for k, _ in present]

    def unpin_many(self, keys: Sequence[bytes]) -> list[bytes]:
        return self.index.unpin(keys)

    def list_keys(self, prefix: bytes = b"", *, after: bytes | None = None,
                  limit: int = 1000) -> list[KeyInfo]:
        """Keys by prefix, in order: a range of every shard's index, merged."""
        p = bytes(prefix).hex()
        lo = f"[{p}" if p else "-"
        if after is not None and (a := bytes(after).hex()) >= p:
            lo = f"({a}"
        hi = f"[{p}\xff" if p else "+"

        def run(c: Any) -> list:
            pipe = c.pipeline(transaction=False)
            for s in range(SHARDS):
                pipe.zrangebylex(self.names.index(s), lo, hi, start=0, num=limit)
            return pipe.execute()
        found = sorted({_s(r) for rows in self._call(run) for r in rows})[:limit]
        return [i for i in self.info_many([bytes.fromhex(r) for r in found]) if i is not None]

    def info_many(self, keys: Sequence[bytes]) -> list[KeyInfo | None]:
        keys = [bytes(k) for k in keys]
        rows = [(k, b) for k, b in zip(keys, self.lookup_many(keys), strict=True)
                if b is not None]

        def details(c: Any) -> list:
            pipe = c.pipeline(transaction=False)
            for key, b in rows:
                pipe.hget(self.names.pins(shard_of(key)), key.hex())
                pipe.hget(self.blobs.meta(b), "size")
            return pipe.execute()
        res = self._call(details) if rows else []
        now = time.time()
        expiry = [None if e is None else float(e) for e in res[0::2]]
        found = {key: KeyInfo(key, b, e is not None and not 0 < e <= now, e or None,
                              int(size) if size is not None else None)
                 for (key, b), e, size in zip(rows, expiry, res[1::2], strict=True)}
        return [found.get(k) for k in keys]

    # --- maintenance (SCAN: gc and usage only) ------------------------------------------------

    def _scan(self, c: Any, pattern: str) -> list[str]:
        return [_s(n) for n in c.scan_iter(match=pattern, count=SCAN_BATCH)]

    def _scan_keys(self) -> list[bytes]:
        names = self._call(lambda c: self._scan(c, self.names.key_pattern))
        return [k for n in names if (k := self.names.parse_key(n)) is not None]

    def blob_ids(self) -> list[str]:
        return self.blobs.ids()

    def unreferenced(self, min_age_s: float = 0.0) -> list[str]:
        """Blobs no key points to (the keys themselves, not the counts: a count a client
        left too high when it died does not keep a blob), untouched for ``min_age_s``."""
        keys = self._scan_keys()
        refs = {b for i in range(0, len(keys), SCAN_BATCH)
                for b in self.lookup_many(keys[i:i + SCAN_BATCH]) if b is not None}
        return self.blobs.idle([b for b in self.blob_ids() if b not in refs], min_age_s)

    def dangling_keys(self) -> list[bytes]:
        keys = self._scan_keys()
        blobs, ok = self._with_bytes(keys)
        return [k for k, b, good in zip(keys, blobs, ok, strict=True) if b and not good]

    def sweep_expired(self) -> int:
        """Index entries of key names a TTL expired (they stay in their shard's index; a
        blob's counts expire with its bytes); returns how many were removed."""
        def run(c: Any) -> int:
            removed = 0
            for s in range(SHARDS):
                index = self.names.index(s)
                rests = [_s(r) for r in c.zrange(index, 0, -1)]
                for i in range(0, len(rests), 500):
                    part = rests[i:i + 500]
                    pipe = c.pipeline(transaction=False)
                    for r in part:
                        pipe.exists(self.names.key(bytes.fromhex(r)))
                    gone = [r for r, there in zip(part, pipe.execute(), strict=True)
                            if not there]
                    if gone:
                        removed += int(c.zrem(index, *gone))
            return removed
        return self._call(run) if self.ttl_s else 0

    def drop_old_format(self) -> int:
        """Delete the names of format 2 (one hash tag a namespace and rank, one ``stats``):
        nothing reads them; their blobs, which no key of format 3 points to, go as
        unreferenced. Returns how many names were deleted."""
        def run(c: Any) -> int:
            old = [n for n in self._scan(c, f"{self.prefix}:*") if self.names.old_format(n)]
            for i in range(0, len(old), 500):
                pipe = c.pipeline(transaction=False)
                for n in old[i:i + 500]:
                    pipe.delete(n)
                pipe.execute()
            return len(old)
        return self._call(run)

    def stats(self) -> tuple[int, int]:
        self.totals = self.blobs.totals()
        return self.totals

    def usage(self) -> TierUsage:
        """Recount every blob (SCAN) and correct the kept totals (TTL expiries)."""
        try:
            ids = self.blob_ids()
            size = self.blobs.recount(ids)
            keys, pinned = self._call(self._index_counts)
        except TierUnavailable:
            return TierUsage(self.name, 0, 0, None)
        self.totals = (size, len(ids))
        return TierUsage(self.name, size, len(ids), None, keys=keys, pinned_bytes=pinned)

    def _index_counts(self, c: Any) -> tuple[int, int]:
        """(keys, pinned bytes): every shard's index, every group's pin counter (SCAN)."""
        pipe = c.pipeline(transaction=False)
        for s in range(SHARDS):
            pipe.zcard(self.names.index(s))
        keys = sum(int(n) for n in pipe.execute())
        pinned = sum(int(c.get(n) or 0) for n in self._scan(c, self.names.pinbytes_pattern))
        return keys, pinned

    def close(self) -> None:
        self.conn.close()
