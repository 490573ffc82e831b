"""The Redis tier against a real redis-server: split values, TTL and pins, dangling keys after
expiry or eviction, gc, chunked reads, sharing between servers with empty local tiers, records
read from the primary tier, two writers of one blob. Outages: test_redis_outages.py."""

from __future__ import annotations

import time

import pytest
import redis
import torch
from redis_helpers import G, bid, k

from cwm_plugin.store.tiers.redis.tier import RedisTier

pytestmark = pytest.mark.redis


def test_split_values_round_trip_and_a_lost_part_is_a_miss(redis_server):
    t = RedisTier(redis_server.url, prefix="t1", max_value_bytes=1024)
    big = bytes(range(256)) * 40             # 10 KiB -> 10 parts
    t.put(bid("a"), big, k(b"1"))
    t.put(bid("b"), b"small", k(b"2"))
    assert t.get_many([bid("a"), bid("b"), bid("c")]) == [big, b"small", None]
    r = redis.Redis.from_url(redis_server.url)
    assert r.exists(f"t1:{{b:{bid('a')}}}:9") and not r.exists(f"t1:{{b:{bid('a')}}}:10")
    assert t.usage().bytes == len(big) + 5 and t.usage().blobs == 2
    r.delete(f"t1:{{b:{bid('a')}}}:3")        # a lost part is a miss, never a torn blob
    assert t.get(bid("a")) is None
    t.close()


def test_ttl_pins_persist_the_bytes_and_unpin_gives_the_ttl_back(redis_server):
    t = RedisTier(redis_server.url, prefix="ttl", ttl_s=100, max_value_bytes=1024)
    r = redis.Redis.from_url(redis_server.url)
    t.put(bid("a"), b"y" * 3000, k(b"1"))
    t.link_many([(k(b"2"), bid("a"))])
    data = [f"ttl:{{b:{bid('a')}}}{sfx}" for sfx in ("", ":0", ":1", ":2", ":m")]  # and counts
    key1 = t.names.key(k(b"1"))
    assert all(0 < r.ttl(n) <= 100 for n in [*data, key1])
    t.pin_many([k(b"1"), k(b"2")])
    assert all(r.ttl(n) == -1 for n in [*data, key1])
    t.put(bid("a"), b"y" * 3000, k(b"3"))     # a new key on the blob never undoes the pin
    assert all(r.ttl(n) == -1 for n in data)
    t.unpin_many([k(b"2")])                   # the other pinned key still protects it
    assert all(r.ttl(n) == -1 for n in data)
    t.unpin_many([k(b"1")])
    assert all(0 < r.ttl(n) <= 100 for n in [*data, key1])
    t.close()


def test_a_pinned_key_re_pointed_keeps_its_new_bytes_and_lets_the_old_go(redis_server):
    """A window's manifest is a pinned key rewritten in place (every thaw): the new bytes
    must lose their TTL like any pinned blob's, else the manifest expired a TTL later, its
    window vanished and its blocks stayed pinned for good."""
    t = RedisTier(redis_server.url, prefix="repoint", ttl_s=100)
    r = redis.Redis.from_url(redis_server.url)
    t.put(bid("a"), b"manifest v1", k(b"m"))
    t.link_many([(k(b"other"), bid("a"))])     # v1's bytes are still used by another key
    t.pin_many([k(b"m")])
    assert r.ttl(f"repoint:{{b:{bid('a')}}}") == -1
    t.put(bid("b"), b"manifest v2", k(b"m"), replace=True)
    assert r.ttl(f"repoint:{{b:{bid('b')}}}") == -1            # pinned: kept
    assert 0 < r.ttl(f"repoint:{{b:{bid('a')}}}") <= 100      # unpinned: its TTL back
    assert t.lookup_many([k(b"m")]) == [bid("b")] and t.get(bid("b")) == b"manifest v2"
    t.unpin_many([k(b"m")])
    assert 0 < r.ttl(f"repoint:{{b:{bid('b')}}}") <= 100
    t.close()


def test_a_new_key_on_a_shared_blob_renews_its_ttl(redis_server):
    t = RedisTier(redis_server.url, prefix="renew", ttl_s=1000)
    r = redis.Redis.from_url(redis_server.url)
    t.put(bid("e"), b"z" * 30, k(b"first"))
    r.expire(f"renew:{{b:{bid('e')}}}", 5)    # as if saved long ago
    t.link_many([(k(b"second"), bid("e"))])
    assert r.ttl(f"renew:{{b:{bid('e')}}}") > 500
    t.close()


@pytest.mark.parametrize("how", ["expired", "evicted"])
def test_a_key_whose_bytes_are_gone_answers_absent_is_removed_and_reported(
        redis_server, make_store, kv_block, how):
    s = make_store(redis_url=redis_server.url, memory_bytes=0, redis_write="through",
                   redis_ttl_s=1 if how == "expired" else None)
    drops = []
    s.redis.set_drop_listener(lambda keys, why: drops.append((keys, why)))
    s.put(k(b"a"), kv_block(1)).result()
    s.put(k(b"b"), kv_block(2)).result()
    r = redis.Redis.from_url(redis_server.url)
    if how == "expired":
        r.persist(s.redis.names.key(k(b"a")))   # the index outlives the bytes
        time.sleep(1.5)
    else:                                     # maxmemory eviction of the bytes alone
        r.delete(f"cwm:{{b:{s.redis.lookup_many([k(b'a')])[0]}}}")
    assert s.contains_many([k(b"a")]) == [False]           # never promised
    assert drops and drops[0] == ([k(b"a")], "dangling")
    assert s.redis.lookup_many([k(b"a")]) == [None]        # removed on the way
    s.put(k(b"a"), kv_block(1)).result()                   # and saved again
    assert torch.equal(s.get(k(b"a")), kv_block(1))


def test_gc_removes_dangling_keys_and_orphan_bytes(redis_server):
    from prometheus_client import CollectorRegistry

    from cwm_plugin.store.config import StoreConfig
    from cwm_plugin.store.tier_set import TierSet

    store = TierSet(StoreConfig(memory_bytes=0, redis_url=redis_server.url, redis_prefix="gc"),
                    registry=CollectorRegistry())     # what `cwm store gc` opens
    (t,) = store.tiers
    r = redis.Redis.from_url(redis_server.url)
    t.put(bid("a"), b"a", k(b"1"))
    t.put(bid("b"), b"b", k(b"2"))
    r.delete(f"gc:{{b:{bid('a')}}}")           # key 1 dangles
    r.set(f"gc:{{b:{bid('c')}}}", b"c")        # a writer died before mapping its key
    assert t.dangling_keys() == [k(b"1")]
    assert t.unreferenced(min_age_s=3600) == [] and t.unreferenced() == [bid("c")]
    report = store.gc(min_age_s=0)
    assert report.dangling_keys == 1 and report.removed_blobs == {"redis": 1}
    assert t.lookup_many([k(b"1"), k(b"2")]) == [None, bid("b")]
    assert sorted(t.blob_ids()) == [bid("b")]
    t.close()


def test_gc_sweeps_the_index_entries_a_ttl_expiry_left_behind(redis_server, make_store,
                                                              kv_block):
    """A key name that expires leaves its shard's index entry behind (never freed otherwise);
    gc removes it and leaves live and pinned ones. A blob's counts carry its bytes' TTL, so
    they expire with them."""
    from cwm_plugin.store.tiers.redis.layout import shard_of

    s = make_store(redis_url=redis_server.url, redis_prefix="swp", redis_ttl_s=1000,
                   memory_bytes=0)
    for name in (b"old", b"live", b"kept"):
        s.put(k(name), kv_block(len(name) + name[0])).result()
    s.flush()
    s.redis.pin_many([k(b"kept")])
    r = redis.Redis.from_url(redis_server.url)
    old = s.redis.lookup_many([k(b"old")])[0]
    assert 0 < r.ttl(s.redis.blobs.meta(old)) <= 1000          # the counts expire too
    r.delete(s.redis.names.key(k(b"old")), *s.redis.blobs.names(r, [old]))  # as if expired

    def entries() -> int:
        return sum(r.zcard(s.redis.names.index(shard_of(k(n)))) for n in (b"old", b"live",
                                                                             b"kept"))
    assert entries() == 3
    report = s.gc(min_age_s=0)
    assert report.expired_entries == 1 and entries() == 2
    assert s.contains_many([k(b"live"), k(b"kept"), k(b"old")]) == [True, True, False]
    assert s.gc(min_age_s=0).expired_entries == 0


def test_format_2_names_are_never_read_and_gc_deletes_them(redis_server, make_store, kv_block):
    """Format 2 kept a model's whole index under one hash tag (one cluster slot) and its
    totals in one ``stats`` hash. Those names are never read: the block is a miss (it
    is recomputed and saved again), nothing fails on them, and gc deletes them and then,
    unreferenced, their blob."""
    from cwm_plugin.store.tiers.redis.layout import Names

    r = redis.Redis.from_url(redis_server.url)
    g, rest, old = G.hex(), b"a".hex(), bid("f")
    r.set(f"cwm:{{b:{old}}}", b"old bytes")
    r.set(f"cwm:{{{g}}}:k:{rest}", old)
    r.hset(f"cwm:{{{g}}}:refs", old, 1)
    r.hset(f"cwm:{{{g}}}:sizes", old, 9)
    r.zadd(f"cwm:{{{g}}}:index", {rest: 0})
    r.set(f"cwm:{{{g}}}:pinbytes", 0)
    r.hset("cwm:stats", mapping={"bytes": 9, "blobs": 1})
    s = make_store(redis_url=redis_server.url, memory_bytes=0, redis_write="through")
    assert s.contains_many([k(b"a")]) == [False] and s.get(k(b"a")) is None
    assert s.redis.list_keys(G) == [] and s.redis.dangling_keys() == []
    s.put(k(b"a"), kv_block(1)).result()
    assert torch.equal(s.get(k(b"a")), kv_block(1))
    assert [i.key for i in s.redis.list_keys(G)] == [k(b"a")]
    report = s.gc(min_age_s=0)
    assert report.old_format_entries == 6 and report.removed_blobs == {"redis": 1}
    assert not any(Names("cwm").old_format(n.decode()) for n in r.scan_iter("cwm:*"))
    assert not r.exists(f"cwm:{{b:{old}}}") and torch.equal(s.get(k(b"a")), kv_block(1))


def test_reads_go_in_bounded_chunks(redis_server):
    t = RedisTier(redis_server.url, prefix="chunk", max_value_bytes=1 << 20,
                  read_chunk_bytes=2 << 20)
    ids = [f"{i:02d}" * 20 for i in range(5)]
    for i, b in enumerate(ids):
        t.put(b, bytes([i]) * 1000, k(bytes([i])))
    rounds = []
    real = t.blobs.get_chunk
    t.blobs.get_chunk = lambda c, part: rounds.append(len(part)) or real(c, part)
    assert t.get_many(ids) == [bytes([i]) * 1000 for i in range(5)]
    assert rounds == [2, 2, 1]               # at most 2 MiB of blobs a round trip
    t.close()


def test_a_restore_from_redis_is_pipelined_round_trip_by_round_trip(redis_server, make_store,
                                                                    kv_block, monkeypatch):
    s = make_store(redis_url=redis_server.url, memory_bytes=0, redis_write="through",
                   redis_max_value_bytes=1 << 20)
    blocks = {k(f"p{i}".encode()): kv_block(i, shape=(2, 3, 32, 64)) for i in range(9)}
    for key, v in blocks.items():
        s.put(key, v)
    s.flush()
    rounds: list[int] = []
    real = s.redis.get_many
    monkeypatch.setattr(s.redis, "get_many", lambda ids: rounds.append(len(ids)) or real(ids))
    got: dict[int, torch.Tensor] = {}
    served = s.read_into(list(blocks), lambda i, t: got.setdefault(i, t.clone()) is not None,
                         shape=(2, 3, 32, 64), dtype=torch.bfloat16)
    assert served == ["redis"] * 9
    assert all(torch.equal(got[i], v) for i, v in enumerate(blocks.values()))
    assert rounds == [1] * 9                # a blob a round trip, decoded while the next comes


def test_shared_redis_serves_a_second_server(redis_server, make_store, tmp_path, kv_block):
    a = make_store(redis_url=redis_server.url, disk_path=str(tmp_path / "a"),
                   redis_write="through", redis_max_value_bytes=4096)
    blocks = {k(f"k{i}".encode()): kv_block(i, shape=(2, 3, 32, 64)) for i in range(5)}
    for key, v in blocks.items():
        a.put(key, v, content=key)
    a.flush()
    b = make_store(redis_url=redis_server.url, disk_path=str(tmp_path / "b"))
    assert b.contains_many(list(blocks)) == [True] * 5
    got = b.get_many(list(blocks))
    assert all(torch.equal(g, v) for g, v in zip(got, blocks.values(), strict=True))
    b.flush()                                 # promotion to b's disk happens behind
    assert b.disk.index.totals()[1] == 5
    b.link(k(b"clone"), k(b"k0"))
    c = make_store(redis_url=redis_server.url, memory_bytes=0)
    assert torch.equal(c.get(k(b"clone"), content=k(b"k0")), blocks[k(b"k0")])


def test_link_repoints_in_every_tier(redis_server, make_store, tmp_path, kv_block):
    s = make_store(redis_url=redis_server.url, disk_path=str(tmp_path / "d"),
                   redis_write="through")
    s.put(k(b"a"), kv_block(1), content=b"c1").result()
    s.put(k(b"b"), kv_block(2), content=b"c2").result()
    old = s.redis.lookup_many([k(b"b")])[0]
    s.link(k(b"b"), k(b"a"))
    new = s.redis.lookup_many([k(b"a")])[0]
    assert s.redis.lookup_many([k(b"b")]) == [new]
    assert s.disk.lookup_many([k(b"b")]) == s.disk.lookup_many([k(b"a")])
    assert s.redis.get(old) is None and s.redis.get(new) is not None
    c = make_store(redis_url=redis_server.url, memory_bytes=0)
    assert torch.equal(c.get(k(b"b"), content=b"c1"), kv_block(1))


def test_records_every_server_rewrites_are_read_from_redis_not_a_stale_local_copy(
        redis_server, make_store, tmp_path):
    a = make_store(redis_url=redis_server.url, disk_path=str(tmp_path / "a"),
                   redis_write="through")
    b = make_store(redis_url=redis_server.url, disk_path=str(tmp_path / "b"))
    key = k(b"record")
    a.put(key, torch.tensor([1]), replace=True).result()
    assert b.get(key, primary=True).tolist() == [1]
    assert b.get(key).tolist() == [1]
    b.flush()                                   # b now holds a local copy (promotion)
    a.put(key, torch.tensor([2]), replace=True).result()
    assert b.get(key, primary=True).tolist() == [2]
    assert b.get(key).tolist() == [2]   # the stale local copies are older revisions: passed
    assert b.metrics.errors.labels("refused_replayed")._value.get() >= 1     # over
    a.delete_many([key])
    assert b.get(key, primary=True) is None


def test_a_second_writer_of_the_same_blob_between_write_and_count_loses_nothing(redis_server):
    """Writer A creates a blob's bytes; before A counts them, B saves the same blob under the
    same key and counts it. A's count must not reset B's: the bytes stay under the key."""
    a = RedisTier(redis_server.url, prefix="race")
    b = RedisTier(redis_server.url, prefix="race")
    key = b"\x01" * 18 + b"\x02" * 32
    blob, data = "ab" * 32, b"x" * 100
    orig = a.index.blobs.write

    def write(c, blob_id, d):
        created = orig(c, blob_id, d)        # A creates the bytes ...
        b.put(blob_id, d, key)               # ... and B saves the same before A counts them
        return created

    a.index.blobs.write = write
    assert a.put(blob, data, key)
    assert a.lookup_many([key]) == [blob] and a.exists_many([key]) == [True]
    assert a.get(blob) == data
