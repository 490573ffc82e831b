"""Keys: namespaces bind blocks to model, layout and vLLM's hashing; stale hashing never matches."""

from __future__ import annotations

import dataclasses

import pytest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from cwm_plugin.connector.keys import (
    Namespace,
    block_keys,
    hash_probe,
    hashes_reproducible,
    model_fingerprint,
)

pytestmark = pytest.mark.unit


def ns(**kw) -> Namespace:
    base = dict(model="m", model_fingerprint="f", dtype="bfloat16", block_size=128,
                hash_block_size=128, num_kv_heads=3, head_size=64, num_layers=30,
                platform="cpu", tp_size=1, hash_algo="sha256", hash_probe="p")
    return Namespace(**{**base, **kw})


@pytest.mark.parametrize("field,value", [("model_fingerprint", "g"), ("dtype", "float32"),
                                         ("block_size", 64), ("num_layers", 29),
                                         ("tp_size", 2), ("hash_probe", "q"),
                                         ("platform", "cuda")])
def test_every_namespace_field_changes_the_keys(field, value):
    h = bytes(32)
    assert ns().key(h) != ns(**{field: value}).key(h)
    assert dataclasses.replace(ns()).key(h) == ns().key(h)


def test_keys_carry_namespace_rank_and_block_hash():
    h = bytes(range(32))
    k0, k1 = ns().key(h, 0), ns().key(h, 1)
    assert k0 != k1 and k0.endswith(h) and len(k0) == 16 + 2 + 32


def test_block_keys_use_the_last_hash_block_of_each_kv_block():
    hashes = [bytes([i]) * 32 for i in range(8)]
    space = ns(block_size=128, hash_block_size=32)
    keys = block_keys(space, hashes, num_blocks=5)
    assert keys == [space.key(hashes[3]), space.key(hashes[7])]  # only 2 whole blocks hashed


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
        assert hash_probe(fn, 128) != first  # other seed -> other namespace, stale keys unused
    finally:
        monkeypatch.delenv("PYTHONHASHSEED")
        kv_cache_utils.init_none_hash(fn)


def test_reproducibility_check(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert hashes_reproducible("sha256")
    assert not hashes_reproducible("xxhash")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert hashes_reproducible("xxhash")


def test_model_fingerprint_tracks_the_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    a = model_fingerprint(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert model_fingerprint(str(tmp_path)) != a
    assert model_fingerprint("org/name") != model_fingerprint("org/other")
