"""The bytes of the Redis tier's blobs: one value a blob, or parts under a small manifest.

``{b:<blob id>}`` under the tier's prefix holds the blob, or for blobs over ``max_value``
bytes a manifest (``MANIFEST`` + JSON ``{"n", "size"}``) naming the parts
``{b:<blob id>}:<i>`` (written with it in one transaction); ``{b:<blob id>}:m`` holds its
reference and pin counts (all in the blob's slot; the counts are :mod:`.key_index`'s). With
a TTL the bytes and the counts expire together unless a pinned key persists them. Approximate totals
(``bytes``, ``blobs``) are kept in ``STATS_SHARDS`` hashes (no single hot key) that
:meth:`RedisBlobs.recount` corrects.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from cwm_plugin.store.tiers.redis.layout import STATS_SHARDS, Names

MANIFEST = b"\x00CWMPARTS"


def parse_manifest(head: bytes | None) -> tuple[int, int] | None:
    """(parts, size) if ``head`` is a split blob's manifest, else None."""
    if not head or not head.startswith(MANIFEST):
        return None
    info = json.loads(head[len(MANIFEST):])
    return int(info["n"]), int(info["size"])


def as_str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedisBlobs:
    """Blob bytes through ``call(fn(client))`` (the tier's bounded, fail-fast connection)."""

    def __init__(self, call: Callable[[Callable[[Any], Any]], Any], prefix: str,
                 ttl_s: int | None, max_value: int, read_chunk: int) -> None:
        self._call = call
        self.prefix = prefix
        self.layout = Names(prefix)
        self.ttl_s = ttl_s
        self.max_value = max_value
        self.read_chunk = read_chunk          # blobs a round trip of get_many

    def name(self, blob_id: str) -> str:
        return f"{self.prefix}:{{b:{blob_id}}}"

    def meta(self, blob_id: str) -> str:
        return f"{self.name(blob_id)}:m"

    def parts(self, blob_id: str, n: int) -> list[str]:
        return [f"{self.name(blob_id)}:{j}" for j in range(n)]

    def write(self, c: Any, blob_id: str, data: bytes) -> bool:
        """Write the bytes unless present, parts before the manifest in one transaction (the
        blob's slot); True if this call created them."""
        ex = self.ttl_s or None
        pipe = c.pipeline(transaction=True)
        value: bytes = data
        if len(data) > self.max_value:
            n = (len(data) + self.max_value - 1) // self.max_value
            mv = memoryview(data)
            for j, part in enumerate(self.parts(blob_id, n)):
                pipe.set(part, bytes(mv[j * self.max_value:(j + 1) * self.max_value]),
                         ex=ex, nx=True)
            value = MANIFEST + json.dumps({"n": n, "size": len(data)}).encode()
        pipe.set(self.name(blob_id), value, ex=ex, nx=True)
        return bool(pipe.execute()[-1])

    def count(self, c: Any, sizes: dict[str, int], sign: int) -> None:
        """Add (``sign`` 1) or take (-1) blobs of these sizes from the totals."""
        if not sizes:
            return
        pipe = c.pipeline(transaction=False)
        for b, size in sizes.items():
            name = self.layout.stats_of(b)
            pipe.hincrby(name, "bytes", sign * size)
            pipe.hincrby(name, "blobs", sign)
        pipe.execute()

    def get_many(self, blob_ids: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for i in range(0, len(blob_ids), self.read_chunk):
            out += self._call(lambda c, part=blob_ids[i:i + self.read_chunk]:
                              self.get_chunk(c, part))
        return out

    def get_chunk(self, c: Any, blob_ids: Sequence[str]) -> list[bytes | None]:
        pipe = c.pipeline(transaction=False)
        for b in blob_ids:
            pipe.get(self.name(b))
        out: list[bytes | None] = list(pipe.execute())
        split = [(i, m) for i, v in enumerate(out) if (m := parse_manifest(v)) is not None]
        if split:
            pipe = c.pipeline(transaction=False)
            for i, (n, _) in split:
                for name in self.parts(blob_ids[i], n):
                    pipe.get(name)
            parts = iter(pipe.execute())
            for i, (n, size) in split:
                mine = [next(parts) for _ in range(n)]
                data = None if any(p is None for p in mine) else b"".join(mine)
                out[i] = data if data is not None and len(data) == size else None
        return out

    def has(self, blob_id: str) -> bool:
        return bool(self._call(lambda c: c.exists(self.name(blob_id))))

    def names(self, c: Any, blob_ids: Sequence[str]) -> list[str]:
        """Every Redis name holding these blobs (values, parts and counts)."""
        return [n for names in self._names_sizes(c, blob_ids).values() for n in names[0]]

    def _names_sizes(self, c: Any, blob_ids: Sequence[str]) -> dict[str, tuple[list[str], int]]:
        """Per blob: its names (the value first) and its size."""
        pipe = c.pipeline(transaction=False)
        for b in blob_ids:
            pipe.getrange(self.name(b), 0, 127)
            pipe.strlen(self.name(b))
        res = pipe.execute() if blob_ids else []
        out: dict[str, tuple[list[str], int]] = {}
        for b, head, length in zip(blob_ids, res[0::2], res[1::2], strict=True):
            m = parse_manifest(head)
            out[b] = ([self.name(b), self.meta(b), *(self.parts(b, m[0]) if m else [])],
                      m[1] if m else int(length or 0))
        return out

    def parts_of(self, heads: dict[str, bytes]) -> dict[str, list[str]]:
        """The part names of the split blobs among these (``heads``: each value's first
        bytes)."""
        return {b: self.parts(b, m[0]) for b, head in heads.items()
                if (m := parse_manifest(head))}

    def meta_many(self, c: Any, blob_ids: Sequence[str]) -> dict[str, tuple[int, int, str]]:
        """(pins, size, group hex) of each blob whose counts are there."""
        pipe = c.pipeline(transaction=False)
        for b in blob_ids:
            pipe.hmget(self.meta(b), ["pins", "size", "grp"])
        return {b: (int(p), int(s or 0), as_str(g or b"")) for b, (p, s, g)
                in zip(blob_ids, pipe.execute(), strict=True) if p is not None}

    def expire(self, c: Any, blob_ids: Sequence[str], *, only_if_ttl: bool = False,
               persist: bool = False) -> None:
        """Renew the TTL of these blobs (``only_if_ttl``: those that have one), or PERSIST."""
        if not blob_ids or (not self.ttl_s and not persist):
            return
        names = self.names(c, blob_ids)
        if only_if_ttl:
            pipe = c.pipeline(transaction=False)
            for n in names:
                pipe.ttl(n)
            names = [n for n, t in zip(names, pipe.execute(), strict=True) if t >= 0]
        pipe = c.pipeline(transaction=False)
        for n in names:
            if persist:
                pipe.persist(n)
            else:
                pipe.expire(n, self.ttl_s)
        pipe.execute()

    def delete(self, blob_ids: Sequence[str]) -> None:
        if not blob_ids:
            return

        def run(c: Any) -> None:
            found = self._names_sizes(c, list(dict.fromkeys(blob_ids)))
            pipe = c.pipeline(transaction=False)
            for names, _ in found.values():
                for n in names:
                    pipe.delete(n)
            res = iter(pipe.execute())
            gone = {}
            for b, (names, size) in found.items():
                dels = [next(res) for _ in names]
                if dels[0]:                   # the value was there: one blob fewer
                    gone[b] = size
            self.count(c, gone, -1)
        self._call(run)

    def present(self, blob_ids: Sequence[str]) -> dict[str, bool]:
        """Whether each blob's bytes are there."""
        if not blob_ids:
            return {}

        def run(c: Any) -> list[int]:
            pipe = c.pipeline(transaction=False)
            for b in blob_ids:
                pipe.exists(self.name(b))
            return pipe.execute()
        return {b: bool(x) for b, x in zip(blob_ids, self._call(run), strict=True)}

    def ids(self) -> list[str]:
        names = self._call(lambda c: [as_str(n) for n in c.scan_iter(
            match=f"{self.prefix}:{{b:*}}", count=1000)])
        return [n[n.index("{b:") + 3:-1] for n in names if n.endswith("}")]

    def idle(self, blob_ids: Sequence[str], min_age_s: float) -> list[str]:
        """Those of ``blob_ids`` untouched for at least ``min_age_s`` seconds."""
        if not blob_ids:
            return []
        return self._call(lambda c: [b for b in blob_ids if (
            c.object("idletime", self.name(b)) or 0) >= min_age_s])

    def recount(self, blob_ids: Sequence[str]) -> int:
        """The bytes of these blobs (split ones by their manifest); resets the totals."""
        def run(c: Any) -> int:
            pipe = c.pipeline(transaction=False)
            for b in blob_ids:
                pipe.strlen(self.name(b))
                pipe.getrange(self.name(b), 0, 127)
            res = pipe.execute() if blob_ids else []
            total = 0
            for length, head in zip(res[0::2], res[1::2], strict=True):
                manifest = parse_manifest(head)
                total += manifest[1] if manifest else int(length or 0)
            pipe = c.pipeline(transaction=False)
            for i in range(STATS_SHARDS):
                pipe.hset(self.layout.stats(i), mapping={
                    "bytes": total if i == 0 else 0, "blobs": len(blob_ids) if i == 0 else 0})
            pipe.execute()
            return total
        return self._call(run)

    def totals(self) -> tuple[int, int]:
        def run(c: Any) -> list:
            pipe = c.pipeline(transaction=False)
            for i in range(STATS_SHARDS):
                pipe.hmget(self.layout.stats(i), ["bytes", "blobs"])
            return pipe.execute()
        rows = self._call(run)
        return sum(int(r[0] or 0) for r in rows), sum(int(r[1] or 0) for r in rows)
