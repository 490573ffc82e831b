"""Session affinity across upstreams serving one model (``routing.affinity``, the default
``session``): each session's requests go to the upstream its cache_salt ranks highest
(rendezvous hashing), so its turns find their prefix in that server's cache while the sessions
spread over every upstream; an upstream going down moves only its own sessions, to the others,
and they come back when it does. ``first`` keeps the first healthy upstream for everyone.

Over real HTTP, each upstream a small real OpenAI-compatible server, so where a request went
is what each one received (and ``X-CWM-Upstream``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest
from sidecar_helpers import ADMIN, KEYS, chat, make_settings

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
SESSIONS = [f"s{i}" for i in range(24)]


def servers(tmp_path, **routing: Any):
    ups = [FakeUpstream(model="tiny") for _ in range(3)]
    threads = [ServerThread(u.app).start() for u in ups]
    settings = make_settings(threads[0].url, tmp_path, "tiktoken:cl100k_base",
                             memory_enabled=False,
                             upstreams=[{"name": n, "url": t.url}
                                        for n, t in zip("abc", threads, strict=True)],
                             routing={"health": {"interval_s": 0}, **routing})
    return ups, threads, ServerThread(create_app(settings)).start()


def where(srv: ServerThread, session: str, content: str = "hello") -> str:
    r = chat(srv, "acme", content, session=session)
    assert r.status_code == 200, r.text
    return r.headers["x-cwm-upstream"]


def test_each_session_keeps_its_upstream_and_sessions_spread_over_all(tmp_path):
    ups, threads, srv = servers(tmp_path)
    try:
        home = {s: where(srv, s) for s in SESSIONS}
        assert all(where(srv, s, "again") == home[s] for s in SESSIONS)
        spread = Counter(home.values())
        assert set(spread) == {"a", "b", "c"} and min(spread.values()) >= 3, spread
        # the relayed routes of a session go where its chat turns go (the same salt)
        for s in SESSIONS[:6]:
            r = httpx.post(f"{srv.url}/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": "once", "max_tokens": 4}, headers={
                "Authorization": f"Bearer {KEYS['acme']}", "X-Session-Id": s})
            assert r.status_code == 200 and r.headers["x-cwm-upstream"] == home[s], s
        # each upstream received exactly its own sessions' requests
        for name, up in zip("abc", ups, strict=True):
            assert len(up.bodies()) == 2 * spread[name]
    finally:
        for s in (srv, *threads):
            s.stop()


def test_an_upstream_going_down_moves_only_its_own_sessions_and_they_come_back(tmp_path):
    ups, threads, srv = servers(tmp_path)
    try:
        home = {s: where(srv, s) for s in SESSIONS}
        threads[0].stop()  # a: nothing listens there now
        moved = {s: where(srv, s, "while a is down") for s in SESSIONS}
        assert all(moved[s] == home[s] for s in SESSIONS if home[s] != "a")
        theirs = Counter(moved[s] for s in SESSIONS if home[s] == "a")
        assert "a" not in theirs and sum(theirs.values()) == Counter(home.values())["a"]
        threads[0] = ServerThread(ups[0].app, port=threads[0].port).start()
        health = httpx.get(f"{srv.url}/health", timeout=30, headers=ADMIN).json()
        assert all(u["up"] for u in health["upstreams"]), health
        assert {s: where(srv, s, "a is back") for s in SESSIONS} == home
    finally:
        for s in (srv, *threads):
            s.stop()


def test_affinity_first_sends_every_session_to_the_first_healthy_upstream(tmp_path):
    ups, threads, srv = servers(tmp_path, affinity="first")
    try:
        assert {where(srv, s) for s in SESSIONS[:8]} == {"a"}
        threads[0].stop()
        assert {where(srv, s) for s in SESSIONS[:8]} == {"b"}
    finally:
        for s in (srv, *threads):
            s.stop()


def test_a_role_keeps_one_model_for_every_session(tmp_path):
    """Two upstreams with the role ``code`` serving different models: every session gets the
    first one's model (as without affinity), never the other's by its hash."""
    c1, c2 = FakeUpstream(model="m1"), FakeUpstream(model="m2")
    with ServerThread(c1.app) as s1, ServerThread(c2.app) as s2:
        settings = make_settings(s1.url, tmp_path, "tiktoken:cl100k_base",
                                 memory_enabled=False,
                                 upstreams=[{"name": "c1", "url": s1.url, "roles": ["code"]},
                                            {"name": "c2", "url": s2.url, "roles": ["code"]}],
                                 routing={"health": {"interval_s": 0},
                                          "aliases": {"coder": "code"}})
        with ServerThread(create_app(settings)) as srv:
            for s in SESSIONS[:12]:
                r = chat(srv, "acme", "hello", session=s, model="coder")
                assert r.status_code == 200 and r.headers["x-cwm-upstream"] == "c1", r.text
            assert c2.bodies() == [] and len(c1.bodies()) == 12
