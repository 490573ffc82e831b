"""A store of memory only: the scheduler's own store has no tier, the workers' memory tiers hold
every block. A block the scheduler promises is still there when its load starts, whatever the
workers saved meanwhile; context records, which nobody could read, are not written (said
once at start, not per request)."""

from __future__ import annotations

import logging

import pytest
import torch
from connector_helpers import BS, SYNC, fill_random, kv_allocation, namespace, vllm_config_for
from test_deferred_lookups import Output
from test_scheduler_side import Blocks, hashes, make_request, step
from vllm.v1.core.sched.output import SchedulerOutput

from cwm_plugin.connector import records
from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.metadata import CWMConnectorMetadata, CWMWorkerMetadata
from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.scheduler.side import SchedulerSide
from cwm_plugin.connector.worker.layout import discover_layout
from cwm_plugin.connector.worker.side import WorkerSide
from cwm_plugin.store.blob import codec

pytestmark = pytest.mark.unit


def pair(open_store, hash_fn, blocks_in_memory: float, sync_load_max_tokens: int = 0):
    """A worker whose memory tier holds ``blocks_in_memory`` blocks, and its scheduler (loads in
    the background, unless ``sync_load_max_tokens``)."""
    cfg, kv = kv_allocation(num_blocks=16)
    fill_random(kv, 9)
    layout, views = discover_layout(vllm_config_for(kv), cfg, kv)
    ns = namespace(layout.describe())
    blob = len(codec.encode(views[0][0].new_zeros(layout.per_block), key=bytes(50),
                            fingerprint=ns.fingerprint, layout=layout.describe(), level=0,
                            content=bytes(32)))
    worker = WorkerSide(open_store(ns.fingerprint, disk_path=None, zstd_level=0,
                                   memory_bytes=int(blocks_in_memory * blob)),
                        StatsCollector(), ns=ns, rank=0, layout=layout, layers=views)
    side = SchedulerSide(ns, ConnectorConfig(**SYNC, sync_load_max_tokens=sync_load_max_tokens),
                         open_store(ns.fingerprint, disk_path=None), StatsCollector(),
                         hash_fn=hash_fn, async_loads=True)
    return worker, side


def run(worker: WorkerSide, meta: CWMConnectorMetadata) -> CWMWorkerMetadata | None:
    """The worker's part of a step, in vLLM's order (loads started after the forward pass, then
    the saves, then the report built while the step's metadata is bound)."""
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    worker.store.flush()
    return worker.take_worker_meta(meta)


def block(worker: WorkerSide, block_id: int) -> torch.Tensor:
    return torch.stack([t[block_id] for t in worker.layers])


def test_a_block_promised_before_its_eviction_was_reported_still_loads(hash_fn, open_store):
    """Asynchronous scheduling: step 3 is planned -- A's blocks promised again -- before the
    scheduler has taken in step 2's report, in which B's saves pushed A's blocks out of the
    worker's memory (budget: 3.5 blocks). The load still finds them, and they are freed once
    the scheduler has seen them reported."""
    worker, side = pair(open_store, hash_fn, 3.5)
    a = make_request(hash_fn, "a", 2 * BS + 1, salt="s")
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    side.update_connector_output(Output(meta=run(
        worker, side.build_connector_meta(step(a, [1, 2, 3], 0, 2 * BS + 1)))))
    side.request_finished(a, [1, 2, 3])
    b = make_request(hash_fn, "b", 3 * BS + 1, salt="t")
    assert side.get_num_new_matched_tokens(b, 0) == (0, False)
    step2 = side.build_connector_meta(step(b, [4, 5, 6, 7], 0, 3 * BS + 1))
    again = make_request(hash_fn, "a2", 2 * BS + 1, salt="s")
    n, asynchronous = side.get_num_new_matched_tokens(again, 0)
    assert (n, asynchronous) == (2 * BS, True)                 # promised from step 1's report
    side.update_state_after_alloc(again, Blocks([8, 9, 10]), n)
    step3 = side.build_connector_meta(step(again, [8, 9, 10], n, 1))
    assert [t.block_ids for t in step3.loads] == [[8, 9]]

    out2 = run(worker, step2)                          # B saved: A's blocks evicted, reported
    assert set(hashes(a, 2)) <= out2.dropped
    out3 = run(worker, step3)
    assert worker.loader.wait(timeout=30)
    assert worker.get_finished() == {"a2"} and worker.take_load_errors() == set()
    assert torch.equal(block(worker, 8), block(worker, 1))
    assert torch.equal(block(worker, 9), block(worker, 2))
    for out in (out2, out3):
        side.update_connector_output(Output(recving={"a2"}, meta=out))
    assert side.get_num_new_matched_tokens(make_request(hash_fn, "a3", 2 * BS + 1, salt="s"),
                                           0) == (0, False)    # the scheduler forgot them
    run(worker, side.build_connector_meta(SchedulerOutput.make_empty()))
    used = worker.store.usage()["memory"]
    assert used["bytes"] <= used["budget"]          # what it saw reported is gone for good
    assert worker.stats.snapshot().get("load_errors", 0) == 0


def test_a_small_load_from_the_memory_tier_runs_in_the_step_that_admits_it(hash_fn, open_store):
    """Up to ``sync_load_max_tokens``, blocks the workers hold in memory are promised as a
    synchronous load: vLLM prefills the request in the same step, the worker loads before
    that step's forward and names it in the step's report; a longer one stays in the
    background."""
    worker, side = pair(open_store, hash_fn, 16, sync_load_max_tokens=2 * BS)
    a = make_request(hash_fn, "a", 3 * BS + 1, salt="s")
    assert side.get_num_new_matched_tokens(a, 0) == (0, False)
    side.update_connector_output(Output(meta=run(
        worker, side.build_connector_meta(step(a, [1, 2, 3, 4], 0, 3 * BS + 1)))))
    side.request_finished(a, [1, 2, 3, 4])

    small = make_request(hash_fn, "small", 2 * BS + 1, salt="s")
    assert side.get_num_new_matched_tokens(small, 0) == (2 * BS, False)   # in this step
    side.update_state_after_alloc(small, Blocks([8, 9, 10]), 2 * BS)
    meta = side.build_connector_meta(step(small, [8, 9, 10], 2 * BS, 1))
    assert [(t.block_ids, t.sync) for t in meta.loads] == [([8, 9], True)]
    out = run(worker, meta)
    assert out.loaded == {"small"}                           # done before the forward
    assert worker.get_finished() == set() and worker.take_load_errors() == set()
    assert torch.equal(block(worker, 8), block(worker, 1))
    assert torch.equal(block(worker, 9), block(worker, 2))
    side.update_connector_output(Output(meta=out))
    assert not side._loading                                 # settled by the report

    large = make_request(hash_fn, "large", 3 * BS + 1, salt="s")
    assert side.get_num_new_matched_tokens(large, 0) == (3 * BS, True)   # over the cap
    side.update_state_after_alloc(large, Blocks([11, 12, 13, 14]), 3 * BS)
    meta = side.build_connector_meta(step(large, [11, 12, 13, 14], 3 * BS, 0))
    assert [t.sync for t in meta.loads] == [False]
    run(worker, meta)
    assert worker.loader.wait(timeout=30) and worker.get_finished() == {"large"}
    assert torch.equal(block(worker, 13), block(worker, 3))


def test_a_memory_only_store_keeps_no_records_and_says_so_once(hash_fn, open_store, caplog):
    ns = namespace()
    with caplog.at_level(logging.WARNING, logger="cwm_plugin"):
        side = SchedulerSide(ns, ConnectorConfig(**SYNC), open_store(ns.fingerprint,
                                                                     disk_path=None),
                             StatsCollector(), hash_fn=hash_fn)
        for i in range(5):
            req = make_request(hash_fn, f"r{i}", 2 * BS + 1, salt=f"s{i}")
            side.get_num_new_matched_tokens(req, 0)
            side.build_connector_meta(step(req, [1, 2, 3], 0, 2 * BS + 1))
            side.request_finished(req, [1, 2, 3])
        side.store.flush()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "no context records" in said[0], said
    assert not records.readable(side.store)


def test_a_durable_store_keeps_records(hash_fn, open_store):
    ns = namespace()
    side = SchedulerSide(ns, ConnectorConfig(**SYNC), open_store(ns.fingerprint),
                         StatsCollector(), hash_fn=hash_fn)
    assert side.saves.keeps_records and records.readable(side.store)
