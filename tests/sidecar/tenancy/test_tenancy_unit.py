"""Least privilege between tenants and users, over real HTTP: namespace listings show the
caller's own, unknown and forbidden namespaces answer alike, a request naming neither session
nor user gets no memory of other conversations (unless its tenant turns that on), users of
one tenant never share KV (unless the tenant shares it on purpose), and a stream the client
drops is billed and recorded up to what was relayed. The upstream is
``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sidecar_helpers import KEYS, drop_stream, make_settings, runtime, salt, wait_idle

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.identity.authenticator import hash_key
from cwm_plugin.sidecar.upstream.stream import CUT_MARK
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def fake() -> FakeUpstream:
    return FakeUpstream(model="tiny", max_model_len=4096)


@pytest.fixture(scope="module")
def up(fake) -> Iterator[ServerThread]:
    with ServerThread(fake.app) as srv:
        yield srv


def serve(up: ServerThread, root: Path, **over: Any) -> ServerThread:
    return ServerThread(create_app(make_settings(up.url, root, "tiktoken:cl100k_base",
                                                 **over))).start()


def h(tenant: str, user: str | None = None, session: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}",
            **({"X-CWM-User": user} if user else {}),
            **({"X-Session-Id": session} if session else {})}


def ask(srv: ServerThread, headers: dict[str, str], text: str, **body: Any) -> httpx.Response:
    r = httpx.post(f"{srv.url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": text}],
        **body})
    assert r.status_code == 200, r.text
    return r


def test_namespace_listings_show_only_the_callers_own(up, tmp_path):
    with ServerThread(create_app(make_settings(up.url, tmp_path, "tiktoken:cl100k_base"))) \
            as srv:
        for user in (None, "alice"):
            r = httpx.get(f"{srv.url}/v1/memory/namespaces", headers=h("beta", user),
                          timeout=30)
            names = {row["namespace"] for row in r.json()["data"]}
            assert names == {"beta", "global", "activity"} | ({"beta/user"} if user else set())


CALLS = [("GET", "/v1/memory/facts", None), ("GET", "/v1/memory/search", {"q": "x"}),
         ("GET", "/v1/memory/view", None),
         ("POST", "/v1/memory/facts", {"text": "planted"}),
         ("POST", "/v1/memory/turns", {"session": "s1", "role": "user", "content": "planted"})]


def test_unknown_and_forbidden_namespaces_answer_alike(up, tmp_path):
    with ServerThread(create_app(make_settings(  # 40 calls in a burst: the rate is not the point
            up.url, tmp_path, "tiktoken:cl100k_base", rate_limits={"rate_limit": "none"}))) \
            as srv:
        def call(method: str, path: str, extra: dict | None, ns: str, user: str | None):
            if method == "GET":
                return httpx.get(f"{srv.url}{path}", headers=h("beta", user), timeout=30,
                                 params={"namespace": ns, **(extra or {})})
            return httpx.post(f"{srv.url}{path}", headers=h("beta", user), timeout=30,
                              json={"namespace": ns, **(extra or {})})

        for method, path, extra in CALLS:
            for user in (None, "mallory"):
                for real, fiction in (("acme", "nobody"), ("acme/user", "nobody/user")):
                    a = call(method, path, extra, real, user)
                    b = call(method, path, extra, fiction, user)
                    assert (a.status_code, b.status_code) == (404, 404), (path, a.text, b.text)
                    assert a.text.replace(real, "N") == b.text.replace(fiction, "N"), path
        assert not (tmp_path / "acme").exists()  # nothing was written for acme


def test_a_request_naming_neither_session_nor_user_gets_no_other_conversations_memory(
        up, fake, tmp_path):
    tenants = [{"name": "acme", "key_sha256": [hash_key(KEYS["acme"])]},
               {"name": "beta", "key_sha256": [hash_key(KEYS["beta"])],
                "stateless_memory": True},
               {"name": "gamma", "key_sha256": [hash_key(KEYS["gamma"])]}]
    srv = serve(up, tmp_path, tenants=tenants)
    try:
        for tenant in ("acme", "beta"):
            ask(srv, h(tenant, session="s1"), "My locker code is ZX-4417.")
            r = httpx.post(f"{srv.url}/v1/memory/facts", headers=h(tenant), timeout=30,
                           json={"text": "The locker code is ZX-4417."})
            assert r.status_code == 201
        wait_idle(srv)
        ask(srv, h("acme"), "What is my locker code?")  # anyone behind acme's key
        assert "ZX-4417" not in json.dumps(fake.last()["messages"])
        ask(srv, h("beta"), "What is my locker code?")  # beta shares on purpose
        assert "ZX-4417" in json.dumps(fake.last()["messages"])
        ask(srv, h("acme", session="s2"), "What is my locker code?")  # a session reads it
        assert "ZX-4417" in json.dumps(fake.last()["messages"])
    finally:
        srv.stop()


def test_users_of_one_tenant_never_share_kv_unless_it_says_so(up, fake, tmp_path):
    tenants = [{"name": "acme", "key_sha256": [hash_key(KEYS["acme"])]},
               {"name": "beta", "key_sha256": [hash_key(KEYS["beta"])],
                "users_share_kv": True},
               {"name": "gamma", "key_sha256": [hash_key(KEYS["gamma"])]}]
    srv = serve(up, tmp_path, tenants=tenants, memory_enabled=False)
    try:
        got = {}
        for tenant in ("acme", "beta"):
            for user in ("alice", "bob", None):
                ask(srv, h(tenant, user, "team"), "hi")
                chat_salt = fake.last()["cache_salt"]
                r = httpx.post(f"{srv.url}/v1/completions", headers=h(tenant, user, "team"),
                               timeout=30, json={"model": "tiny", "prompt": "hi"})
                assert r.status_code == 200
                assert fake.last("/v1/completions")["cache_salt"] == chat_salt
                got[tenant, user] = chat_salt
        assert got["acme", "alice"] == salt("acme", "team", "alice")
        assert got["acme", "bob"] == salt("acme", "team", "bob")
        assert len({got["acme", u] for u in ("alice", "bob", None)}) == 3
        assert got["beta", "alice"] == got["beta", "bob"] == got["beta", None] == \
            salt("beta", "team")
    finally:
        srv.stop()


def test_a_stream_the_client_drops_is_billed_and_recorded_as_cut(tmp_path):
    words = " ".join(f"w{i}" for i in range(40))
    slow = FakeUpstream(model="tiny", max_model_len=4096, script=lambda b: {"content": words})
    slow.stream_delay = 0.1
    with ServerThread(slow.app) as up2:
        srv = serve(up2, tmp_path)
        try:
            body = {"model": "tiny", "stream": True, "max_tokens": 64,
                    "messages": [{"role": "user", "content": "Count for me, please."}]}
            drop_stream(srv, "/v1/chat/completions", body, h("acme", session="cut"), 5)
            wait_idle(srv)
            usage = httpx.get(f"{srv.url}/v1/usage", headers=h("acme"), timeout=30).json()
            total = usage["total"]
            assert total["requests"] == 1 and 5 <= total["completion_tokens"] < 40
            assert total["prompt_tokens"] > 0
            turns = runtime(srv).memory.service.transcript("acme", "cut")
            assert [t["role"] for t in turns] == ["user", "assistant"]
            answer = turns[1]["content"]
            assert answer.startswith("w0 w1 w2 w3") and answer.endswith(CUT_MARK)
            assert "w39" not in answer
        finally:
            srv.stop()
