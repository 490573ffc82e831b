"""Prometheus metrics of the KV block store, each defined once, registrable on any registry.

Every :class:`~cwm_plugin.store.kv_store.KVStore` uses the one :class:`StoreMetrics` of the
registry it is given (:meth:`StoreMetrics.for_registry`; the worker's store gets a private
registry, see ``cwm_plugin/connector/metrics/stats.py``). Stores sharing a registry share its
counters.
"""

from __future__ import annotations

import threading
import weakref

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

NAMESPACE = "cwm_store"
_BY_REGISTRY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BY_REGISTRY_LOCK = threading.Lock()
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class StoreMetrics:
    """The store's metrics; ``tier`` is memory, disk or redis."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else REGISTRY
        kw = {"namespace": NAMESPACE, "registry": reg}
        self.bytes = Gauge("bytes", "Bytes of blobs held per tier (updated on every put, "
                           "eviction and delete)", ["tier"], **kw)
        self.blobs = Gauge("blobs", "Blobs held per tier", ["tier"], **kw)
        self.hits = Counter("hits", "Blob lookups a tier answered with a blob that decoded",
                            ["tier"], **kw)
        self.misses = Counter("misses", "Blob lookups a tier could not answer, or answered "
                              "with a damaged blob (tier=all: keys no tier could serve)",
                              ["tier"], **kw)
        self.evictions = Counter("evictions", "Keys whose blob was evicted to stay in budget",
                                 ["tier"], **kw)
        self.drops = Counter("drops", "Keys a tier dropped on its own, by reason (evicted, "
                             "expired, dangling, quarantined, reset)", ["tier", "reason"], **kw)
        self.raw_bytes = Counter("encoded_raw_bytes", "Tensor bytes given to the encoder", **kw)
        self.stored_bytes = Counter("encoded_bytes", "Blob bytes produced by the encoder", **kw)
        self.ratio = Gauge("compression_ratio",
                           "Raw tensor bytes / blob bytes over everything encoded", **kw)
        self.encode_seconds = Histogram("encode_seconds", "Seconds to encode one block",
                                        buckets=_SECONDS, **kw)
        self.decode_seconds = Histogram("decode_seconds", "Seconds to decode one block",
                                        buckets=_SECONDS, **kw)
        self.errors = Counter("errors", "Store errors by kind (corrupt, incompatible, "
                                        "tier_unavailable, storage_full, write_failed, "
                                        "read_failed, index, index_rebuilt, "
                                        "behind_dropped, quarantine_failed)",
                              ["kind"], **kw)
        self.puts = Counter("puts", "Blocks saved (new blobs written)", **kw)
        self.put_skips = Counter("put_skips", "Saves skipped because the key was present", **kw)
        self.replicated = Counter("replicated", "Blobs copied to a durable tier that lacked "
                                  "them (a window made complete on every durable tier)",
                                  ["tier"], **kw)
        self._raw = 0
        self._stored = 0

    @classmethod
    def for_registry(cls, registry: CollectorRegistry | None = None) -> StoreMetrics:
        """The one StoreMetrics of ``registry`` (made on first use): several stores in one
        process share it instead of registering every metric twice."""
        reg = registry if registry is not None else REGISTRY
        with _BY_REGISTRY_LOCK:
            metrics = _BY_REGISTRY.get(reg)
            if metrics is None:
                metrics = _BY_REGISTRY[reg] = cls(reg)
            return metrics

    def encoded(self, raw: int, stored: int, seconds: float) -> None:
        self.raw_bytes.inc(raw)
        self.stored_bytes.inc(stored)
        self.encode_seconds.observe(seconds)
        self._raw += raw
        self._stored += stored
        if self._stored:
            self.ratio.set(self._raw / self._stored)

    def tier_usage(self, tier: str, nbytes: int, blobs: int) -> None:
        self.bytes.labels(tier).set(nbytes)
        self.blobs.labels(tier).set(blobs)
