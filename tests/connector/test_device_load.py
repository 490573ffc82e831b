"""DeviceLoader: blocks decoded by a real store into pinned staging, copied into paged layers.

Runs on the CPU always and on a GPU when one is present (there: pinned staging, the side
stream, per-layer events, and the two hazards the stream order must prevent). Imports nothing
of vLLM, so the GPU half runs on a machine without it (``pytest --noconftest``).
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from cwm_plugin.connector.worker.device_load import DeviceLoader
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore

pytestmark = pytest.mark.unit

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PER_BLOCK = (4, 3, 32, 64)          # [L, H, N, C] of one stored block
NB = 12
POISON = -7.0


def paged(device: str, dtype: torch.dtype, physical_nhd: bool) -> list[torch.Tensor]:
    """Block-major layer views ``[NB, H, N, C]``; with ``physical_nhd`` the storage is
    ``[NB, N, H, C]`` (a GPU NHD layout) and the logical view is not contiguous."""
    layers = []
    _, h, n, c = PER_BLOCK
    for _ in range(PER_BLOCK[0]):
        if physical_nhd:
            t = torch.full((NB, n, h, c), POISON, dtype=dtype, device=device).permute(0, 2, 1, 3)
        else:
            t = torch.full((NB, h, n, c), POISON, dtype=dtype, device=device)
        layers.append(t)
    return layers


def stored_blocks(store: KVStore, n: int, dtype: torch.dtype) -> dict[bytes, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    blocks = {f"k{i}".encode(): (torch.randn(PER_BLOCK, generator=g) * 2).to(dtype)
              for i in range(n)}
    for key, b in blocks.items():
        store.put(key, b)
    store.flush()
    return blocks


def restore(loader: DeviceLoader, store: KVStore, keys: list[bytes], block_ids: list[int],
            dtype: torch.dtype) -> list[str | None]:
    """What WorkerSide does for a device cache: decode into staging rows, submit the good."""
    staging = loader.staging(len(keys))
    served = store.read_into(keys, lambda i, t: t.data_ptr() == staging[i].data_ptr(),
                             shape=PER_BLOCK, dtype=dtype, into=lambda i: staging[i])
    rows = [i for i, tier in enumerate(served) if tier is not None]
    loader.submit(rows, [block_ids[i] for i in rows])
    return served


def layer_block(layers: list[torch.Tensor], b: int) -> torch.Tensor:
    return torch.stack([layer[b].cpu() for layer in layers])


@pytest.fixture
def store(tmp_path):
    s = KVStore(StoreConfig(fingerprint="dev", memory_bytes=1 << 22, disk_path=str(tmp_path),
                            io_workers=2), registry=CollectorRegistry())
    yield s
    s.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("physical_nhd", [False, True])
def test_restored_blocks_are_bit_exact_and_nothing_else_is_written(store, device, dtype,
                                                                   physical_nhd):
    blocks = stored_blocks(store, 6, dtype)
    layers = paged(device, dtype, physical_nhd)
    block_bytes = torch.empty(PER_BLOCK, dtype=dtype).nbytes
    loader = DeviceLoader(layers, PER_BLOCK, dtype, scratch_bytes=2 * block_bytes)  # 3 chunks
    keys = list(blocks)
    keys.insert(2, b"absent")                   # staged rows with a gap: two runs of copies
    ids = [9, 2, 5, 0, 11, 7, 3]
    served = restore(loader, store, keys, ids, dtype)
    assert served[2] is None and all(s for i, s in enumerate(served) if i != 2)
    for i in range(len(layers)):
        loader.wait_layer(i)
    for key, b in zip(keys, ids, strict=True):
        if key in blocks:
            assert torch.equal(layer_block(layers, b), blocks[key]), b
    for b in set(range(NB)) - {b for k, b in zip(keys, ids, strict=True) if k in blocks}:
        assert bool((layer_block(layers, b) == POISON).all()), f"block {b} was written"
    if device == "cuda":
        assert loader._host.is_pinned()
        assert loader._scratch.nbytes == 2 * block_bytes        # bounded device scratch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_copy_waits_for_queued_compute_and_staging_waits_for_the_copy(store):
    dtype = torch.bfloat16
    blocks = stored_blocks(store, 4, dtype)
    keys = list(blocks)
    layers = paged("cuda", dtype, physical_nhd=True)
    loader = DeviceLoader(layers, PER_BLOCK, dtype)
    # Hazard 1: a step still queued on the compute stream writes block 3 (vLLM reallocated
    # it). The restore must land after it, not under it.
    torch.cuda._sleep(200_000_000)                          # ~0.1 s of queued device work
    for layer in layers:
        layer[3].fill_(1.0)
    restore(loader, store, keys[:2], [3, 4], dtype)
    # Hazard 2: the next step reuses the pinned staging while step 1's copy may still wait
    # behind the sleep: staging() must wait for that copy before handing the rows out.
    restore(loader, store, keys[2:], [6, 7], dtype)
    for i in range(len(layers)):
        loader.wait_layer(i)
    torch.cuda.synchronize()
    assert torch.equal(layer_block(layers, 3), blocks[keys[0]])
    assert torch.equal(layer_block(layers, 4), blocks[keys[1]])
    assert torch.equal(layer_block(layers, 6), blocks[keys[2]])
    assert torch.equal(layer_block(layers, 7), blocks[keys[3]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_submit_returns_before_the_copy_and_each_layer_has_its_event(store):
    dtype = torch.bfloat16
    blocks = stored_blocks(store, 2, dtype)
    layers = paged("cuda", dtype, physical_nhd=False)
    loader = DeviceLoader(layers, PER_BLOCK, dtype)
    staging = loader.staging(2)
    for i, b in enumerate(blocks.values()):
        staging[i].copy_(b)
    torch.cuda._sleep(200_000_000)                          # queued compute, ~0.1 s
    loader.submit([0, 1], [1, 2])
    assert len(loader._events) == len(layers)
    assert not loader._events[-1].query()                   # queued behind the sleep
    loader.wait_layer(0)                                    # device-side: the host goes on
    probe = layers[0][1].float().sum()                      # ordered after layer 0's scatter
    assert probe.item() == blocks[b"k0"][0].float().sum().item()
    loader.clear()
    assert loader._events is None


@pytest.mark.parametrize("device", DEVICES)
def test_staging_is_bounded_and_grows_only_up_to_the_bound(device):
    layers = paged(device, torch.bfloat16, physical_nhd=False)
    block_bytes = torch.empty(PER_BLOCK, dtype=torch.bfloat16).nbytes
    loader = DeviceLoader(layers, PER_BLOCK, torch.bfloat16, staging_bytes=3 * block_bytes)
    assert loader.max_rows == 3
    assert loader.staging(2).shape[0] == 2
    assert loader.staging(3).shape[0] == 3 and loader._host.shape[0] == 3   # not doubled past
    with pytest.raises(ValueError, match="exceed"):
        loader.staging(4)
