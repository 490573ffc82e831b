"""Single tiers: memory LRU and pins, disk atomic writes, budget, ENOSPC, the SQLite index."""

from __future__ import annotations

import errno
import os

import pytest

from cwm_plugin.errors import StorageFull
from cwm_plugin.store.index import BlobIndex
from cwm_plugin.store.tiers.disk import DiskTier
from cwm_plugin.store.tiers.memory import MemoryTier

pytestmark = pytest.mark.unit


def bid(i: int) -> str:
    return f"{i:040x}"


def test_memory_lru_budget_and_pins():
    evicted: list[str] = []
    m = MemoryTier(300, on_evict=evicted.extend)
    for i in range(3):
        assert m.put(bid(i), bytes(100))
    m.pin(bid(0))
    m.get(bid(1))                       # 1 is now more recent than 2
    assert m.put(bid(3), bytes(100))
    assert evicted == [bid(2)]
    assert m.contains(bid(0)) and m.contains(bid(1)) and not m.contains(bid(2))
    assert not m.put(bid(4), bytes(301))        # larger than the whole budget
    m.pin(bid(1)), m.pin(bid(3))
    assert not m.put(bid(5), bytes(100))        # everything pinned: refused, nothing lost
    assert m.usage().bytes == 300 and m.usage().blobs == 3


def test_disk_atomic_layout_and_budget(tmp_path):
    d = DiskTier(tmp_path, budget=1000)
    assert d.put(bid(1), b"a" * 400, key=b"k1") and d.put(bid(2), b"b" * 400)
    assert d.get(bid(1)) == b"a" * 400 and d.index.lookup(b"k1") == bid(1)
    assert d.path(bid(1)).parent.parent.parent == d.blob_dir
    d.index.pin_key(b"k1")
    d.get_many([bid(2)])
    assert d.put(bid(3), b"c" * 400)            # evicts 2 (1 is pinned)
    assert d.get(bid(2)) is None and d.get(bid(1)) is not None
    assert d.usage().bytes == 800 and d.evictions == 1
    assert not d.put(bid(4), b"x" * 1001)
    assert list(d.tmp_dir.iterdir()) == []
    d.close()


def test_disk_refuses_when_only_pinned_left(tmp_path):
    d = DiskTier(tmp_path, budget=500)
    d.put(bid(1), b"a" * 400, key=b"k1")
    d.index.pin_key(b"k1")
    assert not d.put(bid(2), b"b" * 400)
    assert d.get(bid(1)) == b"a" * 400 and d.get(bid(2)) is None
    d.close()


def test_disk_enospc_evicts_and_retries(tmp_path, monkeypatch):
    d = DiskTier(tmp_path, budget=10_000)
    d.put(bid(1), b"a" * 1000)
    real_write = os.write
    calls = {"n": 0}

    def full_once(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_once)
    assert d.put(bid(2), b"b" * 1000)
    assert d.get(bid(1)) is None and d.get(bid(2)) == b"b" * 1000   # 1 was evicted for room
    assert list(d.tmp_dir.iterdir()) == []
    d.close()


def test_disk_enospc_with_nothing_to_evict_is_storage_full(tmp_path, monkeypatch):
    d = DiskTier(tmp_path, budget=10_000)

    def always_full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", always_full)
    with pytest.raises(StorageFull):
        d.put(bid(2), b"b" * 1000)
    assert d.get(bid(2)) is None and not d.contains(bid(2))
    assert list(d.tmp_dir.iterdir()) == [] and d.usage().blobs == 0
    d.close()


def test_index_refcounts_and_pins(tmp_path):
    ix = BlobIndex(tmp_path / "i.sqlite")
    assert not ix.map_key(b"k", bid(1))          # no such blob yet
    ix.add_blob(bid(1), 10)
    assert ix.map_key(b"k1", bid(1)) and ix.map_key(b"k2", bid(1))
    assert ix.refcount(bid(1)) == 2
    assert ix.lookup_many([b"k1", b"k2", b"zz"]) == {b"k1": bid(1), b"k2": bid(1)}
    ix.pin_key(b"k1")
    assert ix.is_pinned(bid(1)) and ix.is_key_pinned(b"k1") and not ix.is_key_pinned(b"k2")
    ix.pin_key(b"k2")
    ix.pin_key(b"k2", False)                     # unpinning one key leaves the other's pin
    assert ix.is_pinned(bid(1)) and ix.eviction_candidates(100) == []
    assert ix.unmap_key(b"k1") == (bid(1), 1)    # deleting a key drops its pin
    assert not ix.is_key_pinned(b"k1") and not ix.is_pinned(bid(1))
    assert ix.eviction_candidates(100) == [(bid(1), 10)]
    assert ix.unmap_key(b"k2") == (bid(1), 0)
    assert ix.unreferenced() == [(bid(1), 10)]
    assert ix.unreferenced(min_age_s=3600) == []  # too young to collect
    ix2 = BlobIndex(tmp_path / "i.sqlite")      # a second opener sees the same catalog
    assert ix2.totals() == (10, 1)
    ix.close(), ix2.close()


def test_index_pin_before_mapping_and_repoint(tmp_path):
    ix = BlobIndex(tmp_path / "i.sqlite")
    ix.pin_key(b"late")                          # write-behind: the pin lands first
    ix.add_blob(bid(1), 10, key=b"late")
    assert ix.is_pinned(bid(1))
    ix.add_blob(bid(2), 20, key=b"other")
    assert ix.repoint(b"late", bid(2)) == (True, bid(1), 0)
    assert ix.is_pinned(bid(2)) and not ix.is_pinned(bid(1))
    assert ix.repoint(b"late", bid(2)) == (True, None, 0)
    assert ix.repoint(b"x", bid(9)) == (False, None, 0)
    assert ix.map_key(b"other", bid(1)) and ix.lookup(b"other") == bid(2)   # first one wins
    assert ix.totals() == (30, 2)
    ix.remove_blobs([bid(1)])
    assert ix.totals() == (20, 1)
    ix.close()


def test_index_migrates_format_1_pins_and_totals(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / "old.sqlite")
    a, b = bid(1), bid(2)
    db.executescript(f"""
        CREATE TABLE blobs (blob_id TEXT PRIMARY KEY, size INTEGER NOT NULL,
                            pinned INTEGER NOT NULL DEFAULT 0, last_access REAL NOT NULL);
        CREATE TABLE keys (key BLOB PRIMARY KEY, blob_id TEXT NOT NULL);
        INSERT INTO blobs VALUES ('{a}', 5, 1, 0), ('{b}', 7, 0, 0);
        INSERT INTO keys VALUES (x'01', '{a}'), (x'02', '{a}'), (x'03', '{b}');
    """)
    db.commit()
    db.close()
    ix = BlobIndex(tmp_path / "old.sqlite")
    assert ix.totals() == (12, 2)
    assert ix.is_key_pinned(b"\x01") and ix.is_key_pinned(b"\x02")
    assert not ix.is_key_pinned(b"\x03") and ix.is_pinned(bid(1))
    assert ix.unreferenced() == []
    ix.close()
