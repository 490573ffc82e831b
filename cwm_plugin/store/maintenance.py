"""Store maintenance over the tier interface: verify every blob, collect what nothing uses,
count usage.

``verify`` decodes every blob of every tier with its checksums and quarantines damaged ones
(sealed blobs, which only their request's salt opens, are checked as far as their header).
``gc`` removes, per tier, blobs no key points to (on disk only those older than ``min_age_s``:
a writer in another process may be between writing a file and mapping its key; Redis blobs
idle for less than that), keys whose blob is gone (dangling), the disk's orphan and stale
temp files, and Redis names of an earlier layout (whose blobs then go as unreferenced).
``tier_usage`` counts each tier and ``update_gauge`` sets its gauges.

Each function takes the opened tiers and the metrics it needs
(:class:`~cwm_plugin.store.tier_set.TierSet` passes its own).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cwm_plugin.errors import CorruptBlob, IncompatibleBlob, TierUnavailable
from cwm_plugin.store.blob import container, crypto
from cwm_plugin.store.metrics import StoreMetrics
from cwm_plugin.store.tiers.base import TIER_ERRORS, Tier

log = logging.getLogger(__name__)
# takes a damaged blob out of use: ``quarantine(tier, blob_id, data, reason=...)``
Quarantine = Callable[..., None]


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


@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    corrupt: list[str] = field(default_factory=list)        # "tier:blob_id"
    incompatible: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)        # indexed but unreadable
    sealed: int = 0                                          # header checked, payload not
    bytes_checked: int = 0

    @property
    def clean(self) -> bool:
        return not (self.corrupt or self.missing)


@dataclass
class GCReport:
    removed_blobs: dict[str, int] = field(default_factory=dict)   # tier -> count
    orphan_files: int = 0
    dangling_keys: int = 0
    expired_entries: int = 0  # Redis index entries of keys and blobs a TTL expired
    old_format_entries: int = 0  # Redis names of an earlier layout (nothing reads them)
    freed_bytes: int = 0


def verify_all(tiers: Sequence[Tier], metrics: StoreMetrics, quarantine: Quarantine, *,
               progress: bool = True) -> VerifyReport:
    """Decode every blob of ``tiers`` with checksum verification; ``quarantine`` bad ones."""
    from tqdm import tqdm

    from cwm_plugin.store.blob.codec import decode  # (torch: gc and usage go without it)

    report = VerifyReport()
    lists = []
    for tier in tiers:
        try:
            lists.append((tier, tier.blob_ids()))
        except TierUnavailable as exc:
            log.warning("verify: skipping the %s tier: %s", tier.name, exc)
    with tqdm(total=sum(len(ids) for _, ids in lists), desc="verify", unit="blob",
              disable=not progress) as bar:
        for tier, ids in lists:
            for blob_id in ids:
                bar.update(1)
                report.checked += 1
                try:
                    data = tier.get(blob_id)
                except TierUnavailable:
                    data = None
                if data is None:
                    report.missing.append(f"{tier.name}:{blob_id}")
                    continue
                report.bytes_checked += len(data)
                try:
                    if crypto.is_sealed(container.peek(data)):
                        report.sealed += 1
                        report.ok += 1
                        continue
                    decode(data, verify=True)
                except CorruptBlob as exc:
                    report.corrupt.append(f"{tier.name}:{blob_id}")
                    metrics.errors.labels("corrupt").inc()
                    quarantine(tier, blob_id, data, reason=str(exc))
                    continue
                except IncompatibleBlob:
                    report.incompatible.append(f"{tier.name}:{blob_id}")
                    continue
                report.ok += 1
    return report


def collect_garbage(tiers: Sequence[Tier], disk: Any, metrics: StoreMetrics,
                    min_age_s: float) -> GCReport:
    """Drop unreferenced blobs, dangling keys, orphan and stale temp files (see the module
    docstring); ``disk``: the disk tier (its orphan files), or None."""
    report = GCReport()
    for tier in tiers:
        try:
            dangling = tier.dangling_keys()
            if dangling:
                tier.delete_many(dangling)
            report.dangling_keys += len(dangling)
            sweep = getattr(tier, "sweep_expired", None)  # (Redis with a TTL)
            if sweep is not None:
                report.expired_entries += sweep()
            old = getattr(tier, "drop_old_format", None)  # (Redis: before its blobs go)
            if old is not None:
                report.old_format_entries += old()
            dead = tier.unreferenced(min_age_s if tier.durable else 0.0)
            before = tier.usage().bytes if dead else 0
            tier.forget_blobs(dead, "gc")
            report.removed_blobs[tier.name] = len(dead)
            if dead:
                report.freed_bytes += max(0, before - tier.usage().bytes)
        except TierUnavailable as exc:
            log.warning("gc: skipping the %s tier: %s", tier.name, exc)
    if disk is not None:
        for path in disk.orphans(max(min_age_s, 60.0)):   # files mid-rename
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            report.orphan_files += 1
            report.freed_bytes += size
    for tier in tiers:
        update_gauge(tier, metrics)
    return report
