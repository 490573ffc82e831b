"""Which durable tier holds which keys, and copying blobs to the durable tiers that lack them.

A window must be complete on every durable tier it is pinned in: with Redis in ``behind``
mode the disk holds a block as soon as vLLM's save resolves while Redis gets it later (or not
at all, when the write-behind queue was full), so a server sharing only the Redis would thaw a
prefix. :func:`presence` says per durable tier which keys it serves (every tier holding a key
counts, a faster one holding it too or not); :func:`replicate` copies
the blob of each key a durable tier lacks from a tier that has it (the same bytes: sealed blobs
stay sealed; content-addressed, so a write-behind arriving later finds it there). A tier that
fails holds none of the keys in the answer, counted and logged once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cwm_plugin.store.tiers.base import TIER_ERRORS


def _blobs(store: Any, tier: Any, keys: Sequence[bytes]) -> list[str | None]:
    try:
        ids = tier.lookup_many(keys)
        there = tier.exists_many(keys)  # a key whose bytes are gone is not served
    except TIER_ERRORS as exc:
        store.tier_set.tier_failed(tier, "lookup", exc, "index")
        return [None] * len(keys)
    return [b if ok else None for b, ok in zip(ids, there, strict=True)]


def presence(store: Any, keys: Sequence[bytes]) -> dict[str, list[bool]]:
    """Durable tier name -> whether it serves each key (every tier when none is durable)."""
    return store.held_by(keys, store.durable or store.tiers)


def replicate(store: Any, keys: Sequence[bytes]) -> dict[str, int]:
    """Copy to each durable tier the blobs of ``keys`` it lacks, from a tier that holds them
    (mapping the key to the copy); returns how many of ``keys`` each durable tier serves now."""
    keys = [bytes(k) for k in keys]
    store.wait_keys(keys)
    tiers = store.durable or store.tiers
    held = {t.name: _blobs(store, t, keys) for t in store.tiers}
    out: dict[str, int] = {}
    # a durable source first: the memory tier's copy may be the uncompressed twin
    sources = sorted(store.tiers, key=lambda t: not t.durable)
    for tier in tiers:
        mine = held[tier.name]
        for i, blob_id in enumerate(mine):
            if blob_id is not None:
                continue
            source = next((s for s in sources if s is not tier and held[s.name][i]), None)
            if source is None:
                continue
            sid = held[source.name][i]
            try:
                data = source.get(sid)
                if data is not None and tier.put(sid, data, keys[i]):
                    mine[i] = sid
                    store.metrics.replicated.labels(tier.name).inc()
            except TIER_ERRORS as exc:
                store.tier_set.tier_failed(tier, "replicate", exc, "write_failed")
                break
        out[tier.name] = sum(b is not None for b in _blobs(store, tier, keys))
    return out
