"""Scheduler-side planning with real vLLM requests and block hashes over a real disk store."""

from __future__ import annotations

import pytest
import torch
from connector_helpers import BS, SYNC
from vllm import SamplingParams
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import Request

from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.keys import kv_block_hashes
from cwm_plugin.connector.metadata import CWMWorkerMetadata
from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.scheduler.side import SchedulerSide, hit_source_of_saves
from cwm_plugin.store.config import StoreConfig

pytestmark = pytest.mark.unit


def side_for(ns, store, **cfg) -> SchedulerSide:
    return SchedulerSide(ns, ConnectorConfig(**{**SYNC, **cfg}), store, StatsCollector())


def make_request(hash_fn, rid: str, n_tokens: int, salt: str | None = "salt") -> Request:
    return Request(rid, list(range(100, 100 + n_tokens)), SamplingParams(max_tokens=4), None,
                   cache_salt=salt,
                   block_hasher=kv_cache_utils.get_request_block_hasher(BS, hash_fn))


def hashes(req: Request, n: int) -> list[bytes]:
    return kv_block_hashes(req.block_hashes, n)


def fill(store, keys: list[bytes]) -> None:
    for k in keys:
        store.put(k, torch.ones(2, 2, BS, 16)).result()
    store.flush()


def step(req: Request, block_ids: list[int], computed: int, scheduled: int) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (block_ids,))]
    out.scheduled_new_reqs[0].num_computed_tokens = computed
    out.num_scheduled_tokens = {req.request_id: scheduled}
    out.total_num_scheduled_tokens = scheduled
    return out


class Blocks:
    """What update_state_after_alloc reads of vLLM's KVCacheBlocks."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int]]:
        return (self.ids,)


def test_lookup_counts_the_stored_prefix_and_leaves_one_token(hash_fn, ns, store):
    side = side_for(ns, store)
    req = make_request(hash_fn, "r1", 4 * BS)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    keys = ns.keys(hashes(req, 4), 0)
    fill(store, keys[:2])
    assert side.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    assert side.get_num_new_matched_tokens(req, BS) == (BS, False)  # one block cached locally
    fill(store, keys[2:])
    # All 4 blocks stored, but the last one must be computed to sample the next token.
    assert side.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
    counted = side.stats.snapshot()
    assert counted["lookups"] == 4 and counted["lookup_seconds"] > 0     # the breakdown's


def test_a_block_is_stored_only_when_every_rank_holds_it(hash_fn, ns, store):
    # TP=2: rank 1's blob of a prefix is gone. The scheduler must neither promise the block
    # (rank 1 would fail to load it on every request) nor skip saving it again.
    side = SchedulerSide(ns, ConnectorConfig(lookup_cache_s=0, **SYNC), store, StatsCollector(),
                         workers=[(ns, 0), (ns, 1)])
    req = make_request(hash_fn, "r1", 3 * BS)
    fill(store, ns.keys(hashes(req, 2), 0))                 # only rank 0 has them
    assert side.get_num_new_matched_tokens(req, 0)[0] == 0
    meta = side.build_connector_meta(step(req, [1, 2, 3], 0, 3 * BS))
    assert [s.block_hashes for s in meta.saves] == [hashes(req, 3)]   # saved again
    fill(store, ns.keys(hashes(req, 2), 1))
    assert side.get_num_new_matched_tokens(make_request(hash_fn, "r2", 3 * BS), 0)[0] == 2 * BS


def test_a_gap_stops_the_prefix_and_salts_never_match(hash_fn, ns, store):
    side = side_for(ns, store)
    req = make_request(hash_fn, "r1", 5 * BS)
    keys = ns.keys(hashes(req, 5), 0)
    fill(store, [keys[0], keys[2], keys[3]])
    assert side.get_num_new_matched_tokens(req, 0)[0] == BS
    other = make_request(hash_fn, "r2", 5 * BS, salt="other")
    unsalted = make_request(hash_fn, "r3", 5 * BS, salt=None)
    assert side.get_num_new_matched_tokens(other, 0)[0] == 0
    assert side.get_num_new_matched_tokens(unsalted, 0)[0] == 0
    salted_only = side_for(ns, store, salted_only=True)
    fill(store, ns.keys(hashes(unsalted, 2), 0))
    assert salted_only.get_num_new_matched_tokens(unsalted, 0)[0] == 0


def test_saves_cover_completed_blocks_once_and_respect_the_cap(hash_fn, ns, store):
    side = side_for(ns, store, max_stored_tokens_per_request=3 * BS)
    req = make_request(hash_fn, "r1", 5 * BS + 3)
    side.get_num_new_matched_tokens(req, 0)
    ids = [10, 11, 12, 13, 14, 15]
    # Chunked prefill: the first step computes 2.5 blocks -> blocks 0 and 1 are saved.
    meta = side.build_connector_meta(step(req, ids, 0, 2 * BS + 8))
    assert [s.block_ids for s in meta.saves] == [[10, 11]]
    assert meta.saves[0].block_hashes == hashes(req, 2)     # rank-free: workers make keys
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


def test_a_step_that_computes_nothing_is_marked_idle_for_the_workers(hash_fn, ns, store):
    """Its requests all wait for their KV: the workers may wait for a load to end."""
    side = side_for(ns, store)
    req = make_request(hash_fn, "r1", 2 * BS + 1)
    assert side.build_connector_meta(step(req, [1, 2, 3], 0, 2 * BS + 1)).idle is False
    assert side.build_connector_meta(SchedulerOutput.make_empty()).idle is True


def test_loads_are_planned_for_allocated_blocks_and_failed_hashes_are_forgotten(hash_fn, ns, store):
    side = side_for(ns, store)
    req = make_request(hash_fn, "r1", 4 * BS + 1)
    hs = hashes(req, 4)
    fill(store, ns.keys(hs, 0))
    n, _ = side.get_num_new_matched_tokens(req, BS)
    assert n == 3 * BS
    side.update_state_after_alloc(req, Blocks([7, 8, 9, 10, 11]), n)
    meta = side.build_connector_meta(step(req, [7, 8, 9, 10, 11], 4 * BS, 1))
    assert len(meta.loads) == 1
    assert meta.loads[0].block_ids == [8, 9, 10] and meta.loads[0].block_hashes == hs[1:4]
    # A worker reports a block it could not load: the scheduler stops trusting that hash.
    side.update_connector_output(type("Out", (), {
        "kv_connector_worker_meta": CWMWorkerMetadata(failed={hs[1]})})())
    store.delete(ns.key(hs[1], 0))
    assert side.get_num_new_matched_tokens(make_request(hash_fn, "r9", 4 * BS + 1), 0)[0] == BS


def loading_three(hash_fn, ns, store, ids: list[int]):
    """A request of ``len(ids) - 1`` blocks and a token whose first 3 blocks are stored,
    promised and allocated ``ids``: (the scheduler side, the request, its block hashes)."""
    side = side_for(ns, store)
    req = make_request(hash_fn, "r1", (len(ids) - 1) * BS + 1)
    hs = hashes(req, len(ids) - 1)
    fill(store, ns.keys(hs[:3], 0))
    n, _ = side.get_num_new_matched_tokens(req, 0)
    assert n == 3 * BS
    side.update_state_after_alloc(req, Blocks(ids), n)
    return side, req, hs


def test_blocks_a_request_loads_are_never_saved_again_by_it(hash_fn, ns, store):
    """The loaded blocks' hashes may be forgotten between the lookup and the step that
    prefills the request (a worker's memory tier reported them dropped; a durable lookup is
    trusted for seconds): they were just read from the store, so the step plans no save of
    them (one would copy every loaded block out of the cache again: an 8k-token restore
    from disk spent ~100 ms faulting in and filling a 188 MB staging copy), only of the
    blocks the request computes."""
    ids = [7, 8, 9, 10, 11, 12]
    side, req, hs = loading_three(hash_fn, ns, store, ids)
    side.build_connector_meta(SchedulerOutput.make_empty())    # the load's step
    side.update_connector_output(type("Out", (), {              # the memory tier dropped them
        "kv_connector_worker_meta": CWMWorkerMetadata(dropped=set(hs[:3]), step=1)})())
    assert all(side.known.get(h) is None for h in hs[:3])
    meta = side.build_connector_meta(step(req, ids, 3 * BS, 2 * BS + 1))
    assert [s.block_hashes for s in meta.saves] == [hs[3:5]]     # computed here, not loaded


def test_a_request_rolled_back_by_a_failed_load_has_its_blocks_planned_again(hash_fn, ns,
                                                                             store):
    """vLLM rolls a request back to a block whose load failed and recomputes from there;
    the workers did not save what was computed over it and reported those hashes failed.
    The blocks recomputed must be planned for saving again, not skipped as handled."""
    ids = [7, 8, 9, 10, 11, 12, 13]
    side, req, hs = loading_three(hash_fn, ns, store, ids)
    meta = side.build_connector_meta(step(req, ids, 3 * BS, 3 * BS + 1))
    assert [s.block_ids for s in meta.saves] == [[10, 11, 12]]  # computed over the loads
    side.update_connector_output(type("Out", (), {  # block 1's load failed: not saved
        "kv_connector_worker_meta": CWMWorkerMetadata(failed={hs[1], *hs[3:6]})})())
    out = SchedulerOutput.make_empty()  # vLLM: num_computed_tokens back to block 1
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=["r1"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
        new_block_ids=[None], num_computed_tokens=[BS], num_output_tokens=[0])
    out.num_scheduled_tokens = {"r1": 5 * BS + 1}
    meta = side.build_connector_meta(out)
    assert [s.block_hashes for s in meta.saves] == [[hs[1], *hs[3:6]]]


def test_hit_sources_name_the_tier(hash_fn, ns, store):
    side = SchedulerSide(ns, ConnectorConfig(**SYNC), store, StatsCollector(),
                         stored_source=CacheHitSource.HOST)
    req = make_request(hash_fn, "r1", 4 * BS + 1)
    hs = hashes(req, 4)
    fill(store, ns.keys(hs[:2], 0))                          # on disk (the index knows them)
    side.update_connector_output(type("Out", (), {           # a worker holds the next two
        "kv_connector_worker_meta": CWMWorkerMetadata(stored={(hs[2], 0), (hs[3], 0)})})())
    n, _ = side.get_num_new_matched_tokens(req, 0)
    assert n == 4 * BS
    side.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5]), n)
    assert side.get_external_cache_hit_sources(req, n) == {
        CacheHitSource.DISK: 2 * BS, CacheHitSource.HOST: 2 * BS}
    assert hit_source_of_saves(StoreConfig(memory_bytes=0, disk_path="/x")) == CacheHitSource.DISK
    assert hit_source_of_saves(StoreConfig(memory_bytes=0, redis_url="redis://h")) == \
        CacheHitSource.EXTERNAL_UNSPECIFIED


@pytest.mark.redis
def test_hits_found_only_in_redis_are_external(hash_fn, ns, open_store, redis_server):
    store = open_store(ns.fingerprint, disk_path=None, redis_url=redis_server.url,
                       redis_write="through")
    side = side_for(ns, store)
    req = make_request(hash_fn, "r1", 2 * BS + 1)
    fill(store, ns.keys(hashes(req, 2), 0))
    n, _ = side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, Blocks([1, 2, 3]), n)
    assert side.get_external_cache_hit_sources(req, n) == {
        CacheHitSource.EXTERNAL_UNSPECIFIED: 2 * BS}


def test_shutdown_closes_the_store(ns, store):
    side = side_for(ns, store)
    side.shutdown()
    with pytest.raises(RuntimeError, match="closed"):
        store.put(b"k" * 50, torch.ones(2))


def with_params(req: Request, **cwm) -> Request:
    req.kv_transfer_params = {"cwm": cwm}
    return req


def finish(side: SchedulerSide, req: Request, ids: list[int]) -> None:
    side.get_num_new_matched_tokens(req, 0)
    side.build_connector_meta(step(req, ids, 0, req.num_tokens))
    side.request_finished(req, ids)
    side.store.flush()


def test_turn_records_are_kept_by_slot_and_background_requests_leave_no_trace(hash_fn, ns,
                                                                              store):
    from cwm_plugin.connector import records
    from cwm_plugin.connector.params import params_of

    side = side_for(ns, store)
    turn3 = with_params(make_request(hash_fn, "t3", 3 * BS), turn=3, keep=2)
    finish(side, turn3, [1, 2, 3])

    def rec(key):
        t = store.get(key, salt="salt")
        return records.ContextRecord.from_tensor(t) if t is not None else None

    assert rec(records.turn_record_key("salt", 3 % 2)).turn == 3
    assert rec(records.context_record_key("salt")).num_prompt_tokens == 3 * BS
    # the sidecar's summary under the session's salt (it has a salt of its own, but even
    # so): no lookup, no save, no record
    bg = with_params(make_request(hash_fn, "bg", 4 * BS), store=False)
    assert side.get_num_new_matched_tokens(bg, 0) == (0, False)
    assert side.build_connector_meta(step(bg, [5, 6, 7, 8], 0, 4 * BS)).saves == []
    side.request_finished(bg, [5, 6, 7, 8])
    warm = with_params(make_request(hash_fn, "w", 2 * BS + 1), record=False)
    finish(side, warm, [9, 10, 11])
    store.flush()
    latest = rec(records.context_record_key("salt"))
    assert latest.turn == 3 and len(latest.tokens) == 3 * BS   # still the client's turn
    # turn 5 replaces turn 3 in slot 1; malformed parameters are the defaults, never an error
    finish(side, with_params(make_request(hash_fn, "t5", 3 * BS), turn=5, keep=2), [1, 2, 3])
    assert rec(records.turn_record_key("salt", 1)).turn == 5
    for bad in ({"turn": "7"}, {"turn": True, "keep": 0}, {"keep": 10_000}, "cwm"):
        req = make_request(hash_fn, "x", BS)
        req.kv_transfer_params = {"cwm": bad}
        p = params_of(req)
        assert p.turn is None and p.keep == 8 and p.store and p.record


def test_a_turn_that_finishes_late_never_replaces_a_later_turns_record(hash_fn, ns, store):
    """Records go by the order the turns arrived at the sidecar (``at``), not by the order
    vLLM finished them: turn 6 finishing before turn 5 stays the session's latest."""
    from cwm_plugin.connector import records

    side = side_for(ns, store)
    side.served_model = "tiny-served"

    def rec(key):
        return records.ContextRecord.from_tensor(store.get(key, salt="salt"))

    finish(side, with_params(make_request(hash_fn, "t6", 4 * BS), turn=6, keep=4, at=1006.0),
           [1, 2, 3, 4])
    finish(side, with_params(make_request(hash_fn, "t5", 3 * BS), turn=5, keep=4, at=1005.0),
           [5, 6, 7])
    latest = rec(records.context_record_key("salt"))
    assert (latest.turn, latest.arrived, len(latest.tokens)) == (6, 1006.0, 4 * BS)
    assert latest.model == "tiny-served"                    # the served name, for warm-ups
    assert rec(records.turn_record_key("salt", 5 % 4)).turn == 5   # its own slot is its own
    # turn 9 (slot 1, arrived later) took turn 5's slot; turn 5 again, late: it stays 9's
    finish(side, with_params(make_request(hash_fn, "t9", 2 * BS), turn=9, keep=4, at=1009.0),
           [8, 9])
    finish(side, with_params(make_request(hash_fn, "t5b", 3 * BS), turn=5, keep=4, at=1005.5),
           [5, 6, 7])
    assert rec(records.turn_record_key("salt", 1)).turn == 9
    assert rec(records.context_record_key("salt")).turn == 9
    # a request naming no arrival (a client of vLLM itself) is ordered by when it finished
    finish(side, make_request(hash_fn, "plain", 2 * BS), [1, 2])
    assert rec(records.context_record_key("salt")).turn is None
