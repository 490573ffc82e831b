"""The hashing self-check across (simulated) restarts: one store, a new SchedulerSide each start."""

from __future__ import annotations

import logging

import pytest
import torch
from connector_helpers import BS, SYNC, namespace
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.keys import hash_probe, kv_block_hashes
from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.scheduler.selfcheck import selfcheck_key
from cwm_plugin.connector.scheduler.side import SchedulerSide

pytestmark = pytest.mark.unit
SHA = get_hash_fn_by_name("sha256")


@pytest.fixture
def vllm_hashing(monkeypatch):
    """vLLM's hashing as a fresh process would set it up; the default again afterwards."""
    def init(seed: str | None) -> None:
        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        kv_cache_utils.init_none_hash(SHA)

    yield init
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils.init_none_hash(SHA)


def start(ns, store) -> SchedulerSide:
    """What a server start makes: a scheduler side over the same durable store."""
    return SchedulerSide(ns, ConnectorConfig(**SYNC), store, StatsCollector(), hash_fn=SHA)


def request(rid: str) -> Request:
    return Request(rid, list(range(500, 500 + 3 * BS + 1)), SamplingParams(max_tokens=1), None,
                   cache_salt="s", block_hasher=kv_cache_utils.get_request_block_hasher(BS, SHA))


def test_a_changed_hash_seed_is_detected_and_stale_blocks_are_never_served(
        vllm_hashing, open_store, caplog):
    ns = namespace()
    store = open_store(ns.fingerprint)
    vllm_hashing(None)
    first = start(ns, store)
    req = request("a")
    assert first.get_num_new_matched_tokens(req, 0)[0] == 0
    assert first.selfcheck.status == "written"
    for key in ns.keys(kv_block_hashes(req.block_hashes, 3), 0):   # the blocks get saved
        store.put(key, torch.ones(2, 2, BS, 16)).result()
    store.flush()

    second = start(ns, store)                                     # restart, same hashing
    assert second.get_num_new_matched_tokens(request("b"), 0)[0] == 3 * BS
    assert second.selfcheck.status == "match"

    vllm_hashing("4242")                                          # restart, another seed
    third = start(ns, store)
    with caplog.at_level(logging.ERROR, logger="cwm_plugin.connector.scheduler.selfcheck"):
        assert third.get_num_new_matched_tokens(request("c"), 0)[0] == 0, \
            "blocks saved under the old hashing were served"
    assert third.selfcheck.status == "mismatch"
    assert third.stats.snapshot()["selfcheck_failures"] == 1
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "PYTHONHASHSEED" in error.getMessage() and "Fix:" in error.getMessage()
    assert "4242" not in error.getMessage()                       # the seed itself stays secret

    store.flush()                                # the record is written off the step
    fourth = start(ns, store)                                     # the new settings stay: quiet
    fourth.get_num_new_matched_tokens(request("d"), 0)
    assert fourth.selfcheck.status == "match"


def test_the_probe_is_taken_after_vllm_initialises_hashing(vllm_hashing, open_store):
    ns = namespace()
    store = open_store(ns.fingerprint)
    # vLLM's EngineCore makes the scheduler (and so the connector) before it calls
    # init_none_hash; whatever NONE_HASH is at that moment must not become the probe.
    vllm_hashing("not-what-vllm-will-use")
    side = start(ns, store)
    assert side.selfcheck is None
    vllm_hashing(None)                                            # vLLM initialises hashing
    side.get_num_new_matched_tokens(request("a"), 0)
    assert side.selfcheck.probe == hash_probe(SHA, BS)


def test_no_durable_tier_means_nothing_to_check(open_store):
    ns = namespace()
    store = open_store(ns.fingerprint, disk_path=None, memory_bytes=1 << 20)
    side = start(ns, store)
    side.get_num_new_matched_tokens(request("a"), 0)
    assert side.selfcheck.status == "skipped"
    assert store.get(selfcheck_key(ns)) is None


def test_a_failing_check_never_takes_the_engine_down(vllm_hashing, open_store, monkeypatch, caplog):
    ns = namespace()
    store = open_store(ns.fingerprint)
    vllm_hashing(None)

    def broken(key):
        raise OSError("disk gone")

    monkeypatch.setattr(store, "get", broken)
    side = start(ns, store)
    with caplog.at_level(logging.ERROR):
        assert side.get_num_new_matched_tokens(request("a"), 0) == (0, False)
    assert side.selfcheck.status == "error" and "disk gone" in caplog.text
