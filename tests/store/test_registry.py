"""The tier registry: the store opens every registered tier its config asks for, in lookup
order, and a tier registered from outside the store's code joins them without an edit there."""

from __future__ import annotations

import sys
import types

import pytest
from prometheus_client import CollectorRegistry

from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.tier_set import TierSet
from cwm_plugin.store.tiers import registry
from cwm_plugin.store.tiers.ram.tier import RamTier

pytestmark = pytest.mark.unit


def test_the_built_in_tiers_open_in_lookup_order(tmp_path):
    assert registry.names() == ["memory", "disk", "redis"]
    cfg = StoreConfig(memory_bytes=1 << 20, disk_path=str(tmp_path / "d"))
    with TierSet(cfg, registry=CollectorRegistry()) as tiers:
        assert [t.name for t in tiers.tiers] == ["memory", "disk"]   # no redis_url: left out


def test_a_registered_tier_is_opened_after_the_others(tmp_path, monkeypatch):
    class SpareTier(RamTier):
        name = "spare"

    asked: list[StoreConfig] = []

    def open_tier(config: StoreConfig) -> SpareTier:
        asked.append(config)
        return SpareTier(1 << 10)

    monkeypatch.setitem(sys.modules, "spare_tier", types.SimpleNamespace(open_tier=open_tier))
    monkeypatch.setattr(registry, "_TIERS", dict(registry._TIERS))
    registry.register("spare", "spare_tier")
    cfg = StoreConfig(memory_bytes=1 << 20, disk_path=str(tmp_path / "d"))
    with TierSet(cfg, registry=CollectorRegistry()) as tiers:
        assert [t.name for t in tiers.tiers] == ["memory", "disk", "spare"]
    assert asked == [cfg]
