"""The store's tiers on their own, without the codec and the read and save paths: what
``cwm store gc`` and ``cwm store usage`` open. Nothing here imports torch, so a maintenance
run beside a server costs it no import: on 2 cores a gc loop that imported torch (~2 s of CPU
a run, even at idle priority) raised the server's inter-token p99 4x
(bench/serving.py's ``store_gc`` round). Usage, gauges and gc are :mod:`.maintenance`'s, which
:class:`~cwm_plugin.store.kv_store.KVStore` calls too.
"""

from __future__ import annotations

import contextlib
import logging

from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.maintenance import GCReport, collect_garbage, tier_usage
from cwm_plugin.store.metrics import StoreMetrics
from cwm_plugin.store.opening import open_tiers

log = logging.getLogger(__name__)


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

    def gc(self, min_age_s: float | None = None) -> GCReport:
        return collect_garbage(self, min_age_s)

    def close(self) -> None:
        for tier in self.tiers:
            with contextlib.suppress(Exception):
                tier.close()

    def __enter__(self) -> TierSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
