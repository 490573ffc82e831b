"""Batch key operations over a store's tiers (:class:`KeySpace`, a part of the KV store).

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

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from cwm_plugin.errors import NotFound
from cwm_plugin.store.save_queue import SaveQueue
from cwm_plugin.store.tier_set import TierSet
from cwm_plugin.store.tiers.base import TIER_ERRORS, KeyInfo, Tier

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
    """The key operations over ``tier_set``; a key's pending save (``saves``) is waited for
    before the key is linked, pinned or deleted."""

    def __init__(self, tier_set: TierSet, saves: SaveQueue) -> None:
        self.tier_set = tier_set
        self._saves = saves

    def where_many(self, keys: Sequence[bytes]) -> list[str | None]:
        """The first tier (in lookup order) holding each key, None if none: where a read would
        come from (a key found is not asked of the slower tiers; :meth:`held_by` says every
        tier holding it)."""
        keys = [bytes(k) for k in keys]
        out: list[str | None] = [None] * len(keys)
        for tier in self.tier_set.tiers:
            todo = [i for i, w in enumerate(out) if w is None]
            if not todo:
                break
            there = self.tier_set.served_by(tier, [keys[i] for i in todo])
            for i, hit in zip(todo, there or [False] * len(todo), strict=True):
                if hit:
                    out[i] = tier.name
        return out

    def held_by(self, keys: Sequence[bytes], tiers: Sequence[Tier] | None = None
                ) -> dict[str, list[bool]]:
        """tier -> whether it serves each key, for every tier (or each of ``tiers``), so a key
        in memory *and* on disk counts for both; a tier that fails holds none."""
        keys = [bytes(k) for k in keys]
        ts = self.tier_set
        return {tier.name: list(ts.served_by(tier, keys) or [False] * len(keys))
                for tier in (ts.tiers if tiers is None else tiers)}

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [w is not None for w in self.where_many(keys)]

    def _each_tier(self, op: str, tiers: Sequence[Tier], fn) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for tier in tiers:
            try:
                out[tier.name] = fn(tier)
            except TIER_ERRORS as exc:
                self.tier_set.tier_failed(tier, op, exc, "index")
        self.tier_set.gauges()
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

        ts = self.tier_set
        sources = {t.name: ts.lookup_in(t, [e for _, e in pairs]) for t in ts.tiers}
        somewhere = [any(sources[t][i] for t in sources) for i in range(len(pairs))]

        def link(tier: Tier) -> list[bytes]:
            blobs = sources[tier.name]
            stale = [n for (n, _), b, any_ in zip(pairs, blobs, somewhere, strict=True)
                     if b is None and any_]
            if stale:
                tier.delete_many(stale)
            return tier.link_many([(n, b) for (n, _), b in zip(pairs, blobs, strict=True)
                                   if b is not None])
        return self._each_tier("link", ts.tiers, link)

    def link(self, new_key: bytes, existing_key: bytes) -> None:
        if not any(self.link_many([(new_key, existing_key)]).values()):
            raise NotFound(f"cannot link: key {bytes(existing_key).hex()[:16]} is not in the "
                           "store", hint="save the block first")

    def pin_tiers(self) -> list[Tier]:
        """Where pins live: the durable tiers (memory only when there is none)."""
        return self.tier_set.durable or self.tier_set.tiers

    def pin_quota(self) -> int | None:
        """The pinned bytes one key group may hold on every tier pins go to: the smallest of
        their pin quotas (None: none has one)."""
        quotas = [q for t in self.pin_tiers()
                  if (q := self.tier_set.config.pin_quota_for(t.name)) is not None]
        return min(quotas, default=None)

    def pin_many(self, keys: Sequence[bytes], *, ttl_s: float | None = None
                 ) -> dict[str, list[bytes]]:
        """Pin keys on the durable tiers (after their pending saves), each tier atomically
        under its pin quota (:class:`~cwm_plugin.store.tiers.base.QuotaExceeded`)."""
        keys = [bytes(k) for k in keys]
        for k in keys:
            self._saves.wait_key(k)
        return self._each_tier("pin", self.pin_tiers(), lambda t: t.pin_many(
            keys, ttl_s=ttl_s, quota_bytes=self.tier_set.config.pin_quota_for(t.name)))

    def unpin_many(self, keys: Sequence[bytes]) -> dict[str, list[bytes]]:
        keys = [bytes(k) for k in keys]
        return self._each_tier("unpin", self.tier_set.tiers, lambda t: t.unpin_many(keys))

    def delete_many(self, keys: Sequence[bytes]) -> dict[str, list[bytes]]:
        """Drop keys and their pins everywhere; blobs no key points to any more are freed."""
        keys = [bytes(k) for k in keys]
        for k in keys:
            self._saves.wait_key(k)
        return self._each_tier("delete", self.tier_set.tiers, lambda t: t.delete_many(keys))

    def lease_many(self, keys: Sequence[bytes], *, ttl_s: float,
                   tiers: Sequence[Tier] | None = None) -> Lease:
        """Protect ``keys`` from eviction, expiry and gc for ``ttl_s`` seconds in ``tiers``
        (default: the durable ones), each tier atomically (:meth:`Tier.lease_many`): no quota
        counts a lease, a shorter one is renewed, a window's pin stays a pin (its expiry at
        least the lease's). A tier that fails is counted and skipped (its keys unprotected)."""
        keys = list(dict.fromkeys(bytes(k) for k in keys))
        out: dict[str, list[bytes]] = {}
        lo = time.time() + ttl_s
        for tier in self.tier_set.durable if tiers is None else tiers:
            try:
                if leased := tier.lease_many(keys, ttl_s=ttl_s):
                    out[tier.name] = leased
            except TIER_ERRORS as exc:
                self.tier_set.tier_failed(tier, "lease", exc, "index")
        return Lease(out, lo, time.time() + ttl_s)

    def release(self, lease: Lease) -> int:
        """Unpin the keys whose lease is still ``lease``'s own (one another lease renewed, or
        a pin taken meanwhile, is left); returns how many were unpinned."""
        n = 0
        for tier in self.tier_set.tiers:
            keys = lease.keys.get(tier.name)
            if not keys or not tier.leases_released:
                continue
            try:
                mine = [k for k, i in zip(keys, tier.info_many(keys), strict=True)
                        if lease.owns(i)]
                n += len(tier.unpin_many(mine)) if mine else 0
            except TIER_ERRORS as exc:
                self.tier_set.tier_failed(tier, "release", exc, "index")
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
        for tier in self.tier_set.tiers:
            try:
                out[tier.name] = tier.info_many(keys)
            except TIER_ERRORS as exc:
                self.tier_set.tier_failed(tier, "info", exc, "index")
        return out

    def list_keys(self, prefix: bytes = b"", *, after: bytes | None = None, limit: int = 1000
                  ) -> dict[str, list[KeyInfo]]:
        """tier -> keys starting with ``prefix`` (byte order, paginated by ``after``)."""
        out: dict[str, list[KeyInfo]] = {}
        for tier in self.tier_set.tiers:
            try:
                out[tier.name] = tier.list_keys(prefix, after=after, limit=limit)
            except TIER_ERRORS as exc:
                self.tier_set.tier_failed(tier, "list", exc, "index")
        return out
