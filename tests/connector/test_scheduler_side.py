"""Scheduler-side planning with real vLLM requests and block hashes over a real disk store."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.keys import Namespace, block_keys, hash_probe
from cwm_plugin.connector.metadata import CWMWorkerMetadata
from cwm_plugin.connector.scheduler import SchedulerSide
from cwm_plugin.connector.stats import StatsCollector
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.tiered import KVStore

pytestmark = pytest.mark.unit
BS = 16


@pytest.fixture(scope="module")
def hash_fn():
    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    return fn


@pytest.fixture
def ns(hash_fn) -> Namespace:
    return Namespace(model="m", model_fingerprint="f", dtype="float32", block_size=BS,
                     hash_block_size=BS, num_kv_heads=2, head_size=8, num_layers=2,
                     platform="cpu", tp_size=1, hash_algo="sha256",
                     hash_probe=hash_probe(hash_fn, BS))


@pytest.fixture
def store(tmp_path, ns):
    s = KVStore(StoreConfig(fingerprint=ns.fingerprint, disk_path=str(tmp_path / "s"),
                            memory_bytes=0))
    yield s
    s.close()


def make_request(hash_fn, rid: str, n_tokens: int, salt: str | None = "salt") -> Request:
    return Request(rid, list(range(100, 100 + n_tokens)), SamplingParams(max_tokens=4), None,
                   cache_salt=salt,
                   block_hasher=kv_cache_utils.get_request_block_hasher(BS, hash_fn))


def fill(store: KVStore, keys: list[bytes]) -> None:
    for k in keys:
        store.put(k, torch.ones(2, 2, BS, 16)).result()
    store.flush()


def step(req: Request, block_ids: list[int], computed: int, scheduled: int) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (block_ids,))]
    out.scheduled_new_reqs[0].num_computed_tokens = computed
    out.num_scheduled_tokens = {req.request_id: scheduled}
    return out


def test_lookup_counts_the_stored_prefix_and_leaves_one_token(hash_fn, ns, store):
    side = SchedulerSide(ns, ConnectorConfig(), store, StatsCollector())
    req = make_request(hash_fn, "r1", 4 * BS)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    keys = block_keys(ns, req.block_hashes, 4)
    fill(store, keys[:2])
    assert side.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    assert side.get_num_new_matched_tokens(req, BS) == (BS, False)  # one block cached locally
    fill(store, keys[2:])
    # All 4 blocks stored, but the last one must be computed to sample the next token.
    assert side.get_num_new_matched_tokens(req, 0) == (3 * BS, False)


def test_a_gap_stops_the_prefix_and_salts_never_match(hash_fn, ns, store):
    side = SchedulerSide(ns, ConnectorConfig(), store, StatsCollector())
    req = make_request(hash_fn, "r1", 5 * BS)
    keys = block_keys(ns, req.block_hashes, 5)
    fill(store, [keys[0], keys[2], keys[3]])
    assert side.get_num_new_matched_tokens(req, 0)[0] == BS
    other = make_request(hash_fn, "r2", 5 * BS, salt="other")
    unsalted = make_request(hash_fn, "r3", 5 * BS, salt=None)
    assert side.get_num_new_matched_tokens(other, 0)[0] == 0
    assert side.get_num_new_matched_tokens(unsalted, 0)[0] == 0
    salted_only = SchedulerSide(ns, ConnectorConfig(salted_only=True), store, StatsCollector())
    fill(store, block_keys(ns, unsalted.block_hashes, 2))
    assert salted_only.get_num_new_matched_tokens(unsalted, 0)[0] == 0


def test_saves_cover_completed_blocks_once_and_respect_the_cap(hash_fn, ns, store):
    side = SchedulerSide(ns, ConnectorConfig(max_stored_tokens_per_request=3 * BS), store,
                         StatsCollector())
    req = make_request(hash_fn, "r1", 5 * BS + 3)
    side.get_num_new_matched_tokens(req, 0)
    ids = [10, 11, 12, 13, 14, 15]
    # Chunked prefill: the first step computes 2.5 blocks -> blocks 0 and 1 are saved.
    meta = side.build_connector_meta(step(req, ids, 0, 2 * BS + 8))
    assert [s.block_ids for s in meta.saves] == [[10, 11]]
    assert meta.saves[0].keys == block_keys(ns, req.block_hashes, 2)
    # Next step finishes the prompt: only block 2 is new, and the cap (3 blocks) stops there.
    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=["r1"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
        new_block_ids=[None], num_computed_tokens=[2 * BS + 8], num_output_tokens=[0])
    out.num_scheduled_tokens = {"r1": 3 * BS - 5}
    meta = side.build_connector_meta(out)
    assert [s.block_ids for s in meta.saves] == [[12]]
    # A second request with the same prefix does not save the blocks again.
    twin = make_request(hash_fn, "r2", 5 * BS + 3)
    side.get_num_new_matched_tokens(twin, 0)
    meta = side.build_connector_meta(step(twin, [20, 21, 22, 23, 24, 25], 0, 5 * BS + 3))
    assert meta.saves == []


def test_loads_are_planned_for_allocated_blocks_and_failed_keys_are_forgotten(hash_fn, ns, store):
    side = SchedulerSide(ns, ConnectorConfig(), store, StatsCollector())
    req = make_request(hash_fn, "r1", 4 * BS + 1)
    keys = block_keys(ns, req.block_hashes, 4)
    fill(store, keys)
    n, _ = side.get_num_new_matched_tokens(req, BS)
    assert n == 3 * BS

    class Blocks:
        def get_block_ids(self):
            return ([7, 8, 9, 10, 11],)

    side.update_state_after_alloc(req, Blocks(), n)
    meta = side.build_connector_meta(step(req, [7, 8, 9, 10, 11], 4 * BS, 1))
    assert len(meta.loads) == 1
    assert meta.loads[0].block_ids == [8, 9, 10] and meta.loads[0].keys == keys[1:4]
    # The worker reports a block it could not load: the scheduler stops trusting that key.
    side.update_connector_output(type("Out", (), {
        "kv_connector_worker_meta": CWMWorkerMetadata(failed_keys={keys[1]})})())
    store.delete(keys[1])
    assert side.get_num_new_matched_tokens(make_request(hash_fn, "r9", 4 * BS + 1), 0)[0] == BS
