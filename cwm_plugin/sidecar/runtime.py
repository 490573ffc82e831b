"""Everything one app instance owns, built once by ``create_app`` and kept on ``app.state``."""

from __future__ import annotations

from dataclasses import dataclass, field

from cwm_plugin.errors import UpstreamError
from cwm_plugin.sidecar.background import Maintainer
from cwm_plugin.sidecar.context import ContextTracker, SnapshotHook, noop_snapshot
from cwm_plugin.sidecar.counting import ModelCounters
from cwm_plugin.sidecar.failopen import FailOpen
from cwm_plugin.sidecar.identity import Authenticator
from cwm_plugin.sidecar.memory_port import MemoryPort
from cwm_plugin.sidecar.metrics import SidecarMetrics
from cwm_plugin.sidecar.openai_errors import ModelNotFound
from cwm_plugin.sidecar.settings import Settings
from cwm_plugin.sidecar.upstream import ModelInfo, Upstream
from cwm_plugin.sidecar.workqueue import Background


@dataclass
class Sidecar:
    settings: Settings
    auth: Authenticator
    upstream: Upstream
    memory: MemoryPort | None
    metrics: SidecarMetrics
    maintainer: Maintainer | None
    counters: ModelCounters
    failopen: FailOpen
    tracker: ContextTracker = field(default_factory=ContextTracker)
    background: Background = field(default_factory=Background)
    snapshot_hook: SnapshotHook = noop_snapshot

    async def model_info(self, name: str) -> ModelInfo:
        try:
            info = await self.upstream.model(name)
        except UpstreamError as exc:
            self.metrics.upstream_errors.labels(exc.code).inc()
            raise
        if info is None:
            raise ModelNotFound(f"the model `{name}` does not exist",
                                hint="GET /v1/models lists the served models")
        return info
