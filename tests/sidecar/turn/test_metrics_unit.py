"""The Grafana dashboard only uses metrics the sidecar really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cwm_plugin.sidecar.metrics import SidecarMetrics

pytestmark = pytest.mark.unit
DASHBOARD = Path(__file__).resolve().parents[3] / "configs" / "grafana-dashboard.json"


def test_dashboard_metrics_exist():
    from cwm_plugin.memory.metrics import MemoryMetrics

    m = SidecarMetrics()
    MemoryMetrics(m.registry)  # the memory package's metrics live on the sidecar's registry
    for tenant in ("acme",):
        m.observe_usage(tenant, "tiny", {"prompt_tokens": 10, "completion_tokens": 2,
                                         "prompt_tokens_details": {"cached_tokens": 4}})
        m.retrieval_seconds.labels(tenant, "tiny").observe(0.01)
    exported = m.render().decode()
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"\b(cwm_[a-z_]+)", e)}
    assert names
    for name in names:
        assert f"# TYPE {re.sub(r'_(total|bucket)$', '', name)}" in exported, name
