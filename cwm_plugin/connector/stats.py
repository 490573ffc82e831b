"""Connector metrics through vLLM's own hook, so they appear on vLLM's ``/metrics``.

Both connector halves count into a :class:`StatsCollector`; vLLM pulls a
:class:`CWMConnectorStats` from each side every step (``get_kv_connector_stats``), ships it to the
API server process, sums it, and calls :class:`CWMPromMetrics.observe`, which feeds Prometheus
counters named ``cwm:connector_*`` and ``cwm:store_*``.

The store measures itself with prometheus-client in whatever process it lives in (hits, bytes,
errors per tier, ...). The worker's store gets a private registry; :func:`registry_deltas` turns
its counters into per-step increments that travel in the same stats object, so every store
metric is exported once, under the same names, with no second definition here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

CONNECTOR_COUNTERS = {
    "lookups": "Scheduler lookups of a request's blocks in the store",
    "lookup_tokens": "Tokens asked for in lookups (beyond the locally cached ones)",
    "hit_tokens": "Tokens the store could provide in lookups",
    "loaded_blocks": "Blocks loaded from the store into the paged KV cache",
    "loaded_bytes": "Bytes of KV loaded into the paged KV cache",
    "load_seconds": "Seconds spent loading blocks (fetch, decode, scatter)",
    "load_errors": "Blocks that failed to load (missing, corrupt, wrong layout) and were recomputed",
    "saved_blocks": "Blocks handed to the store to save",
    "saved_bytes": "Bytes of KV handed to the store to save",
    "save_seconds": "Seconds the step spent copying blocks out for saving",
    "save_errors": "Blocks whose save failed",
}
STORE_PREFIX = "store|"


@dataclass
class CWMConnectorStats(KVConnectorStats):
    data: dict[str, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        out = dict(self.data)
        for k, v in other.data.items():
            out[k] = out.get(k, 0.0) + float(v)
        return CWMConnectorStats(out)

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if not k.startswith(STORE_PREFIX)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsCollector:
    """Thread-safe accumulation of counters between two vLLM pulls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}

    def add(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._data[name] = self._data.get(name, 0.0) + value

    def lookup(self, *, queried: int, hit: int) -> None:
        with self._lock:
            for k, v in (("lookups", 1), ("lookup_tokens", queried), ("hit_tokens", hit)):
                self._data[k] = self._data.get(k, 0.0) + v

    def merge(self, data: dict[str, float]) -> None:
        with self._lock:
            for k, v in data.items():
                self._data[k] = self._data.get(k, 0.0) + v

    def take(self) -> CWMConnectorStats | None:
        with self._lock:
            data, self._data = self._data, {}
        return CWMConnectorStats(data) if any(data.values()) else None


class RegistryDeltas:
    """Per-pull increments of every counter in a prometheus-client registry."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self._last: dict[str, float] = {}

    def take(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for family in self.registry.collect():
            if family.type != "counter":
                continue
            for s in family.samples:
                if not s.name.endswith("_total"):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                key = f"{STORE_PREFIX}{s.name.removesuffix('_total')}|{labels}"
                delta = float(s.value) - self._last.get(key, 0.0)
                self._last[key] = float(s.value)
                if delta:
                    out[key] = delta
        return out


class CWMPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}
        for name, doc in CONNECTOR_COUNTERS.items():
            self._counters[name] = self._counter_cls(
                name=f"cwm:connector_{name}", documentation=doc, labelnames=labelnames)
        self._store_counters: dict[str, tuple[Any, list[str]]] = {}

    def _store_counter(self, metric: str, label_names: list[str]) -> Any:
        found = self._store_counters.get(metric)
        if found is None:
            counter = self._counter_cls(
                name=f"cwm:{metric.removeprefix('cwm_')}",
                documentation=f"cwm store metric {metric} (forwarded from the worker)",
                labelnames=self._labelnames + label_names)
            found = self._store_counters[metric] = (counter, label_names)
        return found[0]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if not value:
                continue
            if key in self._counters:
                self._counters[key].labels(*base).inc(value)
            elif key.startswith(STORE_PREFIX):
                _, metric, labels = key.split("|", 2)
                pairs = [p.split("=", 1) for p in labels.split(",") if p]
                counter = self._store_counter(metric, [k for k, _ in pairs])
                counter.labels(*base, *[v for _, v in pairs]).inc(value)
