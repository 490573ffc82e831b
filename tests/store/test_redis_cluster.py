"""The Redis tier on a real 3-master Redis Cluster: the traffic of one model (one namespace and
rank, through every operation of the tier) spreads over the masters instead of one slot's.
The tier's contract on the cluster is tests/store/test_tier_contract.py (``redis-cluster``)."""

from __future__ import annotations

import hashlib
import random
import uuid

import pytest
import redis

from cwm_plugin.store.tiers.redis.tier import RedisTier

pytestmark = pytest.mark.redis

# commands of the client library and of this test, not of the tier's work
ADMIN = {"info", "cluster", "command", "config", "client", "hello", "ping", "readonly",
         "script", "select", "auth"}
G = bytes(range(16)) + b"\x00\x00"          # one namespace and rank


def served(cluster) -> list[int]:
    """Commands each master has run (scripts' own commands included)."""
    out = []
    for node in cluster.nodes:
        r = redis.Redis(port=node.port)
        try:
            stats = r.info("commandstats")
        finally:
            r.close()
        out.append(sum(v["calls"] for name, v in stats.items()
                       if name.removeprefix("cmdstat_").split("|")[0] not in ADMIN))
    return out


def test_one_models_traffic_spreads_over_the_masters(redis_cluster):
    t = RedisTier(redis_cluster.url, prefix=f"spread{uuid.uuid4().hex[:8]}", cluster=True,
                  ttl_s=3600, max_value_bytes=4096)
    try:
        keys = [G + hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(500)]
        data = [bytes([i % 251]) * (100 + i) for i in range(len(keys))]
        ids = [hashlib.sha256(d).hexdigest()[:40] for d in data]
        before = served(redis_cluster)
        for k, b, d in zip(keys, ids, data, strict=True):
            t.put(b, d, k)                                            # saves
        for i in range(0, len(keys), 50):                             # lookups and restores
            assert t.exists_many(keys[i:i + 50]) == [True] * 50
            assert t.get_many(t.lookup_many(keys[i:i + 50])) == data[i:i + 50]
        clones = [G + b"w" + k[19:] for k in keys[:200]]               # a window's re-key
        assert sorted(t.link_many(list(zip(clones, ids[:200], strict=True)))) == sorted(clones)
        assert len(t.pin_many(clones, ttl_s=600, quota_bytes=1 << 20)) == 200
        assert len(t.list_keys(G + b"w")) == 200
        assert len(t.unpin_many(clones)) == 200
        assert sorted(t.delete_many(clones)) == sorted(clones)
        t.stats()
        ops = [a - b for a, b in zip(served(redis_cluster), before, strict=True)]
    finally:
        t.close()
    shares = [round(n / sum(ops), 3) for n in ops]
    print(f"commands per master: {ops}, shares {shares}")
    assert sum(ops) > 3000
    assert max(shares) <= 0.5, ops


@pytest.fixture(params=["redis", "redis-cluster"])
def tier(request):
    if request.param == "redis":
        url, cluster = request.getfixturevalue("redis_server").url, False
    else:
        url, cluster = request.getfixturevalue("redis_cluster").url, True
    t = RedisTier(url, prefix=f"inv{uuid.uuid4().hex[:8]}", cluster=cluster, ttl_s=3600,
                  max_value_bytes=1024)
    yield t
    t.close()


def test_counts_match_the_keys_after_any_mix_of_operations(tier):
    """References and pins are counted in each blob's slot, pinned bytes in each group's,
    apart from the keys: after a random mix of saves, re-points, links, pins, unpins and
    deletes, every count equals what the keys say."""
    rng = random.Random(7)
    groups = [bytes([g]) * 16 + b"\x00\x01" for g in (1, 2)]
    keys = [g + bytes([i]) * 8 for g in groups for i in range(15)]
    data = {hashlib.sha256(bytes([i])).hexdigest()[:40]: bytes([i]) * (300 * (i + 1))
            for i in range(6)}                                  # some split into parts
    ids = list(data)
    for _ in range(300):
        op = rng.choice(["put", "put", "link", "delete", "pin", "unpin"])
        some = rng.sample(keys, rng.randint(1, 6))
        if op == "put":
            b = rng.choice(ids)
            tier.put(b, data[b], some[0], replace=rng.random() < 0.5)
        elif op == "link":
            tier.link_many([(k, rng.choice(ids)) for k in some])
        elif op == "delete":
            tier.delete_many(some)
        elif op == "pin":
            tier.pin_many(some, ttl_s=rng.choice([None, 600]))
        else:
            tier.unpin_many(some)
    infos = {i.key: i for i in tier.info_many(keys) if i is not None}
    refs: dict[str, int] = {}
    pins: dict[str, int] = {}
    for i in infos.values():
        refs[i.blob_id] = refs.get(i.blob_id, 0) + 1
        pins[i.blob_id] = pins.get(i.blob_id, 0) + int(i.pinned)
    metas = tier._call(lambda c: tier.blobs.meta_many(c, ids))
    for b in ids:
        assert tier.has_blob(b) == (b in refs), b              # freed when unreferenced
        if b in refs:
            counted = tier._call(lambda c, b=b: c.hget(tier.blobs.meta(b), "refs"))
            assert (int(counted), metas[b][0]) == (refs[b], pins[b]), b
    pinned = {g.hex(): sum(len(data[b]) for b in ids if pins.get(b) and metas[b][2] == g.hex())
              for g in groups}
    counters = tier._call(lambda c: {g: int(c.get(tier.names.pinbytes(g)) or 0)
                                     for g in pinned})
    assert counters == pinned
    assert len(tier.list_keys()) == len(infos) and tier.dangling_keys() == []


def test_a_lease_renews_ttls_across_the_slots(redis_cluster):
    t = RedisTier(redis_cluster.url, prefix=f"lease{uuid.uuid4().hex[:8]}", cluster=True,
                  ttl_s=2, max_value_bytes=1024)
    try:
        keys = [G + i.to_bytes(32, "big") for i in range(40)]
        for i, k in enumerate(keys):
            t.put(f"{i:040x}", bytes([i]) * 3000, k)     # split in parts: 3 names a blob
        assert sorted(t.lease_many(keys[:20], ttl_s=30)) == sorted(keys[:20])
        ttls = t._call(lambda c: [c.ttl(t.names.key(k)) for k in keys] +
                       [c.ttl(n) for n in t.blobs.names(c, [f"{i:040x}" for i in range(40)])])
        leased = ttls[:20] + [x for i, x in enumerate(ttls[40:]) if i // 5 < 20]
        assert min(leased) > 25
        assert max(ttls[20:40]) <= 2
    finally:
        t.close()
