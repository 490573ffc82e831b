"""The tiers a store config opens, and the one place their failures are counted and logged.

:class:`TierSet` is what every part of the store works over: the
:class:`~cwm_plugin.store.kv_store.KVStore` composes one with its read, write and key paths, and
``cwm store gc|usage`` opens one alone. Nothing here imports torch, so a maintenance run beside a
server costs it no import (torch's import takes CPU that serving needs: bench/serving.py's
``store_gc`` round measures it). Usage, gauges, verify and gc are :mod:`.maintenance`'s.

Each tier of the registry (:mod:`.tiers.registry`) is asked to open itself from the config
(:func:`open_tiers`). A tier that cannot be opened (a missing or read-only ``disk_path``, a
damaged index that cannot even be moved aside) is logged with what to do, counted, and left
out: the KV store is a cache, so serving goes on with the other tiers. Redis connects lazily,
so a Redis that is down at start is simply unavailable until it answers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence

from cwm_plugin.errors import TierUnavailable
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.maintenance import (
    GCReport,
    VerifyReport,
    collect_garbage,
    tier_usage,
    update_gauge,
    verify_all,
)
from cwm_plugin.store.metrics import StoreMetrics
from cwm_plugin.store.tiers import registry as tier_registry
from cwm_plugin.store.tiers.base import TIER_ERRORS, Tier

log = logging.getLogger(__name__)
LOGGED_KEPT = 4096     # distinct log-once tags remembered (then forgotten, and logged again)


def open_tiers(config: StoreConfig, metrics: StoreMetrics) -> list[Tier]:
    """The tiers ``config`` asks for, in lookup order (see the module docstring)."""
    tiers: list[Tier] = []
    for name in tier_registry.names():
        try:
            tier = tier_registry.opener(name)(config)
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


class TierSet:
    """The tiers of ``config`` in lookup order, memory -> disk -> Redis (a tier that cannot be
    opened is logged and left out), and their metrics."""

    def __init__(self, config: StoreConfig, *, registry=None) -> None:
        """``registry``: the Prometheus registry of the store's metrics (default: the
        process's)."""
        self.config = config
        self.metrics = StoreMetrics.for_registry(registry)
        self.tiers = open_tiers(config, self.metrics)
        self.memory = self._named("memory")
        self.disk = self._named("disk")
        self.redis = self._named("redis")
        self.durable = [t for t in self.tiers if t.durable]
        self._lock = threading.Lock()
        self._logged: set[str] = set()

    def _named(self, name: str):
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def primary(self) -> Tier | None:
        """The tier that decides for records every server rewrites (window manifests, context
        records): Redis when configured (shared), else disk, else memory."""
        return self.redis or self.disk or self.memory

    # --- failures -----------------------------------------------------------------------------

    def log_once(self, tag: str, msg: str, *args: object) -> None:
        """Log a warning the first time ``tag`` comes up."""
        with self._lock:
            if tag in self._logged:
                return
            if len(self._logged) > LOGGED_KEPT:
                self._logged.clear()
            self._logged.add(tag)
        log.warning(msg, *args)

    def tier_failed(self, tier: Tier, op: str, exc: BaseException, kind: str) -> None:
        """Count a tier's failure; log it once, unless it is an outage the tier logs itself."""
        outage = isinstance(exc, TierUnavailable)
        self.metrics.errors.labels("tier_unavailable" if outage else kind).inc()
        if not outage or getattr(tier, "available", True):
            self.log_once(f"{op}-{tier.name}-{type(exc).__name__}", "store: %s on the %s tier "
                          "failed: %s", op, tier.name, exc)

    def lookup_in(self, tier: Tier, keys: Sequence[bytes]) -> list[str | None]:
        """The blob each key maps to in ``tier`` (None: absent, or the tier failed)."""
        try:
            return tier.lookup_many(keys)
        except TIER_ERRORS as exc:
            self.tier_failed(tier, "lookup", exc, "index")
            return [None] * len(keys)

    def served_by(self, tier: Tier, keys: list[bytes]) -> list[bool] | None:
        """Whether ``tier`` serves each key (Redis: only keys whose bytes are there, dangling
        ones are removed on the way); None when the tier fails (counted, logged once)."""
        try:
            return tier.exists_many(keys)
        except TIER_ERRORS as exc:
            self.tier_failed(tier, "lookup", exc, "index")
            return None

    def quarantine(self, tier: Tier, blob_id: str, data: bytes | None, *, key: bytes = b"",
                   reason: str) -> None:
        """Take a damaged blob out of ``tier``; keep its bytes under the disk's quarantine/."""
        try:
            if tier is self.disk:
                self.disk.quarantine(blob_id, reason)
                return
            if self.disk is not None and data is not None:
                (self.disk.quarantine_dir / f"{blob_id}.{tier.name}.{int(time.time())}"
                 ).write_bytes(data)
        except TIER_ERRORS as exc:     # full or read-only disk: still out of use
            self.metrics.errors.labels("quarantine_failed").inc()
            self.log_once("quarantine", "store: could not keep a damaged blob under "
                          "quarantine/: %s", exc)
        with contextlib.suppress(*TIER_ERRORS):
            tier.forget_blobs([blob_id], "quarantined", keys=[key] if key else ())
        self.gauges()

    # --- maintenance --------------------------------------------------------------------------

    def gauge(self, tier: Tier) -> None:
        update_gauge(tier, self.metrics)

    def gauges(self) -> None:
        for tier in self.tiers:
            update_gauge(tier, self.metrics)

    def usage(self) -> dict[str, dict[str, int | None]]:
        """Bytes, blobs, keys and pinned bytes per tier (Redis is recounted: for the CLI)."""
        return tier_usage(self.tiers, self.metrics)

    def verify(self, progress: bool = True) -> VerifyReport:
        return verify_all(self.tiers, self.metrics, self.quarantine, progress=progress)

    def gc(self, min_age_s: float | None = None) -> GCReport:
        """Drop unreferenced blobs older than ``min_age_s`` (default: ``gc_min_age_s``),
        dangling keys and orphan files."""
        return collect_garbage(self.tiers, self.disk, self.metrics,
                               self.config.gc_min_age_s if min_age_s is None else min_age_s)

    def close(self) -> None:
        for tier in self.tiers:
            with contextlib.suppress(Exception):
                tier.close()

    def __enter__(self) -> TierSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
