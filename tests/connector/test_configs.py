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


def test_values_are_typed_from_json_and_strings():
    cfg = ConnectorConfig.from_extra_config({"salted_only": "false", "save_decode_blocks": "0",
                                             "max_stored_tokens_per_request": "32k"})
    assert cfg.salted_only is False and cfg.save_decode_blocks is False
    assert cfg.max_stored_tokens_per_request == 32768


@pytest.mark.parametrize("extra,named", [
    ({"salted_only": "maybe"}, "salted_only must be true or false"),
    ({"max_stored_tokens_per_request": "lots"}, "max_stored_tokens_per_request must be an int"),
    ({"max_stored_tokens_per_request": -1}, "max_stored_tokens_per_request must be >= 0"),
    ({"lookup_cache_s": "soon"}, "lookup_cache_s must be a number"),
    ({"store": "disk"}, "store must be"),
])
def test_bad_connector_values_name_the_field_and_what_it_accepts(extra, named):
    with pytest.raises(ConfigError, match=named):
        ConnectorConfig.from_extra_config(extra)


@pytest.mark.parametrize("settings,named", [
    ({"disk_write": "sometimes"}, "disk_write must be one of through, behind; got 'sometimes'"),
    ({"zstd_level": 30}, "zstd_level must be between 0 and 22; got 30"),
    ({"redis_lookup_timeout_ms": 0}, "redis_lookup_timeout_ms must be between 1 and"),
    ({"encryption_key": "too-short"}, "encryption_key"),
    ({"redis_prefix": "a{b}"}, "redis_prefix"),
    ({"redis_cluster": "perhaps"}, "redis_cluster must be true or false"),
])
def test_bad_store_values_name_the_field_and_what_it_accepts(settings, named):
    with pytest.raises(ConfigError, match=named) as err:
        StoreConfig.from_dict(settings, env={})
    assert "too-short" not in str(err.value)           # a secret is never echoed
