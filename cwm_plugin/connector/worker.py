"""Worker side of the connector: move whole blocks between vLLM's paged KV cache and the store.

Runs in each worker process (one per TP rank), once a step:

* ``start_load_kv`` (before the forward pass, synchronously): derive this rank's keys from the
  planned block hashes, find which tiers hold them (up to the first that none holds), and read
  them through the store's pipeline (:mod:`cwm_plugin.store.reading`): blobs are fetched chunk
  by chunk and decoded in parallel on the store's threads, each straight into a per-thread
  scratch block that the same thread copies into the paged cache (CPU caches; for a device
  cache the step's requests decode into one bounded pinned staging tensor whose copy is
  queued on a side stream, in rounds when it is full: :mod:`~cwm_plugin.connector.device_load`).
  The store checks each blob's KV layout against ours. A block that is missing, corrupt or
  of another layout, and every later block of that request, is reported through
  ``get_block_ids_with_load_errors`` so vLLM recomputes it (``kv_load_failure_policy:
  recompute``). Seconds per stage (lookup, read, decompress,
  transform, copy) are counted as ``cwm:connector_load_phase_seconds``.
* ``wait_for_save`` (after the forward pass): copy this step's completed blocks out of the paged
  cache into one staging tensor and hand each block to the store under this rank's key; the store
  encodes and writes it on its own threads. After the copy vLLM may free the paged blocks.

* ``wait_layer`` (vLLM's ``wait_for_layer_load``): on a device, the compute stream waits for that
  layer's copies; on CPU the blocks are already in place.

Decoding is whole-request rather than layer by layer: the store holds one blob per block with
all layers (one key, one checksum, one round trip), and on CPU the forward pass runs on the same
cores as decoding, so there is no transfer to overlap with compute. On a GPU the host-to-device
copy and each layer's scatter overlap the forward pass's queueing, and layer ``i``'s attention
waits only for its own scatter.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from concurrent.futures import Future

import torch

from cwm_plugin.connector.device_load import DeviceLoader
from cwm_plugin.connector.keys import Namespace
from cwm_plugin.connector.layout import KVLayout
from cwm_plugin.connector.metadata import BlockTransfer, CWMConnectorMetadata, CWMWorkerMetadata
from cwm_plugin.connector.stats import StatsCollector
from cwm_plugin.errors import ConfigError
from cwm_plugin.kernels import jit
from cwm_plugin.kernels.blocks import BlockWriter, gather_blocks
from cwm_plugin.memory.timing import Stages
from cwm_plugin.store.tiered import KVStore

log = logging.getLogger(__name__)

TIER_ORDER = ("memory", "disk", "redis")   # the order the store fetches in
SHUTDOWN_FLUSH_S = 30                      # the longest a shutdown waits for pending saves


class WorkerSide:
    def __init__(self, store: KVStore, stats: StatsCollector, *, ns: Namespace, rank: int,
                 layout: KVLayout, layers: list[torch.Tensor], index: int = 0,
                 layer_index: dict[str, int] | None = None) -> None:
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
        self._failed_loads: set[str] = set()  # requests whose load failed in this step
        self.layer_index = dict(layer_index or {})    # vLLM layer name -> index in layers
        # CPU caches: each block is copied into the paged cache by the thread that decoded it;
        # device caches: decoded into pinned staging, copied on a side stream, one event a layer
        cpu = layers[0].device.type == "cpu"
        self._writer = BlockWriter(layers, 0) if cpu else None
        self._device = None if cpu else DeviceLoader(layers, layout.per_block, self.dtype)
        if self._writer is not None and not self._writer.joined:
            log.info("cwm connector: the KV layers are not one evenly spaced buffer; a "
                     "restored block is copied layer by layer")
        t0 = time.perf_counter()
        jit.warm_up()          # the decoders' compiled kernels, before the first restore
        log.info("cwm connector: codec kernels ready in %.2fs", time.perf_counter() - t0)

    # --- loads --------------------------------------------------------------------------------

    def start_load_kv(self, meta: CWMConnectorMetadata) -> None:
        if meta.reset:
            self.store.reset_memory()
        if self._device is None:
            for transfer in meta.loads:
                self._load(transfer)
        else:
            self._load_device(meta.loads)

    def _load_device(self, loads: list[BlockTransfer]) -> None:
        """Device caches: the step's requests decode into one pinned staging of at most
        ``DeviceLoader.max_rows`` blocks; each filled staging is queued as one copy (the
        forward pass waits for it layer by layer), so a long restore pins a bounded buffer."""
        dev = self._device
        dev.clear()
        left = sum(len(t.block_hashes) for t in loads)
        staging: torch.Tensor | None = None
        rows: list[int] = []
        ids: list[int] = []
        used = 0
        for t in loads:
            lo, n = 0, len(t.block_hashes)
            while lo < n:
                if staging is None or used == staging.shape[0]:
                    self._submit(rows, ids)
                    rows, ids, used = [], [], 0
                    staging = dev.staging(min(dev.max_rows, left))
                hi = min(n, lo + staging.shape[0] - used)
                part = dataclasses.replace(t, block_ids=t.block_ids[lo:hi],
                                           block_hashes=t.block_hashes[lo:hi])
                good = self._load(part, staging[used:used + hi - lo])
                rows.extend(range(used, used + good))
                ids.extend(part.block_ids[:good])
                used += hi - lo
                left -= hi - lo
                if good < hi - lo:           # the rest of this request is recomputed too
                    self._give_up(t, hi)
                    left -= n - hi
                    break
                lo = hi
        self._submit(rows, ids)

    def _submit(self, rows: list[int], block_ids: list[int]) -> None:
        if rows:
            t0 = time.perf_counter()
            self._device.submit(rows, block_ids)
            self.stats.add("load_phase_seconds", time.perf_counter() - t0, phase="copy")

    def wait_layer(self, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: on a device, the compute stream waits for
        that layer's restored blocks (a device-side wait); CPU loads are already done."""
        if self._device is not None:
            self._device.wait_layer(self.layer_index.get(layer_name, -1))

    def _load(self, t: BlockTransfer, staging: torch.Tensor | None = None) -> int:
        """Read one request's blocks (into the paged cache, or into ``staging`` rows for a
        device cache); returns how many leading blocks were served."""
        t0 = time.perf_counter()
        keys = self.ns.keys(t.block_hashes, self.rank, t.extra)
        stages = Stages()
        # A KV prefix with a hole is useless: read up to the first block no tier holds.
        held = self.store.where_many(keys)
        todo = next((i for i, tier in enumerate(held) if tier is None), len(keys))
        stages.add("lookup", time.perf_counter() - t0)
        if staging is None:
            served = self.store.read_into(keys[:todo], self._sink(keys, t.block_ids),
                                          shape=self.layout.per_block, dtype=self.dtype,
                                          layout=self.layout_name, salt=t.salt, stages=stages)
        else:
            served = self._decode_staged(keys[:todo], staging, t.salt, stages)
        good = next((i for i, tier in enumerate(served) if tier is None), len(served))
        self._give_up(t, good)
        self._count_load(served[:good], stages, time.perf_counter() - t0)
        return good

    def _give_up(self, t: BlockTransfer, start: int) -> None:
        """Blocks ``start..`` of a request are not loaded: vLLM recomputes them, and the
        scheduler forgets all of them (the first failed; the rest were not used), so its next
        lookup asks the store again and saves the ones that are really gone."""
        if start < len(t.block_ids):
            self._load_errors.update(t.block_ids[start:])
            self._failed.update(bytes(h) for h in t.block_hashes[start:])
            self._failed_loads.add(t.req_id)
            self.stats.add("load_errors", len(t.block_ids) - start)

    def _sink(self, keys: list[bytes], block_ids: list[int]):
        """Copy a decoded block into the paged cache (on the thread that decoded it)."""
        def sink(i: int, block: torch.Tensor) -> bool:
            if tuple(block.shape) != self.layout.per_block or block.dtype != self.dtype:
                self._wrong_shape(keys[i], block)
                return False
            self._writer.write(block_ids[i], block)
            return True
        return sink

    def _decode_staged(self, keys: list[bytes], staging: torch.Tensor, salt: str | None,
                       stages: Stages) -> list[str | None]:
        """Device caches: decode each block straight into its row of the pinned staging."""
        def check(i: int, block: torch.Tensor) -> bool:
            if block.data_ptr() == staging[i].data_ptr():
                return True
            self._wrong_shape(keys[i], block)
            return False

        return self.store.read_into(keys, check, shape=self.layout.per_block, dtype=self.dtype,
                                    into=lambda i: staging[i], layout=self.layout_name,
                                    salt=salt, stages=stages)

    def _wrong_shape(self, key: bytes, block: torch.Tensor) -> None:
        log.warning("cwm connector: block %s has shape %s %s, expected %s %s; recomputing",
                    key.hex()[:16], tuple(block.shape), block.dtype, self.layout.per_block,
                    self.dtype)

    def _count_load(self, served: list[str | None], stages: Stages, seconds: float) -> None:
        """Count the loaded blocks by the tier that served them, the time by the slowest tier
        that served any, and the seconds of each stage (read, decompress, transform, copy)."""
        slowest = "none"
        for tier in TIER_ORDER:
            n = served.count(tier)
            if n:
                self.stats.add("loaded_blocks", n, tier=tier)
                self.stats.add("loaded_bytes", n * self.block_bytes, tier=tier)
                slowest = tier
        self.stats.add("load_seconds", seconds, tier=slowest)
        for phase, s in stages.seconds.items():
            self.stats.add("load_phase_seconds", s, phase=phase)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- saves --------------------------------------------------------------------------------

    def wait_for_save(self, meta: CWMConnectorMetadata) -> None:
        failed, self._failed_loads = self._failed_loads, set()
        saves = self._unspoiled(meta.saves, failed)
        if not saves:
            return
        t0 = time.perf_counter()
        block_ids = [b for t in saves for b in t.block_ids]
        staged = gather_blocks(self.layers, 0, block_ids)
        i = 0
        for t in saves:
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

    def _unspoiled(self, saves: list[BlockTransfer], failed: set[str]) -> list[BlockTransfer]:
        """The step's saves but those of a request whose load failed in this step: its
        blocks past the failed one were computed attending to whatever the failed block's
        pages held, and saved they would be served later as valid KV under their real
        hashes. vLLM recomputes them (it rolls the request back to the failed block); their
        hashes are reported failed, so they are saved when recomputed."""
        if not failed:
            return saves
        kept = [t for t in saves if t.req_id not in failed]
        for t in saves:
            if t.req_id in failed:
                self._failed.update(bytes(h) for h in t.block_hashes)
                self.stats.add("save_errors", len(t.block_hashes), reason="load_failed")
        return kept

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
        dropped = {h for h in map(self.ns.block_hash, dropped_keys) if h is not None}
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
