"""The scheduler never promises a block that is gone: planned saves, worker reports of stores
and drops, lookups that expire, TP ranks, vLLM's reset_cache; and the context records windows
freeze. Real vLLM requests and hashes, a real store."""

from __future__ import annotations

import time

import pytest
import torch
from connector_helpers import BS, SYNC, fill_random, kv_allocation, namespace, vllm_config_for
from test_scheduler_side import Blocks, fill, hashes, make_request, step

from cwm_plugin.connector import records
from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.metadata import BlockTransfer, CWMConnectorMetadata, CWMWorkerMetadata
from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.scheduler.known import KnownBlocks
from cwm_plugin.connector.scheduler.side import SchedulerSide
from cwm_plugin.connector.worker.layout import discover_layout
from cwm_plugin.connector.worker.side import WorkerSide

pytestmark = pytest.mark.unit


def report(side: SchedulerSide, **meta) -> None:
    side.update_connector_output(type("Out", (), {
        "kv_connector_worker_meta": CWMWorkerMetadata(**meta)})())


def test_planned_saves_are_neither_promised_nor_saved_twice(hash_fn, open_store):
    ns = namespace()
    side = SchedulerSide(ns, ConnectorConfig(), open_store(ns.fingerprint, disk_path=None),
                         StatsCollector())
    req = make_request(hash_fn, "r1", 3 * BS)
    side.get_num_new_matched_tokens(req, 0)
    meta = side.build_connector_meta(step(req, [1, 2, 3], 0, 3 * BS))
    planned = meta.saves[0].block_hashes
    assert planned == hashes(req, 3)
    twin = make_request(hash_fn, "r2", 3 * BS + 1)
    assert side.get_num_new_matched_tokens(twin, 0)[0] == 0       # not written yet
    assert side.build_connector_meta(step(twin, [4, 5, 6, 7], 0, 3 * BS + 1)).saves == []
    report(side, stored={(h, 0) for h in planned})
    assert side.get_num_new_matched_tokens(twin, 0)[0] == 3 * BS


def test_a_block_a_worker_dropped_is_no_longer_promised(hash_fn, open_store):
    # memory-only workers: only their reports say a block exists; an eviction report ends it
    ns = namespace()
    side = SchedulerSide(ns, ConnectorConfig(), open_store(ns.fingerprint, disk_path=None),
                         StatsCollector())
    req = make_request(hash_fn, "r1", 3 * BS + 1)
    hs = hashes(req, 3)
    report(side, stored={(h, 0) for h in hs})
    assert side.get_num_new_matched_tokens(req, 0)[0] == 3 * BS
    report(side, dropped={hs[1]})
    assert side.get_num_new_matched_tokens(req, 0)[0] == BS
    report(side, overflow=True)
    assert side.get_num_new_matched_tokens(req, 0)[0] == 0


def test_every_rank_must_report_a_block_stored(hash_fn, open_store):
    ns = namespace()
    side = SchedulerSide(ns, ConnectorConfig(), open_store(ns.fingerprint, disk_path=None),
                         StatsCollector(), workers=[(ns, 0), (ns, 1)])
    req = make_request(hash_fn, "r1", 2 * BS + 1)
    hs = hashes(req, 2)
    report(side, stored={(h, 0) for h in hs})
    assert side.get_num_new_matched_tokens(req, 0)[0] == 0
    report(side, stored={(hs[0], 1)})
    assert side.get_num_new_matched_tokens(req, 0)[0] == BS


def test_durable_lookups_are_trusted_only_briefly(hash_fn, open_store):
    ns = namespace()
    store = open_store(ns.fingerprint)
    side = SchedulerSide(ns, ConnectorConfig(lookup_cache_s=0.3, **SYNC), store, StatsCollector())
    req = make_request(hash_fn, "r1", 2 * BS + 1)
    fill(store, ns.keys(hashes(req, 2), 0))
    assert side.get_num_new_matched_tokens(req, 0)[0] == 2 * BS
    store.delete_many(ns.keys(hashes(req, 2), 0))    # gone behind the scheduler's back
    time.sleep(0.4)
    assert side.get_num_new_matched_tokens(req, 0)[0] == 0


def test_reset_cache_forgets_everything_and_empties_the_workers_memory(hash_fn, open_store):
    cfg, kv = kv_allocation(num_blocks=8)
    fill_random(kv, 3)
    layout, views = discover_layout(vllm_config_for(kv), cfg, kv)
    ns = namespace(layout.describe())
    worker = WorkerSide(open_store(ns.fingerprint, disk_path=None, memory_bytes=1 << 20),
                        StatsCollector(), ns=ns, rank=0, layout=layout, layers=views)
    side = SchedulerSide(ns, ConnectorConfig(), open_store(ns.fingerprint, disk_path=None),
                         StatsCollector())
    hs = [bytes([i]) * 32 for i in range(2)]
    worker.wait_for_save(CWMConnectorMetadata(saves=[BlockTransfer("r", [1, 2], hs)]))
    worker.store.flush()
    side.update_connector_output(type("Out", (), {
        "kv_connector_worker_meta": worker.take_worker_meta()})())
    assert len(side.known) == 2
    assert side.reset_cache() is True and len(side.known) == 0
    meta = side.build_connector_meta(step(make_request(hash_fn, "r", BS), [0], 0, BS))
    assert meta.reset
    worker.start_load_kv(meta)
    assert worker.store.usage()["memory"]["blobs"] == 0
    assert worker.take_worker_meta().dropped == set(hs)
    assert not side.build_connector_meta(step(make_request(hash_fn, "q", BS), [0], 0, BS)).reset


def test_a_finished_salted_request_leaves_a_context_record(hash_fn, open_store):
    ns = namespace()
    store = open_store(ns.fingerprint)
    side = SchedulerSide(ns, ConnectorConfig(**SYNC), store, StatsCollector(),
                         workers=[(ns, 0), (ns, 1)])
    for salt in ("s1", None):
        req = make_request(hash_fn, f"r-{salt}", 3 * BS + 5, salt=salt)
        side.get_num_new_matched_tokens(req, 0)
        side.update_state_after_alloc(req, Blocks([1, 2, 3, 4]), 0)
        side.build_connector_meta(step(req, [1, 2, 3, 4], 0, 3 * BS + 5))
        side.request_finished(req, [1, 2, 3, 4])
    store.flush()
    rec = records.ContextRecord.from_tensor(store.get(records.context_record_key("s1")))
    assert rec.tokens == list(range(100, 100 + 3 * BS + 5)) and rec.saved_tokens == 3 * BS
    assert rec.hashes() == hashes(make_request(hash_fn, "x", 3 * BS + 5, salt="s1"), 3)
    assert rec.workers == [(ns.digest.hex(), 0), (ns.digest.hex(), 1)]
    assert rec.keys_of(rec.hashes())[1] == ns.keys(rec.hashes(), 1)
    assert rec.namespace["model"] == ns.model and rec.hash_algo == "sha256"
    later = make_request(hash_fn, "r-later", 4 * BS, salt="s1")     # a newer turn replaces it
    side.get_num_new_matched_tokens(later, 0)
    side.build_connector_meta(step(later, [1, 2, 3, 4], 0, 4 * BS))
    side.request_finished(later, [1, 2, 3, 4])
    store.flush()
    newer = records.ContextRecord.from_tensor(store.get(records.context_record_key("s1")))
    assert newer.saved_tokens == 4 * BS and store.usage()["disk"]["keys"] == 1


@pytest.mark.parametrize("algo,length", [("sha256", 32), ("xxhash", 16)])
def test_worker_reports_blocks_its_store_evicted(open_store, algo, length):
    # xxhash block hashes are 16 bytes, sha256 ones 32: both come back out of the store's keys
    cfg, kv = kv_allocation(num_blocks=8)
    fill_random(kv, 4)
    layout, views = discover_layout(vllm_config_for(kv), cfg, kv)
    ns = namespace(layout.describe(), hash_algo=algo)
    one = views[0][0].numel() * views[0].element_size() * len(views)
    worker = WorkerSide(open_store(ns.fingerprint, disk_path=None, memory_bytes=2 * one + 4096,
                                   zstd_level=0),
                        StatsCollector(), ns=ns, rank=0, layout=layout, layers=views)
    hs = [bytes([i]) * length for i in range(4)]
    step = CWMConnectorMetadata(saves=[BlockTransfer("r", [1, 2, 3, 4], hs)], step=1)
    worker.wait_for_save(step)
    worker.store.flush()
    meta = worker.take_worker_meta(step)                    # the step's end: over budget
    assert len(meta.dropped) == 2 and meta.step == 1        # two fit the budget
    keys = ns.keys(hs, 0)
    assert all(t is not None for t in worker.store.get_many(keys))   # reported, not gone yet
    worker.take_worker_meta(CWMConnectorMetadata(step=2, seen=1))    # the scheduler saw it
    got = worker.store.get_many(keys)
    assert [t is None for t in got] == [h in meta.dropped for h in hs]
    assert all(torch.is_tensor(t) for t in got if t is not None)
    known = KnownBlocks(1)                                  # what the scheduler believes
    known.report_stored(meta.stored)
    known.forget(meta.failed | meta.dropped)
    assert [known.get(h) is None for h in hs] == [h in meta.dropped for h in hs]
