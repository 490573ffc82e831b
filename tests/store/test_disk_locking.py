"""The disk index under another process's write lock: lookups and loads never wait behind a
writer's busy wait, and writes go through once the lock is released. A real second process
holds SQLite's write lock (``BEGIN IMMEDIATE``) on the real index file."""

from __future__ import annotations

import threading
import time

import pytest

from cwm_plugin.store.tiers.disk import tier as disk
from cwm_plugin.store.tiers.disk.tier import DiskTier
from cwm_plugin.testing.procs import hold_sqlite_write_lock

pytestmark = pytest.mark.unit

HOLD_S = 3.0
BOUND_S = 0.5       # generous, and far below the whole hold (HOLD_S)


def bid(i: int) -> str:
    return f"{i:040x}"


def k(i: int) -> bytes:
    return b"G" * 18 + i.to_bytes(2, "big")


def timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def test_lookups_and_loads_never_wait_behind_a_writer_busy_waiting(tmp_path, monkeypatch):
    monkeypatch.setattr(disk, "TOUCH_EVERY_S", 0.0)     # every read also touches (a write)
    tier = DiskTier(tmp_path, budget=1 << 20)
    try:
        for i in range(4):
            assert tier.put(bid(i), bytes([i]) * 100, k(i))
        holder = hold_sqlite_write_lock(str(tmp_path / "index.sqlite"), HOLD_S)
        results: list[object] = []
        writer = threading.Thread(target=lambda: results.append(
            tier.put(bid(9), b"\x09" * 100, k(9))))
        writer.start()                                  # it waits for the other process
        time.sleep(0.3)
        assert writer.is_alive()
        found, lookup_s = timed(tier.lookup_many, [k(i) for i in range(4)] + [k(9)])
        datas, load_s = timed(tier.get_many, [bid(0), bid(1)])
        print(f"lookup {lookup_s:.3f}s, load {load_s:.3f}s under a {HOLD_S}s write lock")
        assert lookup_s < BOUND_S and load_s < BOUND_S
        assert found == [bid(i) for i in range(4)] + [None]   # the write is not in yet
        assert datas == [bytes([0]) * 100, bytes([1]) * 100]
        assert holder.wait(timeout=30) == 0
        released = time.time()
        writer.join(timeout=30)
        assert results == [True]                        # the writer went through afterwards
        assert tier.lookup_many([k(9)]) == [bid(9)]
        assert tier.put(bid(10), b"\x0a" * 100, k(10))
        assert tier.delete_many([k(10)]) == [k(10)]
        (last,) = tier.index.db.read("SELECT last_access FROM blobs WHERE blob_id=?", (bid(0),))
        assert last[0] >= released                      # the touch the lock put off landed
    finally:
        tier.close()


def test_opening_an_existing_index_takes_no_write_lock(tmp_path):
    """Every ``cwm store`` run opens the index, at idle CPU priority: a write transaction at
    open would hold the lock that the server's saves and leases need for as long as serving
    keeps that process off the cores. Opening an index that has its schema only reads, so it
    goes through while another process holds the write lock."""
    from cwm_plugin.store.tiers.disk.key_index import DiskKeyIndex

    path = tmp_path / "index.sqlite"
    DiskKeyIndex(path).close()                             # created once (a write)
    holder = hold_sqlite_write_lock(str(path), HOLD_S)
    try:
        index, open_s = timed(lambda: DiskKeyIndex(path, timeout_s=BOUND_S))
        assert open_s < BOUND_S
        index.close()
    finally:
        assert holder.wait(timeout=30) == 0
