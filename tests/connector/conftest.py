"""Fixtures of the connector tests: vLLM's hashing initialised, stores that always close, a
namespace and its store for the scheduler-side tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from connector_helpers import namespace
from prometheus_client import CollectorRegistry
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore


@pytest.fixture(scope="module")
def hash_fn():
    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    return fn


@pytest.fixture
def open_store(tmp_path) -> Iterator[Callable[..., KVStore]]:
    """``open_store(fingerprint, **settings)``: a KVStore on a disk tier under tmp_path (no
    memory tier unless asked), with a private metrics registry; closed after the test."""
    made: list[KVStore] = []

    def make(fingerprint: str, **kw) -> KVStore:
        settings = dict(fingerprint=fingerprint, disk_path=str(tmp_path / "store"),
                        memory_bytes=0)
        store = KVStore(StoreConfig(**{**settings, **kw}), registry=CollectorRegistry())
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
def ns():
    return namespace()


@pytest.fixture
def store(open_store, ns):
    return open_store(ns.fingerprint)
