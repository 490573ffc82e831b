"""Store metrics forwarded through vLLM's stats hook reach Prometheus with their values."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cwm_plugin.connector.metrics.forward import RegistryForwarder
from cwm_plugin.connector.metrics.prom import CWMPromMetrics
from cwm_plugin.connector.metrics.stats import CWMConnectorStats, StatsCollector
from cwm_plugin.store.metrics import StoreMetrics

pytestmark = pytest.mark.unit


def prom(registry: CollectorRegistry) -> CWMPromMetrics:
    """CWMPromMetrics as vLLM builds it (metric classes + engine labels), on ``registry``."""
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    return CWMPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                          ["model_name", "engine"], {0: ["tiny", "0"]})


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})


def test_counters_gauges_and_histograms_reach_prometheus():
    store_reg = CollectorRegistry()
    store = StoreMetrics(store_reg)
    fwd = RegistryForwarder(store_reg, gauge_labels={"rank": "0"})
    store.hits.labels("disk").inc(3)
    store.errors.labels("tier_unavailable").inc()
    store.tier_usage("disk", 4096, 2)
    for seconds in (0.0007, 0.0008, 0.02):
        store.decode_seconds.observe(seconds)
    stats = StatsCollector()
    stats.add("loaded_bytes", 8192, tier="disk")
    stats.merge(fwd.take())

    vllm_reg = CollectorRegistry()
    metrics = prom(vllm_reg)
    metrics.observe(stats.take().data)
    assert value(vllm_reg, "cwm:connector_loaded_bytes_total", tier="disk") == 8192
    assert value(vllm_reg, "cwm:store_hits_total", tier="disk") == 3
    assert value(vllm_reg, "cwm:store_errors_total", kind="tier_unavailable") == 1
    assert value(vllm_reg, "cwm:store_bytes", tier="disk", rank="0") == 4096
    assert value(vllm_reg, "cwm:store_decode_seconds_count", rank="0") == 3
    assert value(vllm_reg, "cwm:store_decode_seconds_bucket", rank="0", le="0.001") == 2
    assert value(vllm_reg, "cwm:store_decode_seconds_bucket", rank="0", le="0.025") == 3
    assert value(vllm_reg, "cwm:store_decode_seconds_sum", rank="0") == pytest.approx(0.0215)

    # Next step: only what changed travels; counters add up, gauges follow the source.
    store.hits.labels("disk").inc(2)
    store.tier_usage("disk", 8192, 4)
    nxt = fwd.take()
    assert nxt == {"c:cwm_store_hits|tier=disk": 2.0, "g:cwm_store_bytes|rank=0,tier=disk": 8192.0,
                   "g:cwm_store_blobs|rank=0,tier=disk": 4.0}
    metrics.observe(nxt)
    assert value(vllm_reg, "cwm:store_hits_total", tier="disk") == 5
    assert value(vllm_reg, "cwm:store_bytes", tier="disk", rank="0") == 8192
    assert fwd.take() == {}


def test_merged_stats_add_counters_and_keep_the_newest_gauge():
    a = CWMConnectorStats({"loaded_blocks|tier=disk": 2, "g:cwm_store_bytes|tier=disk": 10})
    b = CWMConnectorStats({"loaded_blocks|tier=disk": 3, "g:cwm_store_bytes|tier=disk": 7})
    merged = a.aggregate(b)
    assert merged.data == {"loaded_blocks|tier=disk": 5, "g:cwm_store_bytes|tier=disk": 7}
    assert merged.reduce() == {"loaded_blocks{tier=disk}": 5}


def test_scheduler_stores_forward_counters_only():
    reg = CollectorRegistry()
    store = StoreMetrics(reg)
    store.errors.labels("index").inc()
    store.tier_usage("disk", 1, 1)
    store.encode_seconds.observe(0.01)
    assert RegistryForwarder(reg, counters_only=True).take() == {"c:cwm_store_errors|kind=index": 1.0}
