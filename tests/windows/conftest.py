"""Fixtures for the window engine's tests: a real disk store."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore


@pytest.fixture
def store(tmp_path):
    s = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0),
                registry=CollectorRegistry())
    yield s
    s.close()
