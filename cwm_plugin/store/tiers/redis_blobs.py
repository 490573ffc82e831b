"""The bytes of the Redis tier's blobs: one value a blob, or parts under a small manifest.

``{b:<blob id>}`` under the tier's prefix holds the blob, or for blobs over ``max_value``
bytes a manifest (``MANIFEST`` + JSON ``{"n", "size"}``) naming the parts
``{b:<blob id>}:<i>`` (the same cluster slot, written before the manifest). With a TTL the
bytes expire unless the key index (:mod:`.redis`) persists them for a pinned key. ``stats``
keeps approximate totals (``bytes``, ``blobs``) that :meth:`RedisBlobs.recount` corrects.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

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
        self.ttl_s = ttl_s
        self.max_value = max_value
        self.read_chunk = read_chunk          # blobs a round trip of get_many

    def name(self, blob_id: str) -> str:
        return f"{self.prefix}:{{b:{blob_id}}}"

    def parts(self, blob_id: str, n: int) -> list[str]:
        return [f"{self.name(blob_id)}:{j}" for j in range(n)]

    @property
    def stats_key(self) -> str:
        return f"{self.prefix}:stats"

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

    def write(self, c: Any, blob_id: str, data: bytes) -> bool:
        """Write the bytes unless present (then renew a TTL); True if this call created them."""
        ex = self.ttl_s or None
        pipe = c.pipeline(transaction=False)
        value: bytes = data
        if len(data) > self.max_value:
            n = (len(data) + self.max_value - 1) // self.max_value
            mv = memoryview(data)
            for j, part in enumerate(self.parts(blob_id, n)):
                pipe.set(part, bytes(mv[j * self.max_value:(j + 1) * self.max_value]),
                         ex=ex, nx=True)
            value = MANIFEST + json.dumps({"n": n, "size": len(data)}).encode()
        pipe.set(self.name(blob_id), value, ex=ex, nx=True)
        created = bool(pipe.execute()[-1])
        if created:
            c.hincrby(self.stats_key, "bytes", len(data))
            c.hincrby(self.stats_key, "blobs", 1)
        elif ex:
            self.expire(c, [blob_id], only_if_ttl=True)
        return created

    def names(self, c: Any, blob_ids: Sequence[str]) -> list[str]:
        """Every Redis name holding these blobs (values and parts)."""
        pipe = c.pipeline(transaction=False)
        for b in blob_ids:
            pipe.getrange(self.name(b), 0, 127)
        names: list[str] = []
        for b, head in zip(blob_ids, pipe.execute(), strict=True):
            m = parse_manifest(head)
            names += [self.name(b), *(self.parts(b, m[0]) if m else [])]
        return names

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
            names = self.names(c, blob_ids)
            pipe = c.pipeline(transaction=False)
            for b in blob_ids:
                pipe.strlen(self.name(b))
            sizes = pipe.execute()
            pipe = c.pipeline(transaction=False)
            for n in names:
                pipe.delete(n)
            gone = sum(pipe.execute()[:len(names)])
            if gone:
                c.hincrby(self.stats_key, "blobs", -len(blob_ids))
                c.hincrby(self.stats_key, "bytes", -sum(int(s or 0) for s in sizes))
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
            c.hset(self.stats_key, mapping={"bytes": total, "blobs": len(blob_ids)})
            return total
        return self._call(run)

    def totals(self) -> tuple[int, int]:
        vals = self._call(lambda c: c.hmget(self.stats_key, ["bytes", "blobs"]))
        return int(vals[0] or 0), int(vals[1] or 0)
