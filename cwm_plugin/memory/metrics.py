"""Prometheus metrics of the memory package, registered on a registry the caller gives.

No global registry is touched: ``MemoryMetrics()`` makes its own ``CollectorRegistry``; the
sidecar passes its registry so the metrics show on its ``/metrics``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class MemoryMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.retrieval = Histogram(
            "cwm_memory_retrieval_seconds", "Time to search a folder's memory", ["mode"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry)
        self.chunks = Counter("cwm_memory_chunks_indexed_total",
                              "Chunks added to the indexes (including re-indexing)",
                              registry=self.registry)
        self.cache = Counter("cwm_memory_embedding_cache_total",
                             "Embedding cache look-ups by result", ["result"],
                             registry=self.registry)
        self.degraded = Counter(
            "cwm_memory_degraded_total", "Derived state (a saved index, the embedding cache) "
            "that could not be written or read and was done without (recomputed later), and "
            "optional stages that failed and were skipped (rerank: the first ranking kept)",
            ["what"], registry=self.registry)
