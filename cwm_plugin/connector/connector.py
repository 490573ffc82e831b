"""``CWMConnector``: the vLLM KV connector class, a thin shell over the two sides.

vLLM makes one instance per role: SCHEDULER (EngineCore process) and WORKER (each worker
process). Each builds the same :class:`~cwm_plugin.connector.keys.Namespace` from the vLLM config,
opens the store with the settings from ``kv_connector_extra_config`` and delegates to
:class:`SchedulerSide` or :class:`WorkerSide`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.keys import build_namespace, hashes_reproducible
from cwm_plugin.connector.metadata import CWMConnectorMetadata
from cwm_plugin.connector.scheduler import SchedulerSide
from cwm_plugin.connector.stats import (
    CWMConnectorStats,
    CWMPromMetrics,
    RegistryDeltas,
    StatsCollector,
)
from cwm_plugin.connector.worker import WorkerSide
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.tiered import KVStore

log = logging.getLogger(__name__)


class CWMConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.from_extra_config(ktc.kv_connector_extra_config)
        self.ns = build_namespace(vllm_config, kv_cache_config)
        if not hashes_reproducible(self.ns.hash_algo):
            log.error("cwm connector: vLLM's block hashes (%s) are seeded randomly per process "
                      "(set PYTHONHASHSEED or use sha256): saved KV could never be found after a "
                      "restart, so saving is off", self.ns.hash_algo)
            self.cfg.save_enabled = False
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("cwm connector: kv_load_failure_policy is %r; set it to \"recompute\" so "
                        "a corrupt or missing block is recomputed instead of failing the request",
                        ktc.kv_load_failure_policy)
        self.stats = StatsCollector()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._store_deltas: RegistryDeltas | None = None
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler only looks keys up: no memory tier of its own (the worker's memory
            # tier reports what it holds through the worker metadata).
            store = KVStore(self._store_config(memory_bytes=0))
            self._scheduler = SchedulerSide(self.ns, self.cfg, store, self.stats)
        else:
            from prometheus_client import CollectorRegistry
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            registry = CollectorRegistry()
            store = KVStore(self._store_config(), registry=registry)
            self._store_deltas = RegistryDeltas(registry)
            group = kv_cache_config.kv_cache_groups[0]
            self._worker = WorkerSide(store, self.stats, rank=get_tensor_model_parallel_rank(),
                                      num_blocks=kv_cache_config.num_blocks,
                                      layer_names=list(group.layer_names))
        log.info("cwm connector (%s) ready: namespace %s, model %s, %s blocks of %d tokens",
                 role.name, self.ns.fingerprint, self.ns.model, self.ns.dtype, self.ns.block_size)

    def _store_config(self, **override: Any) -> StoreConfig:
        cfg = StoreConfig.from_dict({**self.cfg.store, **override})
        return dataclasses.replace(cfg, fingerprint=self.ns.fingerprint)

    # --- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    # --- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, CWMConnectorMetadata):
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # blocks are copied out once, after all layers, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, CWMConnectorMetadata):
            self._worker.wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> Any:
        return self._worker.take_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # --- metrics ------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> CWMConnectorStats | None:
        if self._store_deltas is not None:
            self.stats.merge(self._store_deltas.take())
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> CWMConnectorStats | None:
        return CWMConnectorStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> CWMPromMetrics:
        return CWMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
