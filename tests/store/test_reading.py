"""The read pipeline: blobs fetched chunk by chunk, decoded on the pool, delivered to a sink."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from cwm_plugin.store.read_path import KEEP_BUFFER_BYTES
from cwm_plugin.store.threads import process_cpus
from cwm_plugin.store.tiers.disk.tier import advise_files
from cwm_plugin.timing import Stages

pytestmark = pytest.mark.unit
SHAPE = (2, 3, 16, 32)


def fill(store, n: int, kv_block, prefix: str = "k") -> dict[bytes, torch.Tensor]:
    blocks = {f"{prefix}{i}".encode(): kv_block(i, shape=SHAPE) for i in range(n)}
    for key, b in blocks.items():
        store.put(key, b)
    store.flush()
    return blocks


def collect(store, keys, **kw):
    got: dict[int, torch.Tensor] = {}
    threads: set[str] = set()

    def sink(i: int, t: torch.Tensor) -> bool:
        got[i] = t.clone()
        threads.add(threading.current_thread().name)
        return True

    stages = Stages()
    served = store.read_into(keys, sink, shape=SHAPE, dtype=torch.bfloat16, stages=stages,
                             **kw)
    return served, got, stages, threads


def test_read_into_delivers_every_block_exactly_on_the_decoding_threads(make_store, tmp_path,
                                                                        kv_block):
    a = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0)
    blocks = fill(a, 12, kv_block)
    b = make_store(disk_path=str(tmp_path / "d"), memory_bytes=1 << 24, io_workers=3)
    keys = [*blocks, b"absent"]
    served, got, stages, threads = collect(b, keys)
    assert served == ["disk"] * 12 + [None]
    assert sorted(got) == list(range(12))
    assert all(torch.equal(got[i], blocks[k]) for i, k in enumerate(keys[:12]))
    assert threads and all(t.startswith("cwm-decode") for t in threads)
    assert set(stages.seconds) == {"read", "decompress", "transform", "copy"}
    # not copied up to memory: the sink's receiver (vLLM's cache) holds them now
    assert b.held_by(keys[:12], [b.memory])["memory"] == [False] * 12
    kept = {id(buf) for buf in b.reads.buffers._free}
    assert kept and b.reads.buffers.free_bytes <= KEEP_BUFFER_BYTES
    served, got, _, _ = collect(b, keys)
    assert served == ["disk"] * 12 + [None]
    assert all(torch.equal(got[i], blocks[k]) for i, k in enumerate(keys[:12]))
    after = {id(buf) for buf in b.reads.buffers._free}
    assert kept <= after and len(after) < len(kept) + 12       # reused, not one a blob
    assert b.get_many(keys[:2])[0] is not None                  # a reader that keeps: promoted
    assert b.held_by(keys[:2], [b.memory])["memory"] == [True, True]


def test_keys_split_over_tiers_come_back_in_order(make_store, tmp_path, kv_block):
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=1 << 24)
    blocks = fill(s, 6, kv_block)
    s.reset_memory()
    for key in list(blocks)[::2]:                           # half of them back in memory
        s.get(key)
    served, got, _, _ = collect(s, list(blocks))
    assert served == ["memory", "disk"] * 3
    assert all(torch.equal(got[i], b) for i, b in enumerate(blocks.values()))


def test_disk_reads_are_hinted_then_fetched_in_chunks(make_store, tmp_path, kv_block,
                                                      monkeypatch):
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0, io_workers=2)
    blocks = fill(s, 10, kv_block)
    calls: list[tuple[str, int]] = []
    real_get, real_prefetch = s.disk.read_lent, s.disk.prefetch
    monkeypatch.setattr(s.disk, "read_lent",
                        lambda ids, bufs: calls.append(("get", len(ids))) or real_get(ids, bufs))
    monkeypatch.setattr(s.disk, "prefetch",
                        lambda ids: calls.append(("prefetch", len(ids))) or real_prefetch(ids))
    got = s.get_many(list(blocks))
    assert all(torch.equal(g, b) for g, b in zip(got, blocks.values(), strict=True))
    assert calls[0] == ("prefetch", 10)
    # a few files at a time (the disk's read_batch), so decoding starts early
    assert [n for op, n in calls[1:]] == [2, 2, 2, 2, 2]


def test_a_sink_that_fails_costs_its_block_only(make_store, kv_block):
    s = make_store(memory_bytes=1 << 24)
    blocks = fill(s, 4, kv_block)

    def sink(i: int, t: torch.Tensor) -> bool:
        if i == 1:
            raise RuntimeError("the paged cache went away")
        return i != 2

    served = s.read_into(list(blocks), sink, shape=SHAPE, dtype=torch.bfloat16)
    assert served == ["memory", None, None, "memory"]
    assert s.metrics.errors.labels("sink_failed")._value.get() == 1


def test_a_block_of_another_shape_reaches_the_sink_as_its_own_tensor(make_store, kv_block):
    s = make_store(memory_bytes=1 << 24)
    s.put(b"odd", kv_block(1, shape=(1, 2, 3))).result()
    seen = []
    served = s.read_into([b"odd"], lambda i, t: seen.append(tuple(t.shape)) or False,
                         shape=SHAPE, dtype=torch.bfloat16)
    assert served == [None] and seen == [(1, 2, 3)]


def test_a_corrupt_blob_is_a_miss_and_the_others_still_arrive(make_store, tmp_path, kv_block):
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0)
    blocks = fill(s, 5, kv_block)
    keys = list(blocks)
    path = s.disk.path(s.disk.lookup_many([keys[2]])[0])
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    served, got, _, _ = collect(s, keys)
    assert served == ["disk", "disk", None, "disk", "disk"] and 2 not in got
    assert s.metrics.errors.labels("corrupt")._value.get() == 1


def test_into_decodes_into_the_callers_tensors(make_store, kv_block):
    s = make_store(memory_bytes=1 << 24)
    blocks = fill(s, 3, kv_block)
    staging = torch.empty(3, *SHAPE, dtype=torch.bfloat16)
    served = s.read_into(list(blocks), lambda i, t: t.data_ptr() == staging[i].data_ptr(),
                         shape=SHAPE, dtype=torch.bfloat16, into=lambda i: staging[i])
    assert served == ["memory"] * 3
    assert all(torch.equal(staging[i], b) for i, b in enumerate(blocks.values()))


def test_advise_files_drops_and_hints_pages(tmp_path):
    paths = [tmp_path / f"f{i}" for i in range(3)]
    for p in paths:
        p.write_bytes(b"x" * 100_000)
    assert advise_files([*paths, tmp_path / "missing"], "DONTNEED") == 3
    assert advise_files(paths, "WILLNEED") == 3
    assert advise_files(paths, "NO_SUCH_ADVICE") == 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and two CPUs")
def test_pool_threads_leave_the_core_their_parent_was_bound_to(make_store, kv_block):
    # vLLM binds its worker's main thread to one core; the store's threads started from it
    # must still decode on every core.
    seen: dict[str, set[int]] = {}

    def pinned_parent() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        s = make_store(memory_bytes=1 << 24, io_workers=2)
        blocks = fill(s, 4, kv_block)
        s.read_into(list(blocks), lambda i, t: seen.setdefault(
            threading.current_thread().name, os.sched_getaffinity(0)) is not None,
                    shape=SHAPE, dtype=torch.bfloat16)
        seen["parent"] = os.sched_getaffinity(0)

    t = threading.Thread(target=pinned_parent)
    t.start()
    t.join()
    assert len(seen.pop("parent")) == 1
    assert seen and all(cpus == process_cpus() and len(cpus) >= 2 for cpus in seen.values())


def test_a_decoder_that_breaks_costs_its_block_and_never_raises(make_store, kv_block,
                                                                monkeypatch):
    from cwm_plugin.store.blob import codec

    s = make_store(memory_bytes=1 << 24)
    blocks = fill(s, 3, kv_block)
    real = codec.decode
    calls = []

    def flaky(data, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("no room for a block")
        return real(data, **kw)

    monkeypatch.setattr(codec, "decode", flaky)
    served, got, stages, _ = collect(s, list(blocks))
    assert served.count(None) == 1 and len(got) == 2
    assert s.metrics.errors.labels("decode_failed")._value.get() == 1
    assert stages.seconds["read"] > 0


def test_the_memory_tier_keeps_blocks_uncompressed_and_hands_them_over_without_a_copy(
        make_store, tmp_path, kv_block):
    """With a disk (or Redis) beside it the memory tier holds each block's uncompressed twin
    (a load is one copy, not a zstd decode), the disk the compressed blob; a read of the twin
    gives the sink a view of the stored bytes. ``memory_compress`` keeps one blob for all."""
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=1 << 24)
    blocks = fill(s, 4, kv_block)
    keys = list(blocks)
    usage = s.usage()
    raw = sum(b.numel() * b.element_size() for b in blocks.values())
    assert usage["memory"]["bytes"] > raw > usage["disk"]["bytes"]
    assert s.metrics.ratio._value.get() > 1.0        # the ratio of the tiers' blobs, not twins
    held = [s.memory.get(b) for b in s.memory.lookup_many(keys)]   # the tier's own bytes
    spans = [(a, a + len(b)) for b in held for a in [np.frombuffer(b, np.uint8).ctypes.data]]
    inside = []

    def sink(i: int, t: torch.Tensor) -> bool:
        inside.append(any(lo <= t.data_ptr() < hi for lo, hi in spans))
        return torch.equal(t, blocks[keys[i]])
    served = s.read_into(keys, sink, shape=SHAPE, dtype=torch.bfloat16)
    assert served == ["memory"] * 4 and inside == [True] * 4      # views of the stored bytes
    assert not set(s.disk.lookup_many(keys)) & set(s.memory.lookup_many(keys))
    served, got, _, _ = collect(s, keys, tiers=[s.disk])      # the disk's blobs decode too
    assert served == ["disk"] * 4 and all(torch.equal(got[i], blocks[k])
                                          for i, k in enumerate(keys))
    one = make_store(disk_path=str(tmp_path / "e"), memory_bytes=1 << 24, memory_compress=True)
    fill(one, 4, kv_block)
    assert one.memory.lookup_many(keys) == one.disk.lookup_many(keys)
    assert one.usage()["memory"]["bytes"] == one.usage()["disk"]["bytes"]


def test_a_durable_tier_lacking_a_block_gets_the_compressed_copy_not_the_memory_twin(
        make_store, tmp_path, kv_block, redis_server):
    """Replication (a window pinned on every durable tier) copies a block Redis lacks from a
    durable tier that holds it: the compressed blob, never the memory tier's uncompressed
    twin, which would take ~1.5x the bytes in Redis."""
    from cwm_plugin.store.replication import replicate
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=1 << 24,
                   redis_url=redis_server.url, redis_prefix="twin")
    blocks = fill(s, 2, kv_block)
    keys = list(blocks)
    s.redis.delete_many(keys[:1])                      # a write-behind that never arrived
    assert s.redis.lookup_many(keys[:1]) == [None]
    assert replicate(s, keys) == {"disk": 2, "redis": 2}
    assert s.redis.lookup_many(keys) == s.disk.lookup_many(keys)
    assert s.redis.lookup_many(keys[:1]) != s.memory.lookup_many(keys[:1])


def test_a_reused_read_buffer_never_lends_an_earlier_blobs_bytes_to_a_truncated_one(
        make_store, tmp_path, kv_block):
    """A buffer goes from one read to the next: a file that is now shorter is a corrupt miss,
    never completed by what the buffer held before (here the file's own lost tail). Three
    things each keep it so: the lent view is the file's size, a short read is cut to what
    was read, and the container's sizes must match the blob's length."""
    s = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0, io_workers=1)
    blocks = fill(s, 2, kv_block)
    b, block_b = list(blocks.items())[1]
    path_b = s.disk.path(s.disk.lookup_many([b])[0])
    whole = path_b.read_bytes()
    served, got, _, _ = collect(s, [b])
    assert served == ["disk"] and torch.equal(got[0], block_b)
    assert any(len(buf) >= len(whole) for buf in s.reads.buffers._free)   # its buffer is back
    path_b.write_bytes(whole[:len(whole) - 100])  # the tail lost (a crash, a bad sector)
    served, _, _, _ = collect(s, [b])
    assert served == [None]
    assert s.metrics.errors.labels("corrupt")._value.get() == 1
