"""Batch key operations over a store's tiers: the key half of :class:`KVStore`.

Each operation is one atomic step per tier (one SQLite transaction, one Lua script per key
group): where keys are, link (re-point keys to other keys' blobs, no copy), pin (durable tiers,
under the pin quota), unpin, delete, and what each tier's index holds. A tier that fails is
counted and logged once (an outage the tier reports itself is only counted) and the operation
goes on with the others: the result says, per tier, which keys it applied to.

A *lease* (:meth:`KeySpace.lease_many`) protects keys for a short while (between the
connector's lookup and its load): a pin with an expiry that no quota counts, taken only on
keys no pin protects (a window's pin is never shortened, removed nor turned into a lease by
one), released by :meth:`KeySpace.release` on the keys whose lease is still its own, or left
to expire. Redis, where only TTLs expire keys, renews TTLs instead (nothing to release).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from cwm_plugin.errors import NotFound, TierUnavailable
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.metrics import StoreMetrics
from cwm_plugin.store.save_queue import SaveQueue
from cwm_plugin.store.tiers.base import KeyInfo, Tier

log = logging.getLogger(__name__)
TIER_ERRORS = (TierUnavailable, OSError, sqlite3.Error)
LEASE_SLACK_S = 0.005   # a tier's stamp of a lease's expiry (Redis keeps milliseconds)


@dataclass(frozen=True)
class Lease:
    """The keys a lease pinned, per tier, and when those pins expire (unix time, between
    ``expires_from`` and ``expires_to``: each tier stamps its own reading of the clock)."""

    keys: dict[str, list[bytes]] = field(default_factory=dict)
    expires_from: float = 0.0
    expires_to: float = 0.0

    @property
    def size(self) -> int:
        return sum(len(k) for k in self.keys.values())

    def expired(self) -> bool:
        return time.time() >= self.expires_from

    def owns(self, info: KeyInfo | None) -> bool:
        """Whether ``info``'s pin is still this lease's own (not renewed, not replaced)."""
        return info is not None and info.leased and info.pin_expires is not None and \
            self.expires_from - LEASE_SLACK_S <= info.pin_expires <= \
            self.expires_to + LEASE_SLACK_S


class KeySpace:
    def __init__(self, config: StoreConfig, metrics: StoreMetrics, saves: SaveQueue) -> None:
        self.config = config
        self.metrics = metrics
        self._saves = saves
        self.tiers: list[Tier] = []
        self.durable: list[Tier] = []
        self._lock = threading.Lock()
        self._logged: set[str] = set()

    def _gauges(self) -> None:  # noqa: B027 - the store refreshes its gauges
        """Refresh usage gauges after a key operation."""

    def _lookup_in(self, tier: Tier, keys: Sequence[bytes]) -> list[str | None]:
        try:
            return tier.lookup_many(keys)
        except TIER_ERRORS as exc:
            self._tier_failed(tier, "lookup", exc, "index")
            return [None] * len(keys)

    def _served_by(self, tier: Tier, keys: list[bytes]) -> list[bool] | None:
        """Whether ``tier`` serves each key (Redis: only keys whose bytes are there, dangling
        ones are removed on the way); None when the tier fails (counted, logged once)."""
        try:
            return tier.exists_many(keys)
        except TIER_ERRORS as exc:
            self._tier_failed(tier, "lookup", exc, "index")
            return None

    def where_many(self, keys: Sequence[bytes]) -> list[str | None]:
        """The first tier (in lookup order) holding each key, None if none: where a read would
        come from (a key found is not asked of the slower tiers; :meth:`held_by` says every
        tier holding it)."""
        keys = [bytes(k) for k in keys]
        out: list[str | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, w in enumerate(out) if w is None]
            if not todo:
                break
            there = self._served_by(tier, [keys[i] for i in todo])
            for i, hit in zip(todo, there or [False] * len(todo), strict=True):
                if hit:
                    out[i] = tier.name
        return out

    def held_by(self, keys: Sequence[bytes], tiers: Sequence[Tier] | None = None
                ) -> dict[str, list[bool]]:
        """tier -> whether it serves each key, for every tier (or each of ``tiers``), so a key
        in memory *and* on disk counts for both; a tier that fails holds none."""
        keys = [bytes(k) for k in keys]
        return {tier.name: list(self._served_by(tier, keys) or [False] * len(keys))
                for tier in (self.tiers if tiers is None else tiers)}

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [w is not None for w in self.where_many(keys)]

    def _each_tier(self, op: str, tiers: Sequence[Tier], fn) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for tier in tiers:
            try:
                out[tier.name] = fn(tier)
            except TIER_ERRORS as exc:
                self._tier_failed(tier, op, exc, "index")
        self._gauges()
        return out

    def link_many(self, pairs: Sequence[tuple[bytes, bytes]]) -> dict[str, list[bytes]]:
        """Point each ``new_key`` at ``existing_key``'s blob in every tier that holds it (no
        copy; a new key that points elsewhere is re-pointed). One atomic step per tier; a tier
        without ``existing_key`` drops its own stale ``new_key`` (the tiers never disagree on
        what a key means). Returns tier -> new keys linked there."""
        pairs = [(bytes(n), bytes(e)) for n, e in pairs]
        for n, e in pairs:
            self._saves.wait_key(e)
            self._saves.wait_key(n)

        sources = {t.name: self._lookup_in(t, [e for _, e in pairs]) for t in self.tiers}
        somewhere = [any(sources[t][i] for t in sources) for i in range(len(pairs))]

        def link(tier: Tier) -> list[bytes]:
            blobs = sources[tier.name]
            stale = [n for (n, _), b, any_ in zip(pairs, blobs, somewhere, strict=True)
                     if b is None and any_]
            if stale:
                tier.delete_many(stale)
            return tier.link_many([(n, b) for (n, _), b in zip(pairs, blobs, strict=True)
                                   if b is not None])
        return self._each_tier("link", self.tiers, link)

    def link(self, new_key: bytes, existing_key: bytes) -> None:
        if not any(self.link_many([(new_key, existing_key)]).values()):
            raise NotFound(f"cannot link: key {bytes(existing_key).hex()[:16]} is not in the "
                           "store", hint="save the block first")

    def pin_tiers(self) -> list[Tier]:
        """Where pins live: the durable tiers (memory only when there is none)."""
        return self.durable or self.tiers

    def pin_many(self, keys: Sequence[bytes], *, ttl_s: float | None = None
                 ) -> dict[str, list[bytes]]:
        """Pin keys on the durable tiers (after their pending saves), each tier atomically
        under its pin quota (:class:`~cwm_plugin.store.tiers.base.QuotaExceeded`)."""
        keys = [bytes(k) for k in keys]
        for k in keys:
            self._saves.wait_key(k)
        return self._each_tier("pin", self.pin_tiers(), lambda t: t.pin_many(
            keys, ttl_s=ttl_s, quota_bytes=self.config.pin_quota_for(t.name)))

    def unpin_many(self, keys: Sequence[bytes]) -> dict[str, list[bytes]]:
        keys = [bytes(k) for k in keys]
        return self._each_tier("unpin", self.tiers, lambda t: t.unpin_many(keys))

    def delete_many(self, keys: Sequence[bytes]) -> dict[str, list[bytes]]:
        """Drop keys and their pins everywhere; blobs no key points to any more are freed."""
        keys = [bytes(k) for k in keys]
        for k in keys:
            self._saves.wait_key(k)
        return self._each_tier("delete", self.tiers, lambda t: t.delete_many(keys))

    def lease_many(self, keys: Sequence[bytes], *, ttl_s: float,
                   tiers: Sequence[Tier] | None = None) -> Lease:
        """Protect ``keys`` from eviction, expiry and gc for ``ttl_s`` seconds in ``tiers``
        (default: the durable ones), each tier atomically (:meth:`Tier.lease_many`): no quota
        counts a lease, a shorter one is renewed, a window's pin stays a pin (its expiry at
        least the lease's). A tier that fails is counted and skipped (its keys unprotected)."""
        keys = list(dict.fromkeys(bytes(k) for k in keys))
        out: dict[str, list[bytes]] = {}
        lo = time.time() + ttl_s
        for tier in self.durable if tiers is None else tiers:
            try:
                if leased := tier.lease_many(keys, ttl_s=ttl_s):
                    out[tier.name] = leased
            except TIER_ERRORS as exc:
                self._tier_failed(tier, "lease", exc, "index")
        return Lease(out, lo, time.time() + ttl_s)

    def release(self, lease: Lease) -> int:
        """Unpin the keys whose lease is still ``lease``'s own (one another lease renewed, or
        a pin taken meanwhile, is left); returns how many were unpinned."""
        n = 0
        for tier in self.tiers:
            keys = lease.keys.get(tier.name)
            if not keys or not tier.leases_released:
                continue
            try:
                mine = [k for k, i in zip(keys, tier.info_many(keys), strict=True)
                        if lease.owns(i)]
                n += len(tier.unpin_many(mine)) if mine else 0
            except TIER_ERRORS as exc:
                self._tier_failed(tier, "release", exc, "index")
        return n

    def pin(self, key: bytes) -> None:
        if not any(self.pin_many([key]).values()):
            raise NotFound(f"cannot pin: key {bytes(key).hex()[:16]} is not in the store",
                           hint="save the block first")

    def unpin(self, key: bytes) -> None:
        self.unpin_many([key])

    def delete(self, key: bytes) -> bool:
        return any(self.delete_many([key]).values())

    def pinned(self, key: bytes) -> bool:
        return any(info.pinned for info in self.key_info(key).values())

    def key_info(self, key: bytes) -> dict[str, KeyInfo]:
        """tier -> what that tier's index holds for ``key``."""
        return {t: infos[0] for t, infos in self.info_many([key]).items() if infos[0]}

    def info_many(self, keys: Sequence[bytes]) -> dict[str, list[KeyInfo | None]]:
        """tier -> what that tier's index holds for each key (None: absent there)."""
        keys = [bytes(k) for k in keys]
        out: dict[str, list[KeyInfo | None]] = {}
        for tier in self.tiers:
            try:
                out[tier.name] = tier.info_many(keys)
            except TIER_ERRORS as exc:
                self._tier_failed(tier, "info", exc, "index")
        return out

    def list_keys(self, prefix: bytes = b"", *, after: bytes | None = None, limit: int = 1000
                  ) -> dict[str, list[KeyInfo]]:
        """tier -> keys starting with ``prefix`` (byte order, paginated by ``after``)."""
        out: dict[str, list[KeyInfo]] = {}
        for tier in self.tiers:
            try:
                out[tier.name] = tier.list_keys(prefix, after=after, limit=limit)
            except TIER_ERRORS as exc:
                self._tier_failed(tier, "list", exc, "index")
        return out

    def _tier_failed(self, tier: Tier, op: str, exc: BaseException, kind: str) -> None:
        """Count a tier's failure; log it once, unless it is an outage the tier logs itself."""
        outage = isinstance(exc, TierUnavailable)
        self.metrics.errors.labels("tier_unavailable" if outage else kind).inc()
        if not outage or getattr(tier, "available", True):
            self._log_once(f"{op}-{tier.name}-{type(exc).__name__}", "store: %s on the %s tier "
                           "failed: %s", op, tier.name, exc)

    def _log_once(self, tag: str, msg: str, *args: object) -> None:
        with self._lock:
            if tag in self._logged:
                return
            if len(self._logged) > 4096:
                self._logged.clear()
            self._logged.add(tag)
        log.warning(msg, *args)

