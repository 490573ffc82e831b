"""Shared Redis tier (single node, Redis Cluster or Valkey): blobs and their key index.

Redis is this tier's own index, so a second server with empty local tiers that shares the Redis
finds and loads the blocks. Layout under ``<prefix>:`` (format 2):

* per key *group* (namespace + rank, hash tag ``{g}`` = the group's hex, one cluster slot):
  ``{g}:k:<rest>`` -> blob id (string with the TTL, none while pinned), and the hashes
  ``{g}:refs`` (blob -> keys), ``{g}:sizes`` (blob -> bytes), ``{g}:pins`` (rest -> expiry),
  ``{g}:pinned`` (blob -> pinned keys), the counter ``{g}:pinbytes`` and the sorted set
  ``{g}:pinexp`` of pin expiries. Batch key operations are one Lua script per group
  (:mod:`.redis_scripts`), atomic.
* ``{b:<blob id>}`` -> the blob, or for blobs over ``max_value_bytes`` a small manifest naming
  the parts ``{b:<blob id>}:<i>`` (same slot; written before the manifest: :mod:`.redis_blobs`
  reads, writes, expires and deletes the bytes). Blob bytes are
  written before the script that maps a key to them and deleted after the script that frees
  them; with ``ttl_s`` they expire unless a pinned key points to them.
* ``stats`` -> hash of ``bytes`` and ``blobs`` (approximate; ``usage()`` recounts).

A key whose bytes are gone (TTL expiry, ``maxmemory`` eviction) answers present in the index;
reads find it *dangling*, remove it and report it dropped (``exists_many`` checks the bytes
too), and ``gc`` removes the rest. Reads fetch blobs in chunks of at most ``read_chunk_bytes``.
Every call is bounded by ``timeout_s``; while Redis is unreachable calls fail fast with
:class:`TierUnavailable` (the store then serves from local tiers), reconnection is retried
with exponential backoff, and the outage is logged once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from cwm_plugin.errors import TierUnavailable
from cwm_plugin.store.tiers.base import (
    GROUP_BYTES,
    KeyInfo,
    QuotaExceeded,
    Tier,
    TierUsage,
    group_of,
)
from cwm_plugin.store.tiers.redis_blobs import RedisBlobs
from cwm_plugin.store.tiers.redis_blobs import as_str as _s
from cwm_plugin.store.tiers.redis_conn import RedisConnection
from cwm_plugin.store.tiers.redis_scripts import SCRIPTS

log = logging.getLogger(__name__)


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
        # A restore (store/reading.py) asks for one blob a round trip and decodes the last
        # one meanwhile: 1.9 MB blobs came at 1.0-1.3 GB/s one a GET, 0.5-0.9 two or more
        # (redis-py with hiredis, local server); get_many still batches up to read_chunk.
        self.read_batch = 1
        self.conn = RedisConnection(url, timeout_s=timeout_s, cluster=cluster, scripts=SCRIPTS,
                                    backoff_s=backoff_s, max_backoff_s=max_backoff_s)
        self._call = self.conn.call
        self.blobs = RedisBlobs(self._call, prefix, ttl_s, max_value_bytes,
                                max(1, read_chunk_bytes // max_value_bytes))
        self.totals: tuple[int, int] | None = None     # (bytes, blobs), approximate

    @property
    def available(self) -> bool:
        return self.conn.available

    # --- names --------------------------------------------------------------------------------

    def _kprefix(self, group: bytes) -> str:
        return f"{self.prefix}:{{{group.hex()}}}:k:"

    def _kname(self, key: bytes) -> str:
        return self._kprefix(group_of(key)) + bytes(key[GROUP_BYTES:]).hex()

    def _gkeys(self, group: bytes) -> list[str]:
        base = f"{self.prefix}:{{{group.hex()}}}:"
        return [base + n for n in ("refs", "sizes", "pins", "pinned", "pinbytes", "pinexp",
                                   "index")]

    @property
    def _ttl(self) -> str:
        return str(self.ttl_s) if self.ttl_s else ""

    @staticmethod
    def _by_group(keys: Iterable[bytes]) -> dict[bytes, list[bytes]]:
        out: dict[bytes, list[bytes]] = {}
        for k in keys:
            out.setdefault(group_of(k), []).append(bytes(k))
        return out

    def _script(self, name: str, group: bytes, keys: Sequence[bytes], args: Sequence) -> Any:
        names = self._gkeys(group) + [self._kname(k) for k in keys]
        argv = [self._ttl, f"{time.time():.3f}", self._kprefix(group), *args]
        return self._call(lambda c: self.conn.scripts[name](keys=names, args=argv, client=c))

    # --- blobs --------------------------------------------------------------------------------

    def get_many(self, blob_ids: Sequence[str]) -> list[bytes | None]:
        return self.blobs.get_many(blob_ids)

    def has_blob(self, blob_id: str) -> bool:
        return self.blobs.has(blob_id)

    def put(self, blob_id: str, data: bytes, key: bytes, *, replace: bool = False) -> bool:
        """Write the blob's bytes (kept if present, TTL renewed), then map ``key`` to it in
        the key's group (one script)."""
        created = self._call(lambda c: self.blobs.write(c, blob_id, data))
        group = group_of(key)
        res = self._script("map", group, [key], [blob_id, len(data), "1" if replace else ""])
        if int(res[0]) == 0 and created:       # the key kept another writer's blob
            self.blobs.delete([blob_id])
        # a pinned key re-pointed (a window's manifest rewritten by a thaw): the new bytes
        # are PERSISTed, the old get their TTL back (else the manifest expired with the TTL
        # and its window vanished, its blocks pinned for good)
        self._after(res)
        return True

    def _after(self, res: Sequence) -> None:
        """Apply a script's blob lists: (.., freed, protect, release) -> delete, PERSIST, EXPIRE."""
        freed, protect, release = ([_s(b) for b in part] for part in res[-3:])
        self.blobs.delete(freed)
        if protect:
            self._call(lambda c: self.blobs.expire(c, protect, persist=True))
        if release:
            self._call(lambda c: self.blobs.expire(c, release))

    def forget_blobs(self, blob_ids: Sequence[str], reason: str,
                     keys: Sequence[bytes] = ()) -> list[bytes]:
        """Delete blobs' bytes and the given keys if they still point to them (other keys of
        a blob are found dangling later)."""
        dropped: list[bytes] = []
        if keys:
            found = self.lookup_many(keys)
            dropped = self._unmap_if([(k, b) for k, b in zip(keys, found, strict=True)
                                      if b is not None and b in set(blob_ids)])
        self.blobs.delete(list(blob_ids))
        self._dropped(dropped, reason)
        return dropped

    def _unmap_if(self, pairs: Sequence[tuple[bytes, str | None]]) -> list[bytes]:
        """Delete keys that still point to the given blob (any blob for None)."""
        out: list[bytes] = []
        groups: dict[bytes, list[tuple[bytes, str | None]]] = {}
        for k, b in pairs:
            groups.setdefault(group_of(k), []).append((bytes(k), b))
        for g, items in groups.items():
            args = [x for k, b in items for x in (k[GROUP_BYTES:].hex(), b or "")]
            res = self._script("delete_many", g, [k for k, _ in items], args)
            out += [g + bytes.fromhex(_s(r)) for r in res[0]]
            self._after(res)
        return out

    # --- keys ---------------------------------------------------------------------------------

    def lookup_many(self, keys: Sequence[bytes]) -> list[str | None]:
        found: dict[bytes, str | None] = {}
        for ks in self._by_group(keys).values():
            vals = self._call(lambda c, ks=ks: c.mget([self._kname(k) for k in ks]))
            found.update({k: _s(v) if v is not None else None
                          for k, v in zip(ks, vals, strict=True)})
        return [found.get(bytes(k)) for k in keys]

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
            self._dropped(self._unmap_if(dangling), "dangling")
        return ok

    def forget_dangling(self, pairs: Sequence[tuple[bytes, str]]) -> None:
        """Keys a read found pointing to missing bytes: remove and report them."""
        self._dropped(self._unmap_if(pairs), "dangling")

    def link_many(self, links: Sequence[tuple[bytes, str]]) -> list[bytes]:
        out: list[bytes] = []
        groups: dict[bytes, list[tuple[bytes, str]]] = {}
        for k, b in links:
            groups.setdefault(group_of(k), []).append((bytes(k), b))
        for g, items in groups.items():
            args = [x for k, b in items for x in (k[GROUP_BYTES:].hex(), b)]
            res = self._script("link_many", g, [k for k, _ in items], args)
            out += [g + bytes.fromhex(_s(r)) for r in res[0]]
            self._after(res)
            if self.ttl_s:          # a blob lives as long as its newest key (pinned: no TTL)
                ids = sorted({b for _, b in items})
                self._call(lambda c, ids=ids: self.blobs.expire(c, ids, only_if_ttl=True))
        return out

    def delete_many(self, keys: Sequence[bytes]) -> list[bytes]:
        return self._unmap_if([(bytes(k), None) for k in keys])

    def pin_many(self, keys: Sequence[bytes], *, ttl_s: float | None = None,
                 quota_bytes: int | None = None) -> list[bytes]:
        expires = 0 if ttl_s is None else time.time() + ttl_s
        out: list[bytes] = []
        for g, ks in self._by_group(keys).items():
            args = [f"{expires:.3f}", "" if quota_bytes is None else str(quota_bytes),
                    *(k[GROUP_BYTES:].hex() for k in ks)]
            res = self._script("pin_many", g, ks, args)
            if res and not isinstance(res[0], list) and int(res[0]) == -1:
                raise QuotaExceeded(f"pinning {len(ks)} keys would hold {int(res[1]):,} pinned "
                                    f"bytes in Redis for one model and rank, over the quota of "
                                    f"{quota_bytes:,}",
                                    hint="delete or unpin windows, or raise pin_quota_bytes")
            out += [g + bytes.fromhex(_s(r)) for r in res[0]]
            self._after([[], *res[1:]])
        return out

    def unpin_many(self, keys: Sequence[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for g, ks in self._by_group(keys).items():
            res = self._script("unpin_many", g, ks, [k[GROUP_BYTES:].hex() for k in ks])
            out += [g + bytes.fromhex(_s(r)) for r in res[0]]
            self._after([[], *res[1:]])
        return out

    def list_keys(self, prefix: bytes = b"", *, after: bytes | None = None,
                  limit: int = 1000) -> list[KeyInfo]:
        """Keys by prefix: within one group (a prefix of 18+ bytes) an ordered range of the
        group's index; shorter prefixes SCAN every group (maintenance only)."""
        if len(prefix) >= GROUP_BYTES:
            found = self._list_group(prefix, after, limit)
        else:
            found = sorted(k for k in self._scan_keys() if k.startswith(prefix)
                           and (after is None or k > after))[:limit]
        return [i for i in self.info_many(found) if i is not None]

    def info_many(self, keys: Sequence[bytes]) -> list[KeyInfo | None]:
        keys = [bytes(k) for k in keys]
        rows = [(k, b) for k, b in zip(keys, self.lookup_many(keys), strict=True)
                if b is not None]

        def details(c: Any) -> list:
            pipe = c.pipeline(transaction=False)
            for key, b in rows:
                names = self._gkeys(group_of(key))
                pipe.hget(names[2], key[GROUP_BYTES:].hex())
                pipe.hget(names[1], b)
            return pipe.execute()
        res = self._call(details) if rows else []
        now = time.time()
        expiry = [None if e is None else float(e) for e in res[0::2]]
        found = {key: KeyInfo(key, b, e is not None and not 0 < e <= now, e or None,
                              int(size) if size is not None else None)
                 for (key, b), e, size in zip(rows, expiry, res[1::2], strict=True)}
        return [found.get(k) for k in keys]

    def _list_group(self, prefix: bytes, after: bytes | None, limit: int) -> list[bytes]:
        group, rest = group_of(prefix), prefix[GROUP_BYTES:].hex()
        lo = f"[{rest}"
        if after is not None and after[:GROUP_BYTES] == group and after[GROUP_BYTES:].hex() >= rest:
            lo = f"({after[GROUP_BYTES:].hex()}"
        elif after is not None and after[:GROUP_BYTES] > group:
            return []
        index = self._gkeys(group)[6]
        rests = self._call(lambda c: c.zrangebylex(index, lo, f"[{rest}\xff", start=0,
                                                   num=limit))
        return [group + bytes.fromhex(_s(r)) for r in rests]

    def _scan_keys(self) -> list[bytes]:
        names = self._call(lambda c: [_s(n) for n in c.scan_iter(
            match=f"{self.prefix}:{{*}}:k:*", count=1000)])
        out = []
        for n in names:
            head, _, rest = n.rpartition(":k:")
            out.append(bytes.fromhex(head[head.index("{") + 1:-1]) + bytes.fromhex(rest))
        return out

    # --- maintenance --------------------------------------------------------------------------

    def blob_ids(self) -> list[str]:
        return self.blobs.ids()

    def _referenced(self) -> set[str]:
        def run(c: Any) -> set[str]:
            out: set[str] = set()
            for name in c.scan_iter(match=f"{self.prefix}:{{*}}:refs", count=1000):
                out |= {_s(b) for b in c.hkeys(name)}
            return out
        return self._call(run)

    def unreferenced(self, min_age_s: float = 0.0) -> list[str]:
        refs = self._referenced()
        return self.blobs.idle([b for b in self.blob_ids() if b not in refs], min_age_s)

    def dangling_keys(self) -> list[bytes]:
        keys = self._scan_keys()
        blobs, ok = self._with_bytes(keys)
        return [k for k, b, good in zip(keys, blobs, ok, strict=True) if b and not good]

    def sweep_expired(self) -> int:
        """Index entries a TTL expiry left behind; returns how many were removed. A key name
        that expired stays in its group's ``index``, and a blob whose bytes expired stays in
        ``refs`` / ``sizes`` (~300 bytes a block saved, never freed: under ``noeviction`` they
        fill ``maxmemory`` in the end). Entries of pinned blobs are left alone."""
        def run(c: Any) -> int:
            removed = 0
            for index in [_s(n) for n in c.scan_iter(match=f"{self.prefix}:{{*}}:index",
                                                     count=1000)]:
                base = index[:-len("index")]
                rests = [_s(r) for r in c.zrange(index, 0, -1)]
                for i in range(0, len(rests), 500):
                    part = rests[i:i + 500]
                    pipe = c.pipeline(transaction=False)
                    for r in part:
                        pipe.exists(f"{base}k:{r}")
                    gone = [r for r, there in zip(part, pipe.execute(), strict=True)
                            if not there]
                    if gone:
                        removed += int(c.zrem(index, *gone))
                blobs = [_s(b) for b in c.hkeys(f"{base}sizes")]
                pinned = {_s(b) for b in c.hkeys(f"{base}pinned")}
                there = self.blobs.present([b for b in blobs if b not in pinned])
                gone = [b for b, ok in there.items() if not ok]
                if gone:
                    c.hdel(f"{base}sizes", *gone)
                    c.hdel(f"{base}refs", *gone)
                    removed += len(gone)
            return removed
        return self._call(run) if self.ttl_s else 0

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
        """(keys, pinned bytes) over every group's index and pin counter (SCAN)."""
        keys = pinned = 0
        for name in c.scan_iter(match=f"{self.prefix}:{{*}}:index", count=1000):
            keys += int(c.zcard(name))
        for name in c.scan_iter(match=f"{self.prefix}:{{*}}:pinbytes", count=1000):
            pinned += int(c.get(name) or 0)
        return keys, pinned

    def close(self) -> None:
        self.conn.close()
