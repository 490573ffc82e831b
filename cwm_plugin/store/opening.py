"""Open the tiers a :class:`~cwm_plugin.store.config.StoreConfig` asks for, in lookup order.

A tier that cannot be opened (a missing or read-only ``disk_path``, a damaged index that
cannot even be moved aside) is logged once with what to do, counted, and left out: the KV
store is a cache, so serving goes on with the other tiers. Redis connects lazily, so a Redis
that is down at start is simply unavailable until it answers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cwm_plugin.errors import TierUnavailable
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.metrics import StoreMetrics
from cwm_plugin.store.tiers.base import Tier

log = logging.getLogger(__name__)


def open_tiers(config: StoreConfig, metrics: StoreMetrics,
               log_once: Callable[..., None]) -> list[Tier]:
    tiers: list[Tier] = []
    if config.memory_bytes > 0:
        from cwm_plugin.store.tiers.ram.tier import RamTier
        tiers.append(RamTier(config.memory_bytes))
    if config.disk_path:
        from cwm_plugin.store.tiers.disk.tier import DiskTier
        try:
            disk = DiskTier(config.disk_path, config.disk_bytes)
        except TierUnavailable as exc:
            metrics.errors.labels("tier_unavailable").inc()
            log.error("store: %s", exc)
        else:
            if disk.recovered:
                metrics.errors.labels("index_rebuilt").inc()
            tiers.append(disk)
    if config.redis_url:
        from cwm_plugin.store.tiers.redis.tier import RedisTier
        tiers.append(RedisTier(config.redis_url, prefix=config.redis_prefix,
                               ttl_s=config.redis_ttl_s,
                               max_value_bytes=config.redis_max_value_bytes,
                               timeout_s=config.redis_timeout_ms / 1000,
                               cluster=config.redis_cluster,
                               read_chunk_bytes=config.redis_read_chunk_bytes))
    return tiers
