"""Shared Redis tier: blobs, key -> blob mappings and refcounts, all in Redis.

Redis is this tier's own index, so a second server with empty local tiers that shares the Redis
finds and loads the blocks. Layout under ``<prefix>:``:

* ``k:<key hex>`` -> blob id; ``r:<blob id>`` -> number of keys pointing to the blob;
* ``b:<blob id>`` -> the blob, or for blobs over ``max_value_bytes`` a small manifest naming
  the parts ``b:<blob id>:<i>`` (written before the manifest, so a reader never sees a
  manifest without its parts); ``pin:<blob id>`` -> pinned marker.

Reads and writes are pipelined. While Redis is unreachable every call fails fast with
:class:`TierUnavailable` (the store then serves from local tiers); reconnection is retried with
exponential backoff, and the outage is logged once, not once per request.
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

log = logging.getLogger(__name__)
T = TypeVar("T")
MANIFEST = b"\x00CWMPARTS"

_MAP = """
local ok
if ARGV[2] ~= '' then ok = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
else ok = redis.call('SET', KEYS[1], ARGV[1], 'NX') end
if ok then
  local n = redis.call('INCR', KEYS[2])
  if ARGV[2] ~= '' then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
  return n
end
return 0
"""
_UNMAP = """
local b = redis.call('GET', KEYS[1])
if not b then return false end
redis.call('DEL', KEYS[1])
local n = redis.call('DECR', ARGV[1] .. b)
return {b, n}
"""


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
        self._map = self._client.register_script(_MAP)
        self._unmap = self._client.register_script(_UNMAP)
        self._lock = threading.Lock()
        self._backoff0 = backoff_s
        self._max_backoff = max_backoff_s
        self._backoff = backoff_s
        self._down_until = 0.0
        self._down = False
        self.failures = 0

    # --- key names ----------------------------------------------------------------------------

    def _k(self, key: bytes) -> str:
        return f"{self.prefix}:k:{key.hex()}"

    def _b(self, blob_id: str) -> str:
        return f"{self.prefix}:b:{blob_id}"

    def _r(self, blob_id: str) -> str:
        return f"{self.prefix}:r:{blob_id}"

    def _pin(self, blob_id: str) -> str:
        return f"{self.prefix}:pin:{blob_id}"

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
        values = self._client.mget([self._b(b) for b in blob_ids])
        out: list[bytes | None] = list(values)
        split = [i for i, v in enumerate(values) if v is not None and v.startswith(MANIFEST)]
        for i in split:
            info = json.loads(values[i][len(MANIFEST):])
            parts = self._client.mget([f"{self._b(blob_ids[i])}:{j}" for j in range(info["n"])])
            if any(p is None for p in parts):
                out[i] = None        # a part expired or was evicted: a miss, not a torn blob
                continue
            data = b"".join(parts)
            out[i] = data if len(data) == info["size"] else None
        return out

    def put(self, blob_id: str, data: bytes) -> bool:
        self._call(lambda: self._put(blob_id, data))
        return True

    def _put(self, blob_id: str, data: bytes) -> None:
        pipe = self._client.pipeline(transaction=False)
        ex = self.ttl_s
        if len(data) <= self.max_value:
            pipe.set(self._b(blob_id), data, ex=ex)
        else:
            n = (len(data) + self.max_value - 1) // self.max_value
            mv = memoryview(data)
            for j in range(n):
                pipe.set(f"{self._b(blob_id)}:{j}",
                         bytes(mv[j * self.max_value:(j + 1) * self.max_value]), ex=ex)
            manifest = MANIFEST + json.dumps({"n": n, "size": len(data)}).encode()
            pipe.set(self._b(blob_id), manifest, ex=ex)
        pipe.execute()

    def contains(self, blob_id: str) -> bool:
        return bool(self._call(lambda: self._client.exists(self._b(blob_id))))

    def delete(self, blob_id: str) -> bool:
        return self._call(lambda: self._delete(blob_id))

    def _delete(self, blob_id: str) -> bool:
        head = self._client.get(self._b(blob_id))
        names = [self._b(blob_id), self._r(blob_id), self._pin(blob_id)]
        if head is not None and head.startswith(MANIFEST):
            n = json.loads(head[len(MANIFEST):])["n"]
            names += [f"{self._b(blob_id)}:{j}" for j in range(n)]
        return bool(self._client.delete(*names)) and head is not None

    # --- keys (Redis is this tier's index) ----------------------------------------------------

    def lookup_many(self, keys: Sequence[bytes]) -> list[str | None]:
        if not keys:
            return []
        vals = self._call(lambda: self._client.mget([self._k(k) for k in keys]))
        return [v.decode() if v is not None else None for v in vals]

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def run() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._k(k))
            return [bool(x) for x in pipe.execute()]
        return self._call(run)

    def map_key(self, key: bytes, blob_id: str) -> bool:
        """Point ``key`` at ``blob_id`` unless it already points somewhere; counts the ref."""
        ttl = str(self.ttl_s) if self.ttl_s else ""
        return bool(self._call(lambda: self._map(keys=[self._k(key), self._r(blob_id)],
                                                 args=[blob_id, ttl])))

    def unmap_key(self, key: bytes) -> tuple[str | None, int]:
        res = self._call(lambda: self._unmap(keys=[self._k(key)], args=[f"{self.prefix}:r:"]))
        if not res:
            return None, 0
        return res[0].decode(), int(res[1])

    def refcount(self, blob_id: str) -> int:
        v = self._call(lambda: self._client.get(self._r(blob_id)))
        return int(v or 0)

    def pin(self, blob_id: str, key: bytes | None, pinned: bool = True) -> None:
        def run() -> None:
            names = [self._b(blob_id)] + ([self._k(key)] if key is not None else [])
            head = self._client.getrange(self._b(blob_id), 0, 127)
            if head and head.startswith(MANIFEST):      # the parts of a split blob too
                n = json.loads(head[len(MANIFEST):])["n"]
                names += [f"{self._b(blob_id)}:{j}" for j in range(n)]
            pipe = self._client.pipeline(transaction=False)
            if pinned:
                pipe.set(self._pin(blob_id), b"1")
                for name in names:
                    pipe.persist(name)
            else:
                pipe.delete(self._pin(blob_id))
                if self.ttl_s:
                    for name in names:
                        pipe.expire(name, self.ttl_s)
            pipe.execute()
        self._call(run)

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
                pipe.exists(self._pin(b))
            res = pipe.execute()
            return [b for i, b in enumerate(ids) if int(res[2 * i] or 0) <= 0
                    and not res[2 * i + 1]]
        return self._call(run)

    def usage(self) -> TierUsage:
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
                    if head and head.startswith(MANIFEST):
                        total += int(json.loads(head[len(MANIFEST):])["size"])
                    else:
                        total += int(length or 0)
                return total
            size = self._call(run) if ids else 0
        except TierUnavailable:
            return TierUsage(self.name, 0, 0, None)
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
