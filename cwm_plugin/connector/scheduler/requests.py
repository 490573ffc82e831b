"""What the scheduler side keeps of each request it sees, and which requests it handles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.connector.metadata import BlockTransfer
from cwm_plugin.connector.params import params_of


@dataclass
class RequestState:
    request: Any  # vllm.v1.request.Request, live: its block_hashes grow as it decodes
    extra: bytes = b""
    block_ids: list[int] = field(default_factory=list)
    handled_blocks: int = 0  # blocks [0, handled) are stored, being stored, or skipped
    saved_blocks: int = 0    # blocks planned for saving or found stored (the record's span)
    lookup_start: int = 0
    lookup_sources: list[CacheHitSource] = field(default_factory=list)
    load: BlockTransfer | None = None
    load_sync: bool = False     # the lookup promised a synchronous load (memory tier, small)
    load_failed: bool = False   # a promised block did not load: recompute, promise no more
    # blocks [lo, hi) this request loads from the store: never saved again by it (their
    # hashes may be forgotten meanwhile: a worker's drop report, the lookup's short trust),
    # unless the load fails (vLLM recomputes them; then they are planned as any block)
    loaded: tuple[int, int] = (0, 0)


def eligible(cfg: ConnectorConfig, request: Any) -> bool:
    """Whether the connector looks up and saves ``request``'s blocks: salted, when only salted
    requests are, and not asked to keep out of the store (``store: false``)."""
    return (not cfg.salted_only or bool(getattr(request, "cache_salt", None))) \
        and params_of(request).store
