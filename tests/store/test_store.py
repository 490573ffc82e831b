"""KVStore over local tiers: durability, promotion, links, pins, gc, corruption, concurrency."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest
import torch
from prometheus_client import generate_latest

from cwm_plugin.errors import NotFound
from cwm_plugin.store.kv_store import KVStore

pytestmark = pytest.mark.unit
G = bytes(18)        # one namespace and rank: keys share blobs only within their group


def g(name: bytes) -> bytes:
    return G + name


def test_put_get_memory_only(make_store, kv_block):
    s = make_store()
    x = kv_block(1)
    s.put(b"a", x, num_tokens=16).result()
    assert torch.equal(s.get(b"a"), x) and s.get(b"zz") is None
    out = s.get_many([b"zz", b"a"])
    assert out[0] is None and torch.equal(out[1], x)
    assert s.contains_many([b"a", b"zz"]) == [True, False]


def test_restart_finds_everything_on_disk(make_store, tmp_path, kv_block):
    s = make_store(disk_path=str(tmp_path / "d"))
    blocks = {f"k{i}".encode(): kv_block(i) for i in range(12)}
    for k, v in blocks.items():
        s.put(k, v)
    s.flush()
    s.close()
    s2 = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0)
    assert all(s2.contains_many(list(blocks)))
    got = s2.get_many(list(blocks))
    assert all(torch.equal(g, v) for g, v in zip(got, blocks.values(), strict=True))


def test_disk_hit_promotes_to_memory(make_store, tmp_path, kv_block):
    s = make_store(disk_path=str(tmp_path / "d"))
    s.put(b"a", kv_block(1)).result()
    s.close()
    s2 = make_store(disk_path=str(tmp_path / "d"))
    assert s2.usage()["memory"]["blobs"] == 0
    s2.get(b"a")
    assert s2.usage()["memory"]["blobs"] == 1
    s2.get(b"a")
    assert s2.metrics.hits.labels("memory")._value.get() == 1
    assert s2.metrics.hits.labels("disk")._value.get() == 1


def test_every_tier_holding_a_key_is_known(make_store, tmp_path, kv_block):
    """A block in memory *and* on disk is on disk too: ``held_by`` asks every tier, while
    ``where_many`` names the tier a read comes from."""
    s = make_store(disk_path=str(tmp_path / "d"))
    s.put(b"both", kv_block(1)).result()
    s.put(b"disk", kv_block(2)).result()
    s.memory.delete_many([b"disk"])
    keys = [b"both", b"disk", b"none"]
    assert s.where_many(keys) == ["memory", "disk", None]
    assert s.held_by(keys) == {"memory": [True, False, False], "disk": [True, True, False]}
    assert s.held_by(keys, s.durable) == {"disk": [True, True, False]}


def test_put_skips_present_and_same_key_concurrently(make_store, tmp_path, kv_block):
    s = make_store(disk_path=str(tmp_path / "d"))
    x = kv_block(3)
    futs = []
    barrier = threading.Barrier(6)

    def writer(i: int) -> None:
        barrier.wait()
        for j in range(10):
            futs.append(s.put(b"same", x))
            futs.append(s.put(f"k{i}-{j}".encode(), kv_block(100 * i + j)))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in futs:
        f.result()
    s.flush()
    assert torch.equal(s.get(b"same"), x)
    assert s.metrics.puts._value.get() == 61
    assert s.disk.index.totals()[1] == 61
    assert list(s.disk.tmp_dir.iterdir()) == []
    for i in range(6):
        assert torch.equal(s.get(f"k{i}-9".encode()), kv_block(100 * i + 9))


def test_two_stores_writing_one_key_never_tear(tmp_path, make_store, kv_block):
    a = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0)
    b = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0)
    x = kv_block(9, shape=(4, 3, 64, 64))
    fa = [a.put(f"k{i}".encode(), x) for i in range(8)]
    fb = [b.put(f"k{i}".encode(), x) for i in range(8)]
    for f in fa + fb:
        f.result()
    c = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0)
    assert all(torch.equal(t, x) for t in c.get_many([f"k{i}".encode() for i in range(8)]))
    assert c.disk.index.totals()[1] == 8 and c.verify(progress=False).clean


def test_link_refcount_delete_and_gc(make_store, tmp_path, kv_block):
    s = make_store(disk_path=str(tmp_path / "d"))
    x = kv_block(4)
    s.put(g(b"orig"), x, content=b"tokens")
    s.link(g(b"clone"), g(b"orig"))                  # waits for the pending save
    blob = s.disk.lookup_many([g(b"orig")])[0]
    assert s.disk.lookup_many([g(b"clone")]) == [blob] and s.disk.index.refcount(blob) == 2
    assert s.usage()["disk"]["blobs"] == 1
    assert s.delete(g(b"orig"))
    assert torch.equal(s.get_many([g(b"clone")], contents=[b"tokens"])[0], x)
    assert s.get(g(b"clone")) is None         # another key's blob, for a reader of no content
    assert s.delete(g(b"clone")) and not s.delete(g(b"clone"))
    assert s.get(g(b"clone")) is None and s.usage()["disk"]["blobs"] == 0
    with pytest.raises(NotFound):
        s.link(g(b"x"), g(b"nothing"))
    # an index rebuild that found a blob whose key was saved again meanwhile: unreferenced
    s.put(g(b"now"), x).result()
    s.disk.index.insert_rebuilt([("ab" * 20, 12, g(b"now"), time.time())])
    assert s.gc().removed_blobs["disk"] == 0     # younger than gc_min_age_s: left alone
    assert s.disk.has_blob("ab" * 20)
    assert s.gc(min_age_s=0).removed_blobs["disk"] == 1
    assert not s.disk.has_blob("ab" * 20) and torch.equal(s.get(g(b"now")), x)


def test_pinned_blocks_survive_eviction(make_store, tmp_path, kv_block):
    x = kv_block(0)
    size = len(__import__("cwm_plugin.store.blob.codec", fromlist=["encode"]).encode(
        x, key=b"k00", fingerprint="test-fp"))
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=3 * size + 100,
                   disk_bytes=4 * size + 100)
    s.put(b"k00", x).result()
    s.pin(b"k00")
    for i in range(1, 10):
        s.put(f"k{i:02d}".encode(), kv_block(i)).result()
    assert s.contains_many([b"k00"]) == [True]
    assert torch.equal(s.get(b"k00"), x)
    blob = s.disk.lookup_many([b"k00"])[0]
    assert s.pinned(b"k00") and s.disk.usage().pinned_bytes == len(s.disk.get(blob))
    assert s.usage()["disk"]["bytes"] <= 4 * size + 100
    assert s.metrics.evictions.labels("disk")._value.get() > 0
    assert s.metrics.evictions.labels("memory")._value.get() > 0
    s.unpin(b"k00")
    for i in range(10, 16):
        s.put(f"k{i:02d}".encode(), kv_block(i)).result()
    assert s.contains_many([b"k00"]) == [False]


def test_corrupt_blob_is_counted_miss_quarantined_logged_once(make_store, tmp_path, caplog, kv_block):
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0)
    s.put(g(b"a"), kv_block(1)).result()
    s.link(g(b"b"), g(b"a"))
    path = s.disk.path(s.disk.lookup_many([g(b"a")])[0])
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert s.get(g(b"a")) is None
        assert s.get(g(b"b")) is None
        assert s.get(g(b"a")) is None
    assert s.metrics.errors.labels("corrupt")._value.get() == 1
    assert sum("corrupt blob" in r.getMessage() for r in caplog.records) == 1
    assert len(list(s.disk.quarantine_dir.glob("*"))) >= 1
    assert s.contains_many([g(b"a"), g(b"b")]) == [False, False]


def test_verify_finds_and_quarantines(make_store, tmp_path, kv_block):
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0)
    for i in range(3):
        s.put(f"k{i}".encode(), kv_block(i)).result()
    path = s.disk.path(s.disk.lookup_many([b"k1"])[0])
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    r = s.verify(progress=False)
    assert r.checked == 3 and r.ok == 2 and len(r.corrupt) == 1
    assert s.verify(progress=False).clean


def test_contains_many_from_another_process(make_store, tmp_path, kv_block):
    s = make_store(disk_path=str(tmp_path / "d"))
    s.put(b"\x01" * 34, kv_block(1)).result()
    code = (
        "import sys\n"
        "from cwm_plugin.store.config import StoreConfig\n"
        "from cwm_plugin.store.kv_store import KVStore\n"
        f"s = KVStore(StoreConfig(disk_path={str(tmp_path / 'd')!r}, memory_bytes=0))\n"
        "print(s.contains_many([b'\\x01' * 34, b'\\x02' * 34]))\n"
        "s.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[True, False]"


def test_wrong_fingerprint_is_a_miss(make_store, tmp_path, kv_block):
    a = make_store(disk_path=str(tmp_path / "d"), fingerprint="model-a")
    a.put(b"k", kv_block(1)).result()
    b = make_store(disk_path=str(tmp_path / "d"), fingerprint="model-b", memory_bytes=0)
    assert b.get(b"k") is None
    assert b.metrics.errors.labels("incompatible")._value.get() == 1


def test_put_blob_and_get_blob(make_store, tmp_path, kv_block):
    s = make_store(disk_path=str(tmp_path / "d"))
    s.put(g(b"a"), kv_block(1), content=b"tokens").result()
    blob = s.get_blob(g(b"a"))
    s.put_blob(g(b"b"), blob, content=b"tokens").result()
    assert torch.equal(s.get_many([g(b"b")], contents=[b"tokens"])[0], kv_block(1))
    assert s.get_blob(g(b"none")) is None


def test_close_is_idempotent_and_put_after_close_fails(make_store, kv_block):
    s = make_store()
    s.close()
    s.close()
    with pytest.raises(RuntimeError):
        s.put(b"a", kv_block(1))


def test_metrics_are_exported(make_store, kv_block):
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    s = KVStore(make_store().config, registry=reg)
    s.put(b"a", kv_block(1)).result()
    s.get(b"a")
    s.usage()
    text = generate_latest(reg).decode()
    for name in ("cwm_store_bytes", "cwm_store_hits_total", "cwm_store_compression_ratio",
                 "cwm_store_encode_seconds_bucket", "cwm_store_decode_seconds_count"):
        assert name in text
    s.close()
    time.sleep(0)


def test_two_stores_share_the_default_registry():
    from cwm_plugin.store.config import StoreConfig

    a = KVStore(StoreConfig(memory_bytes=1 << 20))
    b = KVStore(StoreConfig(memory_bytes=1 << 20))
    assert a.metrics is b.metrics
    a.close(), b.close()


def test_save_queue_backpressure_and_same_key():
    from cwm_plugin.store.save_queue import SaveQueue

    q = SaveQueue(workers=1, depth=1)
    release = threading.Event()
    first = q.submit(b"a", release.wait)
    assert q.submit(b"a", lambda: None) is first          # one in-flight save per key
    second_returned = threading.Event()

    def blocked_caller() -> None:
        q.submit(b"b", lambda: None)
        second_returned.set()

    t = threading.Thread(target=blocked_caller)
    t.start()
    assert not second_returned.wait(0.3)                    # queue full: the caller waits
    release.set()
    assert second_returned.wait(30)
    t.join()
    assert q.flush(timeout=30) and q.pending() == 0
    q.shutdown()


def test_shutdown_with_a_stuck_write_drops_the_queued_ones_after_its_timeout():
    from concurrent.futures import CancelledError

    from cwm_plugin.store.save_queue import SaveQueue

    q = SaveQueue(workers=1, depth=4)
    release = threading.Event()
    stuck = q.submit(b"a", release.wait)
    queued = q.submit(b"b", lambda: None)
    assert not q.flush(timeout=0.2)                         # bounded: it gives up
    threading.Timer(0.3, release.set).start()              # the running write ends on its own
    q.shutdown(drop_queued=True)
    assert stuck.done() and queued.cancelled()
    with pytest.raises(CancelledError):
        queued.result()


def test_disk_full_refuses_put_cleanly(make_store, tmp_path, kv_block, monkeypatch):
    import errno
    import os

    from cwm_plugin.errors import StorageFull

    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0)
    s.put(b"before", kv_block(0)).result()

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(StorageFull):
        s.put(b"a", kv_block(1)).result()
    monkeypatch.undo()
    assert s.contains_many([b"a"]) == [False] and s.get(b"a") is None
    assert list(s.disk.tmp_dir.iterdir()) == []
    assert s.metrics.errors.labels("storage_full")._value.get() >= 1
    s.put(b"a", kv_block(1)).result()                  # space is back: the save works
    assert torch.equal(s.get(b"a"), kv_block(1))


def test_unreadable_disk_blob_is_a_counted_miss(make_store, tmp_path, kv_block, monkeypatch):
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0)
    s.put(b"a", kv_block(1)).result()

    def broken(blob_ids):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(s.disk, "read_lent", lambda ids, buffers: broken(ids))
    assert s.get_many([b"a"]) == [None]
    assert s.metrics.errors.labels("read_failed")._value.get() == 1


def test_get_many_into_a_batch_tensor(make_store, kv_block):
    s = make_store()
    blocks = [kv_block(i) for i in range(3)]
    for i, b in enumerate(blocks):
        s.put(f"k{i}".encode(), b).result()
    s.put(b"odd", kv_block(9, shape=(1, 2, 3))).result()
    out = torch.empty(5, *blocks[0].shape, dtype=blocks[0].dtype)
    got = s.get_many([b"k0", b"zz", b"k2", b"odd", b"k1"], out=out)
    assert got[1] is None and torch.equal(got[3], kv_block(9, shape=(1, 2, 3)))
    for i, j in ((0, 0), (2, 2), (4, 1)):
        assert got[i].data_ptr() == out[i].data_ptr() and torch.equal(out[i], blocks[j])
    with pytest.raises(ValueError):
        s.get_many([b"k0"], out=out)


def test_an_unusable_disk_path_leaves_the_tier_out_and_the_store_serving(tmp_path, caplog,
                                                                         kv_block):
    from prometheus_client import CollectorRegistry

    from cwm_plugin.store.config import StoreConfig

    blocker = tmp_path / "file"
    blocker.write_text("a file where the store's folder should be")
    with caplog.at_level(logging.ERROR):
        s = KVStore(StoreConfig(disk_path=str(blocker / "kv"), memory_bytes=1 << 20),
                    registry=CollectorRegistry())
    try:
        assert s.disk is None and [t.name for t in s.tiers] == ["memory"]
        assert any("disk_path" in r.getMessage() for r in caplog.records)
        assert s.metrics.errors.labels("tier_unavailable")._value.get() == 1
        s.put(b"a", kv_block(1)).result()
        assert torch.equal(s.get(b"a"), kv_block(1))
    finally:
        s.close()
