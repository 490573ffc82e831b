"""The shipped connector configurations parse, and bad settings fail with a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cwm_plugin.connector.config import ConnectorConfig
from cwm_plugin.errors import ConfigError
from cwm_plugin.store.config import StoreConfig

pytestmark = pytest.mark.unit
CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("connector-*.json"))


def test_configs_ship():
    assert {p.name for p in CONFIGS} >= {"connector-cpu.json", "connector-gpu.json",
                                         "connector-shared-redis.json"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_parses(path):
    cfg = json.loads(path.read_text())
    assert cfg["kv_connector"] == "CWMConnector"
    assert cfg["kv_connector_module_path"] == "cwm_plugin.connector"
    assert cfg["kv_load_failure_policy"] == "recompute"
    conn = ConnectorConfig.from_extra_config(cfg["kv_connector_extra_config"])
    StoreConfig.from_dict(conn.store)


def test_unknown_keys_are_named_in_the_error():
    with pytest.raises(ConfigError, match="max_stored_token"):
        ConnectorConfig.from_extra_config({"max_stored_token": 5})
    with pytest.raises(ConfigError, match="disk_pth"):
        StoreConfig.from_dict({"disk_pth": "/tmp/x"})


def test_environment_fallback(monkeypatch):
    monkeypatch.setenv("CWM_CONNECTOR_SALTED_ONLY", "true")
    monkeypatch.setenv("CWM_CONNECTOR_MAX_STORED_TOKENS_PER_REQUEST", "1024")
    cfg = ConnectorConfig.from_extra_config({})
    assert cfg.salted_only is True and cfg.max_stored_tokens_per_request == 1024
    # An explicit setting wins over the environment.
    assert ConnectorConfig.from_extra_config({"salted_only": False}).salted_only is False
