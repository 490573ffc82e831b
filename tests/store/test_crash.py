"""Real processes killed with SIGKILL, and two processes racing on one disk store: a blob is
never partial, a batch key operation is all or nothing, a row never outlives its file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cwm_plugin.store.blob import codec
from cwm_plugin.store.tiers.disk.key_index import DiskKeyIndex

pytestmark = pytest.mark.unit

WRITER = r"""
import sys, torch
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
store = KVStore(StoreConfig(fingerprint="crash", disk_path=sys.argv[1], memory_bytes=0,
                            io_workers=2, zstd_level=1))
g = torch.Generator().manual_seed(0)
i = 0
while True:   # ~4 MiB blocks of incompressible bytes: each write takes a while
    t = torch.randint(-128, 127, (4 << 20,), dtype=torch.int8, generator=g)
    store.put(i.to_bytes(8, "big"), t)
    i += 1
"""


def _run_until(cmd: list[str], ready, delay: float) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready(proc):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the child never got going"
            time.sleep(0.05)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _indexed_blobs(root: Path) -> int:
    if not (root / "index.sqlite").exists():
        return 0
    probe = DiskKeyIndex(root / "index.sqlite")
    try:
        return probe.totals()[1]
    finally:
        probe.close()


@pytest.mark.parametrize("delay", [0.3, 1.1])
def test_sigkill_mid_write_leaves_no_partial_blob(tmp_path, delay):
    root = tmp_path / "d"
    _run_until([sys.executable, "-c", WRITER, str(root)],
               lambda p: _indexed_blobs(root) >= 2, delay)
    index = DiskKeyIndex(root / "index.sqlite")
    blobs = set(index.all_blobs())
    assert len(blobs) >= 2
    on_disk = {p.name: p for p in (root / "blobs").glob("*/*/*")}
    for blob_id in blobs:                                   # every indexed blob is whole
        out = codec.decode(on_disk[blob_id].read_bytes(), fingerprint="crash", verify=True)
        assert out.tensor.numel() == 4 << 20
    for name, path in on_disk.items():                      # unindexed files are whole too
        if name not in blobs:
            codec.decode(path.read_bytes(), verify=True)
    keys = index.lookup_many([i.to_bytes(8, "big") for i in range(10_000)])
    assert set(keys.values()) <= blobs and len(keys) == len(blobs)
    assert index.dangling_keys() == []
    index.close()


BATCHER = r"""
import sys, itertools
from cwm_plugin.store.tiers.disk.tier import DiskTier
from cwm_plugin.store.tiers.redis.tier import RedisTier
kind, where = sys.argv[1], sys.argv[2]
t = DiskTier(where, 1 << 30) if kind == "disk" else RedisTier(where, prefix="kill")
G = b"B" * 18
t.put("ab" * 20, b"x" * 64, G + b"base")
batch = [G + i.to_bytes(4, "big") for i in range(3000)]
for n in itertools.count():
    t.link_many([(k, "ab" * 20) for k in batch])
    t.pin_many(batch)
    print(n, flush=True)
    t.delete_many(batch)
"""


@pytest.mark.parametrize("kind", ["disk", "redis"])
@pytest.mark.parametrize("delay", [0.05, 0.4])
def test_sigkill_mid_batch_leaves_the_old_state_or_the_new(tmp_path, kind, delay, request):
    where = str(tmp_path / "d") if kind == "disk" else request.getfixturevalue("redis_server").url
    _run_until([sys.executable, "-c", BATCHER, kind, where],
               lambda p: p.stdout.readline().strip() != "", delay)
    from cwm_plugin.store.tiers.disk.tier import DiskTier
    from cwm_plugin.store.tiers.redis.tier import RedisTier
    t = DiskTier(where, 1 << 30) if kind == "disk" else RedisTier(where, prefix="kill")
    rows = t.list_keys(b"B" * 18, limit=10_000)
    batch = [r for r in rows if r.key != b"B" * 18 + b"base"]
    if kind == "disk":
        assert len(batch) in (0, 3000), len(batch)         # a batch is whole or absent
        assert len({r.pinned for r in batch}) <= 1         # pinned as a whole, or not at all
        (refs, pins), = t.index.db.read("SELECT refs, pins FROM blobs")
        assert refs == len(rows) and pins == sum(r.pinned for r in rows)   # counters match
    else:       # one script a shard (slot): each shard's part whole; counts never too low
        from collections import Counter

        from cwm_plugin.store.tiers.redis.layout import shard_of
        want = Counter(shard_of(b"B" * 18 + i.to_bytes(4, "big")) for i in range(3000))
        got = Counter(shard_of(r.key) for r in batch)
        assert all(got[s] in (0, n) for s, n in want.items()), got
        pinned: dict[int, set[bool]] = {}
        for r in batch:
            pinned.setdefault(shard_of(r.key), set()).add(r.pinned)
        assert all(len(p) == 1 for p in pinned.values())    # a shard's part pinned whole
        refs, pins = t._call(lambda c: c.hmget(t.blobs.meta("ab" * 20), ["refs", "pins"]))
        assert int(refs) >= len(rows) and int(pins) >= sum(r.pinned for r in rows)
    t.close()


RACER = r"""
import sys, time
from cwm_plugin.store.tiers.disk.tier import DiskTier
root, me, stop = sys.argv[1], sys.argv[2].encode(), float(sys.argv[3])
t = DiskTier(root, 1 << 30, fsync=False)
key = b"R" * 18 + me
while time.time() < stop:
    t.put("cd" * 20, b"same bytes" * 100, key)
    t.delete_many([key])
"""


def test_two_processes_removing_and_re_adding_a_blob_never_leave_a_row_without_its_file(
        tmp_path):
    root = tmp_path / "d"
    from cwm_plugin.store.tiers.disk.tier import DiskTier
    DiskTier(root, 1 << 30).close()
    stop = time.time() + 4
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(root), me, str(stop)],
                              stderr=subprocess.PIPE) for me in ("a", "b")]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read().decode()
    t = DiskTier(root, 1 << 30)
    for blob_id in t.index.all_blobs():
        assert t.path(blob_id).exists(), "an index row outlived its file"
    assert t.dangling_keys() == []
    t.close()
