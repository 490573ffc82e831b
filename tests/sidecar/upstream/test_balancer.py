"""Sidecar replicas behind a real load balancer (nginx from Debian, consistent hash on
``X-Session-Id``, retrying on the next replica a request one could not take): one replica is
killed (SIGKILL) and restarted under a steady chat load of several sessions, and no client
request fails; every turn a client got an answer for is in the shared memory. Replicas are
``cwm serve`` processes on one PostgreSQL memory and one Redis; the upstream is
``cwm_plugin.testing.fake_upstream`` answering after a delay, so requests are in flight when
the replica dies."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from sidecar_helpers import KEYS, SECRET, replica_config

from cwm_plugin import pg_scope
from cwm_plugin.memory.postgres.truth import PostgresTruth
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.nginx_balancer import NginxBalancer
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.testing.sidecar_process import SidecarProcess

pytestmark = pytest.mark.postgres
CLIENTS = 6


def _sessions_on_both(lb: NginxBalancer, port_a: int) -> list[str]:
    """CLIENTS session names the balancer's hash spreads evenly over A and B: the ring
    depends on the replicas' (free, so random) ports, and with names taken blindly all of
    them landed on B now and then, leaving nothing in flight on the replica killed."""
    on_a: list[str] = []
    on_b: list[str] = []
    for k in range(200):
        session = f"load-{k}"
        side = on_a if lb.backend_of(session) == f"127.0.0.1:{port_a}" else on_b
        if len(side) < CLIENTS // 2:
            side.append(session)
        if len(on_a) + len(on_b) == CLIENTS:
            return on_a + on_b
    raise AssertionError(f"the hash put {len(on_a)} of 200 sessions on A")


def _kill_under_load(pg_url: str, redis_url: str, tmp_path: Path, retry: bool
                     ) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """Clients chatting through the balancer while replica A is killed and restarted: the
    turns answered per session (before the kill, in all) and the failed requests."""
    fake = FakeUpstream(model="tiny")
    fake.chat_delay = 0.3  # (requests in flight when the replica dies)
    stop = threading.Event()
    answered: dict[str, int] = {}
    failures: list[str] = []

    def client(session: str, url: str) -> None:
        n = 0
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                r = http.post(f"{url}/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 4, "messages": [
                        {"role": "user", "content": f"Question {n} of {session}?"}]},
                    headers={"Authorization": f"Bearer {KEYS['acme']}",
                             "X-Session-Id": session})
                if r.status_code != 200:
                    failures.append(f"{session} #{n}: {r.status_code} {r.text[:200]}")
                else:
                    answered[session] = n = n + 1

    with ServerThread(fake.app) as up, \
            SidecarProcess(replica_config(tmp_path / "a", pg_url, redis_url, limits=True), up.url,
                           tmp_path / "a", SECRET) as a, \
            SidecarProcess(replica_config(tmp_path / "b", pg_url, redis_url, limits=True), up.url,
                           tmp_path / "b", SECRET) as b, \
            NginxBalancer([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], retry=retry) as lb:
        threads = [threading.Thread(target=client, args=(s, lb.url))
                   for s in _sessions_on_both(lb, a.port)]
        for t in threads:
            t.start()
        time.sleep(4)
        served_before = dict(answered)
        a.kill()
        time.sleep(4)
        a.start()  # the same port: the balancer takes it back
        time.sleep(4)
        stop.set()
        for t in threads:
            t.join(60)
    return served_before, answered, failures


def test_a_replica_killed_and_restarted_under_load_fails_no_request(
        postgres_url: str, redis_server, tmp_path: Path) -> None:
    served_before, answered, failures = _kill_under_load(postgres_url, redis_server.url,
                                                         tmp_path, retry=True)
    assert not failures, failures[:5]
    assert sum(answered.values()) > sum(served_before.values()) + CLIENTS  # load went on
    truth = PostgresTruth(postgres_url, tmp_path / "check")
    try:
        with pg_scope.scoped(pg_scope.folders(["acme"])):  # (the tenant's folder)
            for session, n in answered.items():  # every answered turn is in the memory
                said = {t.content for t in truth.read_turns("acme", session)
                        if t.role == "user"}
                assert {f"Question {k} of {session}?" for k in range(n)} <= said
    finally:
        truth.close()


def test_without_the_balancers_retry_the_kill_fails_requests(postgres_url: str, redis_server,
                                                            tmp_path: Path) -> None:
    """The control: the same kill with the retry off fails the requests in flight on A."""
    _, _, failures = _kill_under_load(postgres_url, redis_server.url, tmp_path, retry=False)
    assert failures
