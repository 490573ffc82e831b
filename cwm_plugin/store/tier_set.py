"""The store's tiers on their own, without the codec and the read and save paths: what
``cwm store gc`` and ``cwm store usage`` open. Nothing here imports torch, so a maintenance
run beside a server costs it no import: on 2 cores a gc loop that imported torch (~2 s of CPU
a run, even at idle priority) raised the server's inter-token p99 4x
(bench/serving.py's ``store_gc`` round). :class:`~cwm_plugin.store.kv_store.KVStore` reports
usage and gauges through the same functions.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.key_ops import TIER_ERRORS
from cwm_plugin.store.metrics import StoreMetrics
from cwm_plugin.store.opening import open_tiers
from cwm_plugin.store.tiers.base import Tier

log = logging.getLogger(__name__)


def tier_usage(tiers: Sequence[Tier], metrics: StoreMetrics
               ) -> dict[str, dict[str, int | None]]:
    """Bytes, blobs, budget, keys and pinned bytes per tier (Redis is recounted); the
    gauges follow."""
    out: dict[str, dict[str, int | None]] = {}
    for tier in tiers:
        u = tier.usage()
        out[u.name] = {"bytes": u.bytes, "blobs": u.blobs, "budget": u.budget,
                       "keys": u.keys, "pinned_bytes": u.pinned_bytes}
        metrics.tier_usage(u.name, u.bytes, u.blobs)
    return out


def update_gauge(tier: Tier, metrics: StoreMetrics) -> None:
    """The tier's bytes and blobs gauges (Redis: its kept totals, no recount)."""
    with contextlib.suppress(*TIER_ERRORS):
        if tier.name == "redis":
            if tier.totals is not None:
                metrics.tier_usage("redis", *tier.totals)
        else:
            u = tier.usage()
            metrics.tier_usage(u.name, u.bytes, u.blobs)


class TierSet:
    """The tiers of ``config``, opened as the store opens them (a tier that cannot open is
    logged and left out)."""

    def __init__(self, config: StoreConfig, *, registry=None) -> None:
        self.config = config
        self.metrics = StoreMetrics.for_registry(registry)
        self.tiers = open_tiers(config, self.metrics, log.warning)
        self.disk = next((t for t in self.tiers if t.name == "disk"), None)

    def usage(self) -> dict[str, dict[str, int | None]]:
        return tier_usage(self.tiers, self.metrics)

    def gc(self, min_age_s: float | None = None):
        from cwm_plugin.store.maintenance import collect_garbage
        return collect_garbage(self, min_age_s)

    def close(self) -> None:
        for tier in self.tiers:
            with contextlib.suppress(Exception):
                tier.close()

    def __enter__(self) -> TierSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
