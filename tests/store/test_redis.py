"""The Redis tier against a real redis-server: split values, TTL, outage and reconnect,
sharing between servers with empty local tiers."""

from __future__ import annotations

import logging
import time

import pytest
import redis
import torch

from cwm_plugin.errors import TierUnavailable
from cwm_plugin.store.tiers.redis import RedisTier
from cwm_plugin.testing.redis_server import RedisServer

pytestmark = pytest.mark.redis


def test_split_values_round_trip(redis_server):
    t = RedisTier(redis_server.url, prefix="t1", max_value_bytes=1024)
    big = bytes(range(256)) * 40             # 10 KiB -> 10 parts
    t.put("aa" * 20, big)
    t.put("bb" * 20, b"small")
    assert t.get_many(["aa" * 20, "bb" * 20, "cc" * 20]) == [big, b"small", None]
    r = redis.Redis.from_url(redis_server.url)
    assert r.exists(f"t1:b:{'aa' * 20}:9") and not r.exists(f"t1:b:{'aa' * 20}:10")
    assert t.usage().bytes == len(big) + 5 and t.usage().blobs == 2
    r.delete(f"t1:b:{'aa' * 20}:3")           # a lost part is a miss, never a torn blob
    assert t.get("aa" * 20) is None
    assert t.delete("aa" * 20) and not r.exists(f"t1:b:{'aa' * 20}:0")
    t.close()


def test_keys_refcounts_and_prefix(redis_server):
    t = RedisTier(redis_server.url, prefix="ns")
    t.put("ab" * 20, b"blob", key=b"k1")                       # blob and key in one script
    assert t.map_key(b"k2", "ab" * 20) == (1, None, 0)
    assert t.map_key(b"k1", "ab" * 20)[0] == 1                 # already there: no double count
    assert t.map_key(b"k1", "cd" * 20)[0] == 0                 # points elsewhere: kept
    assert t.map_key(b"k3", "ef" * 20)[0] == -1                # no such blob
    assert t.refcount("ab" * 20) == 2
    assert t.lookup_many([b"k1", b"zz"]) == ["ab" * 20, None]
    assert t.exists_many([b"k2", b"zz"]) == [True, False]
    assert t.stats() == (4, 1)
    assert t.unmap_key(b"k1") == ("ab" * 20, 1)
    assert t.unmap_key(b"k2") == ("ab" * 20, 0)
    assert t.unreferenced() == ["ab" * 20]
    assert t.delete("ab" * 20) and t.stats() == (0, 0)
    other = RedisTier(redis_server.url, prefix="other")
    assert other.lookup_many([b"k1"]) == [None] and list(other.blob_ids()) == []
    t.close(), other.close()


def test_repoint_moves_refcounts_and_pins(redis_server):
    t = RedisTier(redis_server.url, prefix="rp", ttl_s=100)
    t.put("aa" * 20, b"old", key=b"k")
    t.put("bb" * 20, b"new", key=b"other")
    t.pin("aa" * 20, b"k")
    assert t.map_key(b"k", "bb" * 20, replace=True) == (1, "aa" * 20, 0)
    assert t.refcount("bb" * 20) == 2 and t.refcount("aa" * 20) == 0
    assert t.is_pinned(b"k", "bb" * 20) and not t.is_pinned(b"k", "aa" * 20)
    r = redis.Redis.from_url(redis_server.url)
    assert r.ttl(f"rp:b:{'bb' * 20}") == -1                    # the pin came along
    assert 0 < r.ttl(f"rp:b:{'aa' * 20}") <= 100               # and left the old blob
    assert t.unreferenced() == ["aa" * 20]
    t.close()


def test_unmap_of_an_expired_refcount_leaves_no_negative_key(redis_server):
    t = RedisTier(redis_server.url, prefix="neg", ttl_s=100)
    t.put("ab" * 20, b"x", key=b"k")
    r = redis.Redis.from_url(redis_server.url)
    r.delete(f"neg:r:{'ab' * 20}")                             # the refcount expired first
    assert t.unmap_key(b"k") == ("ab" * 20, 0)
    assert not r.exists(f"neg:r:{'ab' * 20}")
    t.close()


def test_ttl_applies_and_pins_persist_per_key(redis_server):
    t = RedisTier(redis_server.url, prefix="ttl", ttl_s=1)
    t.put("ab" * 20, b"x" * 10, key=b"k")
    t.map_key(b"k2", "ab" * 20)
    r = redis.Redis.from_url(redis_server.url)
    assert 0 < r.ttl(f"ttl:b:{'ab' * 20}") <= 1 and 0 < r.ttl(f"ttl:k:{b'k'.hex()}") <= 1
    t.pin("ab" * 20, b"k")
    t.pin("ab" * 20, b"k2")
    assert r.ttl(f"ttl:b:{'ab' * 20}") == -1 and r.ttl(f"ttl:r:{'ab' * 20}") == -1
    t.put("ab" * 20, b"x" * 10, key=b"k3")      # a re-put never undoes the pin's PERSIST
    assert r.ttl(f"ttl:b:{'ab' * 20}") == -1
    t.pin("ab" * 20, b"k2", pinned=False)       # the other pinned key still protects it
    assert r.ttl(f"ttl:b:{'ab' * 20}") == -1 and r.ttl(f"ttl:k:{b'k'.hex()}") == -1
    split = RedisTier(redis_server.url, prefix="ttl", ttl_s=1, max_value_bytes=1024)
    split.put("cd" * 20, b"y" * 3000, key=b"s")
    split.pin("cd" * 20, b"s")
    assert all(r.ttl(f"ttl:b:{'cd' * 20}{sfx}") == -1 for sfx in ("", ":0", ":1", ":2"))
    t.pin("ab" * 20, b"k", pinned=False)
    deadline = time.monotonic() + 10
    while t.get("ab" * 20) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert t.get("ab" * 20) is None and t.lookup_many([b"k"]) == [None]
    assert split.get("cd" * 20) == b"y" * 3000                  # still pinned
    t.close(), split.close()


def test_a_new_key_on_a_shared_blob_renews_the_blobs_ttl(redis_server):
    # The same content saved under another key (another salt) must not leave that key pointing
    # at a blob that expires first: every name the save touches gets the full TTL again.
    t = RedisTier(redis_server.url, prefix="renew", ttl_s=1000, max_value_bytes=1024)
    r = redis.Redis.from_url(redis_server.url)
    blob = "ef" * 20
    names = [f"renew:b:{blob}{sfx}" for sfx in ("", ":0", ":1", ":2")] + [f"renew:r:{blob}"]
    t.put(blob, b"z" * 3000, key=b"first")
    for name in names:
        r.expire(name, 5)                       # as if saved long ago
    t.put(blob, b"z" * 3000, key=b"second")
    assert all(r.ttl(name) > 500 for name in names), [r.ttl(n) for n in names]
    assert r.ttl(f"renew:k:{b'second'.hex()}") > 500 and t.refcount(blob) == 2
    t.pin(blob, b"second")                      # a pinned blob stays without a TTL
    t.put(blob, b"z" * 3000, key=b"third")
    assert all(r.ttl(name) == -1 for name in names[:4])
    t.close()


def test_split_blobs_of_one_read_share_a_round_trip(redis_server):
    t = RedisTier(redis_server.url, prefix="mget", max_value_bytes=1024)
    blobs = {f"{i:02d}" * 20: bytes([i]) * (1500 + 700 * i) for i in range(4)}
    for b, v in blobs.items():
        t.put(b, v)
    calls = []
    real = t._client.mget
    t._client.mget = lambda names: calls.append(len(names)) or real(names)
    assert t.get_many(list(blobs)) == list(blobs.values())
    assert len(calls) == 2                       # the heads, then every part at once
    t.close()


def test_shared_redis_serves_a_second_server(redis_server, make_store, tmp_path, kv_block):
    a = make_store(redis_url=redis_server.url, disk_path=str(tmp_path / "a"),
                   redis_write="through", redis_max_value_bytes=4096)
    blocks = {f"k{i}".encode(): kv_block(i, shape=(2, 3, 32, 64)) for i in range(5)}
    for k, v in blocks.items():
        a.put(k, v)
    a.flush()
    b = make_store(redis_url=redis_server.url, disk_path=str(tmp_path / "b"))
    assert b.contains_many(list(blocks)) == [True] * 5
    got = b.get_many(list(blocks))
    assert all(torch.equal(g, v) for g, v in zip(got, blocks.values(), strict=True))
    b.flush()                                 # promotion to b's disk happens behind
    assert b.index.totals()[1] == 5
    b.link(b"clone", b"k0")
    c = make_store(redis_url=redis_server.url, memory_bytes=0)
    assert torch.equal(c.get(b"clone"), blocks[b"k0"])
    assert c.redis.refcount(c.redis.lookup_many([b"k0"])[0]) == 2


def test_pin_survives_promotion_from_redis_to_disk(redis_server, make_store, tmp_path, kv_block):
    a = make_store(redis_url=redis_server.url, redis_write="through", memory_bytes=0)
    a.put(b"win", kv_block(0)).result()
    a.pin(b"win")
    size = len(a.get_blob(b"win"))
    b = make_store(redis_url=redis_server.url, disk_path=str(tmp_path / "b"), memory_bytes=0,
                   disk_bytes=4 * size + 100, redis_prefix="cwm")
    assert torch.equal(b.get(b"win"), kv_block(0))       # a Redis hit, promoted behind
    b.flush()
    assert b.index.lookup(b"win") is not None and b.index.is_key_pinned(b"win")
    for i in range(10):
        b.put(f"f{i}".encode(), kv_block(10 + i)).result()
    assert b.index.lookup(b"win") is not None            # never evicted from b's disk


def test_link_repoints_in_every_tier(redis_server, make_store, tmp_path, kv_block):
    s = make_store(redis_url=redis_server.url, disk_path=str(tmp_path / "d"),
                   redis_write="through")
    s.put(b"a", kv_block(1)).result()
    s.put(b"b", kv_block(2)).result()
    old = s.redis.lookup_many([b"b"])[0]
    s.link(b"b", b"a")
    new = s.redis.lookup_many([b"a"])[0]
    assert s.redis.lookup_many([b"b"]) == [new] and s.index.lookup(b"b") == s.index.lookup(b"a")
    assert s.redis.refcount(new) == 2 and s.redis.get(old) is None
    assert s.metrics.blobs.labels("redis")._value.get() == 1      # gauge kept by the scripts
    assert s.metrics.bytes.labels("redis")._value.get() == len(s.redis.get(new))
    c = make_store(redis_url=redis_server.url, memory_bytes=0)
    assert torch.equal(c.get(b"b"), kv_block(1))


def test_outage_local_tiers_keep_serving_and_reconnect(tmp_path, make_store, kv_block, caplog):
    server = RedisServer().start()
    try:
        s = make_store(redis_url=server.url, disk_path=str(tmp_path / "d"),
                       redis_write="through")
        s.redis._max_backoff = 0.2
        s.put(b"a", kv_block(1)).result()
        port = server.port
        server.stop()
        with caplog.at_level(logging.WARNING, logger="cwm_plugin.store.tiers.redis"):
            for i in range(20):
                assert torch.equal(s.get(b"a"), kv_block(1))   # memory/disk keep serving
                assert s.get(f"missing{i}".encode()) is None
                s.put(f"new{i}".encode(), kv_block(i)).result()   # local tiers take it
                assert s.contains_many([b"a", b"zz"]) == [True, False]
        down = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(down) == 1, [r.getMessage() for r in caplog.records]
        assert s.metrics.errors.labels("tier_unavailable")._value.get() >= 1
        with pytest.raises(TierUnavailable):
            s.redis.get("ab" * 20)
        server = RedisServer(port=port).start()
        deadline = time.monotonic() + 15
        ok = False
        while time.monotonic() < deadline and not ok:
            try:
                s.redis.put("cd" * 20, b"back")
                ok = True
            except TierUnavailable:
                time.sleep(0.1)
        assert ok and s.redis.get("cd" * 20) == b"back"
        s.put(b"after", kv_block(2)).result()
        assert s.redis.lookup_many([b"after"])[0] is not None
    finally:
        server.stop()


def test_redis_refusing_writes_is_not_fatal(redis_server, make_store, kv_block):
    r = redis.Redis.from_url(redis_server.url)
    s = make_store(redis_url=redis_server.url, redis_write="through")
    r.config_set("maxmemory", 1)                 # every write is refused with OOM
    r.config_set("maxmemory-policy", "noeviction")
    try:
        s.put(b"a", kv_block(1)).result()        # memory tier takes it
        assert torch.equal(s.get(b"a"), kv_block(1))
        assert s.metrics.errors.labels("tier_unavailable")._value.get() >= 1
    finally:
        r.config_set("maxmemory", 0)
