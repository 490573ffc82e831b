"""Leases: short pins with an expiry that no quota counts, keeping promised blocks from eviction
until they are loaded, that never shorten, remove or take over a pin (a window's); in Redis,
TTLs renewed."""

from __future__ import annotations

import time

import pytest

from cwm_plugin.store.key_ops import Lease
from cwm_plugin.store.tiers.base import QuotaExceeded

pytestmark = pytest.mark.unit


def key(i: int) -> bytes:
    return b"G" * 18 + i.to_bytes(32, "big")


def fill(store, kv_block, ids) -> None:
    for i in ids:
        store.put(key(i), kv_block(i)).result()
    store.flush()


def test_leased_blocks_survive_another_process_evicting_the_disk(make_store, kv_block, tmp_path):
    size = kv_block(0).numel() * kv_block(0).element_size()
    settings = dict(disk_path=str(tmp_path / "d"), disk_bytes=6 * size, memory_bytes=0,
                    zstd_level=0)
    ours, other = make_store(**settings), make_store(**settings)   # two servers, one disk
    fill(ours, kv_block, range(4))
    lease = ours.lease_many([key(0), key(1), key(99)], ttl_s=60)   # 99: absent, skipped
    assert set(lease.keys["disk"]) == {key(0), key(1)} and lease.size == 2
    fill(other, kv_block, range(10, 16))                   # the other server's saves evict
    assert ours.contains_many([key(0), key(1), key(2), key(3)]) == [True, True, False, False]
    assert ours.release(lease) == 2
    fill(other, kv_block, range(20, 26))
    assert ours.contains_many([key(0), key(1)]) == [False, False]  # evictable again


def test_a_lease_leaves_longer_pins_alone_and_renews_shorter_ones(make_store, kv_block,
                                                                  tmp_path):
    store = make_store(disk_path=str(tmp_path / "d"), memory_bytes=0)
    fill(store, kv_block, range(3))
    store.pin_many([key(0)])                               # a window: no expiry
    store.pin_many([key(1)], ttl_s=3600)                   # a window with a TTL
    first = store.lease_many([key(0), key(1), key(2)], ttl_s=30)
    assert first.keys == {"disk": [key(2)]}
    second = store.lease_many([key(2)], ttl_s=60)           # another request, same block
    assert second.keys == {"disk": [key(2)]}
    assert store.release(first) == 0                        # renewed: the second one's now
    assert store.key_info(key(2))["disk"].pinned
    assert store.release(second) == 1
    info = {i: store.key_info(key(i))["disk"] for i in range(3)}
    assert info[0].pinned and info[0].pin_expires is None
    assert info[1].pinned and info[1].pin_expires > time.time() + 3000
    assert not info[2].pinned


def test_a_lease_expires_on_its_own(make_store, kv_block):
    store = make_store(memory_bytes=1 << 20)
    fill(store, kv_block, range(2))
    lease = store.lease_many([key(0), key(1)], ttl_s=0.2, tiers=[store.memory])
    assert lease.size == 2 and not lease.expired()
    assert all(store.key_info(key(i))["memory"].pinned for i in range(2))
    time.sleep(0.3)
    assert lease.expired()
    assert not any(store.key_info(key(i))["memory"].pinned for i in range(2))
    assert store.release(lease) == 0


def blob_size(store, i: int) -> int:
    return next(iter(store.key_info(key(i)).values())).size


@pytest.fixture(params=["disk", "memory"])
def pin_store(request, make_store, tmp_path):
    """A store whose pins live on the disk (its durable tier) or, without one, in memory
    (where the connector's workers lease: ``lease_many`` is given that tier)."""
    def make(**kw):
        if request.param == "disk":
            return make_store(disk_path=str(tmp_path / "d"), memory_bytes=0, zstd_level=0,
                              **kw)
        return make_store(memory_bytes=1 << 20, zstd_level=0, **kw)
    return make


def lease(store, keys, ttl_s):
    return store.lease_many(keys, ttl_s=ttl_s, tiers=store.durable or [store.memory])


def test_leases_do_not_count_toward_the_pin_quota(pin_store, kv_block):
    size = kv_block(0).numel() * kv_block(0).element_size()
    store = pin_store(pin_quota_bytes=int(2.5 * size))     # two blocks' blobs, not three
    fill(store, kv_block, range(4))
    tier = next(iter(store.key_info(key(0))))
    assert blob_size(store, 0) <= 1.25 * size
    taken = lease(store, [key(0), key(1), key(2)], ttl_s=60)   # three requests' blocks
    assert taken.keys == {tier: [key(0), key(1), key(2)]}
    store.pin_many([key(1), key(3)])     # a window: fits, though the leases hold three blobs
    with pytest.raises(QuotaExceeded):   # the leased block 2 pinned too: three, over it
        store.pin_many([key(2)])
    info = {i: store.key_info(key(i))[tier] for i in range(4)}
    assert info[1].pinned and not info[1].leased and info[1].pin_expires is None
    assert info[2].leased                                   # the refused pin changed nothing
    assert store.release(taken) == 2                        # 0 and 2; the window's 1 stays
    assert [store.key_info(key(i))[tier].pinned for i in range(4)] == [False, True, False,
                                                                        True]


def test_a_window_pin_is_never_turned_into_a_lease(pin_store, kv_block):
    store = pin_store()
    fill(store, kv_block, range(3))
    tier = next(iter(store.key_info(key(0))))
    store.pin_many([key(0)], ttl_s=5)                       # a window about to expire
    taken = lease(store, [key(0), key(1)], ttl_s=60)
    assert taken.keys == {tier: [key(1)]}
    early = store.key_info(key(0))[tier]                    # pushed out to the lease's end
    assert early.pinned and not early.leased and early.pin_expires > time.time() + 50
    store.pin_many([key(1)])                                # a window pins a leased block
    assert store.release(taken) == 0
    for i in (0, 1):
        assert store.key_info(key(i))[tier].pinned and not store.key_info(key(i))[tier].leased


@pytest.mark.redis
def test_a_lease_in_redis_renews_ttls_and_never_shortens_one(make_store, kv_block,
                                                            redis_server):
    import redis

    store = make_store(memory_bytes=0, redis_url=redis_server.url, redis_write="through",
                       redis_ttl_s=1)
    fill(store, kv_block, range(3))
    store.pin_many([key(2)])                                # a window: no TTL
    lease = store.lease_many([key(0), key(2), key(99)], ttl_s=30)
    assert lease.keys == {"redis": [key(0), key(2)]}
    tier = store.tiers[-1]
    c = redis.Redis.from_url(redis_server.url)
    names = [tier.names.key(key(0)), tier.names.key(key(1)), tier.names.key(key(2))]
    blob = tier.lookup_many([key(0)])[0]
    assert 25 < c.ttl(names[0]) <= 30 and c.ttl(names[1]) <= 1 and c.ttl(names[2]) == -1
    assert 25 < c.ttl(tier.blobs.name(blob)) <= 30
    assert store.lease_many([key(0)], ttl_s=5).size == 1 and c.ttl(names[0]) > 25  # GT
    time.sleep(1.6)                                         # key 1's TTL runs out
    assert store.contains_many([key(0), key(1), key(2)]) == [True, False, True]
    assert store.get(key(0)) is not None
    assert store.release(lease) == 0                        # nothing to release: a TTL
    assert store.key_info(key(2))["redis"].pinned
    assert Lease().size == 0
