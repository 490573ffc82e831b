"""Keys: namespaces bind blocks to model, layout and vLLM's hashing; ranks never share keys."""

from __future__ import annotations

import dataclasses

import pytest
from connector_helpers import namespace
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from cwm_plugin.connector.keys import (
    build_namespace,
    hash_bytes,
    hash_probe,
    hashes_reproducible,
    kv_block_hashes,
    lora_extra,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("field,value", [
    ("model_fingerprint", "g"), ("model_dtype", "bfloat16"), ("vllm_version", "0.33.0"),
    ("dtype", "bfloat16"), ("block_size", 64), ("num_layers", 29), ("tp_size", 1),
    ("hash_algo", "sha256_cbor"), ("platform", "cuda"),
    ("layout", "CPU_ATTN/amx/LBHNC/auto/float32/2x2x16x16/cpu"), ("quantization", "fp8"),
    ("hf_overrides", '{"rope_theta": 20000}'), ("rope", '{"rope_theta": 10000.0}'),
    ("pp_size", 2)])
def test_every_namespace_field_changes_the_keys(field, value):
    h = bytes(32)
    assert namespace().key(h, 0) != namespace(**{field: value}).key(h, 0)
    assert dataclasses.replace(namespace()).key(h, 0) == namespace().key(h, 0)


def test_keys_carry_namespace_rank_and_block_hash():
    h = bytes(range(32))
    k0, k1 = namespace().key(h, 0), namespace().key(h, 1)
    assert k0 != k1 and k0.endswith(h) and len(k0) == 16 + 2 + 32
    assert namespace().keys([h, h], 1) == [k1, k1]


@pytest.mark.parametrize("algo,length", [
    ("sha256", 32), ("sha256_cbor", 32), ("xxhash", 16), ("xxhash_cbor", 16)])
def test_the_block_hash_comes_back_out_of_a_key_of_its_algorithms_length(algo, length):
    ns = namespace(hash_algo=algo)
    h = bytes(range(100, 100 + length))
    assert hash_bytes(algo) == length
    for key in (ns.key(h, 0), ns.key(h, 3, b"lora-digest")):
        assert ns.block_hash(key) == h
    assert ns.block_hash(ns.key(h + b"x", 0)) is None          # another algorithm's length
    assert ns.block_hash(b"\x00\x01" + bytes(16) + b"latest") is None   # a context record
    if algo.startswith("sha256"):                             # vLLM agrees (xxhash may be absent)
        assert len(get_hash_fn_by_name(algo)((1, 2))) == length


def test_kv_block_hashes_use_the_last_hash_block_of_each_kv_block():
    hashes = [bytes([i]) * 32 for i in range(8)]
    assert kv_block_hashes(hashes, num_blocks=5, ratio=4) == [hashes[3], hashes[7]]
    assert kv_block_hashes(hashes, num_blocks=3) == hashes[:3]


def test_hash_probe_is_stable_and_follows_vllms_seed(monkeypatch):
    fn = get_hash_fn_by_name("sha256")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils.init_none_hash(fn)
    first = hash_probe(fn, 128)
    kv_cache_utils.init_none_hash(fn)
    assert hash_probe(fn, 128) == first  # same seed, same hashes: keys survive restarts
    monkeypatch.setenv("PYTHONHASHSEED", "12345")
    kv_cache_utils.init_none_hash(fn)
    try:
        assert hash_probe(fn, 128) != first
    finally:
        monkeypatch.delenv("PYTHONHASHSEED")
        kv_cache_utils.init_none_hash(fn)


def test_reproducibility_follows_vllms_seed_rule(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert hashes_reproducible("sha256") and hashes_reproducible("sha256_cbor")
    assert not hashes_reproducible("xxhash") and not hashes_reproducible("xxhash_cbor")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert hashes_reproducible("xxhash")


def engine_config(tmp_path, **change):
    """The parts of vLLM's config the namespace reads, with one input changed."""
    from types import SimpleNamespace as NS

    (tmp_path / "config.json").write_text("{}")
    v = dict(quantization=None, hf_overrides={}, rope_theta=10000.0, rope_scaling=None,
             kv_dtype="float32", block_size=16, tp=1, pp=1, hash_algo="sha256",
             dtype="float32", layers=4)
    v.update(change)
    spec = NS(dtype=v["kv_dtype"], block_size=v["block_size"], num_kv_heads=2, head_size=64)
    kv = NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=[f"l{i}" for i in
                                                                 range(v["layers"])])])
    hf = NS(rope_theta=v["rope_theta"], rope_scaling=v["rope_scaling"],
            max_position_embeddings=2048)
    mc = NS(model=str(tmp_path), revision=None, dtype=v["dtype"], quantization=v["quantization"],
            hf_overrides=v["hf_overrides"], hf_text_config=hf)
    cfg = NS(model_config=mc, cache_config=NS(prefix_caching_hash_algo=v["hash_algo"]),
             parallel_config=NS(tensor_parallel_size=v["tp"], pipeline_parallel_size=v["pp"]),
             load_config=NS(download_dir=None))
    return cfg, kv


@pytest.mark.parametrize("change", [
    {"quantization": "fp8"}, {"hf_overrides": {"rope_theta": 20000}},
    {"rope_theta": 20000.0}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"kv_dtype": "float8_e4m3fn"}, {"block_size": 32}, {"tp": 2}, {"pp": 2},
    {"hash_algo": "sha256_cbor"}, {"dtype": "bfloat16"}, {"layers": 5}])
def test_what_changes_kv_for_the_same_weights_changes_the_namespace(tmp_path, change):
    base = build_namespace(*engine_config(tmp_path), "LAYOUT")
    assert build_namespace(*engine_config(tmp_path), "LAYOUT").digest == base.digest
    assert build_namespace(*engine_config(tmp_path, **change), "LAYOUT").digest != base.digest
    assert build_namespace(*engine_config(tmp_path), "OTHER-LAYOUT").digest != base.digest


def test_a_lora_adapters_content_scopes_its_keys(tmp_path):
    from types import SimpleNamespace as NS

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights v1")
    req = NS(lora_name="a", lora_path=str(adapter))
    first = lora_extra(req)
    assert first and lora_extra(None) == b"" and lora_extra(req) == first
    h = bytes(32)
    assert namespace().key(h, 0, first) != namespace().key(h, 0)
    assert namespace().key(h, 0, first)[16:] == namespace().key(h, 0)[16:]   # rank + hash
    (adapter / "adapter_model.safetensors").write_bytes(b"weights v2, same path and name")
    assert lora_extra(req) != first
