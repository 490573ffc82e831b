"""The session tracker is shared per tenant: a tenant opening session after session evicts its
own least recently used prompt states, never another tenant's within its share, and the total
stays bounded. Over real HTTP (the upstream is ``cwm_plugin.testing.fake_upstream``), and the
tracker on its own."""

from __future__ import annotations

import httpx
import pytest
from sidecar_helpers import KEYS, make_settings, runtime

from cwm_plugin.errors import ConfigError
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.settings import load_settings
from cwm_plugin.sidecar.turn.session import ContextTracker
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def up(fake_upstream) -> ServerThread:
    return fake_upstream[1]


def ask(srv: ServerThread, tenant: str, session: str, user: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}", "X-Session-Id": session,
               **({"X-CWM-User": user} if user else {})}
    r = httpx.post(f"{srv.url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


def test_one_tenants_sessions_never_evict_anothers_prompt_state(up, tmp_path):
    """Six states in all, three principals: each is sure of two. acme's two sessions (one
    its user's) outlive beta opening twenty; beta uses what gamma leaves free until gamma
    comes; acme's third session evicts acme's own least recently used."""
    settings = make_settings(up.url, tmp_path, "tiktoken:cl100k_base",
                             sessions={"max_tracked": 6})
    assert settings.session_share() == 2
    with ServerThread(create_app(settings)) as srv:
        tracker = runtime(srv).tracker
        ask(srv, "acme", "a1")
        ask(srv, "acme", "a2", user="alice")
        alice = "acme/" + runtime(srv).auth.user_folder("acme", "alice")  # her owner
        mine = {"a1": tracker.peek("acme", "a1"), "a2": tracker.peek(alice, "a2")}
        assert all(mine.values())
        for i in range(20):
            ask(srv, "beta", f"b{i}")
        assert tracker.peek("acme", "a1") is mine["a1"] and tracker.peek(alice, "a2") is \
            mine["a2"]
        assert (tracker.held("acme"), tracker.held("beta"), len(tracker)) == (2, 4, 6)
        assert tracker.sessions("beta") == ["b16", "b17", "b18", "b19"]  # its newest
        ask(srv, "gamma", "g1")
        ask(srv, "gamma", "g2")  # takes back its share from beta, not from acme
        assert (tracker.held("acme"), tracker.held("beta"), tracker.held("gamma")) == (2, 2, 2)
        ask(srv, "acme", "a1")  # used again: a2 is acme's least recently used now
        ask(srv, "acme", "a3")
        assert tracker.peek("acme", "a1") is mine["a1"] and tracker.peek(alice, "a2") is None
        assert tracker.sessions("beta") == ["b18", "b19"] and len(tracker) == 6


def test_the_tracker_keeps_each_share_and_the_total():
    t = ContextTracker(10, share=3)
    quiet = [t.get("quiet", f"q{i}") for i in range(3)]
    for i in range(1000):  # a tenant churning through sessions, users among them
        t.get("loud" if i % 2 else f"loud/u-{i % 7}", f"s{i}")
        assert len(t) <= 10
    assert [t.peek("quiet", f"q{i}") for i in range(3)] == quiet
    assert t.held("loud") == 7 and len(t) == 10
    # within its share a newcomer takes back what the loud tenant borrowed
    for i in range(3):
        t.get("late", f"l{i}")
    assert (t.held("loud"), t.held("late"), t.held("quiet")) == (4, 3, 3)


def test_a_share_the_total_cannot_hold_is_a_config_error(tmp_path):
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text("secret: 0123456789abcdef0123\n"
                   "tenants:\n"
                   f"  - {{name: a, key_sha256: ['{'0' * 64}']}}\n"
                   f"  - {{name: b, key_sha256: ['{'1' * 64}']}}\n"
                   "sessions: {max_tracked: 100, tenant_share: 60}\n")
    with pytest.raises(ConfigError) as exc:
        load_settings(cfg)
    assert "2 principals x tenant_share 60 is over max_tracked (100)" in str(exc.value)
    assert "raise sessions.max_tracked or lower sessions.tenant_share" in str(exc.value)
    cfg.write_text(cfg.read_text().replace("tenant_share: 60", "tenant_share: 50"))
    assert load_settings(cfg).session_share() == 50
