"""Store maintenance: verify every blob's checksum, collect blobs no key points to.

``gc`` never races a writer: memory blobs are checked and dropped under the store's lock (a
write puts blob and key under it too), disk blobs must also be older than ``min_age_s`` (a
writer in another process, or one between writing a file and mapping its key), and Redis adds a
blob and maps its key in one script, so a Redis blob is never unreferenced while being saved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cwm_plugin.errors import CorruptBlob, IncompatibleBlob, TierUnavailable
from cwm_plugin.store import codec

if TYPE_CHECKING:
    from cwm_plugin.store.tiered import KVStore

log = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    corrupt: list[str] = field(default_factory=list)        # "tier:blob_id"
    incompatible: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)        # indexed but unreadable
    bytes_checked: int = 0

    @property
    def clean(self) -> bool:
        return not (self.corrupt or self.missing)


@dataclass
class GCReport:
    removed_blobs: dict[str, int] = field(default_factory=dict)   # tier -> count
    freed_bytes: int = 0
    orphan_files: int = 0
    dangling_keys: int = 0


def _blob_lists(store: KVStore) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    if store.memory is not None:
        out.append(("memory", store.memory.ids()))
    if store.index is not None:
        out.append(("disk", [b for b, _ in store.index.all_blobs()]))
    if store.redis is not None:
        try:
            out.append(("redis", list(store.redis.blob_ids())))
        except TierUnavailable as exc:
            log.warning("verify: skipping the redis tier: %s", exc)
    return out


def verify_all(store: KVStore, *, progress: bool = True) -> VerifyReport:
    """Decode every blob of every tier with checksum verification; quarantine bad ones."""
    from tqdm import tqdm

    report = VerifyReport()
    lists = _blob_lists(store)
    total = sum(len(ids) for _, ids in lists)
    tiers = {"memory": store.memory, "disk": store.disk, "redis": store.redis}
    with tqdm(total=total, desc="verify", unit="blob", disable=not progress) as bar:
        for name, ids in lists:
            tier = tiers[name]
            assert tier is not None
            for blob_id in ids:
                bar.update(1)
                report.checked += 1
                try:
                    data = tier.get(blob_id)
                except TierUnavailable:
                    report.missing.append(f"{name}:{blob_id}")
                    continue
                if data is None:
                    report.missing.append(f"{name}:{blob_id}")
                    continue
                report.bytes_checked += len(data)
                try:
                    codec.decode(data, verify=True)
                except CorruptBlob as exc:
                    report.corrupt.append(f"{name}:{blob_id}")
                    store.metrics.errors.labels("corrupt").inc()
                    store.quarantine(blob_id, data, name, reason=str(exc))
                    continue
                except IncompatibleBlob:
                    report.incompatible.append(f"{name}:{blob_id}")
                    continue
                report.ok += 1
    return report


def collect_garbage(store: KVStore, min_age_s: float = 600.0) -> GCReport:
    """Drop blobs that no key points to, orphan files and stale temp files; on disk only those
    older than ``min_age_s``."""
    report = GCReport()
    if store.memory is not None:
        n = 0
        with store._lock:
            for blob_id in store.memory.ids():
                if blob_id not in store._by_blob:
                    data = store.memory.get(blob_id)
                    if store.memory.delete(blob_id):
                        n += 1
                        report.freed_bytes += len(data or b"")
        report.removed_blobs["memory"] = n
    if store.disk is not None and store.index is not None:
        dead = store.index.unreferenced(min_age_s)
        for blob_id, size in dead:
            store.disk.delete(blob_id)
            report.freed_bytes += size
        report.removed_blobs["disk"] = len(dead)
        for path in store.disk.orphans(max(min_age_s, 60.0)):   # files mid-rename
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            report.orphan_files += 1
            report.freed_bytes += size
        dangling = store.index.dangling_keys()
        store.index.drop_keys(dangling)
        report.dangling_keys = len(dangling)
    if store.redis is not None:
        try:
            dead_r = store.redis.unreferenced()
            for blob_id in dead_r:
                store.redis.delete(blob_id)
            report.removed_blobs["redis"] = len(dead_r)
        except TierUnavailable as exc:
            log.warning("gc: skipping the redis tier: %s", exc)
    store._gauges()
    return report
