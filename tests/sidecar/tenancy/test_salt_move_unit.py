"""A session's KV stays reachable through a secret rotation (``salt_move.py``): with a windows
store, a session's first request in the grace period re-keys the context its old salt left
under its new salt, once, before it is forwarded; past the grace period nothing is looked up.
The store is a real disk store holding what the connector leaves (``window_helpers.py``);
the sidecar runs over real HTTP in front of ``cwm_plugin.testing.fake_upstream``; no vLLM."""

from __future__ import annotations

import hashlib
import hmac
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from sidecar_helpers import KEYS, chat, make_settings, metric_value, runtime
from window_helpers import BS, block, converse, session_blocks

from cwm_plugin.salts import derive_salt
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
OLD, NEW = "old-secret-0123456789abcdef", "new-secret-0123456789abcdef"
MOVES = "cwm_sidecar_salt_moves_total"


def user_name(secret: str, tenant: str, user: str) -> str:
    mac = hmac.new(secret.encode(), f"user\x00{tenant}\x00{user}".encode(), hashlib.sha256)
    return "u-" + mac.hexdigest()[:32]


def client_salt(secret: str, tenant: str, salt: str) -> str:
    return hmac.new(secret.encode(), f"client\x00{tenant}\x00{salt}".encode(),
                    hashlib.sha256).hexdigest()


def old_sessions(kv: Path, sessions: list[str]) -> dict[str, list[int]]:
    """What vLLM's connector left for ``sessions`` of acme under the old secret's salts (and
    for gamma's own cache_salt "mine")."""
    store = KVStore(StoreConfig(disk_path=str(kv), memory_bytes=0), registry=CollectorRegistry())
    try:
        out = {s: converse(store, derive_salt(OLD.encode(), "acme", s), 3 * BS + 7)
               for s in sessions}
        out["mine"] = converse(store, client_salt(OLD, "gamma", "mine"), 2 * BS)
        return out
    finally:
        store.close()


def serve(tmp_path: Path, fake: FakeUpstream, until: datetime) -> tuple[ServerThread, ...]:
    up = ServerThread(fake.app).start()
    settings = make_settings(up.url, tmp_path / "mem", "tiktoken:cl100k_base",
                             secrets=[{"id": "v2", "value": NEW},
                                      {"id": "v1", "value": OLD, "until": until}],
                             windows={"store": {"disk_path": str(tmp_path / "kv")}})
    return up, ServerThread(create_app(settings)).start()


def moved_to(srv: ServerThread, tokens: list[int], session: str) -> bool:
    """Every block of the session is under its new salt, the blobs the old salt's were."""
    store = runtime(srv).salt_mover.engine.store
    got = session_blocks(store, tokens, derive_salt(NEW.encode(), "acme", session), 3)
    return all(t is not None and t.equal(block(i, rank))
               for rank, ts in enumerate(got) for i, t in enumerate(ts))


def test_a_sessions_kv_moves_to_its_new_salt_once_within_grace(tmp_path):
    alice = user_name(OLD, "acme", "alice@example.com")
    tokens = old_sessions(tmp_path / "kv", ["s1", "s4", "s5", alice])
    fake = FakeUpstream(model="tiny", max_model_len=4096)
    up, srv = serve(tmp_path, fake, datetime.now(UTC) + timedelta(days=7))
    try:
        assert chat(srv, "acme", "hello again").status_code == 200  # session s1
        assert fake.last()["cache_salt"] == derive_salt(NEW.encode(), "acme", "s1")
        assert moved_to(srv, tokens["s1"], "s1")
        assert metric_value(srv, MOVES, tenant="acme", outcome="moved") == 1
        assert chat(srv, "acme", "and again").status_code == 200  # remembered: not again
        assert chat(srv, "acme", "new here", session="s2").status_code == 200
        assert metric_value(srv, MOVES, tenant="acme", outcome="moved") == 1
        assert metric_value(srv, MOVES, tenant="acme", outcome="none") == 1
        # a session named after the user had the old version's name too
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEYS['acme']}"},
                       json={"model": "tiny", "user": "alice@example.com", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        store = runtime(srv).salt_mover.engine.store
        a_new = user_name(NEW, "acme", "alice@example.com")  # its salt is per user now:
        new_alice = hmac.new(NEW.encode(), f"kv-user\x00acme\x00{a_new}\x00{a_new}".encode(),
                             hashlib.sha256).hexdigest()  # moved from the salt before that
        assert all(t is not None for ts in session_blocks(store, tokens[alice], new_alice, 3)
                   for t in ts)
        # concurrent first requests of one session wait for one move
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda i: chat(srv, "acme", f"q{i}", session="s4")
                                  .status_code, range(4)))
        assert codes == [200] * 4 and moved_to(srv, tokens["s4"], "s4")
        assert metric_value(srv, MOVES, tenant="acme", outcome="moved") == 3
        # /v1/completions carries the salt too
        r = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEYS['acme']}",
                                "X-Session-Id": "s5"},
                       json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and moved_to(srv, tokens["s5"], "s5")
        # a tenant's own cache_salt: the salt forwarded for it under the old secret
        r = chat(srv, "gamma", "mine", cache_salt="mine")
        assert r.status_code == 200 and fake.last()["cache_salt"] == client_salt(NEW, "gamma",
                                                                                 "mine")
        assert all(t is not None for ts in session_blocks(
            store, tokens["mine"], client_salt(NEW, "gamma", "mine"), 2) for t in ts)
        assert metric_value(srv, MOVES, tenant="gamma", outcome="moved") == 1
    finally:
        srv.stop()
        up.stop()


def test_past_its_grace_an_old_salt_is_not_looked_up(tmp_path):
    tokens = old_sessions(tmp_path / "kv", ["s1"])
    fake = FakeUpstream(model="tiny", max_model_len=4096)
    up, srv = serve(tmp_path, fake, datetime.now(UTC) - timedelta(hours=1))
    try:
        assert chat(srv, "acme", "hello").status_code == 200
        assert not moved_to(srv, tokens["s1"], "s1")
        assert metric_value(srv, MOVES) == 0
    finally:
        srv.stop()
        up.stop()


def test_the_move_runs_on_the_window_threads(tmp_path, monkeypatch):
    """Not on asyncio's default executor, which every tenant's chat planning shares."""
    tokens = old_sessions(tmp_path / "kv", ["s1"])
    fake = FakeUpstream(model="tiny", max_model_len=4096)
    up, srv = serve(tmp_path, fake, datetime.now(UTC) + timedelta(days=1))
    try:
        engine, threads = runtime(srv).salt_mover.engine, []
        real = engine.move_session

        def move(*a):
            threads.append(threading.current_thread().name)
            return real(*a)
        monkeypatch.setattr(engine, "move_session", move)
        assert chat(srv, "acme", "hello").status_code == 200
        assert moved_to(srv, tokens["s1"], "s1")
        assert threads and all(t.startswith("cwm-windows") for t in threads), threads
    finally:
        srv.stop()
        up.stop()


def test_a_forgotten_session_is_not_moved_twice(tmp_path, monkeypatch):
    """Nothing remembered (as after a restart): the new salt's context record says it moved."""
    from cwm_plugin.sidecar.identity import salt_move

    monkeypatch.setattr(salt_move, "REMEMBER", 0)
    tokens = old_sessions(tmp_path / "kv", ["s1"])
    fake = FakeUpstream(model="tiny", max_model_len=4096)
    up, srv = serve(tmp_path, fake, datetime.now(UTC) + timedelta(days=1))
    try:
        assert chat(srv, "acme", "hello").status_code == 200
        assert chat(srv, "acme", "hello again").status_code == 200
        assert moved_to(srv, tokens["s1"], "s1")
        assert metric_value(srv, MOVES, tenant="acme", outcome="moved") == 1
        assert metric_value(srv, MOVES, tenant="acme", outcome="none") == 1
    finally:
        srv.stop()
        up.stop()


def test_a_store_that_fails_the_move_never_fails_the_request(tmp_path, caplog, monkeypatch):
    """The store fails under the move (its primary tier unreachable, as a Redis outage
    raises it): the request is answered (its prefix computed again), the failure counted,
    and warned about once."""
    from cwm_plugin.errors import TierUnavailable

    old_sessions(tmp_path / "kv", ["s1", "s2"])
    fake = FakeUpstream(model="tiny", max_model_len=4096)
    up, srv = serve(tmp_path, fake, datetime.now(UTC) + timedelta(days=1))
    try:
        def down(*_a, **_k):
            raise TierUnavailable("redis at redis://127.0.0.1:1/0 is unreachable")
        monkeypatch.setattr(runtime(srv).salt_mover.engine, "move_session", down)
        with caplog.at_level("WARNING", logger="cwm_plugin.sidecar.identity.salt_move"):
            assert chat(srv, "acme", "hello").status_code == 200
            assert chat(srv, "acme", "hello", session="s2").status_code == 200
        assert fake.last()["cache_salt"] == derive_salt(NEW.encode(), "acme", "s2")
        assert metric_value(srv, MOVES, tenant="acme", outcome="failed") == 2
        assert sum("could not move" in r.getMessage() for r in caplog.records) == 1
    finally:
        srv.stop()
        up.stop()


def test_a_move_that_failed_is_tried_again_by_the_sessions_next_request(tmp_path, monkeypatch):
    """A move refused (the tenant's window threads busy, a store down) is not remembered as
    done: the session's next request moves its KV."""
    from cwm_plugin.sidecar.identity.ratelimit import RateLimited

    tokens = old_sessions(tmp_path / "kv", ["s1"])
    fake = FakeUpstream(model="tiny", max_model_len=4096)
    up, srv = serve(tmp_path, fake, datetime.now(UTC) + timedelta(days=1))
    try:
        engine = runtime(srv).salt_mover.engine
        real, calls = engine.move_session, []

        def busy_once(*a):
            calls.append(a)
            if len(calls) == 1:
                raise RateLimited("window operations of tenant acme: 2 running, 8 waiting",
                                  retry_after=1)
            return real(*a)
        monkeypatch.setattr(engine, "move_session", busy_once)
        assert chat(srv, "acme", "hello").status_code == 200
        assert not moved_to(srv, tokens["s1"], "s1")
        assert chat(srv, "acme", "hello again").status_code == 200
        assert moved_to(srv, tokens["s1"], "s1")
        assert metric_value(srv, MOVES, tenant="acme", outcome="failed") == 1
        assert metric_value(srv, MOVES, tenant="acme", outcome="moved") == 1
    finally:
        srv.stop()
        up.stop()


def test_a_users_windows_move_to_its_newest_name_within_grace(tmp_path):
    """A user's windows belong to its name under the newest secret: after a rotation the
    user's first request -- a windows route, or only a chat turn -- moves them there, so the
    user lists and thaws them as before, and its tenant still counts them."""
    from cwm_plugin.windows.engine import WindowEngine

    def owner(secret: str, user: str) -> str:
        return "acme/" + user_name(secret, "acme", user)

    old_sessions(tmp_path / "kv", ["s1"])
    store = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0),
                    registry=CollectorRegistry())
    try:   # frozen while the old secret was the newest
        eng = WindowEngine(store, wait_s=0)
        old_salt = derive_salt(OLD.encode(), "acme", "s1")
        eng.freeze(owner(OLD, "alice@example.com"), "plan", session="s1", salt=old_salt)
        eng.freeze(owner(OLD, "bob@example.com"), "notes", session="s1", salt=old_salt)
        eng.freeze("acme", "shared", session="s1", salt=old_salt)
    finally:
        store.close()
    fake = FakeUpstream(model="tiny", max_model_len=4096)
    up, srv = serve(tmp_path, fake, datetime.now(UTC) + timedelta(days=7))
    try:
        alice = {"Authorization": f"Bearer {KEYS['acme']}", "X-CWM-User": "alice@example.com"}
        r = httpx.get(f"{srv.url}/v1/windows", headers=alice, timeout=60)
        assert [w["name"] for w in r.json()["data"]] == ["plan"], r.text
        r = httpx.post(f"{srv.url}/v1/windows/plan/thaw", headers=alice, timeout=60,
                       json={"session": "s9"})
        assert r.status_code == 200 and r.json()["restorable_tokens"] == 3 * BS
        assert chat(srv, "acme", "hi", headers={"X-CWM-User": "bob@example.com"}).status_code \
            == 200
        eng = runtime(srv).windows
        assert [m.name for m in eng.list(owner(NEW, "bob@example.com"))[0]] == ["notes"]
        assert eng.list(owner(OLD, "alice@example.com")) == ([], 0)
        assert [m.name for m in eng.list("acme")[0]] == ["shared"]   # the tenant's stay
        assert len(eng.manifests("acme", whole_tenant=True)) == 3
    finally:
        srv.stop()
        up.stop()
