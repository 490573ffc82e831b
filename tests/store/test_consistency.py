"""KVStore consistency under pins, links, write-behind, gc, damage and metrics: each test fails
without the fix it guards (see the comment at its top)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading
import time

import pytest
import torch

from cwm_plugin.store.blob import codec
from cwm_plugin.store.save_queue import SaveQueue

pytestmark = pytest.mark.unit
G = bytes(18)        # one namespace and rank: keys share blobs only within their group


def g(name: bytes) -> bytes:
    return G + name


def blob_size(block: torch.Tensor) -> int:
    return len(codec.encode(block, key=b"k00", fingerprint="test-fp"))


def flood(store, kv_block, n: int = 12, start: int = 100) -> None:
    for i in range(start, start + n):
        store.put(f"f{i}".encode(), kv_block(i)).result()


def test_unpinning_a_clone_keeps_the_original_protected(make_store, tmp_path, kv_block):
    # pins belong to keys: unpinning the clone leaves the window's pin on the shared blob
    size = blob_size(kv_block(0))
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0, disk_bytes=4 * size + 100)
    s.put(g(b"win"), kv_block(0), content=b"c0").result()
    s.pin(g(b"win"))
    s.link(g(b"clone"), g(b"win"))
    s.pin(g(b"clone"))
    s.unpin(g(b"clone"))
    flood(s, kv_block)
    assert s.contains_many([g(b"win"), g(b"clone")]) == [True, True]
    assert torch.equal(s.get(g(b"clone"), content=b"c0"), kv_block(0)) and s.pinned(g(b"win"))
    s.unpin(g(b"win"))
    flood(s, kv_block, start=200)
    assert s.contains_many([g(b"win"), g(b"clone")]) == [False, False]


def test_pin_right_after_put_with_write_behind(make_store, tmp_path, kv_block):
    # pin() waits for the key's write-behind, so it finds the blob row (no NotFound without a
    # memory tier)
    size = blob_size(kv_block(0))
    root = str(tmp_path / "d")
    s = make_store(disk_path=root, memory_bytes=0, disk_write="behind",
                   disk_bytes=4 * size + 100)
    s.put(b"k", kv_block(0))
    s.pin(b"k")                              # no .result(): pin waits for the key's writes
    s.close()
    s2 = make_store(disk_path=root, memory_bytes=0, disk_bytes=4 * size + 100)
    flood(s2, kv_block)
    assert s2.contains_many([b"k"]) == [True] and s2.pinned(b"k")


def test_link_onto_an_existing_key_repoints_it(make_store, tmp_path, kv_block):
    # memory overwrote, the index kept the old mapping: tiers disagreed
    root = str(tmp_path / "d")
    s = make_store(disk_path=root)
    s.put(g(b"a"), kv_block(1), content=b"c1").result()
    s.put(g(b"b"), kv_block(2), content=b"c2").result()
    old = s.disk.lookup_many([g(b"b")])[0]
    s.link(g(b"b"), g(b"a"))
    assert torch.equal(s.get(g(b"b"), content=b"c1"), kv_block(1))
    assert s.disk.lookup_many([g(b"b")]) == s.disk.lookup_many([g(b"a")])
    assert not s.disk.has_blob(old) and s.memory.lookup_many([g(b"b")]) == s.memory.lookup_many(
        [g(b"a")])
    s.close()
    fresh = make_store(disk_path=root, memory_bytes=0)
    assert torch.equal(fresh.get(g(b"b"), content=b"c1"), kv_block(1))
    assert fresh.usage()["disk"]["blobs"] == 1


def test_write_behind_is_bounded_and_pushes_back(make_store, tmp_path, kv_block, monkeypatch):
    # SaveQueue.behind() bypassed the slots: jobs holding blob bytes grew without limit
    size = blob_size(kv_block(0))
    s = make_store(disk_path=str(tmp_path / "d"), disk_write="behind", memory_bytes=1 << 24,
                   io_workers=1, queue_depth=2, behind_bytes=3 * size)
    gate = threading.Event()
    real = s.disk.put

    def slow_disk(*args, **kw):
        gate.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(s.disk, "put", slow_disk)
    futures = []
    producer = threading.Thread(
        target=lambda: futures.extend(s.put(f"k{i}".encode(), kv_block(i)) for i in range(12)))
    producer.start()
    time.sleep(1.0)
    assert producer.is_alive()                   # put() is held back: backpressure
    assert s._saves.behind_bytes <= 3 * size + size
    gate.set()
    producer.join(60)
    s.flush()
    assert s._saves.behind_peak <= 3 * size + size
    assert s.disk.index.totals()[1] == 12 and all(f.done() for f in futures)   # nothing lost


def test_save_queue_drops_non_waiting_jobs_when_full():
    q = SaveQueue(workers=1, depth=4, behind_bytes=100)
    release = threading.Event()
    assert q.behind(lambda: release.wait(30), key=b"a", nbytes=80)
    assert not q.behind(lambda: None, key=b"b", nbytes=40, wait=False)   # a promotion
    assert q.dropped == 1
    release.set()
    q.wait_key(b"a", timeout=30)
    assert q.flush(30) and q.behind_bytes == 0
    q.shutdown()


def test_a_replacing_save_of_a_key_in_flight_runs_after_it_newest_last():
    """New content for a key whose save is running (two requests of one salt finishing
    together write its context record) runs after it, not merged into the running save's
    future, and of several waiting only the newest runs."""
    q = SaveQueue(workers=2, depth=4)
    release = threading.Event()
    wrote: list[str] = []

    def write(v: str, wait: bool = False):
        def run() -> str:
            if wait:
                release.wait(30)
            wrote.append(v)
            return v
        return run

    first = q.submit(b"rec", write("old", wait=True), replace=True)
    same = q.submit(b"rec", write("dup"))  # not a replacement: the same save
    mid = q.submit(b"rec", write("mid"), replace=True)
    new = q.submit(b"rec", write("new"), replace=True)  # supersedes "mid"
    assert same is first and not mid.done()
    release.set()
    assert first.result(30) == "old" and new.result(30) == "new" and mid.result(30) == "new"
    assert wrote == ["old", "new"]
    assert q.flush(30) and q.inflight(b"rec") is None and q.pending() == 0
    q.wait_key(b"rec", timeout=5)
    q.shutdown()


def test_truncated_blob_is_counted_and_quarantined(make_store, tmp_path, kv_block):
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0)
    s.put(b"a", kv_block(1)).result()
    blob = s.disk.lookup_many([b"a"])[0]
    path = s.disk.path(blob)
    path.write_bytes(path.read_bytes()[:100])
    assert s.get(b"a") is None
    assert s.metrics.errors.labels("corrupt")._value.get() == 1
    assert s.metrics.misses.labels("disk")._value.get() == 1
    assert s.metrics.hits.labels("disk")._value.get() == 0     # a damaged blob is no hit
    kept = list(s.disk.quarantine_dir.glob(f"{blob}*"))
    assert any(p.suffix != ".why" and p.stat().st_size == 100 for p in kept)
    assert not path.exists() and not s.disk.has_blob(blob)
    assert s.contains_many([b"a"]) == [False] and s.verify(progress=False).clean


def test_quarantine_that_cannot_write_still_takes_the_blob_out(make_store, tmp_path, kv_block,
                                                               monkeypatch):
    s = make_store(disk_path=str(tmp_path / "d"), disk_write="behind")
    s.put(b"a", kv_block(1)).result()
    s.flush()
    blob = s.memory.lookup_many([b"a"])[0]
    data = bytearray(s.memory.get(blob))
    data[-5] ^= 0xFF
    s.memory._lru[blob] = bytes(data)           # damaged in memory: quarantine writes a copy

    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_bytes", full)
    assert torch.equal(s.get(b"a"), kv_block(1))       # the disk's good copy serves it
    assert s.metrics.errors.labels("quarantine_failed")._value.get() == 1
    assert s.metrics.errors.labels("corrupt")._value.get() == 1
    assert s.memory.get(blob) == s.disk.get(blob)       # damaged copy out, good one promoted


def test_layout_mismatch_is_an_incompatible_miss(make_store, kv_block):
    s = make_store()
    s.put(b"a", kv_block(1), layout="cpu:blockdim0:[2, 3, 16, 32]").result()
    assert s.get_many([b"a"], layout="cpu:blockdim0:[2, 3, 32, 16]") == [None]
    assert s.metrics.errors.labels("incompatible")._value.get() == 1
    got = s.get_many([b"a"], layout="cpu:blockdim0:[2, 3, 16, 32]")
    assert torch.equal(got[0], kv_block(1))


def test_gauges_follow_puts_and_deletes_without_usage(make_store, tmp_path, kv_block):
    # the disk gauges follow every write and delete, not only usage() (the CLI)
    s = make_store(disk_path=str(tmp_path / "d"))
    for i in range(3):
        s.put(f"k{i}".encode(), kv_block(i)).result()
    disk_bytes = s.metrics.bytes.labels("disk")._value.get()
    assert s.metrics.blobs.labels("disk")._value.get() == 3 and disk_bytes > 0
    assert s.metrics.blobs.labels("memory")._value.get() == 3
    assert (disk_bytes, 3) == s.disk.index.totals()
    s.delete(b"k0")
    assert s.metrics.blobs.labels("disk")._value.get() == 2
    assert s.metrics.blobs.labels("memory")._value.get() == 2


WRITER = r"""
import sys, time, torch
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
root, seed, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
store = KVStore(StoreConfig(fingerprint="two", disk_path=root, memory_bytes=0, io_workers=2))
g = torch.Generator().manual_seed(seed)
blocks = [(torch.randn(4, 3, 64, 64, generator=g) * seed).to(torch.bfloat16) for _ in range(8)]
while time.time() < start:
    time.sleep(0.001)
for i, b in enumerate(blocks):
    store.put(f"k{i}".encode(), b)
store.close()
"""


def test_processes_writing_the_same_keys_never_tear(tmp_path, make_store):
    # three writers create one fresh store at the same instant (the index's WAL switch and
    # schema race) and write the same keys: "database is locked" never escapes the busy
    # timeout in any of them (TP=2 workers share a disk store the same way)
    root = str(tmp_path / "d")
    start = time.time() + 3
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, root, str(seed), str(start)],
                              stderr=subprocess.PIPE) for seed in (1, 2, 3)]
    for p in procs:
        assert p.wait(timeout=180) == 0, p.stderr.read().decode()
    s = make_store(disk_path=root, memory_bytes=0, fingerprint="two")
    got = s.get_many([f"k{i}".encode() for i in range(8)])
    assert all(t is not None and t.shape == (4, 3, 64, 64) for t in got)
    assert s.verify(progress=False).clean            # every file whole, both writers' blobs
    assert s.disk.dangling_keys() == [] and list(s.disk.tmp_dir.iterdir()) == []
    s.gc(min_age_s=0)                                # nothing the losers wrote is left over
    assert s.usage()["disk"]["blobs"] == 8 and s.usage()["disk"]["keys"] == 8
