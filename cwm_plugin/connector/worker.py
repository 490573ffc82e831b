"""Worker side of the connector: move whole blocks between vLLM's paged KV cache and the store.

Runs in each worker process (one per TP rank), once a step:

* ``start_load_kv`` (before the forward pass, synchronously): derive this rank's keys from the
  planned block hashes, fetch them from the store in one batch straight into a staging tensor
  (the store checks each blob's KV layout against ours), and scatter the good prefix into the
  paged cache. A block that is missing, corrupt or of another layout, and every later block of
  that request, is reported through ``get_block_ids_with_load_errors`` so vLLM recomputes it
  (``kv_load_failure_policy: recompute``).
* ``wait_for_save`` (after the forward pass): copy this step's completed blocks out of the paged
  cache into one staging tensor and hand each block to the store under this rank's key; the store
  encodes and writes it on its own threads. After the copy vLLM may free the paged blocks.

Loading is whole-request rather than layer by layer: the store holds one blob per block with all
layers (one key, one checksum, one round trip), and on CPU the forward pass runs on the same
cores as decoding, so there is no transfer to overlap with compute.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future

import torch

from cwm_plugin.connector.keys import Namespace
from cwm_plugin.connector.layout import KVLayout
from cwm_plugin.connector.metadata import BlockTransfer, CWMConnectorMetadata, CWMWorkerMetadata
from cwm_plugin.connector.stats import StatsCollector
from cwm_plugin.errors import ConfigError
from cwm_plugin.kernels.blocks import gather_blocks, scatter_blocks
from cwm_plugin.store.tiered import KVStore

log = logging.getLogger(__name__)

TIER_ORDER = ("memory", "disk", "redis")   # the order the store fetches in
SHUTDOWN_FLUSH_S = 30                      # the longest a shutdown waits for pending saves


class WorkerSide:
    def __init__(self, store: KVStore, stats: StatsCollector, *, ns: Namespace, rank: int,
                 layout: KVLayout, layers: list[torch.Tensor], index: int = 0) -> None:
        if len(layers) != layout.num_layers or any(
                tuple(t.shape[1:]) != layout.block_shape for t in layers):
            raise ConfigError(f"KV tensors {[tuple(t.shape) for t in layers]} do not match the "
                              f"layout {layout.describe()}")
        self.store = store
        self.stats = stats
        self.ns = ns
        self.rank = rank
        self.index = index          # pipeline stage x TP size + TP rank, for the scheduler
        self.layout = layout
        self.layout_name = layout.describe()
        self.layers = layers
        self.dtype = layers[0].dtype
        self.block_bytes = math.prod(layout.per_block) * layers[0].element_size()
        self._load_errors: set[int] = set()
        self._pending: list[tuple[bytes, Future]] = []
        self._stored: set[tuple[bytes, int]] = set()
        self._failed: set[bytes] = set()

    # --- loads --------------------------------------------------------------------------------

    def start_load_kv(self, meta: CWMConnectorMetadata) -> None:
        if meta.reset:
            self.store.reset_memory()
        for transfer in meta.loads:
            self._load(transfer)

    def _tier_hits(self) -> dict[str, float]:
        """The store's per-tier blob hit counters (to tell which tier served a load)."""
        out: dict[str, float] = {}
        for family in self.store.metrics.hits.collect():
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels["tier"]] = float(s.value)
        return out

    def _load(self, t: BlockTransfer) -> None:
        t0 = time.perf_counter()
        keys = self.ns.keys(t.block_hashes, self.rank, t.extra)
        staging = torch.empty((len(keys), *self.layout.per_block), dtype=self.dtype)
        before = self._tier_hits()
        tensors = self.store.get_many(keys, out=staging, layout=self.layout_name, salt=t.salt)
        after = self._tier_hits()
        good = 0
        for i, tensor in enumerate(tensors):
            if tensor is None:
                break
            if tuple(tensor.shape) != self.layout.per_block or tensor.dtype != self.dtype:
                log.warning("cwm connector: block %s has shape %s %s, expected %s %s; recomputing",
                            keys[i].hex()[:16], tuple(tensor.shape), tensor.dtype,
                            self.layout.per_block, self.dtype)
                break
            if tensor.data_ptr() != staging[i].data_ptr():
                staging[i].copy_(tensor)
            good += 1
        if good:
            scatter_blocks(self.layers, 0, t.block_ids[:good], staging[:good])
        if good < len(keys):
            self._load_errors.update(t.block_ids[good:])
            # The scheduler forgets all of them (the first failed; the rest were not tried), so
            # its next lookup asks the store again and saves the ones that are really gone.
            self._failed.update(bytes(h) for h in t.block_hashes[good:])
            self.stats.add("load_errors", len(keys) - good)
        self._count_load(good, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
                         time.perf_counter() - t0)

    def _count_load(self, good: int, served: dict[str, float], seconds: float) -> None:
        """Attribute the ``good`` blocks to the tiers that served them (the store counts a hit
        once the blob decoded; blocks after a break in the prefix go uncounted, in fetch order)
        and the time to the slowest tier that served any."""
        left = good
        slowest = "none"
        for tier in TIER_ORDER:
            n = min(left, int(served.get(tier, 0)))
            if n <= 0:
                continue
            self.stats.add("loaded_blocks", n, tier=tier)
            self.stats.add("loaded_bytes", n * self.block_bytes, tier=tier)
            slowest, left = tier, left - n
        self.stats.add("load_seconds", seconds, tier=slowest)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- saves --------------------------------------------------------------------------------

    def wait_for_save(self, meta: CWMConnectorMetadata) -> None:
        if not meta.saves:
            return
        t0 = time.perf_counter()
        block_ids = [b for t in meta.saves for b in t.block_ids]
        staged = gather_blocks(self.layers, 0, block_ids)
        i = 0
        for t in meta.saves:
            for h in t.block_hashes:
                block = staged[i]
                i += 1
                try:
                    fut = self.store.put(self.ns.key(h, self.rank, t.extra), block,
                                         num_tokens=t.num_tokens, layout=self.layout_name,
                                         salt=t.salt)
                except Exception as exc:  # refused by the store (closed, ...): serving goes on
                    log.warning("cwm connector: save refused: %s", exc)
                    self.stats.add("save_errors", reason="refused")
                    self._failed.add(bytes(h))
                    continue
                if not t.extra:       # LoRA blocks are looked up, never cached as stored
                    self._pending.append((bytes(h), fut))
                else:
                    self._pending.append((b"", fut))
        self.stats.add("save_seconds", time.perf_counter() - t0)

    def take_worker_meta(self) -> CWMWorkerMetadata | None:
        still: list[tuple[bytes, Future]] = []
        for h, fut in self._pending:
            if not fut.done():
                still.append((h, fut))
            elif fut.cancelled() or fut.exception() is not None:
                self.stats.add("save_errors", reason="failed")
                if h:
                    self._failed.add(h)
                log.warning("cwm connector: saving block %s failed: %s", h.hex()[:16],
                            "cancelled" if fut.cancelled() else fut.exception())
            else:
                if h:
                    self._stored.add((h, self.index))
                self.stats.add("saved_blocks")
                self.stats.add("saved_bytes", self.block_bytes)
        self._pending = still
        dropped_keys, overflow = self.store.take_dropped()
        dropped = {k[-32:] for k in dropped_keys if len(k) > 32}
        if not (self._stored or self._failed or dropped or overflow):
            return None
        meta = CWMWorkerMetadata({(h, i) for h, i in self._stored if h not in self._failed},
                                 set(self._failed), dropped, overflow)
        self._stored, self._failed = set(), set()
        return meta

    def shutdown(self) -> None:
        """Finish the saves still encoding or writing, then close the store. vLLM only gets here
        when it shuts down gracefully (``--shutdown-timeout`` > 0); on SIGKILL the saves still
        in flight are lost (never half-written: each blob is renamed into place whole)."""
        pending = sum(1 for _, fut in self._pending if not fut.done())
        t0 = time.perf_counter()
        log.info("cwm connector: shutting down, %d saves in flight", pending)
        if self.store.close(timeout=SHUTDOWN_FLUSH_S):
            log.info("cwm connector: store flushed and closed in %.2fs", time.perf_counter() - t0)
        else:
            log.warning("cwm connector: saves not finished after %ds were dropped (those blocks "
                        "will be recomputed)", SHUTDOWN_FLUSH_S)
