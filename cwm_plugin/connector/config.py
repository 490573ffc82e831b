"""Settings of the KV connector, from ``kv_connector_extra_config`` with environment fallback.

Example ``--kv-transfer-config``::

    {"kv_connector": "CWMConnector", "kv_connector_module_path": "cwm_plugin.connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"store": {"disk_path": "/var/lib/cwm", "redis_url": null},
                                    "max_stored_tokens_per_request": 32768}}

Everything under ``store`` is a :class:`cwm_plugin.store.config.StoreConfig` field (its own
environment fallback, ``CWM_STORE_<FIELD>``, applies). The connector's own fields fall back to
``CWM_CONNECTOR_<FIELD>``. Every value is typed and range-checked (``"false"`` is false,
``"32k"`` is 32768, ``"lots"`` is an error naming the field).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cwm_plugin.typed_config import check_fields, limits, load


@dataclass
class ConnectorConfig:
    store: dict[str, Any] = field(default_factory=dict)
    # Never store more than this many tokens of one request (whole blocks, from the start).
    max_stored_tokens_per_request: int = field(default=65536, metadata=limits(min=0))
    # Save blocks of generated tokens too, so the next turn of a conversation hits them.
    save_decode_blocks: bool = True
    # Only requests that carry a cache_salt are saved and loaded.
    salted_only: bool = False
    load_enabled: bool = True
    save_enabled: bool = True
    # Write a context record per finished salted request (what windows freeze).
    context_records: bool = True
    # How long the scheduler trusts a lookup of the durable tiers (seconds).
    lookup_cache_s: float = field(default=2.0, metadata=limits(min=0, max=3600))
    # How long it trusts the workers' report that a block is stored, where a durable tier
    # holds it (another process may evict it there unseen); memory-only stores: for ever.
    stored_trust_s: float = field(default=60.0, metadata=limits(min=0, max=86400))
    # Lookups of the store run in the background: vLLM's step waits this long at most for one
    # (a fast store costs no extra step), then the request waits a step and asks again ...
    lookup_wait_ms: float = field(default=2.0, metadata=limits(min=0, max=60_000))
    # ... until this deadline, after which the blocks not known yet are misses (computed).
    lookup_deadline_ms: float = field(default=500.0, metadata=limits(min=1, max=600_000))
    # Promised blocks are pinned this long (durable tiers: from the lookup; the worker's
    # memory tier: during the load) so nothing evicts them before they are loaded; 0: off.
    lease_ttl_s: float = field(default=30.0, metadata=limits(min=0, max=3600))
    # The most a step waits for room in the store's save queue (a burst larger than
    # queue_depth); past it, with the store stuck, the step's remaining blocks are not saved.
    save_wait_ms: float = field(default=20.0, metadata=limits(min=0, max=60_000))
    # CPU workers load in the background (the request waits, the others decode); GPU workers
    # load synchronously, their copies overlapping the forward pass.
    async_loads: bool = True
    # ... except a request whose promised blocks are all in the workers' memory tier and span
    # this many tokens at most: loaded before the forward of the step that admits it, which
    # prefills it too (no step waiting on a background load); 0: every CPU load in the
    # background. Its cost is the load's time added to that step, the ITL of the requests
    # decoding beside it: under half a decode step by default (SmolLM2-135M bf16 on 2 cores:
    # 8-9 ms for 1,024 tokens from the uncompressed memory tier, bench/ttft.py's CPU-tier load,
    # so 16-18 ms for 2,048, against a ~41 ms step).
    sync_load_max_tokens: int = field(default=2048, metadata=limits(min=0, max=1 << 20))
    # With vLLM's KV events on (--kv-events-config), announce the blocks our tiers hold in
    # them too (medium CPU / STORAGE: docs/router.md); off: vLLM's own events alone.
    tier_events: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "kv_connector_extra_config")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        return load(cls, extra, env_prefix="CWM_CONNECTOR_", section="kv_connector_extra_config",
                    skip_env=("store",))
