"""The connector's metrics on vLLM's own ``/metrics`` (vLLM's ``build_prom_metrics`` hook).

Runs in vLLM's API server process. The connector's counters (:data:`CONNECTOR_COUNTERS`) are made up
front as ``cwm:connector_<name>``; store metrics arrive forwarded
(:mod:`~cwm_plugin.connector.metrics.forward`) and are made on first sight as ``cwm:store_<name>``
with the store's own label names, as counters, gauges or histograms. A forwarded histogram step is
re-observed bucket by bucket: bucket counts are exact, and each bucket's value is chosen inside it
so that the sum is exact too.
"""

from __future__ import annotations

import math
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from cwm_plugin.connector.metrics.stats import CONNECTOR_COUNTERS, decode_key


def _prom_name(store_name: str) -> str:
    """``cwm_store_hits`` -> ``cwm:store_hits``."""
    return "cwm:" + store_name.removeprefix("cwm_")


class CWMPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, tuple[Any, tuple[str, ...]]] = {}
        for name, (doc, labels) in CONNECTOR_COUNTERS.items():
            metric = self._counter_cls(name=f"cwm:connector_{name}", documentation=doc,
                                       labelnames=labelnames + list(labels))
            self._counters[name] = (metric, labels)
        self._store: dict[str, tuple[Any, tuple[str, ...]]] = {}

    def _store_metric(self, kind: str, name: str, labels: tuple[str, ...],
                      buckets: list[float] | None = None) -> tuple[Any, tuple[str, ...]]:
        found = self._store.get(name)
        if found is None:
            kw: dict[str, Any] = {"name": _prom_name(name),
                                  "documentation": f"cwm store metric {name} (forwarded)",
                                  "labelnames": self._labelnames + list(labels)}
            if kind == "c":
                metric = self._counter_cls(**kw)
            elif kind == "g":
                metric = self._gauge_cls(multiprocess_mode="mostrecent", **kw)
            else:
                metric = self._histogram_cls(buckets=buckets, **kw)
            found = self._store[name] = (metric, labels)
        return found

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = list(self.per_engine_labelvalues[engine_idx])
        histograms: dict[tuple[str, tuple], dict[str, Any]] = {}
        for key, value in transfer_stats_data.items():
            name, labels = decode_key(key)
            kind, _, metric_name = name.partition(":")
            if not metric_name:                                   # a connector counter
                if name in self._counters and value:
                    metric, names = self._counters[name]
                    metric.labels(*base, *[labels.get(n, "") for n in names]).inc(value)
            elif kind == "c" and value:
                metric, names = self._store_metric("c", metric_name, tuple(sorted(labels)))
                metric.labels(*base, *[labels[n] for n in names]).inc(value)
            elif kind == "g":
                metric, names = self._store_metric("g", metric_name, tuple(sorted(labels)))
                metric.labels(*base, *[labels[n] for n in names]).set(value)
            elif kind in ("h", "hs"):
                le = labels.pop("le", None)
                entry = histograms.setdefault((metric_name, tuple(sorted(labels.items()))),
                                              {"labels": labels, "buckets": {}, "sum": 0.0})
                if kind == "h":
                    entry["buckets"][float(le)] = value
                else:
                    entry["sum"] = value
        for (metric_name, _), entry in histograms.items():
            self._observe_histogram(base, metric_name, entry)

    def _observe_histogram(self, base: list, name: str, entry: dict[str, Any]) -> None:
        counts = {b: int(n) for b, n in entry["buckets"].items() if n > 0}
        if not counts:
            return
        metric, names = self._store_metric("h", name, tuple(sorted(entry["labels"])),
                                           buckets=[b for b in sorted(entry["buckets"])
                                                    if math.isfinite(b)])
        child = metric.labels(*base, *[entry["labels"][n] for n in names])
        for value, n in spread(counts, sorted(entry["buckets"]), entry["sum"]):
            for _ in range(n):
                child.observe(value)


def spread(counts: dict[float, int], bounds: list[float], total: float
           ) -> list[tuple[float, int]]:
    """One value per bucket (``counts``: upper bound -> observations) inside that bucket, such
    that the observations add up to ``total`` whenever the buckets allow it."""
    lower = {b: (bounds[i - 1] if i else 0.0) for i, b in enumerate(bounds)}
    n_all = sum(counts.values())
    mean = total / n_all
    values = {b: _clamp(mean, lower[b], b) for b in counts}
    rest = total - sum(values[b] * n for b, n in counts.items())
    for b, n in counts.items():
        if abs(rest) <= 1e-12 * max(1.0, abs(total)):
            break
        target = _clamp(values[b] + rest / n, lower[b], b)
        rest -= (target - values[b]) * n
        values[b] = target
    return [(values[b], n) for b, n in counts.items()]


def _clamp(value: float, lower: float, upper: float) -> float:
    """``value`` inside the bucket ``(lower, upper]``."""
    return min(max(value, math.nextafter(lower, math.inf)), upper)
