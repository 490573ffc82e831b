"""WorkerSide with real tensors (vLLM's own KV allocator) over a real store on a temp disk."""

from __future__ import annotations

import pytest
import torch
from connector_helpers import fill_random, kv_allocation, namespace, vllm_config_for

from cwm_plugin.connector.metadata import BlockTransfer, CWMConnectorMetadata
from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.worker.device_load import DeviceLoader
from cwm_plugin.connector.worker.layout import discover_layout
from cwm_plugin.connector.worker.side import WorkerSide

pytestmark = pytest.mark.unit
NB = 16


def h(i: int) -> bytes:
    return bytes([i]) * 32


def make_worker(open_store, *, rank: int = 0, seed: int | None = None, store=None,
                async_loads: bool = True, **store_kw) -> WorkerSide:
    cfg, kv = kv_allocation(num_blocks=NB)
    if seed is not None:
        fill_random(kv, seed)
    layout, views = discover_layout(vllm_config_for(kv), cfg, kv)
    ns = namespace(layout.describe())
    store = store if store is not None else open_store(ns.fingerprint, **store_kw)
    return WorkerSide(store, StatsCollector(), ns=ns, rank=rank, layout=layout, layers=views,
                      async_loads=async_loads)


def save(worker: WorkerSide, block_ids: list[int], hashes: list[bytes]) -> None:
    worker.wait_for_save(CWMConnectorMetadata(saves=[
        BlockTransfer("req", block_ids, hashes, num_tokens=len(hashes) * 16)]))
    worker.store.flush()


def finish_loads(worker: WorkerSide) -> set[int]:
    """The block ids that failed, once the step's loads are done (CPU workers load in the
    background and report them as vLLM collects its step's output)."""
    assert worker.loader.wait(timeout=60)
    worker.get_finished()
    return worker.take_load_errors()


def load(worker: WorkerSide, block_ids: list[int], hashes: list[bytes]) -> set[int]:
    worker.start_load_kv(CWMConnectorMetadata(loads=[BlockTransfer("req", block_ids, hashes)]))
    return finish_loads(worker)


def load_step(worker: WorkerSide, *requests: tuple[list[int], list[bytes]]) -> set[int]:
    """One step loading several requests; returns the block ids that failed."""
    worker.start_load_kv(CWMConnectorMetadata(loads=[
        BlockTransfer(f"r{i}", ids, hashes) for i, (ids, hashes) in enumerate(requests)]))
    return finish_loads(worker)


def same_blocks(src: WorkerSide, dst: WorkerSide, pairs) -> None:
    for a, b in pairs:
        assert torch.equal(block(dst, b), block(src, a)), (a, b)


def block(worker: WorkerSide, block_id: int) -> torch.Tensor:
    return torch.stack([layer[block_id] for layer in worker.layers])


def test_saved_blocks_load_bit_exactly_into_other_block_ids(open_store):
    src = make_worker(open_store, seed=1)
    save(src, [1, 2, 3], [h(1), h(2), h(3)])
    meta = src.take_worker_meta()
    assert meta.stored == {(h(1), 0), (h(2), 0), (h(3), 0)} and not meta.failed
    assert src.stats.snapshot()["saved_blocks"] == 3
    assert src.stats.snapshot()["saved_bytes"] == 3 * src.block_bytes

    dst = make_worker(open_store, store=src.store)           # fresh, zeroed KV cache
    assert load(dst, [5, 6, 7], [h(1), h(2), h(3)]) == set()
    for a, b in ((1, 5), (2, 6), (3, 7)):
        assert torch.equal(block(dst, b), block(src, a))
    assert torch.count_nonzero(block(dst, 1)) == 0            # nothing else was written
    got = dst.stats.snapshot()
    assert got["loaded_blocks|tier=disk"] == 3
    assert got["loaded_bytes|tier=disk"] == 3 * dst.block_bytes
    assert got["load_seconds|tier=disk"] > 0 and "load_errors" not in got
    # where the load's time went (bench/ttft.py prints it)
    assert {k for k in got if k.startswith("load_phase_seconds")} == {
        f"load_phase_seconds|phase={p}"
        for p in ("lookup", "read", "decompress", "transform", "copy")}


def staged(worker: WorkerSide, chunk_blocks: int, staging_blocks: int = 64) -> WorkerSide:
    """Switch a CPU worker to the device path (pinned staging and copies are synchronous on a
    CPU; the GPU half is tests/connector/test_device_load.py)."""
    worker.loader.writer = None
    worker.loader.device = DeviceLoader(worker.layers, worker.layout.per_block, worker.dtype,
                                        scratch_bytes=chunk_blocks * worker.block_bytes,
                                        staging_bytes=staging_blocks * worker.block_bytes)
    return worker


def test_the_staged_path_of_device_caches_loads_the_same_blocks(open_store):
    # A GPU cache is loaded through one reused host staging tensor per step and chunked
    # copies; on the CPU the same path runs when the direct writer is switched off.
    src = make_worker(open_store, seed=4)
    save(src, [1, 2, 3, 4], [h(1), h(2), h(3), h(4)])
    dst = staged(make_worker(open_store, store=src.store), chunk_blocks=2)
    assert load(dst, [5, 6, 7, 8], [h(1), h(2), h(9), h(3)]) == {7, 8}
    assert torch.equal(block(dst, 5), block(src, 1)) and torch.equal(block(dst, 6), block(src, 2))
    assert torch.count_nonzero(block(dst, 7)) == 0 and torch.count_nonzero(block(dst, 8)) == 0
    # two requests in one step, the first with a hole: their good blocks go in one submit
    assert load_step(dst, ([9, 10, 11], [h(3), h(9), h(1)]),
                     ([12, 13, 14], [h(4), h(2), h(1)])) == {10, 11}
    same_blocks(src, dst, ((3, 9), (4, 12), (2, 13), (1, 14)))
    assert torch.count_nonzero(block(dst, 10)) == 0 and torch.count_nonzero(block(dst, 11)) == 0
    staging = dst.loader.device._host
    assert load(dst, [15], [h(2)]) == set() and dst.loader.device._host is staging      # reused
    assert torch.equal(block(dst, 15), block(src, 2))
    dst.wait_layer("model.layers.0.self_attn.attn")           # no events on a CPU: a no-op


def test_a_restore_longer_than_the_staging_goes_in_rounds(open_store):
    # Pinned staging is bounded (2 blocks here): a step of 3 + 3 blocks is decoded and copied
    # in rounds; a hole in the second request still fails its later blocks, in any round.
    src = make_worker(open_store, seed=6)
    save(src, [1, 2, 3, 4], [h(1), h(2), h(3), h(4)])
    dst = staged(make_worker(open_store, store=src.store), chunk_blocks=1, staging_blocks=2)
    assert load_step(dst, ([5, 6, 7], [h(1), h(2), h(3)]),
                     ([8, 9, 10], [h(4), h(9), h(2)])) == {9, 10}
    same_blocks(src, dst, ((1, 5), (2, 6), (3, 7), (4, 8)))
    assert torch.count_nonzero(block(dst, 10)) == 0
    assert dst.loader.device._host.shape[0] == 2                  # never grew past the bound
    assert dst.stats.snapshot()["load_errors"] == 2


def test_loads_from_the_memory_tier_are_labelled_memory(open_store):
    worker = make_worker(open_store, seed=2, memory_bytes=1 << 24)
    save(worker, [1, 2], [h(1), h(2)])
    assert load(worker, [9, 10], [h(1), h(2)]) == set()
    assert worker.stats.snapshot()["loaded_blocks|tier=memory"] == 2


def test_each_tp_rank_saves_and_loads_its_own_shard(open_store):
    rank0 = make_worker(open_store, rank=0, seed=10)
    rank1 = make_worker(open_store, rank=1, seed=11, store=rank0.store)
    assert not torch.equal(block(rank0, 1), block(rank1, 1))  # different shards, same hashes
    for w in (rank0, rank1):
        save(w, [1, 2], [h(1), h(2)])
    fresh0 = make_worker(open_store, rank=0, store=rank0.store)
    fresh1 = make_worker(open_store, rank=1, store=rank0.store)
    assert load(fresh0, [4, 5], [h(1), h(2)]) == set()
    assert load(fresh1, [4, 5], [h(1), h(2)]) == set()
    assert torch.equal(block(fresh0, 4), block(rank0, 1))
    assert torch.equal(block(fresh1, 4), block(rank1, 1)), "rank 1 got another rank's shard"
    assert torch.equal(block(fresh1, 5), block(rank1, 2))


def test_a_block_missing_on_one_rank_is_a_load_error_there_only(open_store):
    rank0 = make_worker(open_store, rank=0, seed=20)
    save(rank0, [1, 2], [h(1), h(2)])                        # rank 1 never saved them
    rank1 = make_worker(open_store, rank=1, store=rank0.store)
    assert load(rank1, [6, 7], [h(1), h(2)]) == {6, 7}
    assert rank1.take_worker_meta().failed == {h(1), h(2)}
    assert torch.count_nonzero(block(rank1, 6)) == 0
    fresh0 = make_worker(open_store, rank=0, store=rank0.store)
    assert load(fresh0, [6, 7], [h(1), h(2)]) == set()


def test_a_failed_block_breaks_the_prefix_and_the_rest_is_recomputed(open_store):
    src = make_worker(open_store, seed=3)
    save(src, [1, 2, 4], [h(1), h(2), h(4)])                 # h(3) was never stored
    dst = make_worker(open_store, store=src.store)
    assert load(dst, [10, 11, 12, 13], [h(1), h(2), h(3), h(4)]) == {12, 13}
    assert torch.equal(block(dst, 10), block(src, 1)) and torch.equal(block(dst, 11), block(src, 2))
    # Block 13's blob exists, but a KV prefix with a hole is useless: it is not written.
    assert torch.count_nonzero(block(dst, 12)) == 0 and torch.count_nonzero(block(dst, 13)) == 0
    assert dst.stats.snapshot()["load_errors"] == 2
    # The scheduler forgets both (h(4) was not tried): its next lookup asks the store again.
    assert dst.take_worker_meta().failed == {h(3), h(4)}
    assert dst.take_load_errors() == set()                   # reported once


def test_blocks_computed_over_a_failed_load_are_never_saved(open_store):
    """A step loads a request's prefix and computes its next blocks: when the load fails,
    those blocks attended to whatever the failed block's pages held. Saved, they would be
    served later as valid KV under their real hashes; they are not saved, reported failed
    (saved when vLLM recomputes them), while another request's saves in the step go on."""
    src = make_worker(open_store, seed=3)
    save(src, [1, 2], [h(1), h(2)])                          # h(3) was never stored
    dst = make_worker(open_store, store=src.store, seed=8, async_loads=False)  # (a GPU's)
    dst.start_load_kv(CWMConnectorMetadata(loads=[
        BlockTransfer("spoiled", [10, 11, 12], [h(1), h(2), h(3)])]))
    assert dst.take_load_errors() == {12}
    dst.wait_for_save(CWMConnectorMetadata(saves=[
        BlockTransfer("spoiled", [13, 14], [h(13), h(14)], num_tokens=5 * 16),
        BlockTransfer("fine", [5], [h(5)], num_tokens=16)]))
    dst.store.flush()
    keys = dst.ns.keys([h(13), h(14), h(5)], dst.rank, b"")
    assert dst.store.contains_many(keys) == [False, False, True]
    meta = dst.take_worker_meta()
    assert {h(13), h(14)} <= meta.failed and (h(5), 0) in meta.stored
    assert dst.stats.snapshot()["save_errors|reason=load_failed"] == 2
    dst.wait_for_save(CWMConnectorMetadata(saves=[  # the next step recomputed them: saved
        BlockTransfer("spoiled", [13], [h(13)], num_tokens=4 * 16)]))
    dst.store.flush()
    assert dst.store.contains_many(keys[:1]) == [True]


def test_a_blob_of_another_shape_is_a_load_error_not_a_crash(open_store):
    worker = make_worker(open_store)
    other = torch.ones(worker.layout.num_layers, 3, 16, 16)   # 3 heads instead of 2
    worker.store.put(worker.ns.key(h(1), 0), other).result()
    assert load(worker, [2], [h(1)]) == {2}
    assert torch.count_nonzero(block(worker, 2)) == 0


def test_a_blob_of_another_layout_with_the_same_shape_is_a_load_error(open_store):
    worker = make_worker(open_store)
    same_shape = torch.ones(worker.layout.per_block)
    other = worker.layout_name.replace("/vec/", "/amx/")      # another ISA packs blocks
    worker.store.put(worker.ns.key(h(1), 0), same_shape, layout=other).result()
    assert load(worker, [2], [h(1)]) == {2}
    assert torch.count_nonzero(block(worker, 2)) == 0


def test_saves_the_store_refuses_are_counted_and_reported_not_raised(open_store):
    worker = make_worker(open_store, seed=4)
    worker.store.close()
    save(worker, [1, 2], [h(1), h(2)])
    got = worker.stats.snapshot()
    assert got["save_errors|reason=refused"] == 2 and "saved_blocks" not in got
    assert worker.take_worker_meta().failed == {h(1), h(2)}


def test_saves_that_fail_in_the_store_are_reported_as_failed(open_store):
    worker = make_worker(open_store, seed=5, disk_bytes=1)    # no tier can take a block
    save(worker, [1, 2], [h(1), h(2)])
    meta = worker.take_worker_meta()
    assert meta.failed == {h(1), h(2)} and not meta.stored
    got = worker.stats.snapshot()
    assert got["save_errors|reason=failed"] == 2 and "saved_blocks" not in got
    assert worker.take_worker_meta() is None                 # nothing new to report


def test_layers_that_do_not_match_the_layout_are_refused(open_store):
    worker = make_worker(open_store)
    with pytest.raises(Exception, match="do not match"):
        WorkerSide(worker.store, StatsCollector(), ns=worker.ns, rank=0, layout=worker.layout,
                   layers=worker.layers[:1])
