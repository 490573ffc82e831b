"""The Redis tier's key index across cluster slots: look up, map, link, delete, pin, unpin.

A key's name, pin and index entry live in its shard's slot, a blob's reference and pin counts
in the blob's slot, a key group's pinned bytes in the group's slot (:mod:`.layout`). An
operation runs one script per shard of its keys and one per blob whose counts it changes:
atomic within each slot, not across slots (a client cut off between two scripts leaves each
shard's part of a batch whole, and counts too high, never too low: :mod:`.scripts`).
Scripts go down one pipeline on a single node, one call each on a cluster (redis-py does not
pipeline scripts there); reads are pipelined across slots.

The blob counts a script changed come back as :class:`Change` and are settled here: the parts
of a blob left without references are deleted (its value and counts went in the script), the
bytes of a blob's first pinned key are PERSISTed and those of its last unpinned one get their
TTL back, and the group's pinned bytes follow. Pinning reserves the bytes it will add in the
group's counter first, refused over the quota before anything is pinned.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cwm_plugin.store.tiers.base import QuotaExceeded, group_of
from cwm_plugin.store.tiers.redis.blobs import RedisBlobs
from cwm_plugin.store.tiers.redis.blobs import as_str as _s
from cwm_plugin.store.tiers.redis.conn import RedisConnection
from cwm_plugin.store.tiers.redis.layout import GROUP_HEX, shard_of

Deltas = dict[str, list[int]]     # blob -> [references, pins] to add


@dataclass(frozen=True)
class Change:
    """What a blob script did to one blob."""

    blob: str
    refs: int            # after; 0: freed (value and counts deleted), -1: not held, -2: unknown
    pins_before: int
    pins_after: int
    size: int
    grp: str             # the group (hex) whose pinned bytes the blob counts in
    head: bytes          # the freed value's first bytes (a split blob's manifest)

    @classmethod
    def of(cls, blob: str, res: Sequence) -> Change:
        head = res[5] if isinstance(res[5], bytes) else b""
        return cls(blob, int(res[0]), int(res[1]), int(res[2]), int(res[3] or 0), _s(res[4]),
                   head)

    @property
    def applied(self) -> bool:
        return self.refs > 0

    @property
    def pinned_bytes(self) -> int:
        """The bytes this change added to (or took from) its group's pinned bytes."""
        return self.size * (int(self.applied and self.pins_after > 0) - int(self.pins_before > 0))


def _add(deltas: Deltas, blob: str, refs: int, pins: int) -> None:
    d = deltas.setdefault(blob, [0, 0])
    d[0] += refs
    d[1] += pins


class RedisKeyIndex:
    def __init__(self, conn: RedisConnection, blobs: RedisBlobs, ttl_s: int | None) -> None:
        self.conn = conn
        self._call = conn.call
        self.blobs = blobs
        self.names = blobs.layout
        self.ttl_s = ttl_s

    @property
    def _ttl(self) -> str:
        return str(self.ttl_s) if self.ttl_s else ""

    # --- running scripts ----------------------------------------------------------------------

    def _run(self, calls: Sequence[tuple[str, list[str], list]]) -> list[Any]:
        if not calls:
            return []

        def run(c: Any) -> list[Any]:
            scripts = self.conn.scripts
            if self.conn.cluster:
                return [scripts[n](keys=k, args=a, client=c) for n, k, a in calls]
            pipe = c.pipeline(transaction=False)
            for n, k, a in calls:
                scripts[n](keys=k, args=a, client=pipe)
            return pipe.execute()
        return self._call(run)

    def _keys(self, script: str, items: Iterable[tuple[bytes, list]], head: Sequence = ()
              ) -> dict[str, list]:
        """A key script over ``(key, its args)``, one call a shard: the rows by key hex."""
        shards: dict[int, list[tuple[bytes, list]]] = defaultdict(list)
        for key, args in items:
            shards[shard_of(key)].append((key, args))
        now = f"{time.time():.3f}"
        calls = [(script, [self.names.index(s), self.names.pins(s),
                           *(self.names.key(k) for k, _ in its)],
                  [self._ttl, now, *head, *(a for _, args in its for a in args)])
                 for s, its in shards.items()]
        return {_s(row[0]): [_s(x) if isinstance(x, bytes) else x for x in row[1:]]
                for rows in self._run(calls) for row in rows}

    def _deltas(self, deltas: Deltas) -> list[Change]:
        items = [(b, d) for b, d in deltas.items() if b and (d[0] or d[1])]
        res = self._run([("blob_ref", [self.blobs.name(b), self.blobs.meta(b)], list(d))
                         for b, d in items])
        return [Change.of(b, r) for (b, _), r in zip(items, res, strict=True)]

    def _settle(self, changes: Sequence[Change], reserved: dict[str, int] | None = None) -> None:
        freed = {c.blob: c.head for c in changes if c.refs == 0}
        protect = [c.blob for c in changes if c.applied and c.pins_before == 0 < c.pins_after]
        release = [c.blob for c in changes if c.applied and c.pins_before > 0 == c.pins_after]
        quota: dict[str, int] = defaultdict(int)
        for c in changes:
            quota[c.grp] += c.pinned_bytes
        for g, n in (reserved or {}).items():
            quota[g] -= n
        moves = {g: n for g, n in quota.items() if g and n}
        if not (freed or protect or release or moves):
            return

        self._run([("drop_parts", [self.blobs.name(b), *parts], [])
                   for b, parts in self.blobs.parts_of(freed).items()])

        def run(c: Any) -> None:
            if freed:
                self.blobs.count(c, {x.blob: x.size for x in changes if x.refs == 0}, -1)
            if protect:
                self.blobs.expire(c, protect, persist=True)
            if release:
                self.blobs.expire(c, release)
            self._move_pinned(c, moves)
        self._call(run)

    def _move_pinned(self, c: Any, moves: dict[str, int]) -> None:
        if moves:
            pipe = c.pipeline(transaction=False)
            for g, n in moves.items():
                pipe.incrby(self.names.pinbytes(g), n)
            pipe.execute()

    # --- keys ---------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[str | None]:
        if not keys:
            return []
        names = [self.names.key(bytes(k)) for k in keys]
        vals = self._call(lambda c: c.mget_nonatomic(names) if self.conn.cluster
                          else c.mget(names))
        return [_s(v) if v is not None else None for v in vals]

    def pinned(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key has a pin (expired ones too, until they are processed)."""
        if not keys:
            return []

        def run(c: Any) -> list:
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.hexists(self.names.pins(shard_of(k)), bytes(k).hex())
            return pipe.execute()
        return [bool(x) for x in self._call(run)]

    def put(self, blob_id: str, data: bytes, key: bytes, *, replace: bool) -> bool:
        """Write the blob's bytes unless present and take a reference, then map the key (first
        writer wins unless ``replace``); a reference not used is given back. A pinned key
        re-pointed moves its pin to the new bytes. False if the bytes were freed twice
        under this call (another writer's delete racing it): nothing mapped."""
        key = bytes(key)
        pin = replace and self.pinned([key])[0]
        for _ in range(2):
            created = self._call(lambda c: self.blobs.write(c, blob_id, data))
            res = self._run([("blob_ref", [self.blobs.name(blob_id), self.blobs.meta(blob_id)],
                              [1, int(pin), len(data), group_of(key).hex(),
                               "1" if created else ""])])[0]
            if created:
                self._call(lambda c: self.blobs.count(c, {blob_id: len(data)}, 1))
            if int(res[0]) > 0:
                break
        else:
            return False
        if not created and self.ttl_s:
            self._call(lambda c: self.blobs.expire(c, [blob_id], only_if_ttl=True))
        status, old, pinned = self._keys("set_keys", [
            (key, [key.hex(), blob_id, "1" if replace else ""])])[key.hex()]
        fix: Deltas = {}
        if int(status) != 2:                       # the same blob, or another writer's kept
            _add(fix, blob_id, -1, -int(pin))
        else:
            _add(fix, blob_id, 0, int(pinned) - int(pin))
            _add(fix, old, -1, -int(pinned))
        self._settle([Change.of(blob_id, res), *self._deltas(fix)])
        return True

    def link(self, links: Sequence[tuple[bytes, str]]) -> list[bytes]:
        """Point keys at blobs this tier holds: references first, then the keys, one script a
        shard; returns the keys linked."""
        links = list({bytes(k): b for k, b in links}.items())
        pre = self.pinned([k for k, _ in links])
        want: Deltas = {}
        for (_, b), p in zip(links, pre, strict=True):
            _add(want, b, 1, int(p))
        taken = self._deltas(want)
        held = {c.blob for c in taken if c.applied}
        todo = [(k, b, int(p)) for (k, b), p in zip(links, pre, strict=True) if b in held]
        rows = self._keys("set_keys", [(k, [k.hex(), b, "1"]) for k, b, _ in todo])
        fix: Deltas = {}
        for k, b, p in todo:
            status, old, pinned = rows[k.hex()]
            if int(status) == 1:
                _add(fix, b, -1, -p)
            else:
                _add(fix, b, 0, int(pinned) - p)
                _add(fix, old, -1, -int(pinned))
        self._settle([*taken, *self._deltas(fix)])
        if self.ttl_s and held:      # a blob lives as long as its newest key (pinned: no TTL)
            self._call(lambda c: self.blobs.expire(c, sorted(held), only_if_ttl=True))
        return [k for k, _, _ in todo]

    def unmap(self, pairs: Sequence[tuple[bytes, str | None]]) -> list[bytes]:
        """Delete keys that still point to the given blob (any blob for None)."""
        rows = self._keys("delete_keys", [(bytes(k), [bytes(k).hex(), b or ""])
                                          for k, b in pairs])
        fix: Deltas = {}
        for blob, pinned in rows.values():
            _add(fix, blob, -1, -int(pinned))
        self._settle(self._deltas(fix))
        self._drop_expiries([r for r, (_, pinned) in rows.items() if int(pinned)])
        return [bytes.fromhex(r) for r in rows]

    def pin(self, keys: Sequence[bytes], expires: float, quota: int | None) -> list[bytes]:
        keys = list(dict.fromkeys(bytes(k) for k in keys))
        self.expire_pins({group_of(k).hex() for k in keys})
        blobs, pre = self.lookup(keys), self.pinned(keys)
        ids = sorted({b for b in blobs if b})
        metas = self._call(lambda c: self.blobs.meta_many(c, ids)) if ids else {}
        add: dict[str, int] = defaultdict(int)
        want: Deltas = {}
        for b, p in zip(blobs, pre, strict=True):
            if b and not p:
                if b in metas and metas[b][0] == 0 and b not in want:
                    add[metas[b][2]] += metas[b][1]
                _add(want, b, 0, 1)
        reserved = self._reserve(add, quota, len(keys))
        taken = self._deltas(want)
        counted = {c.blob for c in taken if c.applied}
        rows = self._keys("pin_keys", [(k, [k.hex()]) for k in keys], head=[f"{expires:.3f}"])
        fix: Deltas = {}
        for k, b, p in zip(keys, blobs, pre, strict=True):
            row = rows.get(k.hex())
            newly = row is not None and not int(row[1])
            mine = bool(b) and not p and b in counted
            if mine and not (newly and row[0] == b):
                _add(fix, b, 0, -1)               # counted, but not pinned by us after all
            if newly and not (mine and row[0] == b):
                _add(fix, row[0], 0, 1)
        self._settle([*taken, *self._deltas(fix)], reserved)
        self._set_expiries(list(rows), expires)
        return [bytes.fromhex(r) for r in rows]

    def unpin(self, keys: Sequence[bytes]) -> list[bytes]:
        keys = list(dict.fromkeys(bytes(k) for k in keys))
        self.expire_pins({group_of(k).hex() for k in keys})
        done = self._unpin_keys(keys, only_expired=False)
        self._drop_expiries(done)
        return [bytes.fromhex(r) for r in done]

    def expire_pins(self, groups: Iterable[str]) -> None:
        """Unpin the keys of these groups whose pin expired (the blob counts, the bytes' TTL,
        the group's pinned bytes follow)."""
        groups = sorted(groups)
        now = time.time()

        def due(c: Any) -> list:
            pipe = c.pipeline(transaction=False)
            for g in groups:
                pipe.zrangebyscore(self.names.pinexp(g), "-inf", now)
            return pipe.execute()
        found = {g: [_s(m) for m in ms] for g, ms in zip(groups, self._call(due), strict=True)
                 if ms} if groups else {}
        if not found:
            return
        self._unpin_keys([bytes.fromhex(m) for ms in found.values() for m in ms],
                         only_expired=True)
        self._run([("unexpire", [self.names.pinexp(g)], [f"{now:.3f}", *ms])
                   for g, ms in found.items()])

    def _unpin_keys(self, keys: Sequence[bytes], *, only_expired: bool) -> list[str]:
        rows = self._keys("unpin_keys", [(k, [k.hex()]) for k in keys],
                          head=["1" if only_expired else ""])
        fix: Deltas = {}
        for (blob,) in rows.values():
            _add(fix, blob, 0, -1)
        self._settle(self._deltas(fix))
        return list(rows)

    def _reserve(self, add: dict[str, int], quota: int | None, n: int) -> dict[str, int]:
        reserved: dict[str, int] = {}
        for g, size in add.items():
            res = self._run([("reserve", [self.names.pinbytes(g)],
                              [size, "" if quota is None else quota])])[0]
            if int(res[0]) == -1:
                self._call(lambda c: self._move_pinned(c, {x: -s for x, s in reserved.items()}))
                raise QuotaExceeded(f"pinning {n} keys would hold {int(res[1]):,} pinned bytes "
                                    f"in Redis for one model and rank, over the quota of "
                                    f"{quota:,}",
                                    hint="delete or unpin windows, or raise pin_quota_bytes")
            reserved[g] = size
        return reserved

    def _by_group(self, hexes: Iterable[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for r in hexes:
            out[r[:GROUP_HEX]].append(r)
        return out

    def _set_expiries(self, hexes: Sequence[str], expires: float) -> None:
        if not expires:
            self._drop_expiries(hexes)
            return

        def run(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            for g, rs in self._by_group(hexes).items():
                pipe.zadd(self.names.pinexp(g), dict.fromkeys(rs, expires))
            pipe.execute()
        if hexes:
            self._call(run)

    def _drop_expiries(self, hexes: Sequence[str]) -> None:
        def run(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            for g, rs in self._by_group(hexes).items():
                pipe.zrem(self.names.pinexp(g), *rs)
            pipe.execute()
        if hexes:
            self._call(run)
