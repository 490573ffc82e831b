"""StoreConfig: unknown keys, environment fallback, value checks, YAML files."""

from __future__ import annotations

import pytest

from cwm_plugin.errors import ConfigError
from cwm_plugin.store.config import StoreConfig

pytestmark = pytest.mark.unit


def test_defaults_and_dict():
    cfg = StoreConfig.from_dict({"disk_path": "/x", "zstd_level": 3}, env={})
    assert cfg.disk_path == "/x" and cfg.zstd_level == 3 and cfg.memory_bytes == 2 << 30


def test_every_tier_that_holds_pins_has_a_pin_quota_by_default():
    """Pinned blobs are never evicted: without a quota one key group could pin a tier full.
    Half of a tier's budget; Redis, with no budget here, redis_pin_quota_bytes."""
    cfg = StoreConfig.from_dict({"disk_bytes": "10G", "memory_bytes": "2G"}, env={})
    assert cfg.pin_quota_for("disk") == 5 << 30 and cfg.pin_quota_for("memory") == 1 << 30
    assert cfg.pin_quota_for("redis") == cfg.redis_pin_quota_bytes == 4 << 30
    cfg = StoreConfig.from_dict({"redis_pin_quota_bytes": "1G"}, env={})
    assert cfg.pin_quota_for("redis") == 1 << 30
    cfg = StoreConfig.from_dict({"pin_quota_bytes": "3G"}, env={})   # every tier's
    assert {cfg.pin_quota_for(t) for t in ("memory", "disk", "redis")} == {3 << 30}


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="disk_pth"):
        StoreConfig.from_dict({"disk_pth": "/x"}, env={})


def test_env_fallback_and_precedence():
    env = {"CWM_STORE_MEMORY_BYTES": "512M", "CWM_STORE_SHUFFLE": "false",
           "CWM_STORE_REDIS_URL": "redis://h:1/0", "CWM_STORE_ZSTD_LEVEL": "5"}
    cfg = StoreConfig.from_dict({"zstd_level": 2}, env=env)
    assert cfg.memory_bytes == 512 << 20 and cfg.shuffle is False
    assert cfg.redis_url == "redis://h:1/0" and cfg.zstd_level == 2
    cfg = StoreConfig.from_dict({}, env={"CWM_STORE_BEHIND_BYTES": "64M",
                                         "CWM_STORE_GC_MIN_AGE_S": "0"})
    assert cfg.behind_bytes == 64 << 20 and cfg.gc_min_age_s == 0


@pytest.mark.parametrize("bad", [{"zstd_level": 30}, {"disk_write": "sometimes"},
                                 {"io_workers": 0}, {"memory_bytes": "lots"},
                                 {"shuffle": "maybe"}, {"queue_depth": 0},
                                 {"behind_bytes": -1}, {"gc_min_age_s": -5}])
def test_bad_values(bad):
    with pytest.raises(ConfigError):
        StoreConfig.from_dict(bad, env={})


def test_yaml_file(tmp_path):
    p = tmp_path / "store.yaml"
    p.write_text("store:\n  disk_path: /data\n  disk_bytes: 1G\n  redis_ttl_s: 60\n")
    cfg = StoreConfig.from_file(p)
    assert cfg.disk_path == "/data" and cfg.disk_bytes == 1 << 30 and cfg.redis_ttl_s == 60
    with pytest.raises(ConfigError):
        StoreConfig.from_file(tmp_path / "missing.yaml")


def test_example_config_loads():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "store.example.yaml"
    cfg = StoreConfig.from_file(path)
    assert cfg.memory_bytes == 2 << 30 and cfg.disk_write == "through"


@pytest.mark.parametrize("url", ["localhost:6379", "redis://host:abc/0", "http://h:6379",
                                 "redis://:secret@:6379"])
def test_a_redis_url_redis_py_cannot_use_is_refused_at_start(url):
    with pytest.raises(ConfigError, match="is not a Redis URL") as exc:
        StoreConfig(redis_url=url)
    assert "secret" not in str(exc.value)
    for good in ("redis://127.0.0.1:6379/0", "rediss://:pw@cache.example:6380",
                 "unix:///run/redis.sock"):
        assert StoreConfig(redis_url=good).redis_url == good
