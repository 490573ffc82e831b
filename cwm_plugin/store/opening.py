"""Open the tiers a :class:`~cwm_plugin.store.config.StoreConfig` asks for, in lookup order.

Each tier of the registry (:mod:`.tiers.registry`) is asked to open itself from the config. A
tier that cannot be opened (a missing or read-only ``disk_path``, a damaged index that cannot
even be moved aside) is logged once with what to do, counted, and left out: the KV store is a
cache, so serving goes on with the other tiers. Redis connects lazily, so a Redis that is down
at start is simply unavailable until it answers.
"""

from __future__ import annotations

import logging

from cwm_plugin.errors import TierUnavailable
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.metrics import StoreMetrics
from cwm_plugin.store.tiers import registry
from cwm_plugin.store.tiers.base import Tier

log = logging.getLogger(__name__)


def open_tiers(config: StoreConfig, metrics: StoreMetrics) -> list[Tier]:
    tiers: list[Tier] = []
    for name in registry.names():
        try:
            tier = registry.opener(name)(config)
        except TierUnavailable as exc:
            metrics.errors.labels("tier_unavailable").inc()
            log.error("store: %s", exc)
            continue
        if tier is None:
            continue
        if tier.recovered:
            metrics.errors.labels("index_rebuilt").inc()
        tiers.append(tier)
    return tiers
