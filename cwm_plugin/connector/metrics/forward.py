"""Forward a process-private prometheus-client registry (the store's) into connector stats.

The store measures itself with prometheus-client wherever it lives; the connector gives each of
its stores a private registry and, every vLLM step, turns what changed into stats entries (see
:mod:`~cwm_plugin.connector.metrics.stats` for the key format):

* counters: the increment since the last step;
* gauges: the current value, when it changed (labelled with the worker's ``rank``: memory tiers
  are per rank, disk and Redis are shared, so summing ranks is the reader's choice);
* histograms: per-bucket increments (non-cumulative, every bucket when any moved, so the
  receiving side learns the bucket bounds) and the increment of the sum.

So every store metric reaches vLLM's ``/metrics`` once, under the store's own names, with no
second definition here.
"""

from __future__ import annotations

from typing import Any

from cwm_plugin.connector.metrics.stats import encode_key


class RegistryForwarder:
    def __init__(self, registry: Any, *, gauge_labels: dict[str, str] | None = None,
                 counters_only: bool = False) -> None:
        self.registry = registry
        self.gauge_labels = dict(gauge_labels or {})
        self.counters_only = counters_only
        self._last: dict[str, float] = {}

    def _delta(self, key: str, value: float) -> float:
        delta = value - self._last.get(key, 0.0)
        self._last[key] = value
        return delta

    def take(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for family in self.registry.collect():
            if family.type == "counter":
                self._counters(family, out)
            elif self.counters_only:
                continue
            elif family.type == "gauge":
                self._gauges(family, out)
            elif family.type == "histogram":
                self._histogram(family, out)
        return out

    def _counters(self, family: Any, out: dict[str, float]) -> None:
        for s in family.samples:
            if s.name.endswith("_total"):
                key = encode_key("c:" + s.name.removesuffix("_total"), s.labels)
                delta = self._delta(key, float(s.value))
                if delta:
                    out[key] = delta

    def _gauges(self, family: Any, out: dict[str, float]) -> None:
        for s in family.samples:
            key = encode_key("g:" + s.name, {**s.labels, **self.gauge_labels})
            if self._last.get(key) != float(s.value):
                self._last[key] = float(s.value)
                out[key] = float(s.value)

    def _histogram(self, family: Any, out: dict[str, float]) -> None:
        """Per label set: cumulative buckets -> per-bucket increments since the last step."""
        series: dict[tuple, dict[str, Any]] = {}
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            entry = series.setdefault(tuple(sorted(labels.items())), {"labels": labels,
                                                                      "buckets": []})
            if s.name.endswith("_bucket"):
                entry["buckets"].append((float(s.labels["le"]), s.labels["le"], float(s.value)))
            elif s.name.endswith("_sum"):
                entry["sum"] = float(s.value)
        for entry in series.values():
            labels = {**entry["labels"], **self.gauge_labels}
            deltas: list[tuple[str, float]] = []
            below = 0.0
            for _, le, cumulative in sorted(entry["buckets"]):
                key = encode_key("h:" + family.name, {**labels, "le": le})
                deltas.append((key, self._delta(key, cumulative - below)))
                below = cumulative
            if not any(d for _, d in deltas):
                continue
            out.update(deltas)
            sum_key = encode_key("hs:" + family.name, labels)
            out[sum_key] = self._delta(sum_key, entry.get("sum", 0.0))
