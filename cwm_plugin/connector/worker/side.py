"""Worker side of the connector: move whole blocks between vLLM's paged KV cache and the store.

Runs in each worker process (one per TP rank), once a step:

* ``start_load_kv``: this step's loads (:mod:`~cwm_plugin.connector.worker.loads`): on CPU caches
  handed to background threads (the request waits in vLLM's WAITING_FOR_REMOTE_KVS, the
  others decode), reported in ``get_finished`` once the blocks are in the paged cache; on
  device caches done before the forward pass. Blocks that fail are reported through
  ``get_block_ids_with_load_errors`` and recomputed.
* ``wait_for_save`` (after the forward pass): copy this step's completed blocks out of the paged
  cache into one staging tensor and hand each block to the store under this rank's key; the store
  encodes and writes it on its own threads. After the copy vLLM may free the paged blocks. The
  step waits for the store ``save_wait_ms`` at most: when ``queue_depth`` saves are pending
  and none finishes in that time (a stuck disk or Redis), the step's remaining blocks are not
  saved (counted as ``save_errors{reason=backpressure}``, logged once; the scheduler forgets
  them, so a later request saves them).
* ``wait_layer`` (vLLM's ``wait_for_layer_load``): on a device, the compute stream waits for that
  layer's copies; on CPU there is nothing to wait for.

Decoding is whole-request rather than layer by layer: the store holds one blob per block with
all layers (one key, one checksum, one round trip), and on CPU the forward pass runs on the same
cores as decoding, so there is no transfer to overlap with compute. On a GPU the host-to-device
copy and each layer's scatter overlap the forward pass's queueing, and layer ``i``'s attention
waits only for its own scatter.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future

import torch

from cwm_kernels import jit
from cwm_kernels.blocks import gather_blocks
from cwm_plugin.connector.content import each
from cwm_plugin.connector.keys import KeyNamespace
from cwm_plugin.connector.metadata import BlockTransfer, CWMConnectorMetadata, CWMWorkerMetadata
from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.warn_once import WarnOnce
from cwm_plugin.connector.worker.layout import KVLayout
from cwm_plugin.connector.worker.loads import Loader
from cwm_plugin.errors import ConfigError
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.store.save_queue import QueueFull

log = logging.getLogger(__name__)

SHUTDOWN_FLUSH_S = 30                      # the longest a shutdown waits for pending saves
# An idle step (every request waits for its load) waits this long at most for one to end:
# vLLM's loop would otherwise spin through empty steps, holding the GIL the loading threads
# need (an 8k-token CPU-tier load took 104 ms beside the spinning loop, 57-82 ms with it). A
# request arriving meanwhile is scheduled this much later at most.
IDLE_WAIT_S = 0.005


class WorkerSide:
    def __init__(self, store: KVStore, stats: StatsCollector, *, ns: KeyNamespace, rank: int,
                 layout: KVLayout, layers: list[torch.Tensor], index: int = 0,
                 layer_index: dict[str, int] | None = None, async_loads: bool = True,
                 lease_ttl_s: float = 30.0, save_wait_s: float = 0.02) -> None:
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
        self._pending: list[tuple[bytes, Future]] = []
        self._stored: set[tuple[bytes, int]] = set()
        self._failed: set[bytes] = set()
        self._warn = WarnOnce(log)
        self.save_wait_s = save_wait_s
        self.layer_index = dict(layer_index or {})    # vLLM layer name -> index in layers
        self.loader = Loader(store, stats, ns=ns, rank=rank, layout=layout, layers=layers,
                             block_bytes=self.block_bytes, asynchronous=async_loads,
                             lease_ttl_s=lease_ttl_s)
        if store.memory is not None:    # the scheduler promises what it believes is there
            store.memory.defer_evictions()
        if self.loader.writer is not None and not self.loader.writer.joined:
            log.info("cwm connector: the KV layers are not one evenly spaced buffer; a "
                     "restored block is copied layer by layer")
        t0 = time.perf_counter()
        jit.warm_up()          # the decoders' compiled kernels, before the first restore
        log.info("cwm connector: codec kernels ready in %.2fs", time.perf_counter() - t0)

    # --- loads --------------------------------------------------------------------------------

    @property
    def async_loads(self) -> bool:
        """Whether loads run in the background (the scheduler answers ``(n, True)``)."""
        return self.loader.asynchronous

    def start_load_kv(self, meta: CWMConnectorMetadata) -> None:
        if meta.reset:
            self.store.reset_memory()
        self.loader.start(meta.loads)

    def wait_layer(self, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: on a device, the compute stream waits for
        that layer's restored blocks (a device-side wait)."""
        self.loader.wait_layer(self.layer_index.get(layer_name, -1))

    def get_finished(self, *, idle: bool = False) -> set[str]:
        """Requests whose background load is done (vLLM's ``finished_recving``). ``idle``: the
        step computed nothing, so it first waits up to ``IDLE_WAIT_S`` for a running load to
        end (see :meth:`~cwm_plugin.connector.worker.loads.Loader.wait_any`)."""
        if idle:
            self.loader.wait_any(IDLE_WAIT_S)
        return self.loader.take_finished()

    def take_load_errors(self) -> set[int]:
        return self.loader.take_errors()

    # --- saves --------------------------------------------------------------------------------

    def wait_for_save(self, meta: CWMConnectorMetadata) -> None:
        saves = self._unspoiled(meta.saves, self.loader.take_spoiled())
        if not saves:
            return
        t0 = time.perf_counter()
        room_until = time.monotonic() + self.save_wait_s   # waiting for the queue, at most
        block_ids = [b for t in saves for b in t.block_ids]
        staged = gather_blocks(self.layers, 0, block_ids)
        i = 0
        for t in saves:
            for h, content in zip(t.block_hashes, each(t.contents, t.block_hashes), strict=True):
                block = staged[i]
                i += 1
                try:
                    fut = self.store.put(self.ns.key(h, self.rank, t.extra), block,
                                         num_tokens=t.num_tokens, layout=self.layout_name,
                                         salt=t.salt, content=content,
                                         wait=max(0.0, room_until - time.monotonic()))
                except QueueFull:      # a stuck tier: drop the save, never stall the step
                    room_until = 0.0   # (and the step's next saves wait no more)
                    self._warn("backpressure", "the store's save queue is full (a slow or "
                               "stuck tier): blocks are not saved until it drains (counted as "
                               "cwm:connector_save_errors{reason=backpressure})")
                    self.stats.add("save_errors", reason="backpressure")
                    self._failed.add(bytes(h))
                    continue
                except Exception as exc:  # refused by the store (closed, ...): serving goes on
                    self._warn(f"refused-{type(exc).__name__}", f"save refused: {exc}")
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

    def take_worker_meta(self, step: CWMConnectorMetadata | None = None
                         ) -> CWMWorkerMetadata | None:
        """What this step's store did (``step``: the step's metadata, still bound), once the
        memory tier has freed what the scheduler saw evicted and retired what is over budget
        (:meth:`~cwm_plugin.store.kv_store.KVStore.settle_memory`)."""
        if step is not None:
            self.store.settle_memory(step.step, step.seen)
        self._failed |= self.loader.take_failed()
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
        loaded = self.loader.take_sync_done()
        if not (self._stored or self._failed or dropped or overflow or loaded):
            return None
        meta = CWMWorkerMetadata({(h, i) for h, i in self._stored if h not in self._failed},
                                 set(self._failed), dropped, overflow, loaded,
                                 step.step if step is not None else 0)
        self._stored, self._failed = set(), set()
        return meta

    def shutdown(self) -> None:
        """Finish the saves still encoding or writing, then close the store. vLLM only gets here
        when it shuts down gracefully (``--shutdown-timeout`` > 0); on SIGKILL the saves still
        in flight are lost (never half-written: each blob is renamed into place whole)."""
        pending = sum(1 for _, fut in self._pending if not fut.done())
        self.loader.shutdown(timeout=SHUTDOWN_FLUSH_S)
        t0 = time.perf_counter()
        log.info("cwm connector: shutting down, %d saves in flight", pending)
        if self.store.close(timeout=SHUTDOWN_FLUSH_S):
            log.info("cwm connector: store flushed and closed in %.2fs", time.perf_counter() - t0)
        else:
            log.warning("cwm connector: saves not finished after %ds were dropped (those blocks "
                        "will be recomputed)", SHUTDOWN_FLUSH_S)
