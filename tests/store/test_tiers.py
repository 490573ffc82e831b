"""Single tiers beyond the shared contract: memory LRU and pins, disk atomic writes, budget,
ENOSPC, evictions reported, a damaged or old index rebuilt, an unusable directory."""

from __future__ import annotations

import errno
import os
import sqlite3

import pytest

from cwm_plugin.errors import StorageFull, TierUnavailable
from cwm_plugin.store.blob import codec
from cwm_plugin.store.tiers.disk.tier import DiskTier
from cwm_plugin.store.tiers.ram.tier import RamTier

pytestmark = pytest.mark.unit


def bid(i: int) -> str:
    return f"{i:040x}"


def k(i: int) -> bytes:
    return b"G" * 18 + i.to_bytes(2, "big")


def recording(tier):
    drops: list[tuple[list[bytes], str]] = []
    tier.set_drop_listener(lambda keys, why: drops.append((keys, why)))
    return drops


def test_memory_lru_reports_evictions_and_keeps_pins_out_of_the_lru():
    m = RamTier(300)
    drops = recording(m)
    for i in range(3):
        assert m.put(bid(i), bytes(100), k(i))
    m.pin_many([k(0)])
    m.get(bid(1))                                  # 1 is now more recent than 2
    assert m.put(bid(3), bytes(100), k(3))
    assert drops == [([k(2)], "evicted")] and m.lookup_many([k(2)]) == [None]
    assert bid(0) not in m._lru                    # eviction never walks past pins
    assert not m.put(bid(4), bytes(301), k(4))     # larger than the whole budget


def test_memory_refuses_before_evicting_when_pins_leave_no_room():
    # budget 300, 200 bytes pinned, 50 unpinned, put 150: refused, and the 50 stay mapped
    m = RamTier(300)
    drops = recording(m)
    m.put(bid(1), bytes(200), k(1))
    m.pin_many([k(1)])
    m.put(bid(2), bytes(50), k(2))
    assert not m.put(bid(3), bytes(150), k(3))
    assert m.lookup_many([k(2), k(3)]) == [bid(2), None] and m.get(bid(2)) == bytes(50)
    assert drops == [] and m.usage().bytes == 250


def test_memory_evictions_acknowledged_retire_first_and_free_once_seen():
    """The connector workers' memory tier: a put evicts nothing; the step's end retires what is
    over budget (reported dropped, still served); the blobs go once the scheduler has seen the
    report, except those a lease or a new save brought back."""
    m = RamTier(300)
    m.defer_evictions()
    drops = recording(m)
    for i in range(5):
        assert m.put(bid(i), bytes(100), k(i))      # 500 bytes: over, nothing evicted yet
    assert drops == [] and m.lookup_many([k(i) for i in range(5)]) == [bid(i) for i in range(5)]
    assert m.evict(step=7) == [k(0), k(1)]          # the coldest two, reported
    assert drops == [([k(0), k(1)], "evicted")]
    assert m.get(bid(0)) == bytes(100) and m.lookup_many([k(0)]) == [bid(0)]   # still here
    assert m.evict(step=8) == []                    # retired bytes are not counted twice
    m.lease_many([k(0)], ttl_s=60)                  # a promise made before the scheduler knew
    assert m.free_retired(upto=6) == 0              # not seen yet: kept
    assert m.free_retired(upto=7) == 1              # seen: k(1) goes, the leased k(0) stays
    assert m.lookup_many([k(0), k(1)]) == [bid(0), None] and m.get(bid(0)) == bytes(100)
    assert m.usage().bytes == 400 and m.usage().blobs == 4
    m.unpin_many([k(0)])
    assert m.evict(step=9) == [k(2)] and m.put(bid(2), bytes(100), k(2))   # saved again
    assert m.free_retired(upto=9) == 0 and m.lookup_many([k(2)]) == [bid(2)]
    assert not m.put(bid(9), bytes(301), k(9))      # larger than the budget: refused
    for i in range(10, 14):                          # twice the budget: evicted at once
        assert m.put(bid(i), bytes(100), k(i))
    assert m.usage().bytes <= 600


def test_disk_atomic_layout_budget_and_reported_evictions(tmp_path):
    d = DiskTier(tmp_path, budget=1000)
    drops = recording(d)
    assert d.put(bid(1), b"a" * 400, k(1)) and d.put(bid(2), b"b" * 400, k(2))
    assert d.get(bid(1)) == b"a" * 400 and d.lookup_many([k(1)]) == [bid(1)]
    assert d.path(bid(1)).parent.parent.parent == d.blob_dir
    d.pin_many([k(1)])
    assert d.put(bid(3), b"c" * 400, k(3))         # evicts 2 (1 is pinned)
    assert drops == [([k(2)], "evicted")]
    assert d.get(bid(2)) is None and d.get(bid(1)) is not None
    assert d.usage().bytes == 800 and d.usage().pinned_bytes == 400 and d.evictions == 1
    assert not d.put(bid(4), b"x" * 1001, k(4))
    assert list(d.tmp_dir.iterdir()) == []
    d.close()


def test_disk_refuses_when_only_pinned_left(tmp_path):
    d = DiskTier(tmp_path, budget=500)
    d.put(bid(1), b"a" * 400, k(1))
    d.pin_many([k(1)])
    assert not d.put(bid(2), b"b" * 400, k(2))
    assert d.get(bid(1)) == b"a" * 400 and d.get(bid(2)) is None
    d.close()


def test_disk_eviction_reads_an_index_of_unpinned_blobs_only(tmp_path):
    # eviction cost must not grow with the number of pins: the planner uses the partial index
    d = DiskTier(tmp_path, budget=1 << 20)
    plan = d.index.db.read("EXPLAIN QUERY PLAN SELECT blob_id, size FROM blobs WHERE pins = 0 "
                           "ORDER BY last_access")
    assert any("blobs_evictable" in str(row) for row in plan), plan
    d.close()


def test_disk_enospc_evicts_and_retries(tmp_path, monkeypatch):
    d = DiskTier(tmp_path, budget=10_000)
    d.put(bid(1), b"a" * 1000, k(1))
    real_write = os.write
    calls = {"n": 0}

    def full_once(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_once)
    assert d.put(bid(2), b"b" * 1000, k(2))
    assert d.get(bid(1)) is None and d.get(bid(2)) == b"b" * 1000   # 1 was evicted for room
    assert list(d.tmp_dir.iterdir()) == []
    d.close()


def test_disk_enospc_with_nothing_to_evict_is_storage_full(tmp_path, monkeypatch):
    d = DiskTier(tmp_path, budget=10_000)

    def always_full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", always_full)
    with pytest.raises(StorageFull):
        d.put(bid(2), b"b" * 1000, k(2))
    assert d.get(bid(2)) is None and not d.has_blob(bid(2))
    assert list(d.tmp_dir.iterdir()) == [] and d.usage().blobs == 0
    d.close()


def blob_for(key: bytes, seed: int) -> tuple[str, bytes]:
    import torch

    from cwm_plugin.store.blob.address import blob_id_of
    t = torch.randn(2, 8, generator=torch.Generator().manual_seed(seed))
    data = codec.encode(t, key=key, fingerprint="fp")
    return blob_id_of(data), data


@pytest.mark.parametrize("damage", ["garbage", "truncated", "old-format"])
def test_a_damaged_index_is_moved_aside_and_rebuilt_from_the_blob_files(tmp_path, damage):
    d = DiskTier(tmp_path, budget=1 << 20)
    blobs = [blob_for(k(i), i) for i in range(3)]
    for i, (b, data) in enumerate(blobs):
        d.put(b, data, k(i))
    d.close()
    index = tmp_path / "index.sqlite"
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"index.sqlite{suffix}").unlink(missing_ok=True)
    if damage == "garbage":
        raw = bytearray(index.read_bytes())
        raw[100:4096] = os.urandom(3996)           # the schema page and beyond
        index.write_bytes(bytes(raw))
    elif damage == "truncated":
        index.write_bytes(index.read_bytes()[:1500])
    else:                                          # an index written by format 1
        index.unlink()
        db = sqlite3.connect(index)
        db.executescript("CREATE TABLE blobs (blob_id TEXT PRIMARY KEY, size INTEGER, "
                         "pinned INTEGER, last_access REAL); CREATE TABLE keys (key BLOB, "
                         "blob_id TEXT);")
        db.close()
    d2 = DiskTier(tmp_path, budget=1 << 20, rebuild_in_background=False)
    assert d2.recovered is not None
    assert list(tmp_path.glob("index.sqlite.damaged-*"))
    assert d2.lookup_many([k(i) for i in range(3)]) == [b for b, _ in blobs]
    assert d2.get(blobs[1][0]) == blobs[1][1] and d2.usage().blobs == 3
    d2.close()


def test_a_full_disk_at_open_leaves_the_index_alone_and_the_tier_unavailable(tmp_path,
                                                                             monkeypatch):
    """SQLite failing to write at open (a full disk, an I/O error) says nothing about the
    index: it is not moved aside as damaged (every pin and link would be lost), and the tier
    is unavailable rather than failing vLLM's start."""
    from cwm_plugin.store.tiers.disk import key_index as disk_index

    d = DiskTier(tmp_path, budget=1 << 20)
    b, data = blob_for(k(1), 1)
    d.put(b, data, k(1))
    d.pin_many([k(1)])
    d.close()

    def full(self):
        exc = sqlite3.OperationalError("database or disk is full")
        exc.sqlite_errorcode = sqlite3.SQLITE_FULL
        raise exc

    monkeypatch.setattr(disk_index.DiskKeyIndex, "_init_schema", full)
    with pytest.raises(TierUnavailable, match="database or disk is full"):
        DiskTier(tmp_path, budget=1 << 20)
    assert not list(tmp_path.glob("index.sqlite.damaged-*"))
    monkeypatch.undo()  # room again: the index is as it was, its pin too
    d = DiskTier(tmp_path, budget=1 << 20)
    assert d.recovered is None and d.lookup_many([k(1)]) == [b]
    assert d.usage().pinned_bytes > 0
    d.close()


def test_an_unusable_directory_is_tier_unavailable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(TierUnavailable, match="disk_path"):
        DiskTier(blocker / "store", budget=1 << 20)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):     # root writes anywhere; the not-a-directory case above
            pytest.skip("running as a user that ignores directory permissions")
        with pytest.raises(TierUnavailable, match="writable"):
            DiskTier(ro, budget=1 << 20)
    finally:
        ro.chmod(0o700)
