"""Connector statistics as they travel through vLLM's metrics hook, and the connector's counters.

Both connector halves count into a :class:`StatsCollector`; every step vLLM pulls a
:class:`CWMConnectorStats` from each side (``get_kv_connector_stats``), ships it to the API server
process, sums the workers' and the scheduler's, and hands it to
:class:`~cwm_plugin.connector.metrics.prom.CWMPromMetrics`, which feeds ``cwm:connector_*`` and
``cwm:store_*`` on vLLM's ``/metrics``.

One stats entry is ``key -> float``. A key is ``<name>|<label>=<value>,...``; connector counters use
their bare name (:data:`CONNECTOR_COUNTERS`), forwarded store metrics a kind prefix
(:mod:`~cwm_plugin.connector.metrics.forward`): ``c:`` counter increments, ``g:`` gauge values (the
newest wins when two stats merge), ``h:`` histogram bucket increments (with an ``le`` label) and
``hs:`` histogram sum increments.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

# name -> (documentation, label names)
CONNECTOR_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lookups": ("Scheduler lookups of a request's blocks in the store", ()),
    "lookup_tokens": ("Tokens asked for in lookups (beyond the locally cached ones)", ()),
    "lookup_seconds": ("Seconds vLLM's scheduling step spent on the connector's lookups (the "
                       "store is asked in the background; this is the step's share)", ()),
    "lookup_store_seconds": ("Seconds the background lookups spent asking the store (off the "
                             "step)", ()),
    "lookups_deferred": ("Lookups still running in the background when vLLM asked: the request "
                         "waited a step (answer None) while the others went on", ()),
    "lookup_timeouts": ("Lookups not done by lookup_deadline_ms: the blocks not known were "
                        "counted as misses and computed", ()),
    "async_loads": ("Loads run in the background (CPU workers), by outcome: ok, or failed "
                    "(some blocks recomputed)", ("outcome",)),
    "leases": ("Leases protecting promised blocks from eviction until their load, by event: "
               "taken, released, expired (released after their TTL), failed (none taken)",
               ("event",)),
    "load_failures_recomputed": ("Requests whose promised blocks failed to load and were "
                                 "recomputed instead of failing", ()),
    "hit_tokens": ("Tokens the store could provide in lookups", ()),
    "loaded_blocks": ("Blocks loaded into the paged KV cache, by the tier that served them",
                      ("tier",)),
    "loaded_bytes": ("Bytes of KV loaded into the paged KV cache, by the tier that served them",
                     ("tier",)),
    "load_seconds": ("Seconds spent loading (fetch, decode, scatter), by the slowest tier a "
                     "load touched", ("tier",)),
    "load_phase_seconds": ("Seconds of each load stage: lookup (which tiers hold the blocks) "
                           "and read (fetching blobs) on the loading thread, decompress (zstd, "
                           "checksums), transform (the inverse byte transform) and copy (into "
                           "the paged cache) summed over the decoding threads", ("phase",)),
    "load_errors": ("Blocks that failed to load (missing, corrupt, other layout) and were "
                    "recomputed", ()),
    "saved_blocks": ("Blocks the store accepted", ()),
    "saved_bytes": ("Bytes of KV in the blocks the store accepted", ()),
    "save_seconds": ("Seconds the step spent copying blocks out for saving", ()),
    "save_errors": ("Blocks (and records) whose save was refused at once (refused), failed "
                    "later (failed) or was not made: computed over a failed load (load_failed), "
                    "or the store's save queue was full (backpressure)", ("reason",)),
    "selfcheck_failures": ("Start-up self-checks that found vLLM's block hashes changed since "
                           "the store was filled", ()),
    "dropped_blocks": ("Blocks the workers' stores reported dropped (evicted, expired, "
                       "dangling), so the scheduler stopped promising them", ()),
}
STORE_KINDS = ("c:", "g:", "h:", "hs:")


def encode_key(name: str, labels: dict[str, str] | None = None) -> str:
    inner = ",".join(f"{k}={v}" for k, v in sorted((labels or {}).items()))
    return f"{name}|{inner}" if inner else name


def decode_key(key: str) -> tuple[str, dict[str, str]]:
    name, _, inner = key.partition("|")
    labels = dict(p.split("=", 1) for p in inner.split(",") if p)
    return name, labels


@dataclass
class CWMConnectorStats(KVConnectorStats):
    data: dict[str, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        out = dict(self.data)
        for k, v in other.data.items():
            out[k] = float(v) if k.startswith("g:") else out.get(k, 0.0) + float(v)
        return CWMConnectorStats(out)

    def reduce(self) -> dict[str, int | float]:
        """The connector's own counters, for vLLM's periodic log line."""
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            if not k.startswith(STORE_KINDS):
                out[k.replace("|", "{").replace(",", ";") + ("}" if "|" in k else "")] = v
        return out

    def is_empty(self) -> bool:
        return not self.data


class StatsCollector:
    """Thread-safe accumulation of counters between two vLLM pulls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}

    def add(self, name: str, value: float = 1.0, **labels: Any) -> None:
        key = encode_key(name, {k: str(v) for k, v in labels.items()})
        with self._lock:
            self._data[key] = self._data.get(key, 0.0) + value

    def lookup(self, *, queried: int, hit: int) -> None:
        with self._lock:
            for k, v in (("lookups", 1), ("lookup_tokens", queried), ("hit_tokens", hit)):
                self._data[k] = self._data.get(k, 0.0) + v

    def merge(self, data: dict[str, float]) -> None:
        with self._lock:
            for k, v in data.items():
                self._data[k] = v if k.startswith("g:") else self._data.get(k, 0.0) + v

    def take(self) -> CWMConnectorStats | None:
        with self._lock:
            data, self._data = self._data, {}
        return CWMConnectorStats(data) if data else None

    def snapshot(self) -> dict[str, float]:
        """A copy of what was counted since the last :meth:`take` (for tests and logs)."""
        with self._lock:
            return dict(self._data)
