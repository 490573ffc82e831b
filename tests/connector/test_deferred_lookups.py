"""The scheduler side never waits on the store: lookups in the background with a deadline,
leases on promised blocks until their load, failed asynchronous loads recomputed. Real vLLM
requests and block hashing over a real disk store (SQLite index)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from connector_helpers import BS, SYNC
from vllm import SamplingParams
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.keys import kv_block_hashes
from cwm_plugin.connector.metadata import CWMWorkerMetadata
from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.scheduler.side import SchedulerSide
from cwm_plugin.testing.procs import hold_sqlite_write_lock, wait_until

pytestmark = pytest.mark.unit
STEP_BOUND_S = 0.2     # generous for a loaded 2-core machine: the stall was the store's time


def side_for(ns, store, *, async_loads: bool = False, **cfg) -> SchedulerSide:
    return SchedulerSide(ns, ConnectorConfig(**cfg), store, StatsCollector(),
                         async_loads=async_loads)


def make_request(hash_fn, rid: str, n_tokens: int, salt: str = "salt") -> Request:
    return Request(rid, list(range(100, 100 + n_tokens)), SamplingParams(max_tokens=4), None,
                   cache_salt=salt,
                   block_hasher=kv_cache_utils.get_request_block_hasher(BS, hash_fn))


def fill(store, keys: list[bytes]) -> None:
    for k in keys:
        store.put(k, torch.ones(2, 2, BS, 16)).result()
    store.flush()


def keys_of(ns, req: Request, n: int) -> list[bytes]:
    return ns.keys(kv_block_hashes(req.block_hashes, n), 0)


def timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


class Gate:
    """Hold the store's lookups until opened (a stuck SQLite or Redis, in-process)."""

    def __init__(self, store, monkeypatch) -> None:
        self.open = threading.Event()
        self.calls = 0
        real = store.where_many

        def where_many(keys):
            self.calls += 1
            self.open.wait(30)
            return real(keys)
        monkeypatch.setattr(store, "where_many", where_many)


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int]]:
        return (self.ids,)


class Output:
    """What update_connector_output reads of vLLM's KVConnectorOutput."""

    def __init__(self, *, recving=(), invalid=(), meta: CWMWorkerMetadata | None = None):
        self.finished_recving = set(recving)
        self.invalid_block_ids = set(invalid)
        self.kv_connector_worker_meta = meta


def test_a_stuck_store_defers_the_request_not_the_step(hash_fn, ns, store, monkeypatch):
    fill(store, keys_of(ns, make_request(hash_fn, "x", 3 * BS + 1), 3))
    gate = Gate(store, monkeypatch)
    side = side_for(ns, store, lookup_wait_ms=2, lookup_deadline_ms=30_000)
    req = make_request(hash_fn, "r1", 3 * BS + 1)
    answer, seconds = timed(side.get_num_new_matched_tokens, req, 0)
    assert answer == (None, False) and seconds < STEP_BOUND_S      # ask again next step
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    gate.open.set()
    wait_until(lambda: side.get_num_new_matched_tokens(req, 0)[0] is not None, timeout=10,
               interval=0.01, what="the lookup to finish")
    assert side.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
    assert gate.calls == 1                                  # one lookup, not one a step
    counted = side.stats.snapshot()
    assert counted["lookups_deferred"] >= 2 and "lookup_timeouts" not in counted
    assert counted["lookup_seconds"] < 3 * STEP_BOUND_S     # the steps' share only
    assert counted["lookup_store_seconds"] > 0               # the store's time, off the step


def test_a_fast_store_answers_in_the_same_step(hash_fn, ns, store):
    req = make_request(hash_fn, "r1", 2 * BS + 1)
    fill(store, keys_of(ns, req, 2))
    side = side_for(ns, store, lookup_wait_ms=5_000)        # a budget a fast store never uses up
    assert side.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    assert "lookups_deferred" not in side.stats.snapshot()


def test_a_lookup_past_its_deadline_computes_what_is_not_known(hash_fn, ns, store, monkeypatch):
    req = make_request(hash_fn, "r1", 4 * BS + 1)
    hs = kv_block_hashes(req.block_hashes, 4)
    fill(store, keys_of(ns, req, 4))
    gate = Gate(store, monkeypatch)
    side = side_for(ns, store, lookup_wait_ms=1, lookup_deadline_ms=150)
    side.update_connector_output(Output(meta=CWMWorkerMetadata(stored={(hs[0], 0), (hs[1], 0)})))
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    time.sleep(0.25)
    answer, seconds = timed(side.get_num_new_matched_tokens, req, 0)
    assert answer == (2 * BS, False) and seconds < STEP_BOUND_S    # the known blocks only
    assert side.stats.snapshot()["lookup_timeouts"] == 1
    gate.open.set()


def test_a_locked_sqlite_index_costs_the_step_nothing_and_the_lease_waits(hash_fn, ns, store,
                                                                          tmp_path):
    """Another process holds SQLite's write lock: lookups (WAL reads) answer, the lease (a
    write) waits in the background and lands when the lock is released."""
    req = make_request(hash_fn, "r1", 3 * BS + 1)
    keys = keys_of(ns, req, 3)
    fill(store, keys)
    side = side_for(ns, store, lookup_wait_ms=2_000, lease_ttl_s=30)
    holder = hold_sqlite_write_lock(tmp_path / "store" / "index.sqlite", 1.5)
    answer, seconds = timed(side.get_num_new_matched_tokens, req, 0)
    assert answer == (3 * BS, False) and seconds < 1.0
    assert not store.key_info(keys[0])["disk"].pinned      # the lease waits for the lock
    assert holder.wait(timeout=30) == 0
    wait_until(lambda: store.key_info(keys[0])["disk"].pinned, timeout=30,
               what="the lease to be taken after the lock")
    assert side.stats.snapshot()["leases|event=taken"] == 1


def test_promised_blocks_are_leased_until_loaded_and_windows_pins_are_left_alone(
        hash_fn, ns, store):
    req = make_request(hash_fn, "r1", 3 * BS + 1)
    keys = keys_of(ns, req, 3)
    fill(store, keys)
    store.pin_many([keys[0]])                                # a window's pin: no expiry
    side = side_for(ns, store, **SYNC, lease_ttl_s=30, async_loads=True)
    n, asynchronous = side.get_num_new_matched_tokens(req, 0)
    assert (n, asynchronous) == (3 * BS, True)
    wait_until(lambda: side.stats.snapshot().get("leases|event=taken") == 1, timeout=10, interval=0.02,
               what="the lease")
    info = {k: store.key_info(k)["disk"] for k in keys}
    assert info[keys[0]].pinned and info[keys[0]].pin_expires is None   # not shortened
    for k in keys[1:]:
        assert info[k].pinned and 0 < info[k].pin_expires - time.time() <= 30
    side.update_state_after_alloc(req, Blocks([4, 5, 6, 7]), n)
    meta = side.build_connector_meta(_new_step(req, [4, 5, 6, 7]))
    assert [t.block_ids for t in meta.loads] == [[4, 5, 6]]
    side.update_connector_output(Output())                   # not loaded yet: still leased
    time.sleep(0.2)
    assert store.key_info(keys[1])["disk"].pinned
    side.update_connector_output(Output(recving={"r1"}))     # the workers loaded it
    wait_until(lambda: not store.key_info(keys[1])["disk"].pinned, timeout=10, interval=0.02,
               what="the lease's release")
    assert not store.key_info(keys[2])["disk"].pinned
    assert store.key_info(keys[0])["disk"].pinned           # the window's pin stays
    counted = side.stats.snapshot()
    assert counted["leases|event=released"] == 1 and "load_failures_recomputed" not in counted


def test_a_lease_that_outlived_its_ttl_is_counted_expired_and_a_finished_request_releases(
        hash_fn, ns, store):
    one, two = (make_request(hash_fn, r, 2 * BS + 1, salt=r) for r in ("a", "b"))
    fill(store, keys_of(ns, one, 2) + keys_of(ns, two, 2))
    side = side_for(ns, store, **SYNC, lease_ttl_s=0.3, async_loads=True)
    assert side.get_num_new_matched_tokens(one, 0)[0] == 2 * BS
    assert side.get_num_new_matched_tokens(two, 0)[0] == 2 * BS
    wait_until(lambda: side.stats.snapshot().get("leases|event=taken") == 2, timeout=10, interval=0.02,
               what="two leases")
    side.request_finished(two, [])                           # aborted before any load
    time.sleep(0.5)
    side.request_finished(one, [])                           # ... after its lease expired
    wait_until(lambda: side.stats.snapshot().get("leases|event=expired") == 1, timeout=10, interval=0.02,
               what="the expired lease counted")
    assert side.stats.snapshot()["leases|event=released"] == 1
    assert not any(store.key_info(k)["disk"].pinned for k in keys_of(ns, two, 2))


def test_a_failed_async_load_is_recomputed_and_never_promised_again(hash_fn, ns, store):
    req = make_request(hash_fn, "r1", 3 * BS + 1)
    fill(store, keys_of(ns, req, 3))
    side = side_for(ns, store, **SYNC, async_loads=True)
    n, _ = side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, Blocks([4, 5, 6, 7]), n)
    side.build_connector_meta(_new_step(req, [4, 5, 6, 7]))
    # block 4 failed (evicted between the lookup and the load): vLLM recomputes from it
    side.update_connector_output(Output(recving={"r1"}, invalid={4},
                                        meta=CWMWorkerMetadata(failed=set(
                                            kv_block_hashes(req.block_hashes, 3)))))
    assert side.stats.snapshot()["load_failures_recomputed"] == 1
    # vLLM asks again for the request it rolled back to 0: the index still lists the blocks,
    # a second promise would fail the same way
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)


def test_trust_in_stored_blocks_expires_where_a_durable_tier_could_lose_them(hash_fn, ns,
                                                                             store):
    req = make_request(hash_fn, "r1", 2 * BS + 1)
    hs = kv_block_hashes(req.block_hashes, 2)
    side = side_for(ns, store, **SYNC, stored_trust_s=0.2)
    side.update_connector_output(Output(meta=CWMWorkerMetadata(stored={(h, 0) for h in hs})))
    assert side.get_num_new_matched_tokens(req, 0)[0] == 2 * BS   # believed, no lookup
    time.sleep(0.3)              # another process evicted them meanwhile (never stored here)
    assert side.get_num_new_matched_tokens(req, 0)[0] == 0


def _new_step(req: Request, block_ids: list[int]):
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(req, (block_ids,))]
    out.num_scheduled_tokens = {}
    return out


def test_leases_cancelled_before_they_ran_give_their_backlog_room_back(store, monkeypatch):
    """A request ending while its lease waits behind a stuck store frees its place: after
    more such cancellations than the backlog holds, a lease is still taken."""
    from cwm_plugin.connector.scheduler.leases import Leases

    stuck, go = threading.Event(), threading.Event()
    leases = Leases(store, StatsCollector(), ttl_s=30, backlog=3)
    real = leases._lease

    def slow(keys):
        if not stuck.is_set():
            stuck.set()
            go.wait(10)           # the first job holds the only lease thread
        return real(keys)

    monkeypatch.setattr(leases, "_lease", slow)
    leases.take("first", [b"k" * 50])
    stuck.wait(5)
    for i in range(10):        # queued behind it, then their requests end
        leases.take(f"r{i}", [bytes([i]) * 50])
        leases.release(f"r{i}")
    go.set()
    leases.take("later", [b"z" * 50])
    assert leases.holding("later")            # room was given back: a lease was queued
    assert leases.stats.snapshot().get("leases|failed", 0) == 0
    leases.shutdown()


def test_a_synchronous_load_is_settled_by_the_output_that_names_it(hash_fn, ns, store):
    """Device workers load in the step (not in the background); with vLLM's async scheduling
    the next step is built before this step's output arrives, so an output that does not name
    the load (an earlier step's) must not release its lease or lose its failed blocks."""
    req = make_request(hash_fn, "r1", 3 * BS + 1)
    keys = keys_of(ns, req, 3)
    fill(store, keys)
    side = side_for(ns, store, **SYNC, lease_ttl_s=30, async_loads=False)
    n, asynchronous = side.get_num_new_matched_tokens(req, 0)
    assert (n, asynchronous) == (3 * BS, False)
    wait_until(lambda: side.stats.snapshot().get("leases|event=taken") == 1, timeout=10,
               interval=0.02, what="the lease")
    side.update_state_after_alloc(req, Blocks([4, 5, 6, 7]), n)
    side.build_connector_meta(_new_step(req, [4, 5, 6, 7]))
    side.update_connector_output(Output(invalid={5}))     # the previous step's output
    time.sleep(0.2)
    assert store.key_info(keys[1])["disk"].pinned and "load_failures_recomputed" not in \
        side.stats.snapshot()
    side.update_connector_output(Output(invalid={5}, meta=CWMWorkerMetadata(loaded={"r1"})))
    wait_until(lambda: not store.key_info(keys[1])["disk"].pinned, timeout=10, interval=0.02,
               what="the lease's release")
    assert side.stats.snapshot()["load_failures_recomputed"] == 1
