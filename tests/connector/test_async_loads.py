"""CPU workers load in the background and never let vLLM's step wait on the store: real
tensors (vLLM's own KV allocator) over a real store."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_worker_side import block, finish_loads, h, make_worker, save

from cwm_plugin.connector.connector import CWMConnector
from cwm_plugin.connector.metadata import BlockTransfer, CWMConnectorMetadata
from cwm_plugin.connector.worker.side import WorkerSide

pytestmark = pytest.mark.unit
STEP_BOUND_S = 0.2      # generous for a loaded 2-core machine


def gate_reads(store, monkeypatch) -> threading.Event:
    """Hold the store's reads until the event is set (a stuck disk or Redis)."""
    opened = threading.Event()
    real = store.read_into

    def read_into(*args, **kw):
        opened.wait(30)
        return real(*args, **kw)
    monkeypatch.setattr(store, "read_into", read_into)
    return opened


def test_a_load_runs_in_the_background_and_is_reported_once_in_the_cache(open_store,
                                                                         monkeypatch):
    src = make_worker(open_store, seed=1)
    save(src, [1, 2, 3], [h(1), h(2), h(3)])
    dst = make_worker(open_store, store=src.store)
    assert dst.async_loads
    opened = gate_reads(dst.store, monkeypatch)
    t0 = time.monotonic()
    dst.start_load_kv(CWMConnectorMetadata(loads=[BlockTransfer("r1", [5, 6, 7],
                                                                [h(1), h(2), h(3)])]))
    assert time.monotonic() - t0 < STEP_BOUND_S              # the step went on
    assert dst.get_finished() == set() and dst.take_load_errors() == set()
    assert torch.count_nonzero(block(dst, 5)) == 0
    opened.set()
    assert dst.loader.wait(timeout=30)
    assert dst.get_finished() == {"r1"} and dst.take_load_errors() == set()
    for a, b in ((1, 5), (2, 6), (3, 7)):
        assert torch.equal(block(dst, b), block(src, a))
    assert dst.get_finished() == set()                       # reported once
    assert dst.stats.snapshot()["async_loads|outcome=ok"] == 1


def test_failed_blocks_come_in_the_pass_that_reports_the_request_finished(open_store):
    src = make_worker(open_store, seed=3)
    save(src, [1, 2], [h(1), h(2)])                          # h(3) was never stored
    dst = make_worker(open_store, store=src.store)
    dst.start_load_kv(CWMConnectorMetadata(loads=[BlockTransfer("r1", [10, 11, 12, 13],
                                                                [h(1), h(2), h(3), h(4)])]))
    assert dst.loader.wait(timeout=30)
    assert dst.take_load_errors() == set()                   # not before the request is done
    assert dst.get_finished() == {"r1"}
    assert dst.take_load_errors() == {12, 13}                # vLLM asks right after
    assert dst.take_worker_meta().failed == {h(3), h(4)}
    assert dst.stats.snapshot()["async_loads|outcome=failed"] == 1
    # vLLM recomputes blocks 12 and 13 in a later step: nothing spoils that step's saves
    dst.wait_for_save(CWMConnectorMetadata(saves=[BlockTransfer("r1", [12], [h(3)],
                                                                num_tokens=48)]))
    dst.store.flush()
    assert dst.store.contains_many([dst.ns.key(h(3), 0)]) == [True]


def test_promised_blocks_stay_in_the_memory_tier_until_loaded(open_store, monkeypatch):
    """The worker's memory tier is an LRU: saves during a load would evict the blocks it is
    about to read. They are pinned (a lease) until the load is done, then evictable again."""
    src = make_worker(open_store, seed=5, disk_path=None, memory_bytes=1 << 20)
    per_block = src.block_bytes + 1024
    dst = make_worker(open_store, seed=6, disk_path=None, memory_bytes=4 * per_block)
    save(dst, [1, 2], [h(1), h(2)])
    opened = gate_reads(dst.store, monkeypatch)
    dst.start_load_kv(CWMConnectorMetadata(loads=[BlockTransfer("r1", [9, 10], [h(1), h(2)])]))
    save(dst, [3, 4, 5, 6], [h(3), h(4), h(5), h(6)])        # would evict h(1), h(2)
    keys = dst.ns.keys([h(1), h(2)], 0, b"")
    assert dst.store.contains_many(keys) == [True, True]
    opened.set()
    assert dst.loader.wait(timeout=30)
    assert dst.get_finished() == {"r1"} and dst.take_load_errors() == set()
    assert torch.equal(block(dst, 9), block(dst, 1)) and torch.equal(block(dst, 10), block(dst, 2))
    assert not any(info.pinned for k in keys for info in dst.store.key_info(k).values())


def test_a_full_save_queue_drops_saves_instead_of_stalling_the_step(open_store, monkeypatch):
    worker = make_worker(open_store, seed=7, queue_depth=2)
    opened = threading.Event()
    disk = worker.store.disk
    real_put = disk.put

    def stuck_put(*args, **kw):                 # the disk is stuck (another process's lock)
        opened.wait(30)
        return real_put(*args, **kw)
    monkeypatch.setattr(disk, "put", stuck_put)
    t0 = time.monotonic()
    worker.wait_for_save(CWMConnectorMetadata(saves=[BlockTransfer(
        "r1", [1, 2, 3, 4, 5], [h(i) for i in range(1, 6)], num_tokens=80)]))
    assert time.monotonic() - t0 < STEP_BOUND_S
    counted = worker.stats.snapshot()
    assert counted["save_errors|reason=backpressure"] == 3
    opened.set()
    worker.store.flush()
    meta = worker.take_worker_meta()
    assert meta.failed == {h(3), h(4), h(5)}                 # the scheduler forgets them
    assert meta.stored == {(h(1), 0), (h(2), 0)}


def test_a_burst_larger_than_the_queue_waits_for_room_while_the_store_moves(open_store):
    worker = make_worker(open_store, seed=8, queue_depth=2)
    worker.save_wait_s = 30.0                    # room comes as the disk writes
    save(worker, [1, 2, 3, 4, 5], [h(i) for i in range(1, 6)])
    meta = worker.take_worker_meta()
    assert meta.stored == {(h(i), 0) for i in range(1, 6)} and not meta.failed
    assert "save_errors|reason=backpressure" not in worker.stats.snapshot()


def connector_over(worker: WorkerSide) -> CWMConnector:
    """The connector's worker half as vLLM drives it each step (bind, start_load_kv, ...)
    over a real WorkerSide; the rest of start-up is not under test."""
    connector = CWMConnector.__new__(CWMConnector)
    connector._connector_metadata = None
    connector._loads_started_for = None
    connector._worker = worker
    return connector


def test_background_loads_start_when_the_step_binds_its_metadata_before_the_forward(
        open_store):
    """vLLM calls start_load_kv after the forward unless a load is synchronous: started at
    bind, a load that ends during the forward is reported in the same step."""
    src = make_worker(open_store, seed=1)
    save(src, [1, 2, 3], [h(1), h(2), h(3)])
    dst = make_worker(open_store, store=src.store)
    connector = connector_over(dst)
    meta = CWMConnectorMetadata(loads=[BlockTransfer("r1", [5, 6, 7], [h(1), h(2), h(3)])])
    connector.bind_connector_metadata(meta)
    assert dst.loader.wait(timeout=30)                       # the forward would run here
    assert connector.get_finished(set()) == (None, {"r1"})
    connector.start_load_kv(None)                            # after the forward: no second load
    assert dst.loader.wait(timeout=30)
    assert connector.get_finished(set()) == (None, None)
    assert dst.stats.snapshot()["async_loads|outcome=ok"] == 1
    for a, b in ((1, 5), (2, 6), (3, 7)):
        assert torch.equal(block(dst, b), block(src, a))
    connector.bind_connector_metadata(meta)                  # bound again: started once
    assert dst.stats.snapshot()["async_loads|outcome=ok"] == 1


def test_an_idle_step_waits_for_a_running_load_instead_of_spinning(open_store, monkeypatch):
    """A step that schedules no tokens (every request waits for its KV) waits in
    get_finished for a running load to end, the GIL free, instead of returning at once and
    letting vLLM's loop spin through empty steps; a step that computes never waits, nor one
    with no load running."""
    from cwm_plugin.connector.worker import side
    monkeypatch.setattr(side, "IDLE_WAIT_S", 30.0)   # here: until the load ends
    src = make_worker(open_store, seed=1)
    save(src, [1, 2], [h(1), h(2)])
    dst = make_worker(open_store, store=src.store)
    connector = connector_over(dst)
    opened = gate_reads(dst.store, monkeypatch)
    meta = CWMConnectorMetadata(loads=[BlockTransfer("r1", [5, 6], [h(1), h(2)])])
    connector.bind_connector_metadata(meta)
    assert connector.get_finished(set()) == (None, None)     # computing: no wait
    connector.clear_connector_metadata()
    connector.bind_connector_metadata(CWMConnectorMetadata(step=2, idle=True))
    threading.Timer(0.2, opened.set).start()
    t0 = time.monotonic()
    assert connector.get_finished(set()) == (None, {"r1"})   # the idle step waited for it
    assert 0.1 < time.monotonic() - t0 < 20
    t0 = time.monotonic()
    assert connector.get_finished(set()) == (None, None)     # nothing runs: no wait
    assert time.monotonic() - t0 < STEP_BOUND_S
    assert torch.equal(block(dst, 5), block(src, 1)) and torch.equal(block(dst, 6), block(src, 2))


def test_synchronous_loads_still_start_in_start_load_kv(open_store):
    src = make_worker(open_store, seed=1)
    save(src, [1, 2], [h(1), h(2)])
    dst = make_worker(open_store, store=src.store, async_loads=False)
    connector = connector_over(dst)
    connector.bind_connector_metadata(
        CWMConnectorMetadata(loads=[BlockTransfer("r1", [5, 6], [h(1), h(2)])]))
    assert torch.count_nonzero(block(dst, 5)) == 0           # nothing loaded at bind
    connector.start_load_kv(None)
    assert torch.equal(block(dst, 5), block(src, 1)) and torch.equal(block(dst, 6), block(src, 2))


def test_a_synchronous_load_reads_the_memory_tier_only_never_disk_inside_the_step(
        open_store, monkeypatch):
    """It runs before vLLM's forward: a block the memory tier no longer holds (here: all of
    them, the memory dropped; the disk still has them) is a load error vLLM recomputes, not a
    disk read on the step. A background load of the same blocks reads them from disk."""
    src = make_worker(open_store, seed=1, memory_bytes=64 << 20)
    save(src, [1, 2], [h(1), h(2)])
    dst = make_worker(open_store, store=src.store)
    dst.store.reset_memory()
    disk = dst.store.disk
    touched: list[str] = []
    for name in ("exists_many", "get_many", "read_lent", "prefetch"):
        real = getattr(disk, name)

        def spy(*a, _name=name, _real=real, **kw):
            touched.append(_name)
            return _real(*a, **kw)
        monkeypatch.setattr(disk, name, spy)
    dst.start_load_kv(CWMConnectorMetadata(loads=[BlockTransfer("r1", [5, 6], [h(1), h(2)],
                                                                sync=True)]))
    assert touched == []
    assert dst.loader.take_sync_done() == {"r1"}
    assert dst.take_load_errors() == {5, 6}                  # recomputed by vLLM
    assert torch.count_nonzero(block(dst, 5)) == 0
    dst.start_load_kv(CWMConnectorMetadata(loads=[BlockTransfer("r2", [5, 6], [h(1), h(2)])]))
    assert finish_loads(dst) == set() and "read_lent" in touched
    assert torch.equal(block(dst, 5), block(src, 1)) and torch.equal(block(dst, 6), block(src, 2))


def test_a_synchronous_load_that_raises_is_recomputed_and_never_stops_the_step(
        open_store, monkeypatch, caplog):
    src = make_worker(open_store, seed=1, memory_bytes=64 << 20)
    save(src, [1, 2], [h(1), h(2)])
    dst = make_worker(open_store, store=src.store)

    def broken(*a, **kw):
        raise RuntimeError("the KV store is closed")
    monkeypatch.setattr(dst.store, "read_into", broken)
    dst.start_load_kv(CWMConnectorMetadata(loads=[BlockTransfer("r1", [5, 6], [h(1), h(2)],
                                                                sync=True)]))
    assert dst.loader.take_sync_done() == {"r1"}
    assert dst.take_load_errors() == {5, 6}                  # recomputed by vLLM
    assert "recomputed" in caplog.text
