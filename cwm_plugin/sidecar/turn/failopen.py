"""Fail-open: a memory, index, embedder or tokenizer failure never fails a client's request.

The request is answered without memory (or without recording the turn); the failure is
logged once per (tenant, stage, kind of error) with its traceback (later ones at debug level),
counted in ``cwm_sidecar_memory_failures_total{tenant,stage}`` and flagged to the client in
the ``X-CWM-Memory-Status`` response header. No message that reaches the client names a file
on the server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cwm_plugin.sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)
HEADER = "X-CWM-Memory-Status"


@dataclass
class FailOpen:
    metrics: SidecarMetrics
    _seen: set[tuple[str, str, str]] = field(default_factory=set)

    def failed(self, tenant: str, stage: str, exc: BaseException) -> str:
        """Count and log one failure; returns the header value to send."""
        self.metrics.memory_failures.labels(tenant, stage).inc()
        key = (tenant, stage, type(exc).__name__)
        if key in self._seen:
            log.debug("memory %s failed again for tenant %s: %r", stage, tenant, exc)
        else:
            self._seen.add(key)
            log.warning("memory %s failed for tenant %s; answering without it (logged once "
                        "per kind of error)", stage, tenant, exc_info=exc)
        return f"unavailable; stage={stage}"
