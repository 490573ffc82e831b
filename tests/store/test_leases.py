"""Leases: short pins with an expiry and no quota that keep promised blocks from eviction until
they are loaded, and that never shorten or remove a longer pin (a window's)."""

from __future__ import annotations

import time

import pytest

from cwm_plugin.store.keyspace import Lease

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


@pytest.mark.redis
def test_leases_in_redis(make_store, kv_block, redis_server):
    store = make_store(memory_bytes=0, redis_url=redis_server.url, redis_write="through",
                       redis_ttl_s=3600)
    fill(store, kv_block, range(2))
    store.pin_many([key(1)])
    lease = store.lease_many([key(0), key(1)], ttl_s=30)
    assert lease.keys == {"redis": [key(0)]}
    info = store.key_info(key(0))["redis"]
    assert info.pinned and 0 < info.pin_expires - time.time() <= 30.5
    assert store.release(lease) == 1
    assert not store.key_info(key(0))["redis"].pinned
    assert store.key_info(key(1))["redis"].pinned
    assert Lease().size == 0

