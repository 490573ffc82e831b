"""Salts isolate tenants only while nobody can collide block hashes: the connector refuses to
start where a known-seed xxhash would key blobs that outlive the process unsealed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from cwm_plugin.connector.connector import CWMConnector
from cwm_plugin.errors import ConfigError

pytestmark = pytest.mark.unit
KEY = "66" * 32


def start(hash_algo: str, store: dict) -> CWMConnector:
    """The connector as vLLM makes it on a worker (the refusal comes before any tier opens)."""
    ktc = KVTransferConfig(kv_connector="CWMConnector", kv_role="kv_both",
                           kv_connector_extra_config={"store": store})
    cfg = SimpleNamespace(kv_transfer_config=ktc, shutdown_timeout=30,
                          cache_config=SimpleNamespace(prefix_caching_hash_algo=hash_algo))
    return CWMConnector(cfg, KVConnectorRole.WORKER)


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("tier", ["disk_path", "redis_url"])
def test_a_known_seed_xxhash_over_an_unsealed_persistent_store_refuses_to_start(
        monkeypatch, tmp_path, algo, tier):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    where = str(tmp_path) if tier == "disk_path" else "redis://127.0.0.1:1/0"
    with pytest.raises(ConfigError) as refusal:
        start(algo, {tier: where, "memory_bytes": 0})
    assert algo in str(refusal.value) and "cache_salt" in str(refusal.value)
    assert "sha256" in refusal.value.hint and "encryption_key" in refusal.value.hint


@pytest.mark.parametrize("algo,store,seed", [
    ("xxhash", {"encryption_key": KEY, "disk": True}, "0"),   # sealed under each salt
    ("xxhash", {}, "0"),                                      # memory only: vLLM's own reach
    ("xxhash", {"disk": True}, None),   # a random seed: nobody can aim (and nothing is saved)
    ("sha256", {"disk": True}, "0"),
    ("sha256_cbor", {"disk": True}, None),
])
def test_where_nobody_can_aim_a_collision_it_starts(monkeypatch, tmp_path, algo, store, seed):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    settings = {k: v for k, v in store.items() if k != "disk"}
    if store.get("disk"):
        settings["disk_path"] = str(tmp_path)
    connector = start(algo, settings)
    assert connector.hash_algo == algo


def test_the_hash_block_size_is_the_one_vllm_hashes_requests_with():
    """vLLM 0.32 resolves it into the scheduler's KVCacheConfig before it makes the connector;
    a config not resolved yet gets vLLM's own resolution (what EngineCore hashes with)."""
    from connector_helpers import BS, kv_allocation
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    from cwm_plugin.connector.connector import hash_block_size

    kv, _ = kv_allocation()
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS, prefix_match_unit=None,
                                     enable_prefix_caching=True),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        kv_transfer_config=object())
    assert kv.hash_block_size is None
    assert hash_block_size(vllm_config, kv) == resolve_kv_cache_block_sizes(kv, vllm_config)[1]
    kv.hash_block_size = BS // 4          # finer hashes (a hybrid model's prefix_match_unit)
    assert hash_block_size(vllm_config, kv) == BS // 4
