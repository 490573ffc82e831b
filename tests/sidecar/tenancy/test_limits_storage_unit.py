"""Where the limits count, over real HTTP: a Redis every sidecar shares (a real redis-server),
and a Redis that hangs. A hung Redis costs the first requests at most ``storage_timeout_s``
(it never blocks the event loop: ``/health`` and the other requests go on), is logged once
and counted, and the limits keep holding in this process until it is asked again."""

from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from sidecar_helpers import KEYS, make_settings, metric_value

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.identity.authenticator import hash_key
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

LIMITED = "cwm_sidecar_rate_limited_total"


class HungRedis:
    """A TCP server that takes connections and commands and never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        self.reads = 0  # data that arrived (connections opened, commands sent)
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.reads += 1
            self._conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        while True:
            try:
                if not conn.recv(65536):
                    return
            except OSError:
                return
            self.reads += 1

    def close(self) -> None:
        self.sock.close()
        for c in self._conns:
            c.close()


def settings(up: ServerThread, root, storage: str):
    return make_settings(up.url, root, "tiktoken:cl100k_base",
                         rate_limits={"storage": storage, "rate_limit": "100/minute"},
                         tenants=[{"name": t, "key_sha256": [hash_key(KEYS[t])],
                                   **({"rate_limit": "5/minute"} if t == "beta" else {})}
                                  for t in ("acme", "beta", "gamma")])


def chat(srv: ServerThread, tenant: str) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/chat/completions", timeout=20,
                      headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                      json={"model": "tiny", "max_tokens": 4,
                            "messages": [{"role": "user", "content": "hello"}]})


@pytest.mark.unit
def test_a_hung_redis_stalls_nothing_and_the_limits_still_hold(tmp_path, caplog):
    hung = HungRedis()
    fake = FakeUpstream(model="tiny")
    try:
        with ServerThread(fake.app) as up, \
                ServerThread(create_app(settings(up, tmp_path, hung.url))) as srv:
            with ThreadPoolExecutor(8) as pool:  # at once, while the storage hangs
                first = list(pool.map(lambda t: chat(srv, t), ["beta"] * 4 + ["acme"] * 4))
                health = pool.submit(httpx.get, f"{srv.url}/health", timeout=20)
                assert health.result().status_code == 200
            assert [r.status_code for r in first] == [200] * 8
            asked = hung.reads
            # the storage is left alone now: the counts are this process's, and they hold
            codes = [chat(srv, "beta").status_code for _ in range(4)]
            assert codes == [200, 429, 429, 429]
            assert chat(srv, "gamma").status_code == 200
            assert hung.reads == asked
            assert metric_value(srv, LIMITED, limit="storage_error") >= 1
            assert metric_value(srv, LIMITED, tenant="beta", limit="requests") == 3
    finally:
        hung.close()
    failed = [r for r in caplog.records if "rate limit storage failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR


@pytest.mark.redis
def test_the_limits_count_in_a_shared_redis(tmp_path, redis_server):
    fake = FakeUpstream(model="tiny")
    with ServerThread(fake.app) as up, \
            ServerThread(create_app(settings(up, tmp_path, redis_server.url))) as srv, \
            ServerThread(create_app(settings(up, tmp_path, redis_server.url))) as other:
        codes = [chat(s, "beta").status_code for s in (srv, other) * 4]
        assert codes == [200] * 5 + [429] * 3  # one count for both sidecars
        assert chat(other, "acme").status_code == 200
        assert metric_value(srv, LIMITED, limit="storage_error") == 0
    keys = redis.Redis.from_url(redis_server.url).keys("LIMITS:*")
    assert any(b"beta" in k for k in keys), keys


@pytest.mark.redis
def test_tokens_a_failed_redis_call_had_taken_are_given_back(redis_server):
    """Redis fails midway through a reservation (its hour's count taken, its day's refused):
    the request is counted in this process instead, and the tokens taken in Redis are given
    back there, so the tenant loses none of its shared quota to the outage."""
    import asyncio

    from prometheus_client import CollectorRegistry, Counter

    from cwm_plugin.sidecar.identity.ratelimit import TenantLimits
    from cwm_plugin.sidecar.settings import TenantConfig
    from cwm_plugin.sidecar.settings.limits import RateLimitSettings

    counter = Counter("limited", "x", ["tenant", "limit"], registry=CollectorRegistry())
    limits = TenantLimits(
        RateLimitSettings(storage=redis_server.url, rate_limit=None,
                          token_quota="1000/hour;5000/day", storage_timeout_s=2),
        [TenantConfig(name="acme", key_sha256=[hash_key(KEYS["acme"])])], counter)
    storage = limits._shared.storage
    real, calls = storage.incr, []

    async def incr(*a, **k):
        calls.append(k.get("amount"))
        if len(calls) == 2:  # the day's count: Redis goes away
            raise redis.ConnectionError("redis went away")
        return await real(*a, **k)
    storage.incr = incr

    async def run() -> int:
        res = await limits.reserve("acme", 600)
        await asyncio.gather(*list(limits._tasks))  # the give-back, in the background
        assert res.tokens == 600 and res.counts is limits._local  # counted here instead
        return sum(int(v) for k in redis.Redis.from_url(redis_server.url).keys("LIMITS:*")
                   for v in [redis.Redis.from_url(redis_server.url).get(k) or 0])

    assert asyncio.run(run()) == 0  # Redis holds none of the 600
