"""Loading a request's blocks from the store into vLLM's paged KV cache (the worker's half).

For each load the worker derives this rank's keys from the planned block hashes, finds which
tiers hold them (up to the first that none holds: a KV prefix with a hole is useless) and
reads them through the store's pipeline (:mod:`cwm_plugin.store.read_path`): blobs are fetched
chunk by chunk and decoded in parallel on the store's threads, each straight into a per-thread
scratch block that the same thread copies into the paged cache. A block that is missing,
corrupt or of another layout, and every later block of that request, is a load error: its
block ids go to vLLM (``get_block_ids_with_load_errors``), which recomputes them, and its
hashes to the scheduler, which stops promising them.

Two ways to run, chosen per worker:

* **in the background** (CPU caches, the default): ``start`` leases the request's keys in this
  worker's memory tier for ``lease_ttl_s`` (its LRU must not evict a promised block before it
  is read) and hands the load to a small thread pool; vLLM's step goes on, the other requests
  decode, and the request is reported in ``get_finished``'s ``finished_recving`` once its
  blocks are in the paged cache, its failed block ids in the same pass (vLLM's contract for
  asynchronous loads). vLLM keeps the request's blocks allocated (and unused by anyone else)
  until then, even if it is aborted meanwhile.
* **synchronously**, before the forward pass: device (GPU) caches, where the step's requests
  decode into one bounded pinned staging tensor whose copy is queued on a side stream, in
  rounds when it is full (:mod:`~cwm_plugin.connector.worker.device_load`), and the forward pass
  waits for it layer by layer. They stay synchronous: a background thread would queue its
  copies on its own (default) stream, unordered against vLLM's compute stream, which may still
  be using a block that was just reallocated to the request.

Seconds per stage (lookup, read, decompress, transform, copy) are counted as
``cwm:connector_load_phase_seconds``; background loads as ``cwm:connector_async_loads``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import threading
import time

import torch

from cwm_kernels.blocks import BlockWriter
from cwm_plugin.connector.content import each
from cwm_plugin.connector.keys import KeyNamespace
from cwm_plugin.connector.metadata import BlockTransfer
from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.warn_once import WarnOnce
from cwm_plugin.connector.worker.device_load import DeviceLoader
from cwm_plugin.connector.worker.layout import KVLayout
from cwm_plugin.store.key_ops import Lease
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.store.threads import unpin
from cwm_plugin.timing import Stages

log = logging.getLogger(__name__)

TIER_ORDER = ("memory", "disk", "redis")   # the order the store fetches in
THREADS = 2                                # background loads running at once


class Loader:
    def __init__(self, store: KVStore, stats: StatsCollector, *, ns: KeyNamespace, rank: int,
                 layout: KVLayout, layers: list[torch.Tensor], block_bytes: int,
                 asynchronous: bool = True, lease_ttl_s: float = 30.0) -> None:
        self.store = store
        self.stats = stats
        self.ns = ns
        self.rank = rank
        self.layout = layout
        self.layout_name = layout.describe()
        self.dtype = layers[0].dtype
        self.block_bytes = block_bytes
        self.lease_ttl_s = lease_ttl_s
        # CPU caches: each block is copied into the paged cache by the thread that decoded it;
        # device caches: decoded into pinned staging, copied on a side stream, one event a layer
        cpu = layers[0].device.type == "cpu"
        self.writer = BlockWriter(layers, 0) if cpu else None
        self.device = None if cpu else DeviceLoader(layers, layout.per_block, self.dtype)
        self.asynchronous = cpu and asynchronous
        self._pool = cf.ThreadPoolExecutor(THREADS, thread_name_prefix="cwm-load",
                                           initializer=unpin) if self.asynchronous else None
        self._lock = threading.Lock()
        self._running: set[cf.Future] = set()
        self._done: list[tuple[BlockTransfer, int]] = []   # finished, not reported yet
        self._errors: set[int] = set()     # block ids vLLM must recompute
        self._failed: set[bytes] = set()   # hashes the scheduler must stop promising
        self._spoiled: set[str] = set()    # requests whose synchronous load failed this step
        self._warn = WarnOnce(log)
        self._sync_done: set[str] = set()

    # --- starting -----------------------------------------------------------------------------

    def start(self, loads: list[BlockTransfer]) -> None:
        """This step's loads: queued in the background, or done before returning."""
        if self.device is not None:
            self._load_device(loads)
            self._sync_done.update(t.req_id for t in loads)
        elif self._pool is None:
            for t in loads:
                self._load_now(t)
        else:
            for t in loads:
                if t.sync:      # small, from the memory tier: before the forward (no lease:
                    self._load_now(t)                               # nothing runs meanwhile)
                    continue
                lease = self._protect(t)
                fut = self._pool.submit(self._background, t, lease)
                with self._lock:
                    self._running.add(fut)
                fut.add_done_callback(self._discard)

    def _load_now(self, t: BlockTransfer) -> None:
        """A synchronous load, on vLLM's step: whatever fails is recomputed, never raised."""
        good = 0
        try:
            good = self._load(t)
        except Exception as exc:     # a closed store, a bug: recomputed, never a crash
            self._warn("sync", "a load failed (%r); its blocks are recomputed", exc)
        self._give_up(t, good, spoils=True)
        self._sync_done.add(t.req_id)

    def _protect(self, t: BlockTransfer) -> Lease | None:
        """Lease the request's keys in this worker's memory tier until its load is done."""
        if self.store.memory is None or self.lease_ttl_s <= 0:
            return None
        return self.store.lease_many(self.ns.keys(t.block_hashes, self.rank, t.extra),
                                     ttl_s=self.lease_ttl_s, tiers=[self.store.memory])

    def _background(self, t: BlockTransfer, lease: Lease | None) -> None:
        good = 0
        try:
            good = self._load(t)
        except Exception as exc:     # a closed store, a bug: recomputed, never a crash
            self._warn("background", "a background load failed (%r); its blocks are "
                       "recomputed", exc)
        finally:
            if lease is not None and lease.size:
                self.store.release(lease)
            with self._lock:
                self._done.append((t, good))

    def _discard(self, fut: cf.Future) -> None:
        with self._lock:
            self._running.discard(fut)

    # --- results ------------------------------------------------------------------------------

    def take_finished(self) -> set[str]:
        """Requests whose background load ended since the last call (their failed blocks
        join :meth:`take_errors` now, so they reach vLLM in the same pass)."""
        with self._lock:
            done, self._done = self._done, []
        for t, good in done:
            self._give_up(t, good, spoils=False)
            self.stats.add("async_loads", outcome="ok" if good == len(t.block_ids) else "failed")
        return {t.req_id for t, _ in done}

    def take_sync_done(self) -> set[str]:
        """Requests whose synchronous load ran since the last call (reported in the worker
        metadata of the step that ran it)."""
        done, self._sync_done = self._sync_done, set()
        return done

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_failed(self) -> set[bytes]:
        failed, self._failed = self._failed, set()
        return failed

    def take_spoiled(self) -> set[str]:
        spoiled, self._spoiled = self._spoiled, set()
        return spoiled

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background loads running now (tests, shutdown); False on timeout."""
        with self._lock:
            running = list(self._running)
        return not cf.wait(running, timeout=timeout).not_done

    def wait_any(self, timeout: float) -> None:
        """Wait until a background load ends, ``timeout`` seconds at most (no wait when none
        runs or one has ended unreported); the GIL is free meanwhile."""
        with self._lock:
            running = list(self._running)
            ended = bool(self._done)
        if running and not ended:
            cf.wait(running, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def shutdown(self, timeout: float | None = None) -> None:
        self.wait(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _give_up(self, t: BlockTransfer, start: int, *, spoils: bool) -> None:
        """Blocks ``start..`` of a request are not loaded: vLLM recomputes them, and the
        scheduler forgets all of them (the first failed; the rest were not used), so its next
        lookup asks the store again and saves the ones that are really gone. ``spoils``: the
        request computes in this step (a synchronous load), over whatever the pages hold."""
        if start < len(t.block_ids):
            self._errors.update(t.block_ids[start:])
            self._failed.update(bytes(h) for h in t.block_hashes[start:])
            if spoils:
                self._spoiled.add(t.req_id)
            self.stats.add("load_errors", len(t.block_ids) - start)

    # --- loading ------------------------------------------------------------------------------

    def _load(self, t: BlockTransfer, staging: torch.Tensor | None = None) -> int:
        """Read one request's blocks (into the paged cache, or into ``staging`` rows for a
        device cache); returns how many leading blocks were served."""
        t0 = time.perf_counter()
        keys = self.ns.keys(t.block_hashes, self.rank, t.extra)
        contents = each(t.contents, t.block_hashes)
        stages = Stages()
        # a synchronous load runs inside vLLM's step: the memory tier only, never disk or
        # Redis I/O (a block it no longer holds is a load error: vLLM recomputes it)
        tiers = [self.store.memory] if t.sync and self.store.memory is not None else None
        if tiers is not None:
            held = self.store.held_by(keys, tiers)[tiers[0].name]
        else:
            held = [w is not None for w in self.store.where_many(keys)]
        todo = next((i for i, there in enumerate(held) if not there), len(keys))
        stages.add("lookup", time.perf_counter() - t0)
        if staging is None:
            served = self.store.read_into(keys[:todo], self._sink(keys, t.block_ids),
                                          shape=self.layout.per_block, dtype=self.dtype,
                                          layout=self.layout_name, salt=t.salt, stages=stages,
                                          contents=contents[:todo], tiers=tiers)
        else:
            served = self._decode_staged(keys[:todo], staging, t.salt, stages,
                                         contents[:todo])
        good = next((i for i, tier in enumerate(served) if tier is None), len(served))
        self._count_load(served[:good], stages, time.perf_counter() - t0)
        return good

    def _load_device(self, loads: list[BlockTransfer]) -> None:
        """Device caches: the step's requests decode into one pinned staging of at most
        ``DeviceLoader.max_rows`` blocks; each filled staging is queued as one copy (the
        forward pass waits for it layer by layer), so a long restore pins a bounded buffer."""
        dev = self.device
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
                    self._submit_copies(rows, ids)
                    rows, ids, used = [], [], 0
                    staging = dev.staging(min(dev.max_rows, left))
                hi = min(n, lo + staging.shape[0] - used)
                part = dataclasses.replace(t, block_ids=t.block_ids[lo:hi],
                                           block_hashes=t.block_hashes[lo:hi],
                                           contents=t.contents[lo:hi])
                good = self._load(part, staging[used:used + hi - lo])
                self._give_up(part, good, spoils=True)
                rows.extend(range(used, used + good))
                ids.extend(part.block_ids[:good])
                used += hi - lo
                left -= hi - lo
                if good < hi - lo:           # the rest of this request is recomputed too
                    self._give_up(t, hi, spoils=True)
                    left -= n - hi
                    break
                lo = hi
        self._submit_copies(rows, ids)

    def _submit_copies(self, rows: list[int], block_ids: list[int]) -> None:
        if rows:
            t0 = time.perf_counter()
            self.device.submit(rows, block_ids)
            self.stats.add("load_phase_seconds", time.perf_counter() - t0, phase="copy")

    def wait_layer(self, index: int) -> None:
        """Before a layer's attention: on a device, the compute stream waits for that layer's
        restored blocks (a device-side wait); CPU loads are done or in the background."""
        if self.device is not None:
            self.device.wait_layer(index)

    def _sink(self, keys: list[bytes], block_ids: list[int]):
        """Copy a decoded block into the paged cache (on the thread that decoded it)."""
        def sink(i: int, block: torch.Tensor) -> bool:
            if tuple(block.shape) != self.layout.per_block or block.dtype != self.dtype:
                self._wrong_shape(keys[i], block)
                return False
            self.writer.write(block_ids[i], block)
            return True
        return sink

    def _decode_staged(self, keys: list[bytes], staging: torch.Tensor, salt: str | None,
                       stages: Stages, contents: list[bytes]) -> list[str | None]:
        """Device caches: decode each block straight into its row of the pinned staging."""
        def check(i: int, block: torch.Tensor) -> bool:
            if block.data_ptr() == staging[i].data_ptr():
                return True
            self._wrong_shape(keys[i], block)
            return False

        return self.store.read_into(keys, check, shape=self.layout.per_block, dtype=self.dtype,
                                    into=lambda i: staging[i], layout=self.layout_name,
                                    salt=salt, stages=stages, contents=contents)

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
