"""A writer killed with SIGKILL in the middle of writing never leaves a visible partial blob,
and the index stays consistent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cwm_plugin.store import codec
from cwm_plugin.store.index import BlobIndex

pytestmark = pytest.mark.unit

WRITER = r"""
import sys, torch
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.tiered import KVStore
store = KVStore(StoreConfig(fingerprint="crash", disk_path=sys.argv[1], memory_bytes=0,
                            io_workers=2, zstd_level=1))
g = torch.Generator().manual_seed(0)
i = 0
while True:   # ~4 MiB blocks of incompressible bytes: each write takes a while
    t = torch.randint(-128, 127, (4 << 20,), dtype=torch.int8, generator=g)
    store.put(i.to_bytes(8, "big"), t)
    i += 1
"""


@pytest.mark.parametrize("delay", [0.3, 1.1])
def test_sigkill_mid_write_leaves_no_partial_blob(tmp_path, delay):
    root = tmp_path / "d"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (root / "index.sqlite").exists():
                probe = BlobIndex(root / "index.sqlite")
                enough = probe.totals()[1] >= 2
                probe.close()
                if enough:
                    break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    index = BlobIndex(root / "index.sqlite")
    blobs = dict(index.all_blobs())
    assert len(blobs) >= 2
    blob_dir = root / "blobs"
    on_disk = {p.name: p for p in blob_dir.glob("*/*/*")}
    for blob_id, size in blobs.items():                     # every indexed blob is whole
        data = on_disk[blob_id].read_bytes()
        assert len(data) == size
        out = codec.decode(data, fingerprint="crash", verify=True)
        assert out.tensor.numel() == 4 << 20
    for name, path in on_disk.items():                      # unindexed files are whole too
        if name not in blobs:
            codec.decode(path.read_bytes(), verify=True)
    keys = index.lookup_many([i.to_bytes(8, "big") for i in range(10_000)])
    assert set(keys.values()) <= set(blobs) and len(keys) == len(blobs)
    assert index.dangling_keys() == []
    index.close()
