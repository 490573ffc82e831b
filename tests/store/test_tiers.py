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
    assert d.put(bid(1), b"a" * 400) and d.put(bid(2), b"b" * 400)
    assert d.get(bid(1)) == b"a" * 400
    assert d.path(bid(1)).parent.parent.parent == d.blob_dir
    d.index.set_pinned(bid(1), True)
    d.get_many([bid(2)])
    assert d.put(bid(3), b"c" * 400)            # evicts 2 (1 is pinned)
    assert d.get(bid(2)) is None and d.get(bid(1)) is not None
    assert d.usage().bytes == 800 and d.evictions == 1
    assert not d.put(bid(4), b"x" * 1001)
    assert list(d.tmp_dir.iterdir()) == []
    d.close()


def test_disk_refuses_when_only_pinned_left(tmp_path):
    d = DiskTier(tmp_path, budget=500)
    d.put(bid(1), b"a" * 400)
    d.index.set_pinned(bid(1), True)
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
    assert ix.unmap_key(b"k1") == (bid(1), 1)
    assert ix.unmap_key(b"k2") == (bid(1), 0)
    assert ix.unreferenced() == [(bid(1), 10)]
    ix.set_pinned(bid(1), True)
    assert ix.unreferenced() == [] and ix.is_pinned(bid(1))
    ix2 = BlobIndex(tmp_path / "i.sqlite")      # a second opener sees the same catalog
    assert ix2.totals() == (10, 1)
    ix.close(), ix2.close()
