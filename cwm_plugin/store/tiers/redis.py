"""Shared Redis tier: blobs, key -> blob mappings, refcounts and per-key pins, all in Redis.

Redis is this tier's own index, so a second server with empty local tiers that shares the Redis
finds and loads the blocks. Layout under ``<prefix>:``:

* ``k:<key hex>`` -> blob id; ``r:<blob id>`` -> number of keys pointing to the blob;
* ``b:<blob id>`` -> the blob, or for blobs over ``max_value_bytes`` a small manifest naming
  the parts ``b:<blob id>:<i>`` (written before the manifest, so a reader never sees a
  manifest without its parts);
* ``pins:<blob id>`` -> the set of pinned keys (hex) pointing to the blob: while it is not
  empty the blob, its parts, its refcount and those keys carry no TTL;
* ``stats`` -> hash of ``bytes`` and ``blobs``, kept by the same scripts that add and delete
  blobs (TTL expiries are not seen: ``usage()`` recounts and corrects it).

A save is one round trip: the parts (``SET NX``) and one script that adds the blob if it is
new (never touching an existing blob's TTL, so a pin's PERSIST survives a re-put) and maps the
key, atomically, so ``gc`` never sees a new blob without its key. Reads are one ``MGET`` for the
blobs and one for the parts of all split blobs. While Redis is unreachable every call fails
fast with :class:`TierUnavailable` (the store then serves from local tiers); reconnection is
retried with exponential backoff, and the outage is logged once, not once per request.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cwm_plugin.errors import TierUnavailable
from cwm_plugin.store.tiers.base import Tier, TierUsage
from cwm_plugin.store.tiers.redis_scripts import SCRIPTS

log = logging.getLogger(__name__)
T = TypeVar("T")
MANIFEST = b"\x00CWMPARTS"

def parse_manifest(head: bytes | None) -> tuple[int, int] | None:
    """(parts, size) if ``head`` is a split blob's manifest, else None."""
    if not head or not head.startswith(MANIFEST):
        return None
    info = json.loads(head[len(MANIFEST):])
    return int(info["n"]), int(info["size"])


class RedisTier(Tier):
    name = "redis"

    def __init__(self, url: str, *, prefix: str = "cwm", ttl_s: int | None = None,
                 max_value_bytes: int = 8 << 20, timeout_s: float = 5.0,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0) -> None:
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.max_value = max_value_bytes
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=min(timeout_s, 2.0),
            retry=Retry(NoBackoff(), 0), health_check_interval=30)
        self._safe_url = _redact(url)
        self._scripts = {name: self._client.register_script(src)
                         for name, src in SCRIPTS.items()}
        self._lock = threading.Lock()
        self._backoff0 = backoff_s
        self._max_backoff = max_backoff_s
        self._backoff = backoff_s
        self._down_until = 0.0
        self._down = False
        self.failures = 0
        self.totals: tuple[int, int] | None = None     # (bytes, blobs) from the last write

    # --- key names ----------------------------------------------------------------------------

    def _k(self, key: bytes) -> str:
        return f"{self.prefix}:k:{key.hex()}"

    def _b(self, blob_id: str) -> str:
        return f"{self.prefix}:b:{blob_id}"

    def _r(self, blob_id: str) -> str:
        return f"{self.prefix}:r:{blob_id}"

    def _pins(self, blob_id: str) -> str:
        return f"{self.prefix}:pins:{blob_id}"

    @property
    def _stats(self) -> str:
        return f"{self.prefix}:stats"

    def _parts(self, blob_id: str, n: int) -> list[str]:
        return [f"{self._b(blob_id)}:{j}" for j in range(n)]

    @property
    def _ttl(self) -> str:
        return str(self.ttl_s) if self.ttl_s else ""

    # --- availability -------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return not self._down

    def _call(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._down and time.monotonic() < self._down_until:
                raise TierUnavailable(f"redis at {self._safe_url} is unreachable",
                                      hint="serving from local tiers; retrying with backoff")
        try:
            out = fn()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._mark_down(exc)
            raise TierUnavailable(f"redis at {self._safe_url} is unreachable: {exc}",
                                  hint="serving from local tiers; retrying with backoff") from exc
        except redis.RedisError as exc:     # reachable but refused (OOM, READONLY, ...)
            raise TierUnavailable(f"redis at {self._safe_url} refused the request: {exc}",
                                  hint="check Redis' maxmemory and role") from exc
        if self._down:
            with self._lock:
                self._down, self._backoff = False, self._backoff0
            log.warning("redis tier: reconnected to %s", self._safe_url)
        return out

    def _mark_down(self, exc: BaseException) -> None:
        with self._lock:
            self.failures += 1
            first = not self._down
            if not first:
                self._backoff = min(self._backoff * 2, self._max_backoff)
            self._down = True
            self._down_until = time.monotonic() + self._backoff
        if first:
            log.warning("redis tier: %s unreachable (%s); serving from local tiers, retrying "
                        "with backoff up to %.0fs", self._safe_url, exc, self._max_backoff)

    # --- blobs --------------------------------------------------------------------------------

    def get(self, blob_id: str) -> bytes | None:
        return self.get_many([blob_id])[0]

    def get_many(self, blob_ids: Sequence[str]) -> list[bytes | None]:
        if not blob_ids:
            return []
        return self._call(lambda: self._get_many(blob_ids))

    def _get_many(self, blob_ids: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = list(self._client.mget([self._b(b) for b in blob_ids]))
        split = [(i, m) for i, v in enumerate(out) if (m := parse_manifest(v)) is not None]
        names = [p for i, (n, _) in split for p in self._parts(blob_ids[i], n)]
        parts = iter(self._client.mget(names) if names else [])
        for i, (n, size) in split:
            mine = [next(parts) for _ in range(n)]
            if any(p is None for p in mine):
                out[i] = None        # a part expired or was evicted: a miss, not a torn blob
                continue
            data = b"".join(mine)
            out[i] = data if len(data) == size else None
        return out

    def put(self, blob_id: str, data: bytes, *, key: bytes | None = None) -> bool:
        """Store a blob (kept as it is if present, its TTL renewed) and, with ``key``, map the
        key to it in the same script. One round trip."""
        self._call(lambda: self._put(blob_id, data, key))
        return True

    def _put(self, blob_id: str, data: bytes, key: bytes | None) -> None:
        pipe = self._client.pipeline(transaction=False)
        ex = self.ttl_s
        value: bytes = data
        if len(data) > self.max_value:
            n = (len(data) + self.max_value - 1) // self.max_value
            mv = memoryview(data)
            parts = self._parts(blob_id, n)
            for j, name in enumerate(parts):
                pipe.set(name, bytes(mv[j * self.max_value:(j + 1) * self.max_value]),
                         ex=ex, nx=True)
            if ex:  # parts already there keep their bytes; renew their TTL like the blob's
                self._scripts["touch"](keys=parts, args=[self._ttl], client=pipe)
            value = MANIFEST + json.dumps({"n": n, "size": len(data)}).encode()
        keys = [self._b(blob_id), self._stats]
        if key is not None:
            keys += [self._k(key), self._r(blob_id), self._pins(blob_id)]
        self._scripts["put"](keys=keys, args=[value, self._ttl, blob_id, len(data)], client=pipe)
        res = pipe.execute()[-1]
        self.totals = (int(res[2] or 0), int(res[3] or 0))

    def contains(self, blob_id: str) -> bool:
        return bool(self._call(lambda: self._client.exists(self._b(blob_id))))

    def delete(self, blob_id: str) -> bool:
        return self._call(lambda: self._delete(blob_id))

    def _delete(self, blob_id: str) -> bool:
        head = self._client.getrange(self._b(blob_id), 0, 127)
        manifest = parse_manifest(head)
        size = manifest[1] if manifest else int(self._client.strlen(self._b(blob_id)))
        keys = [self._b(blob_id), self._r(blob_id), self._pins(blob_id),
                f"{self.prefix}:pin:{blob_id}", self._stats]
        keys += self._parts(blob_id, manifest[0]) if manifest else []
        existed, total, blobs = self._scripts["delete"](keys=keys, args=[size])
        self.totals = (int(total or 0), int(blobs or 0))
        return bool(existed)

    # --- keys (Redis is this tier's index) ----------------------------------------------------

    def lookup_many(self, keys: Sequence[bytes]) -> list[str | None]:
        if not keys:
            return []
        vals = self._call(lambda: self._client.mget([self._k(k) for k in keys]))
        return [v.decode() if v is not None else None for v in vals]

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [b is not None for b in self.lookup_many(keys)]

    def map_key(self, key: bytes, blob_id: str, *, replace: bool = False
                ) -> tuple[int, str | None, int]:
        """Point ``key`` at ``blob_id`` (counting the reference). A key that points elsewhere
        keeps its blob unless ``replace`` (then its old blob loses a reference, and a pin on
        the key moves with it). Returns (status, previous blob if replaced, refs left to it):
        status 1 mapped, 0 kept elsewhere, -1 the blob is gone."""
        def run() -> list:
            return self._scripts["map"](
                keys=[self._k(key), self._b(blob_id), self._r(blob_id), self._pins(blob_id)],
                args=[blob_id, self._ttl, f"{self.prefix}:", key.hex(), "1" if replace else ""])
        status, old, left, moved = self._call(run)
        old_id = old.decode() if old else None
        if moved and old_id:                # the pin followed the key: fix both blobs' TTLs
            self.pin(blob_id, key, True)
            self._call(lambda: self._expire_if_unpinned(old_id))
        return int(status), old_id, int(left)

    def unmap_key(self, key: bytes) -> tuple[str | None, int]:
        res = self._call(lambda: self._scripts["unmap"](keys=[self._k(key)],
                                                        args=[f"{self.prefix}:", key.hex()]))
        if not res:
            return None, 0
        blob_id, left, unpinned = res[0].decode(), int(res[1]), int(res[2])
        if unpinned and left > 0:
            self._call(lambda: self._expire_if_unpinned(blob_id))
        return blob_id, left

    def refcount(self, blob_id: str) -> int:
        v = self._call(lambda: self._client.get(self._r(blob_id)))
        return int(v or 0)

    # --- pins (per key) -----------------------------------------------------------------------

    def pin(self, blob_id: str, key: bytes, pinned: bool = True) -> None:
        """Pin or unpin ``key`` (which points to ``blob_id``). The blob keeps no TTL while any
        of its keys is pinned."""
        def run() -> None:
            manifest = parse_manifest(self._client.getrange(self._b(blob_id), 0, 127))
            keys = [self._pins(blob_id), self._k(key), self._b(blob_id), self._r(blob_id)]
            keys += self._parts(blob_id, manifest[0]) if manifest else []
            self._scripts["pin"](keys=keys, args=[key.hex(), "1" if pinned else "", self._ttl])
            if not pinned:
                self._client.delete(f"{self.prefix}:pin:{blob_id}")     # format 1 marker
        self._call(run)

    def _expire_if_unpinned(self, blob_id: str) -> None:
        if not self.ttl_s or self._client.scard(self._pins(blob_id)):
            return
        manifest = parse_manifest(self._client.getrange(self._b(blob_id), 0, 127))
        names = [self._b(blob_id), self._r(blob_id)]
        names += self._parts(blob_id, manifest[0]) if manifest else []
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.expire(name, self.ttl_s)
        pipe.execute()

    def is_pinned(self, key: bytes, blob_id: str) -> bool:
        return bool(self._call(lambda: self._client.sismember(self._pins(blob_id), key.hex())))

    # --- maintenance --------------------------------------------------------------------------

    def blob_ids(self) -> Iterator[str]:
        """Every blob id under the prefix (SCAN; for maintenance, not the request path)."""
        plen = len(self._b(""))
        for name in self._call(lambda: list(self._client.scan_iter(f"{self.prefix}:b:*",
                                                                      count=1000))):
            rest = name.decode()[plen:]
            if ":" not in rest:
                yield rest

    def unreferenced(self) -> list[str]:
        ids = list(self.blob_ids())
        if not ids:
            return []

        def run() -> list[str]:
            pipe = self._client.pipeline(transaction=False)
            for b in ids:
                pipe.get(self._r(b))
                pipe.exists(self._pins(b), f"{self.prefix}:pin:{b}")
            res = pipe.execute()
            return [b for i, b in enumerate(ids) if int(res[2 * i] or 0) <= 0
                    and not res[2 * i + 1]]
        return self._call(run)

    def stats(self) -> tuple[int, int]:
        """(bytes, blobs) as kept by the write and delete scripts (one round trip)."""
        vals = self._call(lambda: self._client.hmget(self._stats, ["bytes", "blobs"]))
        self.totals = (int(vals[0] or 0), int(vals[1] or 0))
        return self.totals

    def usage(self) -> TierUsage:
        """Recount every blob (SCAN) and correct the kept totals (TTL expiries)."""
        try:
            ids = list(self.blob_ids())

            def run() -> int:
                pipe = self._client.pipeline(transaction=False)
                for b in ids:
                    pipe.strlen(self._b(b))
                    pipe.getrange(self._b(b), 0, 127)
                res = pipe.execute()
                total = 0
                for length, head in zip(res[0::2], res[1::2], strict=True):
                    manifest = parse_manifest(head)
                    total += manifest[1] if manifest else int(length or 0)
                self._client.hset(self._stats, mapping={"bytes": total, "blobs": len(ids)})
                return total
            size = self._call(run)
        except TierUnavailable:
            return TierUsage(self.name, 0, 0, None)
        self.totals = (size, len(ids))
        return TierUsage(self.name, size, len(ids), None)

    def close(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self._client.close()


def _redact(url: str) -> str:
    """The URL without a password, for log lines."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
