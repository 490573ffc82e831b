"""Worker side of the connector: move whole blocks between vLLM's paged KV cache and the store.

Runs in the worker process, once a step:

* ``start_load_kv`` (before the forward pass, synchronously): fetch the planned blocks from the
  store in one batch, check each against the expected per-block shape and dtype, and scatter the
  good prefix into the paged cache. A block that is missing, corrupt or of the wrong layout, and
  every later block of that request, is reported through ``get_block_ids_with_load_errors`` so
  vLLM recomputes it (``kv_load_failure_policy: recompute``).
* ``wait_for_save`` (after the forward pass): copy this step's completed blocks out of the paged
  cache into one staging tensor and hand each block to the store, which encodes and writes it in
  its own pool. After the copy the paged blocks are no longer needed, so vLLM may free them.

Loading is whole-request rather than layer by layer: the store holds one blob per block with all
layers (one key, one checksum, one round trip), and on CPU the forward pass runs on the same
cores as decoding, so there is no transfer to overlap with compute.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch

from cwm_plugin.connector.metadata import BlockTransfer, CWMConnectorMetadata, CWMWorkerMetadata
from cwm_plugin.connector.stats import StatsCollector
from cwm_plugin.kernels.blocks import block_shape, gather_blocks, scatter_blocks
from cwm_plugin.store.tiered import KVStore

log = logging.getLogger(__name__)


def discover_block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    """The axis of a layer's KV tensor that indexes blocks.

    vLLM (RFC #42082) gives each layer a logical ``[B, H, N, C]`` view whatever the physical
    stride order, so the block axis is 0; older or foreign layouts (e.g. a leading K/V axis) are
    found by the one axis whose size is the number of blocks, and an ambiguous shape is refused.
    """
    dims = [i for i, s in enumerate(tensor.shape) if s == num_blocks]
    if 0 in dims:
        return 0
    if len(dims) == 1:
        return dims[0]
    raise RuntimeError(
        f"cannot tell the block axis of a KV tensor of shape {tuple(tensor.shape)} with "
        f"{num_blocks} blocks; refusing to guess (report this layout to the cwm maintainers)"
    )


class WorkerSide:
    def __init__(self, store: KVStore, stats: StatsCollector, *, rank: int, num_blocks: int,
                 layer_names: list[str]) -> None:
        self.store = store
        self.stats = stats
        self.rank = rank
        self.num_blocks = num_blocks
        self.layer_names = layer_names
        self.layers: list[torch.Tensor] = []
        self.block_dim = 0
        self.per_block: tuple[int, ...] = ()
        self.dtype: torch.dtype | None = None
        self.layout = ""
        self._load_errors: set[int] = set()
        self._pending: list[tuple[bytes, Future]] = []
        self._stored: set[bytes] = set()
        self._failed: set[bytes] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = [n for n in self.layer_names if n in kv_caches] or sorted(kv_caches)
        missing = set(kv_caches) - set(names)
        if missing:
            raise RuntimeError(f"KV tensors for layers not in the KV cache group: {sorted(missing)}")
        self.layers = [kv_caches[n] for n in names]
        first = self.layers[0]
        self.block_dim = discover_block_dim(first, self.num_blocks)
        self.per_block = (len(self.layers), *block_shape(first, self.block_dim))
        self.dtype = first.dtype
        self.layout = f"{first.device.type}:blockdim{self.block_dim}:{list(self.per_block)}"
        log.info("cwm connector: %d layers, block tensor %s %s, block axis %d",
                 len(self.layers), self.per_block, self.dtype, self.block_dim)

    # --- loads --------------------------------------------------------------------------------

    def start_load_kv(self, meta: CWMConnectorMetadata) -> None:
        for transfer in meta.loads:
            self._load(transfer)

    def _load(self, t: BlockTransfer) -> None:
        t0 = time.perf_counter()
        tensors = self.store.get_many(t.keys)
        good: list[torch.Tensor] = []
        for key, tensor in zip(t.keys, tensors, strict=True):
            if tensor is None or tuple(tensor.shape) != self.per_block or tensor.dtype != self.dtype:
                if tensor is not None:
                    log.warning("cwm connector: block %s has shape %s %s, expected %s %s; recomputing",
                                key.hex()[:16], tuple(tensor.shape), tensor.dtype, self.per_block,
                                self.dtype)
                break
            good.append(tensor)
        if good:
            scatter_blocks(self.layers, self.block_dim, t.block_ids[:len(good)], torch.stack(good))
        failed = t.block_ids[len(good):]
        if failed:
            self._load_errors.update(failed)
            self.stats.add("load_errors", len(failed))
            self._failed.update(t.keys[len(good):])
        self.stats.add("loaded_blocks", len(good))
        self.stats.add("loaded_bytes", sum(x.numel() * x.element_size() for x in good))
        self.stats.add("load_seconds", time.perf_counter() - t0)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- saves --------------------------------------------------------------------------------

    def wait_for_save(self, meta: CWMConnectorMetadata) -> None:
        if not meta.saves:
            return
        t0 = time.perf_counter()
        block_ids = [b for t in meta.saves for b in t.block_ids]
        staged = gather_blocks(self.layers, self.block_dim, block_ids)
        i = 0
        for t in meta.saves:
            for key in t.keys:
                block = staged[i]
                i += 1
                try:
                    fut = self.store.put(key, block, num_tokens=t.num_tokens, layout=self.layout)
                except Exception as exc:  # refused by the store (full, closed): serving goes on
                    log.warning("cwm connector: save refused: %s", exc)
                    self.stats.add("save_errors")
                    self._failed.add(key)
                    continue
                self._pending.append((key, fut))
        self.stats.add("saved_blocks", i)
        self.stats.add("saved_bytes", staged.numel() * staged.element_size())
        self.stats.add("save_seconds", time.perf_counter() - t0)

    def take_worker_meta(self) -> CWMWorkerMetadata | None:
        still: list[tuple[bytes, Future]] = []
        for key, fut in self._pending:
            if not fut.done():
                still.append((key, fut))
            elif fut.exception() is not None:
                self.stats.add("save_errors")
                self._failed.add(key)
                log.warning("cwm connector: saving block %s failed: %s", key.hex()[:16],
                            fut.exception())
            else:
                self._stored.add(key)
        self._pending = still
        if not self._stored and not self._failed:
            return None
        meta = CWMWorkerMetadata(self._stored - self._failed, self._failed)
        self._stored, self._failed = set(), set()
        return meta

    def shutdown(self) -> None:
        self.store.flush(timeout=30)
        self.store.close()
