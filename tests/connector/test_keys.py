"""Keys: namespaces bind blocks to model, layout and vLLM's hashing; ranks never share keys."""

from __future__ import annotations

import dataclasses

import pytest
from connector_helpers import namespace
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from cwm_plugin.connector.keys import hash_probe, hashes_reproducible, kv_block_hashes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("field,value", [
    ("model_fingerprint", "g"), ("model_dtype", "bfloat16"), ("vllm_version", "0.33.0"),
    ("dtype", "bfloat16"), ("block_size", 64), ("num_layers", 29), ("tp_size", 1),
    ("hash_algo", "sha256_cbor"), ("platform", "cuda"),
    ("layout", "CPU_ATTN/amx/LBHNC/auto/float32/2x2x16x16/cpu")])
def test_every_namespace_field_changes_the_keys(field, value):
    h = bytes(32)
    assert namespace().key(h, 0) != namespace(**{field: value}).key(h, 0)
    assert dataclasses.replace(namespace()).key(h, 0) == namespace().key(h, 0)


def test_keys_carry_namespace_rank_and_block_hash():
    h = bytes(range(32))
    k0, k1 = namespace().key(h, 0), namespace().key(h, 1)
    assert k0 != k1 and k0.endswith(h) and len(k0) == 16 + 2 + 32
    assert namespace().keys([h, h], 1) == [k1, k1]


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
