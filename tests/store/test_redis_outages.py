"""A Redis that fails under the store: down and back (the local tiers keep serving), refusing
writes, evicting any name under allkeys-lru pressure, black-holed, one slow answer, a cluster no
node of which answers. None of it fails a read or a write of the store; each is counted."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import pytest
import redis
import torch
from redis_helpers import bid, k

from cwm_plugin.errors import TierUnavailable
from cwm_plugin.testing.redis_server import RedisServer

pytestmark = pytest.mark.redis


def test_outage_local_tiers_keep_serving_and_reconnect(tmp_path, make_store, kv_block, caplog):
    server = RedisServer().start()
    try:
        s = make_store(redis_url=server.url, disk_path=str(tmp_path / "d"),
                       redis_write="through")
        s.redis.conn.max_backoff = 0.2
        s.put(k(b"a"), kv_block(1)).result()
        port = server.port
        server.stop()
        with caplog.at_level(logging.WARNING):
            for i in range(20):
                assert torch.equal(s.get(k(b"a")), kv_block(1))  # memory/disk keep serving
                assert s.get(k(f"missing{i}".encode())) is None
                s.put(k(f"new{i}".encode()), kv_block(i)).result()   # local tiers take it
                assert s.contains_many([k(b"a"), k(b"zz")]) == [True, False]
        down = [r for r in caplog.records if "redis" in r.getMessage()]
        assert len(down) == 1, [r.getMessage() for r in caplog.records]
        assert s.metrics.errors.labels("tier_unavailable")._value.get() >= 1
        with pytest.raises(TierUnavailable):
            s.redis.get(bid("a"))
        server = RedisServer(port=port).start()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                s.redis.put(bid("c"), b"back", k(b"c"))
                break
            except TierUnavailable:
                time.sleep(0.1)
        assert s.redis.get(bid("c")) == b"back"
        s.put(k(b"after"), kv_block(2)).result()
        assert s.redis.lookup_many([k(b"after")])[0] is not None
    finally:
        server.stop()


def test_redis_refusing_writes_is_not_fatal(redis_server, make_store, kv_block):
    r = redis.Redis.from_url(redis_server.url)
    s = make_store(redis_url=redis_server.url, redis_write="through")
    r.config_set("maxmemory", 1)                 # every write is refused with OOM
    r.config_set("maxmemory-policy", "noeviction")
    try:
        s.put(k(b"a"), kv_block(1)).result()     # memory tier takes it
        assert torch.equal(s.get(k(b"a")), kv_block(1))
        assert s.metrics.errors.labels("tier_unavailable")._value.get() >= 1
    finally:
        r.config_set("maxmemory", 0)


def test_under_allkeys_lru_pressure_reads_are_right_or_misses(redis_server, make_store,
                                                              kv_block):
    # allkeys-lru may evict any name: bytes, keys, refcounts. Content addressing and checksums
    # keep every read right (a block is the saved one, or a miss); nothing raises.
    r = redis.Redis.from_url(redis_server.url)
    # 4 MiB, 10 MiB written: at 2 MiB a server's ~1 MiB of its own and the clients' buffers
    # (a 256 KiB blob each) left room for one blob, and a read's buffers could evict it
    r.config_set("maxmemory", 4 << 20)
    r.config_set("maxmemory-policy", "allkeys-lru")
    s = make_store(redis_url=redis_server.url, memory_bytes=0, redis_write="through",
                   zstd_level=0)
    blocks = {k(f"{i}".encode()): kv_block(i, shape=(4, 8, 64, 64)) for i in range(40)}
    for key, v in blocks.items():
        s.put(key, v).result()
    got = s.get_many(list(blocks))
    assert 0 < sum(g is None for g in got) < len(blocks)
    assert all(g is None or torch.equal(g, v) for g, v in zip(got, blocks.values(),
                                                              strict=True))
    there = s.contains_many(list(blocks))
    assert all(torch.equal(s.get(key), v) for (key, v), ok in zip(blocks.items(), there,
                                                                  strict=True) if ok)


class BlackHole:
    """A loopback TCP server that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self._stop = True
        for c in self.conns:
            c.close()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)     # wakes the accepting thread
        self.sock.close()


def test_a_black_holed_redis_costs_a_lookup_tens_of_ms_and_comes_back(make_store, kv_block):
    hole = BlackHole()
    try:
        # the scheduler's store: lookups only, with the short lookup timeout
        s = make_store(redis_url=f"redis://127.0.0.1:{hole.port}/0", memory_bytes=0,
                       redis_timeout_ms=50)
        s.redis.conn.backoff0 = s.redis.conn._backoff = 0.3
        t0 = time.perf_counter()
        for _ in range(20):
            assert s.contains_many([k(b"x")]) == [False]
        spent = time.perf_counter() - t0
        assert spent < 2.0, spent       # 20 lookups: three wait out the timeout, the rest skip
        assert s.redis.conn.failures >= 1 and not s.redis.available and len(hole.conns) <= 4
    finally:
        hole.close()
    server = RedisServer(port=hole.port).start()
    try:
        deadline = time.monotonic() + 15
        while not s.redis.available and time.monotonic() < deadline:
            s.contains_many([k(b"x")])
            time.sleep(0.05)
        assert s.redis.available                         # the tier came back by itself
        s.redis.put(bid("d"), b"ok", k(b"x"))
        assert s.contains_many([k(b"x")]) == [True]
    finally:
        server.stop()


def test_one_slow_answer_fails_that_lookup_only_and_the_tier_stays_up(redis_server, make_store):
    """A Redis busy for longer than the lookup timeout once (CLIENT PAUSE here; a large write
    or a loaded machine in life) costs that lookup, not seconds of misses."""
    s = make_store(redis_url=redis_server.url, memory_bytes=0, redis_timeout_ms=100)
    s.redis.put(bid("d"), b"ok", k(b"x"))
    other = redis.Redis.from_url(redis_server.url)
    other.client_pause(400)
    assert s.contains_many([k(b"x")]) == [False]            # timed out: a miss ...
    assert s.redis.available and s.redis.conn.failures == 0  # ... not an outage
    time.sleep(0.45)
    assert s.contains_many([k(b"x")]) == [True]


def test_a_cluster_no_node_of_which_answers_is_a_tier_down_not_a_crash(tmp_path, make_store,
                                                                      kv_block):
    """``RedisClusterException`` is no ``RedisError``; uncaught in the scheduler's look-up it
    would take vLLM's engine down on the first request. It is the tier being down."""
    s = make_store(redis_url="redis://127.0.0.1:1/0", redis_cluster=True,
                   disk_path=str(tmp_path / "d"))
    s.put(k(b"a"), kv_block(1)).result()  # the local tiers take it
    assert s.where_many([k(b"a"), k(b"b")])[1] is None
    assert s.contains_many([k(b"a"), k(b"b")]) == [True, False]
    assert torch.equal(s.get_many([k(b"a")])[0], kv_block(1))
    assert s.get(k(b"b")) is None
    assert s.metrics.errors.labels("tier_unavailable")._value.get() >= 1
    with pytest.raises(TierUnavailable):
        s.redis.get(bid("a"))
