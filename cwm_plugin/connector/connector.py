"""``CWMConnector``: the vLLM KV connector class, a thin shell over the two sides.

vLLM makes one instance per role: SCHEDULER (EngineCore process) and WORKER (each worker
process). Start-up, in vLLM's order:

1. each worker's ``register_kv_caches``: the KV layout is taken from the attention backend
   (:func:`~cwm_plugin.connector.worker.layout.discover_layout`), the namespace built, the
   store opened and a :class:`WorkerSide` made for this TP rank;
2. vLLM collects ``get_handshake_metadata`` from every worker and hands it to the scheduler's
   ``set_xfer_handshake_metadata_pp_aware``: the scheduler builds every worker's namespace from
   its layout (pipeline stages differ), opens its store (no memory tier: it only looks keys up,
   with Redis' short lookup timeout) and makes its :class:`SchedulerSide`, which counts a block
   as stored only when every worker holds it;
3. the scheduler's first lookup runs the hashing self-check (after vLLM initialised hashing),
   in the background like every lookup.

Before anything opens, a setting under which salts would not isolate tenants is refused
(:func:`~cwm_plugin.connector.keys.check_isolation`: xxhash with a known seed over a disk or
Redis store without encryption).

A promised block that fails to load must be recomputed, never fail its request: the scheduler
side sets vLLM's ``kv_load_failure_policy`` to ``recompute`` when it is ``fail`` (vLLM's
default; vLLM reads it right after making the connector), and logs that it did.

Until step 2 the scheduler side answers "nothing stored" and plans no saves. Each store gets a
private metrics registry, forwarded into vLLM's ``/metrics`` every step
(:mod:`~cwm_plugin.connector.metrics.forward`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.keys import (
    KeyNamespace,
    build_namespace,
    check_isolation,
    hashes_reproducible,
)
from cwm_plugin.connector.metadata import CWMConnectorMetadata, CWMHandshake
from cwm_plugin.connector.metrics.forward import RegistryForwarder
from cwm_plugin.connector.metrics.prom import CWMPromMetrics
from cwm_plugin.connector.metrics.stats import CWMConnectorStats, StatsCollector
from cwm_plugin.connector.records import SERVED_LAYOUT, readable, served_key, write_record
from cwm_plugin.connector.scheduler.side import SchedulerSide, hit_source_of_saves
from cwm_plugin.connector.worker.layout import discover_layout
from cwm_plugin.connector.worker.side import WorkerSide
from cwm_plugin.errors import ConfigError
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore

log = logging.getLogger(__name__)


def use_vllm_log_handlers() -> None:
    """Send ``cwm_plugin``'s logs through vLLM's handlers (its format, its stream, its level),
    unless the application set up logging itself (handlers on ``cwm_plugin`` or on the root
    logger, which our records reach anyway). Without this the connector's INFO lines (ready,
    self-check, shutdown flush) would be dropped: vLLM configures only the ``vllm`` logger, and
    with no handler anywhere Python shows warnings only."""
    ours, theirs = logging.getLogger("cwm_plugin"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)


def recompute_load_failures(ktc: Any) -> None:
    """Make vLLM recompute blocks that fail to load (a cache miss must never fail a request):
    set ``kv_load_failure_policy`` to ``recompute``; refuse to start if it cannot be set."""
    policy = getattr(ktc, "kv_load_failure_policy", "recompute")
    if policy == "recompute":
        return
    try:
        ktc.kv_load_failure_policy = "recompute"
    except Exception as exc:  # a frozen or validating config
        raise ConfigError(f"cwm connector: vLLM's kv_load_failure_policy is {policy!r} and "
                          f"could not be changed ({exc})",
                          hint='add "kv_load_failure_policy": "recompute" to '
                               "--kv-transfer-config: a block evicted between the lookup and "
                               "the load must be recomputed, not fail the request") from exc
    if ktc.kv_load_failure_policy != "recompute":
        raise ConfigError(f"cwm connector: vLLM's kv_load_failure_policy stays {policy!r}",
                          hint='add "kv_load_failure_policy": "recompute" to '
                               "--kv-transfer-config")
    log.warning("cwm connector: kv_load_failure_policy was %r; set to \"recompute\": a block "
                "that cannot be loaded (evicted or damaged after the lookup) is recomputed "
                "instead of failing its request", policy)


def hash_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """Tokens per vLLM block hash (``Request.block_hashes``): what vLLM's EngineCore resolved
    into the KV cache config before it made the scheduler (and its connector), else vLLM's own
    resolution of it (the function EngineCore uses)."""
    size = getattr(kv_cache_config, "hash_block_size", None)
    if size is None:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1]
    return int(size)


def tier_events_on(cfg: ConnectorConfig, vllm_config: Any) -> bool:
    """Whether our tiers' blocks go into vLLM's KV events: only where vLLM publishes events
    (``--kv-events-config``) and ``tier_events`` is on."""
    events = getattr(vllm_config, "kv_events_config", None)
    return cfg.tier_events and bool(
        events is not None and getattr(events, "enable_kv_cache_events", False))


class CWMConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        use_vllm_log_handlers()
        ktc = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.from_extra_config(ktc.kv_connector_extra_config)
        self.store_settings = StoreConfig.from_dict(self.cfg.store)
        self.hash_algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
        check_isolation(self.hash_algo, self.store_settings)
        if not hashes_reproducible(self.hash_algo):
            log.error("cwm connector: vLLM's block hashes (%s) are seeded randomly per process "
                      "(set PYTHONHASHSEED or use sha256): saved KV could never be found after a "
                      "restart, so saving is off", self.hash_algo)
            self.cfg.save_enabled = False
        if role == KVConnectorRole.SCHEDULER:
            recompute_load_failures(ktc)
        if role == KVConnectorRole.SCHEDULER and not getattr(vllm_config, "shutdown_timeout", 0):
            log.warning("cwm connector: vLLM's --shutdown-timeout is 0, so on SIGTERM it kills its "
                        "workers at once and saves still being written are lost (those blocks "
                        "are recomputed later); start vLLM with --shutdown-timeout 30")
        self.stats = StatsCollector()
        self._loads_started_for: KVConnectorMetadata | None = None
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._forwarders: list[RegistryForwarder] = []
        self._warned_no_layout = False

    def _namespace(self, layout: str) -> KeyNamespace:
        return build_namespace(self._vllm_config, self._kv_cache_config, layout)

    def _open_store(self, ns: KeyNamespace, *, memory: bool, rank: str) -> KVStore:
        registry = CollectorRegistry()
        s = self.store_settings
        scheduler = {} if memory else {"memory_bytes": 0,
                                       "redis_timeout_ms": s.redis_lookup_timeout_ms}
        cfg = dataclasses.replace(s, fingerprint=ns.fingerprint, **scheduler)
        store = KVStore(cfg, registry=registry)
        # The scheduler's store forwards counters only (its gauges would repeat the workers').
        self._forwarders.append(RegistryForwarder(registry, gauge_labels={"rank": rank},
                                                  counters_only=not memory))
        return store

    # --- start-up -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        layout, views = discover_layout(self._vllm_config, self._kv_cache_config, kv_caches)
        ns = self._namespace(layout.describe())
        rank = get_tensor_model_parallel_rank()
        stage = get_pp_group().rank_in_group
        store = self._open_store(ns, memory=True, rank=str(rank))
        at = {v.data_ptr(): i for i, v in enumerate(views)}
        layer_index = {name: at[t.data_ptr()] for name, t in kv_caches.items()
                       if t.data_ptr() in at}
        self._worker = WorkerSide(store, self.stats, ns=ns, rank=rank, layout=layout,
                                  layers=views, index=stage * ns.tp_size + rank,
                                  layer_index=layer_index, async_loads=self.cfg.async_loads,
                                  lease_ttl_s=self.cfg.lease_ttl_s,
                                  save_wait_s=self.cfg.save_wait_ms / 1000)
        log.info("cwm connector (worker, stage %d rank %d) ready: namespace %s, model %s, "
                 "loads %s", stage, rank, ns.fingerprint, ns.model,
                 "in the background" if self._worker.async_loads else "before the forward pass")

    def get_handshake_metadata(self) -> CWMHandshake | None:
        if self._worker is None:
            return None
        return CWMHandshake(self._worker.layout_name, self._worker.rank,
                            self._worker.async_loads)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Layouts keyed by (pipeline rank, TP rank): every worker's namespace is looked up."""
        layouts = {ranks: m.layout for ranks, m in metadata.items() if isinstance(m, CWMHandshake)}
        if (0, 0) not in layouts or len(layouts) != len(metadata):
            log.error("cwm connector: not every worker sent its KV layout (got %s of %d); "
                      "loading and saving stay off", sorted(layouts), len(metadata))
            return
        self._adopt_layouts(layouts, all(m.async_loads for m in metadata.values()))

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    def _adopt_layouts(self, layouts: dict[tuple[int, int], str], async_loads: bool) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name

        namespaces = {lay: self._namespace(lay) for lay in set(layouts.values())}
        workers = [(namespaces[layouts[ranks]], ranks[1]) for ranks in sorted(layouts)]
        ns = workers[0][0]
        spec_block = ns.block_size
        hash_block = hash_block_size(self._vllm_config, self._kv_cache_config)
        store = self._open_store(ns, memory=False, rank="scheduler")
        self._scheduler = SchedulerSide(
            ns, self.cfg, store, self.stats, hash_fn=get_hash_fn_by_name(self.hash_algo),
            hash_ratio=max(1, spec_block // hash_block),
            stored_source=hit_source_of_saves(self.store_settings), workers=workers,
            async_loads=async_loads,
            events=tier_events_on(self.cfg, self._vllm_config))
        served = getattr(self._vllm_config.model_config, "served_model_name", None) or ns.model
        served = str(served[0] if isinstance(served, list | tuple) else served)
        self._scheduler.served_model = served  # context records name it (windows, warm-ups)
        if readable(store):
            write_record(store, served_key(served), {
                "model": served, "namespace": dataclasses.asdict(ns),
                "workers": [(n.digest.hex(), r) for n, r in workers]}, SERVED_LAYOUT,
                what="the served-model record")
        log.info("cwm connector (scheduler) ready: namespace %s, model %s, KV layout %s, "
                 "%d worker(s), %s loads", ns.fingerprint, ns.model, ns.layout, len(workers),
                 "asynchronous" if self._scheduler.async_loads else "synchronous")

    def _side(self) -> SchedulerSide | None:
        if self._scheduler is None and not self._warned_no_layout:
            self._warned_no_layout = True
            log.error("cwm connector: the scheduler never received the workers' KV layout "
                      "(handshake); nothing is loaded or saved")
        return self._scheduler

    # --- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        side = self._side()
        return side.get_num_new_matched_tokens(request, num_computed_tokens) if side else (0, False)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        side = self._side()
        if side is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return side.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if (side := self._side()) is not None:
            side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        side = self._side()
        return side.build_connector_meta(scheduler_output) if side else CWMConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        side = self._side()
        return side.request_finished(request, block_ids) if side else (False, None)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    def take_events(self) -> list[Any]:
        """Our tiers' KV events since the last call (``scheduler/events.py``), published by
        vLLM beside its own when ``--kv-events-config`` turns them on."""
        events = self._scheduler.events if self._scheduler is not None else None
        return events.take() if events is not None else []

    # --- worker side --------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's metadata, before its forward pass (vLLM has zeroed the step's new blocks
        by then). Background loads start here, not in ``start_load_kv``, which vLLM calls after
        the forward when no load is synchronous: a load that ends while the forward runs is
        reported in this step's ``get_finished`` and its request prefills in the next step,
        one step earlier. The blocks it fills belong to a request this forward does not
        touch (it waits for its KV, 0 tokens scheduled), so the forward reads none of them."""
        super().bind_connector_metadata(connector_metadata)
        if (self._worker is not None and self._worker.async_loads
                and isinstance(connector_metadata, CWMConnectorMetadata)
                and connector_metadata is not self._loads_started_for):
            self._loads_started_for = connector_metadata
            self._worker.start_load_kv(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if (self._worker is not None and isinstance(meta, CWMConnectorMetadata)
                and meta is not self._loads_started_for):
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # CPU caches are filled in start_load_kv; on a GPU the compute stream waits for this
        # layer's queued copies (device-side, the host does not block)
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # blocks are copied out once, after all layers, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, CWMConnectorMetadata):
            self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose background load is done (their failed blocks come with
        ``get_block_ids_with_load_errors`` in the same pass); no sends."""
        meta = self._connector_metadata
        idle = isinstance(meta, CWMConnectorMetadata) and meta.idle
        done = self._worker.get_finished(idle=idle) if self._worker is not None else set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> Any:
        if self._worker is None:
            return None
        meta = self._connector_metadata
        return self._worker.take_worker_meta(meta if isinstance(meta, CWMConnectorMetadata)
                                             else None)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # --- metrics ------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> CWMConnectorStats | None:
        for forwarder in self._forwarders:
            self.stats.merge(forwarder.take())
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> CWMConnectorStats | None:
        return CWMConnectorStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> CWMPromMetrics:
        return CWMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
