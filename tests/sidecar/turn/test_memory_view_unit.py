"""Multi-resolution memory: a chat request picks the quick view (durable facts and the session
summary, no transcript passages) or the full one (``X-CWM-Memory-View``, default from
``prompt.memory_view``) and is told how many tokens were injected (``X-CWM-Memory-Tokens``, the
debug header too); ``GET /v1/memory/view`` returns a namespace's memory at either resolution
with its token count, permission-checked, never writing a file. Over real HTTP in front of
``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sidecar_helpers import KEYS, chat, make_settings, runtime, wait_idle

from cwm_plugin.memory.tokens import make_counter
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
COUNTER = make_counter("tiktoken:cl100k_base")
CODE = "ZX-4417"
FACT = "The user drinks green tea every morning."
SUMMARY = "The user asked where their locker is; it is on floor three."
QUESTION = "What is the code of my locker?"


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeUpstream]:
    yield FakeUpstream(model="tiny", max_model_len=4096)


@pytest.fixture(scope="module")
def srv(fake, tmp_path_factory) -> Iterator[ServerThread]:
    root: Path = tmp_path_factory.mktemp("view")
    with ServerThread(fake.app) as up, \
            ServerThread(create_app(make_settings(up.url, root, "tiktoken:cl100k_base"))) as s:
        assert chat(s, "acme", f"My locker code is {CODE}, remember it.").status_code == 200
        r = httpx.post(f"{s.url}/v1/memory/facts", headers=auth("acme"), timeout=60,
                       json={"text": FACT, "category": "preference", "importance": 0.9})
        assert r.status_code == 201, r.text
        wait_idle(s)
        svc = runtime(s).memory.now
        svc.set_summary("acme", "s1", SUMMARY, upto_turn=svc.transcript("acme", "s1")[-1]["id"])
        yield s


def injected(fake: FakeUpstream) -> str:
    """The memory text the sidecar merged in (a system message of its own)."""
    first = fake.last()["messages"][0]
    return first["content"] if first["role"] == "system" else ""


def test_quick_injects_facts_and_the_summary_never_passages(srv, fake):
    r = chat(srv, "acme", QUESTION, session="s2", debug=True,
             headers={"X-CWM-Memory-View": "quick"})
    assert r.status_code == 200 and r.headers["X-CWM-Memory-View"] == "quick"
    text = injected(fake)
    assert FACT in text and CODE not in text
    tokens = int(r.headers["X-CWM-Memory-Tokens"])
    assert tokens == COUNTER.count(text) > 0
    debug = json.loads(r.headers["X-CWM-Memory"])
    assert debug["view"] == "quick" and debug["injected"] == tokens
    assert len(debug["hits"]) == debug["facts"] == 1  # the fact's hit, no conversation's
    # the session's own summary is the short form of its conversation
    r = chat(srv, "acme", QUESTION, session="s1", headers={"X-CWM-Memory-View": "quick"})
    assert r.status_code == 200 and SUMMARY in injected(fake) and CODE not in injected(fake)


def test_full_is_the_whole_selection_and_the_default(srv, fake):
    r = chat(srv, "acme", QUESTION, session="s3")
    assert r.status_code == 200 and r.headers["X-CWM-Memory-View"] == "full"
    text = injected(fake)
    assert CODE in text and FACT in text
    assert int(r.headers["X-CWM-Memory-Tokens"]) == COUNTER.count(text)
    r = chat(srv, "acme", QUESTION, session="s4", headers={"X-CWM-Memory-View": "full"})
    assert CODE in injected(fake)
    r = chat(srv, "acme", QUESTION, session="s5", headers={"X-CWM-Memory-View": "all"})
    assert r.status_code == 400 and "x-cwm-memory-view" in r.json()["error"]["message"]


def view(srv, tenant: str, **params) -> httpx.Response:
    return httpx.get(f"{srv.url}/v1/memory/view", headers=auth(tenant), params=params,
                     timeout=60)


def test_the_view_route_quick_full_counted_capped_and_permission_checked(srv):
    root = runtime(srv).settings.memory.root
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in Path(root).rglob("*")
              if p.is_file() and ".index" not in p.parts}
    quick = view(srv, "acme", view="quick").json()
    assert quick["object"] == "memory.view" and quick["namespace"] == "acme"
    assert FACT in quick["text"] and SUMMARY in quick["text"] and CODE not in quick["text"]
    assert quick["tokens"] == COUNTER.count(quick["text"]) and quick["facts"] == 1
    full = view(srv, "acme", view="full").json()
    assert CODE in full["text"] and SUMMARY in full["text"] and FACT in full["text"]
    assert full["tokens"] == COUNTER.count(full["text"]) > quick["tokens"]
    assert view(srv, "acme").json()["view"] == "full"  # prompt.memory_view
    by_model = view(srv, "acme", view="quick", model="tiny").json()
    assert by_model["counted_with"] == "tiny" and by_model["tokens"] == quick["tokens"]
    assert view(srv, "acme", model="no-such-model").status_code == 404
    capped = view(srv, "acme", view="full", max_tokens=quick["tokens"] // 2 + 1).json()
    assert capped["truncated"] and capped["tokens"] <= quick["tokens"] // 2 + 1
    assert view(srv, "acme", view="huge").status_code == 400
    # another tenant may not read acme's namespace, and its own holds nothing of acme's
    r = view(srv, "beta", view="full", namespace="acme")
    assert r.status_code == 404 and "namespace_not_found" in r.text  # as if there were none
    own = view(srv, "beta", view="full").json()
    assert CODE not in own["text"] and FACT not in own["text"]
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in before}
    assert after == before  # reading never writes
