"""The key-index contract every tier keeps, run against each real tier: memory, disk (SQLite),
Redis (a real redis-server). Keys of one group share their first 18 bytes (namespace + rank)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from cwm_plugin.store.tiers.base import QuotaExceeded, Tier
from cwm_plugin.store.tiers.disk.tier import DiskTier
from cwm_plugin.store.tiers.ram.tier import RamTier
from cwm_plugin.store.tiers.redis.tier import RedisTier

G = b"N" * 16 + b"\x00\x01"          # one group


def key(i: int, group: bytes = G) -> bytes:
    return group + i.to_bytes(4, "big")


def bid(i: int) -> str:
    return f"{i:040x}"


@pytest.fixture(params=["memory", "disk", "redis", "redis-cluster"])
def tier(request, tmp_path) -> Iterator[Tier]:
    if request.param == "memory":
        t: Tier = RamTier(1 << 20)
    elif request.param == "disk":
        t = DiskTier(tmp_path / "d", 1 << 20, rebuild_in_background=False)
    elif request.param == "redis":
        server = request.getfixturevalue("redis_server")
        t = RedisTier(server.url, prefix="c", max_value_bytes=1024)
    else:                                     # a shared cluster: a prefix of the test's own
        cluster = request.getfixturevalue("redis_cluster")
        t = RedisTier(cluster.url, prefix=f"c{uuid.uuid4().hex[:8]}", max_value_bytes=1024,
                      cluster=True)
    drops: list[tuple[list[bytes], str]] = []
    t.set_drop_listener(lambda keys, why: drops.append((keys, why)))
    t.drops = drops  # type: ignore[attr-defined]
    yield t
    t.close()


pytestmark = pytest.mark.unit


def test_put_lookup_get_and_first_writer_wins(tier):
    assert tier.put(bid(1), b"a" * 3000, key(1))          # split into parts on Redis
    assert tier.lookup_many([key(1), key(2)]) == [bid(1), None]
    assert tier.get_many([bid(1), bid(9)]) == [b"a" * 3000, None]
    assert tier.put(bid(2), b"b" * 10, key(1))           # the key keeps its blob
    assert tier.lookup_many([key(1)]) == [bid(1)]
    assert tier.put(bid(2), b"b" * 10, key(1), replace=True)   # a record being rewritten
    assert tier.lookup_many([key(1)]) == [bid(2)]
    assert not tier.has_blob(bid(1))                     # nothing points to it: freed
    assert tier.exists_many([key(1), key(3)]) == [True, False]


def test_link_many_repoints_and_frees_and_delete_keeps_shared(tier):
    tier.put(bid(1), b"one", key(1))
    tier.put(bid(2), b"two", key(2))
    linked = tier.link_many([(key(3), bid(1)), (key(2), bid(1)), (key(4), bid(99))])
    assert sorted(linked) == [key(2), key(3)]            # no blob 99 here: skipped
    assert tier.lookup_many([key(1), key(2), key(3), key(4)]) == [bid(1)] * 3 + [None]
    assert not tier.has_blob(bid(2))                     # its only key moved away
    assert sorted(tier.delete_many([key(1), key(2), key(7)])) == [key(1), key(2)]
    assert tier.get_many([bid(1)]) == [b"one"]           # key 3 still shares it
    assert tier.delete_many([key(3)]) == [key(3)] and not tier.has_blob(bid(1))


def test_pins_quota_expiry_and_listing(tier):
    for i in range(3):
        tier.put(bid(i), bytes(100), key(i))
    tier.link_many([(key(10), bid(0))])
    assert sorted(tier.pin_many([key(0), key(10), key(5)], quota_bytes=250)) == \
        [key(0), key(10)]                                 # one blob: 100 bytes pinned
    with pytest.raises(QuotaExceeded, match="quota"):
        tier.pin_many([key(1), key(2)], quota_bytes=250)  # 300 > 250: nothing pinned
    assert not any(i.pinned for i in tier.list_keys(key(1)) + tier.list_keys(key(2)))
    tier.pin_many([key(1)], quota_bytes=250, ttl_s=0.5)
    rows = tier.list_keys(G)
    assert [r.key for r in rows] == sorted([key(0), key(1), key(2), key(10)])
    by_key = {r.key: r for r in rows}
    assert by_key[key(0)].pinned and by_key[key(10)].pinned and by_key[key(1)].pinned
    assert by_key[key(1)].pin_expires is not None and by_key[key(0)].pin_expires is None
    assert by_key[key(0)].blob_id == bid(0) and by_key[key(0)].size == 100
    assert [r.key for r in tier.list_keys(G, after=key(1), limit=1)] == [key(2)]
    assert tier.unpin_many([key(10), key(2)]) == [key(10)]
    time.sleep(0.6)
    tier.pin_many([key(2)], quota_bytes=250)             # key 1's pin expired: room again
    assert not {r.key: r for r in tier.list_keys(G)}[key(1)].pinned
    assert tier.list_keys(b"other-prefix") == []


def test_a_lease_is_not_a_pin(tier):
    for i in range(3):
        tier.put(bid(i), bytes(100), key(i))
    tier.pin_many([key(0)], ttl_s=5)                     # a window's pin, expiring soon
    leased = tier.lease_many([key(0), key(1), key(9)], ttl_s=60)
    assert tier.usage().pinned_bytes == 100              # the window's blob, not the lease's
    if not tier.leases_released:     # Redis: TTLs renewed, none here (tests/store/test_leases)
        assert leased == [] and not tier.info_many([key(1)])[0].pinned
        return
    assert leased == [key(1)]                            # the window's pin stays its own
    w, lz = tier.info_many([key(0), key(1)])
    assert w.pinned and not w.leased and w.pin_expires > time.time() + 50
    assert lz.pinned and lz.leased
    tier.pin_many([key(2)], quota_bytes=250)     # 200 pinned bytes: the lease's 100 not counted
    with pytest.raises(QuotaExceeded):
        tier.pin_many([key(1)], quota_bytes=250)          # the leased blob pinned: 300
    assert tier.info_many([key(1)])[0].leased
    tier.pin_many([key(1)], quota_bytes=300)
    assert not tier.info_many([key(1)])[0].leased        # a pin taken on it: a pin now
    assert tier.lease_many([key(1)], ttl_s=60) == []
    assert tier.info_many([key(1)])[0].pin_expires is None   # a pin without expiry: kept so


def test_forget_reports_dropped_keys(tier):
    tier.put(bid(1), b"x" * 50, key(1))
    tier.link_many([(key(2), bid(1))])
    dropped = tier.forget_blobs([bid(1)], "quarantined", keys=[key(1), key(2)])
    assert sorted(dropped) == [key(1), key(2)]
    assert tier.drops == [(dropped, "quarantined")]
    assert tier.lookup_many([key(1), key(2)]) == [None, None] and not tier.has_blob(bid(1))


def test_groups_are_independent(tier):
    other = b"M" * 16 + b"\x00\x01"
    tier.put(bid(1), b"1", key(1))
    tier.put(bid(2), b"2", key(1, other))
    assert tier.lookup_many([key(1), key(1, other)]) == [bid(1), bid(2)]
    tier.pin_many([key(1, other)], quota_bytes=1)
    tier.pin_many([key(1)], quota_bytes=1)               # quotas are per group
    assert [r.key for r in tier.list_keys(other)] == [key(1, other)]
    assert sorted(tier.blob_ids()) == [bid(1), bid(2)] and tier.unreferenced() == []
