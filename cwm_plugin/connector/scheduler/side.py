"""Scheduler side of the connector: which blocks to load and which to save, per step.

Runs in vLLM's EngineCore process. It never touches tensors: it plans with vLLM's (rank-free) block
hashes and turns each scheduler step into a :class:`CWMConnectorMetadata`; each worker derives its
own keys. A block is loadable only when *every* worker (TP rank x pipeline stage) holds its key:
lookups ask the durable tiers for all of them, and the workers' reports of what they stored, dropped
or failed to load feed :class:`~cwm_plugin.connector.scheduler.known.KnownBlocks`, which never
promises a block for longer than it can vouch for it.

Which blocks each step saves, and the context record a finished request leaves, is decided
by :class:`~cwm_plugin.connector.scheduler.saves.Saves`. A request whose ``kv_transfer_params``
say ``store: false`` (the sidecar's background prompts) is neither looked up, saved nor
recorded (:mod:`~cwm_plugin.connector.params`).

Nothing here waits on the store. Lookups run in the background (:mod:`.lookups`): a request
whose lookup still runs is answered ``None`` (vLLM asks again next step) until a deadline, past
which its unknown blocks are misses. Promised blocks are leased in the durable tiers
(:mod:`.leases`) until their load is done; the workers' memory tiers free nothing a promise may
still name (each metadata carries its ``step`` and ``seen``, the newest worker report taken in:
:meth:`~cwm_plugin.store.tiers.ram.tier.RamTier.defer_evictions`). CPU workers load in the
background: a hit is answered ``(n, True)``, the request waits in vLLM's WAITING_FOR_REMOTE_KVS
until the workers report it loaded (``get_finished``), and decoding requests go on meanwhile. A
load that fails is recomputed (the connector sets vLLM's ``kv_load_failure_policy`` to
``recompute``) and that request is promised nothing again.

Each transfer carries its blocks' content identities (:mod:`~cwm_plugin.connector.content`),
which the workers write into the blobs they save and expect of the blobs they load.

Hit sources for vLLM's ``prompt_tokens_cached_by_source``: blocks the workers reported storing
are ``host`` (their memory tier) when they have one, blocks in the disk index ``disk``, the rest
(Redis) ``external_unspecified``.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.content import ContentChains
from cwm_plugin.connector.keys import KeyNamespace, kv_block_hashes, lora_extra
from cwm_plugin.connector.metadata import BlockTransfer, CWMConnectorMetadata, CWMWorkerMetadata
from cwm_plugin.connector.metrics.stats import StatsCollector
from cwm_plugin.connector.scheduler.events import TierEvents, medium_of
from cwm_plugin.connector.scheduler.known import KnownBlocks
from cwm_plugin.connector.scheduler.leases import Leases
from cwm_plugin.connector.scheduler.lookups import Lookups
from cwm_plugin.connector.scheduler.requests import RequestState, eligible
from cwm_plugin.connector.scheduler.saves import Saves
from cwm_plugin.connector.scheduler.selfcheck import SelfCheck, run_selfcheck
from cwm_plugin.connector.warn_once import WarnOnce
from cwm_plugin.store.kv_store import KVStore

log = logging.getLogger(__name__)
SHUTDOWN_FLUSH_S = 30          # the longest a shutdown waits for context records being written


def hit_source_of_saves(store_settings: Any) -> CacheHitSource:
    """Where the workers load a block they saved this run: their memory tier if they have one,
    else the disk, else Redis (``store_settings``: the workers' StoreConfig)."""
    if store_settings.memory_bytes > 0:
        return CacheHitSource.HOST
    return CacheHitSource.DISK if store_settings.disk_path else CacheHitSource.EXTERNAL_UNSPECIFIED


class SchedulerSide:
    def __init__(self, ns: KeyNamespace, cfg: ConnectorConfig, store: KVStore,
                 stats: StatsCollector, *, hash_fn: Any = None, hash_ratio: int = 1,
                 stored_source: CacheHitSource = CacheHitSource.HOST,
                 workers: list[tuple[KeyNamespace, int]] | None = None,
                 async_loads: bool = False, events: bool = False) -> None:
        self.ns = ns
        self.cfg = cfg
        self.store = store
        self.stats = stats
        self.hash_fn = hash_fn
        self.hash_ratio = hash_ratio
        self.block_size = ns.block_size
        self.selfcheck: SelfCheck | None = None
        self.served_model = ""  # the name vLLM serves the model under (the connector sets it)
        # (namespace of the worker's pipeline stage, its TP rank), in worker-index order
        self.workers = workers or [(ns, 0)]
        self.known = KnownBlocks(len(self.workers), lookup_ttl_s=cfg.lookup_cache_s,
                                 stored_ttl_s=cfg.stored_trust_s if store.durable else math.inf,
                                 stored_source=stored_source)
        self.lookups = Lookups(store, self.workers, stats, wait_s=cfg.lookup_wait_ms / 1000,
                               deadline_s=cfg.lookup_deadline_ms / 1000)
        self.leases = Leases(store, stats, ttl_s=cfg.lease_ttl_s)
        self.contents = ContentChains(hash_fn, self.block_size // hash_ratio, hash_ratio)
        self.max_blocks = cfg.max_stored_tokens_per_request // self.block_size
        # our tiers' KV events (when vLLM publishes events)
        self.events = TierEvents(medium_of(stored_source), self.block_size) if events else None
        self.saves = Saves(cfg, store, stats, ns=ns, workers=self.workers, hash_ratio=hash_ratio,
                           max_blocks=self.max_blocks, known=self.known, contents=self.contents,
                           events=self.events)
        # the workers load in the background (CPU) and report it in get_finished
        self.async_loads = async_loads and cfg.async_loads
        self._reqs: dict[str, RequestState] = {}
        # loads sent to the workers and not reported done: req id -> (load, asynchronous)
        self._loading: dict[str, tuple[BlockTransfer, bool]] = {}
        self._reset_pending = False
        self._step = self._seen = 0   # metadata built; the newest worker report taken in
        self._selfcheck_started = False
        self._warn = WarnOnce(log)

    # --- helpers ------------------------------------------------------------------------------

    def _hashes(self, request: Any, num_blocks: int) -> list[bytes]:
        return kv_block_hashes(request.block_hashes, num_blocks, self.hash_ratio)

    def _state(self, request: Any) -> RequestState:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = RequestState(
                request, lora_extra(getattr(request, "lora_request", None)))
        state.request = request
        return state

    def _keys(self, hashes: list[bytes], extra: bytes) -> list[bytes]:
        """Every worker's keys of ``hashes``."""
        return [k for ns, rank in self.workers for k in ns.keys(hashes, rank, extra)]

    def _sources(self, req_id: str, hashes: list[bytes], extra: bytes
                 ) -> list[CacheHitSource] | None:
        """Where each block of the loadable prefix of ``hashes`` comes from, or None while
        the lookup of the blocks not known runs. Blocks of a LoRA request (``extra``) are not
        cached: their keys differ by adapter content."""
        known = [None if extra else self.known.get(h) for h in hashes]
        unknown = [h for h, s in zip(hashes, known, strict=True) if s is None]
        if unknown:
            found = self.lookups.resolve(req_id, unknown, extra)
            if found is None:
                return None
            if not extra:
                self.known.found(found)
            known = [s or found.get(h) for s, h in zip(known, hashes, strict=True)]
        return list(itertools.takewhile(lambda s: s is not None, known))

    def _start_selfcheck(self) -> None:
        """The hashing self-check reads and writes the store: it runs before the first
        lookup job, off the step (after vLLM initialised its hashing)."""
        if not self._selfcheck_started and self.hash_fn is not None:
            self._selfcheck_started = True
            self.lookups.before_next(self._check_hashing)

    def _check_hashing(self) -> None:
        if self.selfcheck is not None or self.hash_fn is None:
            return
        try:
            self.selfcheck = run_selfcheck(self.store, self.ns, self.hash_fn, self.block_size)
        except Exception as exc:  # a check must never take the engine down
            log.error("cwm connector: the hashing self-check could not run (%s); serving goes "
                      "on, it runs again at the next start", exc)
            self.selfcheck = SelfCheck("error", "")
        if self.selfcheck.status == "mismatch":
            self.stats.add("selfcheck_failures")

    # --- vLLM hooks ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens loadable past ``num_computed_tokens``; None while the lookup runs (vLLM
        skips the request this step); True with a hit when the workers load it in the
        background (CPU), False when they load it before the step's forward: on a device, or a
        small load from their memory tier (``sync_load_max_tokens``), whose request vLLM then
        prefills in the same step."""
        self._start_selfcheck()
        state = self._state(request)
        state.lookup_sources = []
        rid = request.request_id
        if not self.cfg.load_enabled or not eligible(self.cfg, request) or state.load_failed:
            return 0, False
        # Leave at least one token to compute: vLLM needs a forward pass to sample from.
        max_blocks = min((request.num_tokens - 1) // self.block_size, self.max_blocks)
        start = num_computed_tokens // self.block_size
        if start >= max_blocks:
            self.lookups.forget(rid)
            return 0, False
        t0 = time.perf_counter()
        hashes = self._hashes(request, max_blocks)[start:]
        sources = self._sources(rid, hashes, state.extra)
        self.stats.add("lookup_seconds", time.perf_counter() - t0)
        if sources is None:
            self.stats.add("lookups_deferred")
            return None, False
        state.lookup_start, state.lookup_sources = start, sources
        self.stats.lookup(queried=len(hashes) * self.block_size,
                          hit=len(sources) * self.block_size)
        if sources:        # protected from eviction until loaded (in the background)
            self.leases.take(rid, self._keys(hashes[:len(sources)], state.extra))
        else:
            self.leases.release(rid)
        n = len(sources) * self.block_size
        state.load_sync = self.async_loads and 0 < n <= self.cfg.sync_load_max_tokens and \
            all(s == CacheHitSource.HOST for s in sources)
        return n, n > 0 and self.async_loads and not state.load_sync

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        state = self._reqs.get(request.request_id)
        n = num_external_tokens // self.block_size
        if state is None or len(state.lookup_sources) < n or n * self.block_size != \
                num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens} \
                if num_external_tokens else {}
        out: dict[CacheHitSource, int] = {}
        for source in state.lookup_sources[:n]:
            out[source] = out.get(source, 0) + self.block_size
        return out

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._state(request)
        if num_external_tokens <= 0:
            return
        n = num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0]
        start = state.lookup_start
        hashes = self._hashes(request, start + n)[start:]
        state.load = BlockTransfer(request.request_id, list(block_ids[start:start + n]), hashes,
                                   num_tokens=(start + n) * self.block_size,
                                   salt=getattr(request, "cache_salt", None), extra=state.extra,
                                   contents=self.contents.of(request, hashes, start),
                                   sync=state.load_sync)
        state.saved_blocks = max(state.saved_blocks, start + n)
        state.loaded = (start, start + n)

    def build_connector_meta(self, scheduler_output: Any) -> CWMConnectorMetadata:
        self.lookups.new_step()
        self._step += 1
        meta = CWMConnectorMetadata(reset=self._reset_pending, step=self._step, seen=self._seen,
                                    idle=not getattr(scheduler_output,
                                                     "total_num_scheduled_tokens", 1))
        self._reset_pending = False
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            # Blocks computed before this step (local prefix cache or loaded by us) are known
            # stored or planned, or were computed here before: the worker's store skips any it
            # holds already (no lookup on the step).
            state.handled_blocks = 0
            self.saves.plan(state, new.req_id, new.num_computed_tokens
                            + scheduler_output.num_scheduled_tokens.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            # vLLM rolls a request back to a block whose load failed (and recomputes the rest):
            # what was planned past the roll-back point is planned again
            back = cached.num_computed_tokens[i] // self.block_size
            state.handled_blocks = min(state.handled_blocks, back)
            lo, hi = state.loaded       # (and the blocks past it are not loaded ones)
            state.loaded = (lo, max(lo, min(hi, back)))
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self.saves.plan(state, req_id, done, meta)
        for state in self._reqs.values():
            if state.load is not None:
                meta.loads.append(state.load)
                self._loading[state.load.req_id] = (state.load,
                                                    self.async_loads and not state.load.sync)
                state.load = None
        for req_id in scheduler_output.finished_req_ids:
            self._reqs.pop(req_id, None)
            self._end(req_id)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        # Saves copy blocks out at the end of the step that computed them, so nothing here
        # needs the blocks any longer.
        state = self._reqs.pop(request.request_id, None)
        self._end(request.request_id)
        self.saves.finished(state, request, self.served_model)
        return False, None

    def _end(self, req_id: str) -> None:
        """A request is finished: no lookup for it any more; its lease goes, unless its load
        still runs (then when the workers report it done)."""
        self.lookups.forget(req_id)
        self.contents.forget(req_id)
        if req_id not in self._loading:
            self.leases.release(req_id)

    def _loads_done(self, connector_output: Any) -> None:
        """Loads the workers finished (asynchronous: reported in ``finished_recving``;
        synchronous: named in the worker metadata of the step that ran them): release their leases; a load with a block
        that failed (``invalid_block_ids``) is recomputed by vLLM, and its request is never
        promised blocks again (a block the index still lists would fail the same way)."""
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        received = set(getattr(connector_output, "finished_recving", None) or ())
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, CWMWorkerMetadata):  # synchronous loads the workers ran
            received |= meta.loaded
        for req_id, (load, _) in list(self._loading.items()):
            if req_id not in received:  # (with async scheduling the next step is built
                continue                # before this output arrives: settle by name)
            del self._loading[req_id]
            self.leases.release(req_id)
            if invalid.isdisjoint(load.block_ids):
                continue
            self.stats.add("load_failures_recomputed")
            if (state := self._reqs.get(req_id)) is not None:
                state.load_failed = True
                state.loaded = (0, 0)        # recomputed: saved as any computed block
            self._warn("load", "promised blocks could not be loaded (evicted, deleted or "
                       "damaged after the lookup); vLLM recomputes them (counted as "
                       "cwm:connector_load_failures_recomputed)")

    def update_connector_output(self, connector_output: Any) -> None:
        self._loads_done(connector_output)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, CWMWorkerMetadata):
            return
        self._seen = max(self._seen, meta.step)   # its drops are forgotten below
        if meta.overflow:
            self.known.clear()
        stored = self.known.report_stored(meta.stored)
        self.known.forget(meta.failed | meta.dropped)
        if self.events is not None:
            self.events.stored(stored)
            self.events.removed(meta.failed | meta.dropped)
        if meta.dropped:
            self.stats.add("dropped_blocks", len(meta.dropped))

    def reset_cache(self) -> bool:
        """vLLM's reset of the connector's cache: forget every block believed stored and have
        the workers drop their memory tiers (durable tiers are left: ``cwm store``)."""
        self.known.clear()
        self._reset_pending = True
        if self.events is not None and self.events.medium == MEDIUM_CPU:
            self.events.cleared()  # (the durable tiers keep theirs)
        log.info("cwm connector: cache reset (scheduler beliefs cleared, memory tiers dropped)")
        return True

    def shutdown(self) -> None:
        """Stop the lookups and leases (a stuck store is not waited for: leases expire), then
        write the pending records, for ``SHUTDOWN_FLUSH_S`` at most."""
        self.lookups.shutdown()
        self.leases.shutdown()
        self.store.close(timeout=SHUTDOWN_FLUSH_S)
