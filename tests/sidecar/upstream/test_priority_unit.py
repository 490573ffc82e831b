"""Request priority (``api/priority.py``): a client's own ``priority`` is forwarded as sent
only with the ``priority`` grant (without it, never below 0: a client may go after others,
never ahead of another tenant's requests), on chat and on the relayed routes; a chat turn that
continues a conversation gets ``routing.returning_priority`` on the upstreams that schedule by
priority, and nothing on those that do not (they refuse any priority but 0). Over real HTTP,
each upstream a small real OpenAI-compatible server, so what each received is visible."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sidecar_helpers import KEYS, chat, make_settings

from cwm_plugin.sidecar.app import create_app
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


def test_a_continuing_turn_goes_first_and_a_first_turn_does_not(pair):
    p, _, _, srv = pair
    assert chat(srv, "beta", FIRST, session="s1").status_code == 200
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


def test_a_clients_priority_needs_the_grant_to_go_ahead_of_others(pair):
    p, _, _, srv = pair
    assert chat(srv, "beta", FIRST, session="s2", priority=-50).status_code == 200
    assert sent(p) == 0  # beta lacks the grant: not ahead of anyone
    assert chat(srv, "acme", FIRST, session="s2", priority=-50).status_code == 200
    assert sent(p) == -50
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/responses", {"input": "x"})):
        r = httpx.post(f"{srv.url}{path}", timeout=30, json={
            "model": "tiny", "priority": -9, **body}, headers={
            "Authorization": f"Bearer {KEYS['beta']}", "X-Vllm-Priority": "-100"})
        assert r.status_code == 200, r.text
        assert sent(p, path) == 0
        assert "x-vllm-priority" not in {h.lower() for h in p.headers(path)}
    r = chat(srv, "beta", FIRST, priority="high")
    assert r.status_code == 400 and "`priority` must be an integer" in r.text


def test_an_upstream_without_priority_scheduling_never_gets_one(pair):
    p, plain, sp, srv = pair
    sp.stop()  # p is gone: the turn fails over to plain
    r = chat(srv, "beta", SECOND, session="s3")
    assert r.status_code == 200 and r.headers["x-cwm-upstream"] == "plain"
    assert sent(plain) == "absent"
