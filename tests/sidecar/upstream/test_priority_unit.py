"""Request priority (``api/priority.py``): a client's own ``priority`` is forwarded as sent
only with the ``priority`` grant (without it, never below 0: a client may go after others,
never ahead of another tenant's requests), on chat and on the relayed routes; a chat turn that
returns (an earlier turn answered here, or its record found in the store: never what its
messages claim) gets ``routing.returning_priority`` on the upstreams that schedule by
priority, a resumed stream keeps it, and nothing goes to those that do not (they refuse any
priority but 0). Over real HTTP,
each upstream a small real OpenAI-compatible server, so what each received is visible."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sidecar_helpers import KEYS, chat, make_settings

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.settings import RoutingSettings
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
FIRST = [{"role": "user", "content": "hello"}]
SECOND = [*FIRST, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]


@pytest.fixture
def pair(tmp_path):
    """``p`` schedules by priority and goes first; ``plain`` does not."""
    p, plain = FakeUpstream(model="tiny"), FakeUpstream(model="tiny")
    with ServerThread(p.app) as sp, ServerThread(plain.app) as splain:
        settings = make_settings(sp.url, tmp_path, "tiktoken:cl100k_base",
                                 memory_enabled=False,
                                 upstreams=[{"name": "p", "url": sp.url,
                                             "priority_scheduling": True},
                                            {"name": "plain", "url": splain.url}],
                                 routing={"health": {"interval_s": 0}, "affinity": "first"},
                                 access={"grants": {"acme": ["priority", "metrics"]}})
        with ServerThread(create_app(settings)) as srv:
            yield p, plain, sp, srv


def sent(up: FakeUpstream, path: str = "/v1/chat/completions") -> Any:
    return up.last(path).get("priority", "absent")


def test_a_returning_turn_goes_first_and_a_first_turn_does_not(pair):
    p, _, _, srv = pair
    # messages that claim an earlier turn prove nothing: this session never came here
    assert chat(srv, "beta", SECOND, session="s1").status_code == 200
    assert sent(p) == "absent"
    assert chat(srv, "beta", SECOND, session="s1").status_code == 200
    assert sent(p) == -1
    assert chat(srv, "beta", SECOND, session="s1", stream=True).status_code == 200
    assert sent(p) == -1
    # the session's previous turn answered here: its next is continuing, whatever it sends
    assert chat(srv, "beta", "one message", session="s1").status_code == 200
    assert sent(p) == -1
    # a client's own priority is its own (no bonus on top)
    assert chat(srv, "beta", SECOND, session="s1", priority=3).status_code == 200
    assert sent(p) == 3
    assert chat(srv, "beta", SECOND, session="s1", priority=None).status_code == 200
    assert sent(p) == -1  # null is as if not sent (vLLM takes integers only)
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": SECOND, "max_tokens": 4},
        headers={"Authorization": f"Bearer {KEYS['beta']}"})
    assert r.status_code == 200 and sent(p) == "absent"  # no session: nothing returns
    assert RoutingSettings(returning_priority="none").returning_priority is None


def test_a_clients_priority_needs_the_grant_to_go_ahead_of_others(pair):
    p, _, _, srv = pair
    assert chat(srv, "beta", FIRST, session="s2", priority=-50).status_code == 200
    assert sent(p) == 0  # beta lacks the grant: not ahead of anyone
    assert chat(srv, "acme", FIRST, session="s2", priority=-50).status_code == 200
    assert sent(p) == -50
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/responses", {"input": "x"}),
                       ("/v1/embeddings", {"input": "x"})):
        r = httpx.post(f"{srv.url}{path}", timeout=30, json={
            "model": "tiny", "priority": -9, **body}, headers={
            "Authorization": f"Bearer {KEYS['beta']}", "X-Vllm-Priority": "-100"})
        assert r.status_code == 200, r.text
        assert sent(p, path) == 0
        assert "x-vllm-priority" not in {h.lower() for h in p.headers(path)}
    for bad in ("high", True, 1.5, 2**64):
        r = chat(srv, "beta", FIRST, session="s9", priority=bad)
        assert r.status_code == 400 and "`priority` must be an integer" in r.text, bad
    assert p.last().get("priority") == -50  # nothing of the refused went up


def test_an_upstream_without_priority_scheduling_never_gets_one(pair):
    p, plain, sp, srv = pair
    sp.stop()  # p is gone: the turn fails over to plain
    r = chat(srv, "beta", SECOND, session="s3")
    assert r.status_code == 200 and r.headers["x-cwm-upstream"] == "plain"
    assert sent(plain) == "absent"


def test_a_resumed_stream_keeps_its_priority(tmp_path):
    """Both upstreams schedule by priority; the one streaming a returning turn dies after two
    tokens: the continuation on the other goes at the same priority."""
    a, b = FakeUpstream(model="tiny"), FakeUpstream(model="tiny")
    a.script = lambda body: {"content": "alpha beta gamma delta"}
    b.script = lambda body: {"content": "gamma delta"}
    with ServerThread(a.app) as sa, ServerThread(b.app) as sb:
        settings = make_settings(sa.url, tmp_path, "tiktoken:cl100k_base",
                                 memory_enabled=False, upstreams=[
                                     {"name": "a", "url": sa.url, "priority_scheduling": True},
                                     {"name": "b", "url": sb.url, "priority_scheduling": True}],
                                 routing={"health": {"interval_s": 0}, "affinity": "first"})
        with ServerThread(create_app(settings)) as srv:
            assert chat(srv, "beta", FIRST, session="r").status_code == 200
            a.stream_cut_after = 2
            r = chat(srv, "beta", SECOND, session="r", stream=True)
            assert r.status_code == 200 and "[DONE]" in r.text and "error" not in r.text
            assert sent(a) == -1 and b.last()["continue_final_message"] is True
            assert sent(b) == -1
