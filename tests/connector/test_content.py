"""Blocks carry their content identity from the scheduler to the blob: a session's blocks
re-keyed under another salt (what a window's thaw links) load through the connector, and a
swapped blob file loads as an error (recomputed), not as another block's KV."""

from __future__ import annotations

import pytest
import torch
from connector_helpers import BS, SYNC
from test_scheduler_side import Blocks, make_request, step
from test_worker_side import block, finish_loads, make_worker

from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.metadata import CWMConnectorMetadata
from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.scheduler.side import SchedulerSide
from cwm_plugin.store.blob import container
from cwm_plugin.windows import hashing

pytestmark = pytest.mark.unit
N = 4


def scheduler(worker, hash_fn) -> SchedulerSide:
    return SchedulerSide(worker.ns, ConnectorConfig(**SYNC, lease_ttl_s=0), worker.store,
                         StatsCollector(), hash_fn=hash_fn)


def unsalted(req) -> list[bytes]:
    return hashing.chain(req.all_token_ids, salt=None, block_size=BS, hash_block_size=BS,
                         hash_algo="sha256", lora=None, num_blocks=N)


def saved_session(open_store, hash_fn, salt: str):
    """A salted request's first N blocks saved by the worker as the scheduler planned them."""
    worker = make_worker(open_store, seed=5)
    side = scheduler(worker, hash_fn)
    req = make_request(hash_fn, "r1", N * BS + 1, salt=salt)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = side.build_connector_meta(step(req, list(range(1, N + 2)), 0, N * BS + 1))
    worker.wait_for_save(meta)
    worker.store.flush()
    return worker, side, req, meta.saves[0]


def test_a_salted_requests_blobs_name_the_tokens_unsalted_chain(open_store, hash_fn):
    worker, _, req, saved = saved_session(open_store, hash_fn, "salt-a")
    assert saved.contents == unsalted(req) != saved.block_hashes
    keys = worker.ns.keys(saved.block_hashes, 0)
    blobs = [worker.store.get_blob(k) for k in keys]
    assert [container.peek(b)["content"] for b in blobs] == [c.hex() for c in unsalted(req)]
    plain = make_request(hash_fn, "r2", N * BS + 1, salt=None)   # no salt: its own hashes
    assert plain.block_hashes[:N] == unsalted(req)


def test_a_thawed_sessions_linked_blocks_load_and_swapped_ones_do_not(open_store, hash_fn):
    src, side, req, saved = saved_session(open_store, hash_fn, "salt-a")
    store = src.store
    other = make_request(hash_fn, "r3", N * BS + 1, salt="salt-b")   # the same tokens
    theirs = worker_keys(src, other.block_hashes[:N])
    store.link_many(list(zip(theirs, worker_keys(src, saved.block_hashes), strict=True)))

    def load_other(rid: str) -> tuple[set[int], object]:
        req_b = make_request(hash_fn, rid, N * BS + 1, salt="salt-b")
        n, _ = side.get_num_new_matched_tokens(req_b, 0)
        assert n == N * BS
        side.update_state_after_alloc(req_b, Blocks([8, 9, 10, 11, 12]), n)
        meta = side.build_connector_meta(step(req_b, [8, 9, 10, 11, 12], n, 1))
        assert meta.loads[0].contents == unsalted(req)
        dst = make_worker(open_store, store=store)
        dst.start_load_kv(CWMConnectorMetadata(loads=meta.loads))
        return finish_loads(dst), dst

    errors, dst = load_other("r4")
    assert errors == set()
    for a, b in zip(range(1, N + 1), range(8, 12), strict=True):
        assert torch.equal(block(dst, b), block(src, a))
    first, second = (store.disk.path(b) for b in store.disk.lookup_many(theirs[:2]))
    a, b = first.read_bytes(), second.read_bytes()
    first.write_bytes(b)
    second.write_bytes(a)
    errors, dst = load_other("r5")
    assert errors == {8, 9, 10, 11}                 # the first block and all after it
    assert dst.store.metrics.errors.labels("refused_foreign_key")._value.get() >= 1


def worker_keys(worker, hashes: list[bytes]) -> list[bytes]:
    return worker.ns.keys(hashes, 0)
