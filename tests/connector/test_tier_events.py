"""Our tiers in vLLM's KV events (``scheduler/events.py``), with real vLLM requests and block
hashes over a real disk store: a block is announced when every worker reported it saved, with
its tier's medium, its token ids, its parent and the salt in block 0's extra keys as vLLM's own
events carry it; removed when a worker drops it; never announced when its save failed."""

from __future__ import annotations

import pytest
from connector_helpers import BS, SYNC
from test_scheduler_side import hashes, make_request, step
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.connector import tier_events_on
from cwm_plugin.connector.metadata import CWMWorkerMetadata
from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.scheduler.events import external_hash
from cwm_plugin.connector.scheduler.side import SchedulerSide

pytestmark = pytest.mark.unit


def side_for(ns, store, source=CacheHitSource.HOST, events=True) -> SchedulerSide:
    return SchedulerSide(ns, ConnectorConfig(**SYNC), store, StatsCollector(),
                         stored_source=source, events=events)


def report(side: SchedulerSide, **meta) -> None:
    side.update_connector_output(type("Out", (), {
        "kv_connector_worker_meta": CWMWorkerMetadata(**meta)})())


def test_saved_blocks_are_announced_with_their_tokens_parent_and_salt(hash_fn, ns, store):
    side = side_for(ns, store)
    req = make_request(hash_fn, "r1", 4 * BS + 1)
    hs = hashes(req, 4)
    side.get_num_new_matched_tokens(req, 0)
    meta = side.build_connector_meta(step(req, [1, 2, 3, 4, 5], 0, 4 * BS + 1))
    assert [s.block_hashes for s in meta.saves] == [hs]
    assert side.events is not None and side.events.take() == []  # planned: not yet
    report(side, stored={(h, 0) for h in reversed(hs)})  # reported in any order
    (ev,) = side.events.take()
    assert isinstance(ev, BlockStored) and ev.medium == "CPU" and ev.block_size == BS
    assert ev.block_hashes == [external_hash(h) for h in hs] and ev.parent_block_hash is None
    assert ev.token_ids == list(req.all_token_ids[:4 * BS])
    assert ev.extra_keys == [("salt",), None, None, None]  # as vLLM's: block 0 holds the salt
    # the next blocks of the same request chain onto the last one announced
    req2 = make_request(hash_fn, "r2", 6 * BS + 1)
    hs2 = hashes(req2, 6)
    assert hs2[:4] == hs
    side.get_num_new_matched_tokens(req2, 0)
    side.build_connector_meta(step(req2, list(range(10, 17)), 4 * BS, 2 * BS + 1))
    report(side, stored={(h, 0) for h in hs2[4:]})
    (ev2,) = side.events.take()
    assert ev2.parent_block_hash == external_hash(hs[3]) and ev2.extra_keys is None
    assert ev2.token_ids == list(req2.all_token_ids[4 * BS:6 * BS])
    # a worker drops one (evicted): removed; one never announced is not
    report(side, dropped={hs[1], b"x" * 32}, step=1)
    assert side.events.take() == [BlockRemoved(block_hashes=[external_hash(hs[1])],
                                               medium="CPU")]
    # a cache reset drops the memory tiers: every block announced there is removed
    side.reset_cache()
    (gone,) = side.events.take()
    assert sorted(gone.block_hashes) == sorted(external_hash(h) for h in [hs[0], *hs[2:],
                                                                           *hs2[4:]])


def test_a_failed_save_is_never_announced_and_a_durable_tier_is_storage(hash_fn, ns, store):
    side = side_for(ns, store, source=CacheHitSource.DISK)
    req = make_request(hash_fn, "r1", 3 * BS + 1)
    hs = hashes(req, 3)
    side.get_num_new_matched_tokens(req, 0)
    side.build_connector_meta(step(req, [1, 2, 3, 4], 0, 3 * BS + 1))
    report(side, failed={hs[1]}, stored={(hs[0], 0), (hs[2], 0)})
    events = side.events.take()
    assert [e.block_hashes for e in events] == [[external_hash(hs[0])], [external_hash(hs[2])]]
    assert {e.medium for e in events} == {"STORAGE"}
    side.reset_cache()  # the durable tiers keep their blocks
    assert side.events.take() == []


def test_no_events_unless_vllm_publishes_them(hash_fn, ns, store):
    side = side_for(ns, store, events=False)
    assert side.events is None


@pytest.mark.parametrize(("published", "tier_events", "on"), [
    (True, True, True), (True, False, False), (False, True, False), (None, True, False)])
def test_tier_events_only_where_vllm_publishes_and_the_config_wants_them(published, tier_events,
                                                                           on):
    events = None if published is None else type("E", (), {"enable_kv_cache_events": published})
    vllm_config = type("V", (), {"kv_events_config": events})()
    cfg = ConnectorConfig.from_extra_config({"tier_events": tier_events})
    assert tier_events_on(cfg, vllm_config) is on
