"""Who a key acts for, over real HTTP: a key bound to one user (``user_keys``) acts for that
user on every route and for no other, a principal with ``users: none`` refuses a named user
with what to configure, and ``users: any`` (the default) acts for the user a request names.
The upstream is ``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sidecar_helpers import KEYS, make_settings, salt

from cwm_plugin.errors import ConfigError
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.identity.authenticator import hash_key
from cwm_plugin.sidecar.settings import load_settings
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
USER_KEYS = {"alice": "key-acme-alice", "bob": "key-acme-bob"}


@pytest.fixture(scope="module")
def fake(fake_upstream) -> FakeUpstream:
    return fake_upstream[0]


@pytest.fixture
def srv(fake_upstream, tmp_path: Path) -> Iterator[ServerThread]:
    tenants = [
        {"name": "acme", "key_sha256": [hash_key(KEYS["acme"])],
         "user_keys": [{"user": u, "key_sha256": [hash_key(k)]} for u, k in USER_KEYS.items()]},
        {"name": "beta", "key_sha256": [hash_key(KEYS["beta"])], "users": "none"},
        {"name": "gamma", "key_sha256": [hash_key(KEYS["gamma"])]},
    ]
    settings = make_settings(fake_upstream[1].url, tmp_path / "memory", "tiktoken:cl100k_base",
                             tenants=tenants, activity={"root": str(tmp_path / "activity")})
    with ServerThread(create_app(settings)) as server:
        yield server


def h(key: str, user: str | None = None, session: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **({"X-CWM-User": user} if user else {}),
            **({"X-Session-Id": session} if session else {})}


def call(srv: ServerThread, method: str, path: str, headers: dict[str, str],
         body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(method, f"{srv.url}{path}", headers=headers, json=body, timeout=60)


CHAT = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
ROUTES = [("POST", "/v1/chat/completions", CHAT),
          ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4}),
          ("GET", "/v1/memory/facts", None),
          ("POST", "/v1/memory/facts", {"text": "a fact"}),
          ("GET", "/v1/sessions", None),
          ("GET", "/v1/activity", None), ("POST", "/v1/activity", {"what": "x"}),
          ("GET", "/v1/usage", None)]


def test_a_user_key_acts_for_its_own_user_on_every_route_and_for_no_other(srv, fake):
    alice, bob = USER_KEYS["alice"], USER_KEYS["bob"]
    # alice's key naming no user acts for alice: her memory, her salt, her activity
    r = call(srv, "POST", "/v1/memory/facts", h(alice), {"text": "Alice's locker is 17."})
    assert r.status_code == 201, r.text
    assert call(srv, "POST", "/v1/chat/completions", h(alice, session="s1"),
                CHAT).status_code == 200
    assert fake.last()["cache_salt"] == salt("acme", "s1", "alice")
    entry = call(srv, "POST", "/v1/activity", h(alice), {"what": "alice acted"}).json()
    assert entry["principal"].startswith("acme/u-")
    # the same user as acme's own key naming her (users: any, the default)
    facts = call(srv, "GET", "/v1/memory/facts", h(KEYS["acme"], "alice")).json()["data"]
    assert [f["text"] for f in facts] == ["Alice's locker is 17."]
    assert call(srv, "GET", "/v1/sessions", h(KEYS["acme"], "alice")).json()["data"] == \
        [{"session": "s1", "windows": 0}]
    # bob's key: never alice's memory; naming her is refused on every route, nothing done
    assert call(srv, "GET", "/v1/memory/facts", h(bob)).json()["data"] == []
    asks = [(method, path, h(bob, "alice", "s1"), body) for method, path, body in ROUTES] + \
        [(method, path, h(bob, session="s1"), {**body, "user": "alice"})  # OpenAI's field
         for method, path, body in ROUTES[:2]]
    sent = (len(fake.bodies()), len(fake.bodies("/v1/completions")))
    for method, path, headers, body in asks:
        r = call(srv, method, path, headers, body)
        assert r.status_code == 403, (method, path, r.text)
        err = r.json()["error"]
        assert err["code"] == "permission_denied" and "alice" not in r.text
        assert "acts for its own user only" in err["message"]
    assert (len(fake.bodies()), len(fake.bodies("/v1/completions"))) == sent
    # naming its own user is fine
    assert call(srv, "POST", "/v1/chat/completions", h(bob, "bob"), CHAT).status_code == 200
    assert call(srv, "GET", "/v1/memory/facts", h(KEYS["acme"], "alice")).json()["data"] == \
        facts  # nothing bob's key sent reached alice's namespace


def test_users_none_refuses_a_named_user_and_says_what_to_configure(srv):
    for method, path, body in ROUTES:
        r = call(srv, method, path, h(KEYS["beta"], "carol", "s1"), body)
        assert r.status_code == 403, (method, path, r.text)
        err = r.json()["error"]
        assert err["code"] == "permission_denied" and "carol" not in r.text
        assert "act for no user (users: none)" in err["message"]
        assert "`users: any` on `beta`" in err["message"] and "user_keys" in err["message"]
    assert call(srv, "POST", "/v1/chat/completions", h(KEYS["beta"], session="s1"),
                {**CHAT, "user": "carol"}).status_code == 403
    assert call(srv, "POST", "/v1/chat/completions", h(KEYS["beta"], session="s1"),
                CHAT).status_code == 200
    # the default, users: any: the key acts for the user a request names
    r = call(srv, "POST", "/v1/activity", h(KEYS["gamma"], "carol"), {"what": "x"})
    assert r.status_code == 201 and r.json()["principal"].startswith("gamma/u-")


def test_a_key_listed_twice_or_a_bad_user_key_is_a_config_error(tmp_path):
    cfg = tmp_path / "sidecar.yaml"
    base = "secret: 0123456789abcdef0123\ntenants:\n"
    a, b = "a" * 64, "b" * 64
    for tenants, said in [
        (f"  - {{name: t, key_sha256: ['{a}'], user_keys: [{{user: u, key_sha256: ['{a}']}}]}}",
         f"the key with sha256 {a[:12]}... is listed twice"),
        (f"  - {{name: t, key_sha256: ['{a}']}}\n  - {{name: s, key_sha256: ['{a}']}}",
         "is listed twice: a key belongs to one principal and at most one of its users"),
        (f"  - {{name: t, key_sha256: ['{a}'], user_keys: [{{user: u, key_sha256: [x]}}]}}",
         "key_sha256 entries must be 64 hex digits"),
        (f"  - {{name: t, key_sha256: ['{a}'], user_keys: [{{user: '', key_sha256: ['{b}']}}]}}",
         "user_keys.0.user"),
        (f"  - {{name: t, key_sha256: ['{a}'], users: some}}", "users"),
    ]:
        cfg.write_text(base + tenants + "\n")
        with pytest.raises(ConfigError) as exc:
            load_settings(cfg)
        assert said in str(exc.value), str(exc.value)


def test_a_user_key_writes_only_its_users_data_and_holds_none_of_the_principals_grants(
        srv, fake):
    alice, tenant = USER_KEYS["alice"], KEYS["acme"]
    fact = {"namespace": "acme", "text": "The office opens at 9."}
    assert call(srv, "POST", "/v1/memory/facts", h(tenant), fact).status_code == 201
    # the principal's own namespace (every user's selection reads it): RO for a user key
    for method, path, body in [
            ("POST", "/v1/memory/facts", {**fact, "text": "The office is closed."}),
            ("POST", "/v1/memory/turns", {"namespace": "acme", "session": "s1",
                                          "role": "user", "content": "x"})]:
        r = call(srv, method, path, h(alice), body)
        assert r.status_code == 403, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "permission_denied"
        assert "a user key of principal `acme` has RO on namespace `acme`" in err["message"]
        assert "key_sha256" in err["message"]
    facts = call(srv, "GET", "/v1/memory/facts?namespace=acme", h(alice)).json()["data"]
    assert [f["text"] for f in facts] == ["The office opens at 9."]
    rows = call(srv, "GET", "/v1/memory/namespaces", h(alice)).json()["data"]
    assert {r["namespace"]: r["access"] for r in rows}["acme"] == "RO"
    # a tenant key acting for alice keeps the principal's access
    assert call(srv, "POST", "/v1/memory/facts", h(tenant, "alice"),
                {**fact, "text": "Doors close at 6."}).status_code == 201
    # acme's grants (debug, metrics, admin) are the principal's, not its users' keys'
    sent = len(fake.bodies())
    for method, path, headers, body in [
            ("POST", "/v1/chat/completions", {**h(alice), "X-CWM-Debug": "1"}, CHAT),
            ("GET", "/metrics", h(alice), None), ("GET", "/v1/cache/stats", h(alice), None),
            ("POST", "/v1/auto_freeze", h(alice), {"enabled": False})]:
        r = call(srv, method, path, headers, body)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "permission_denied"
        assert "a user key of principal `acme` holds none of the principal's grants" in \
            r.json()["error"]["message"]
    assert len(fake.bodies()) == sent
    assert "upstreams" not in call(srv, "GET", "/health", h(alice)).json()
    assert "upstreams" in call(srv, "GET", "/health", h(tenant)).json()
    assert call(srv, "GET", "/metrics", h(tenant)).status_code == 200


def test_user_keys_access_none_hides_the_principals_namespace_and_chain(fake_upstream,
                                                                        tmp_path):
    tenants = [{"name": "acme", "key_sha256": [hash_key(KEYS["acme"])],
                "user_keys": [{"user": "alice", "key_sha256": [hash_key(USER_KEYS["alice"])]}],
                "user_keys_access": "none"}]
    settings = make_settings(fake_upstream[1].url, tmp_path / "memory", "tiktoken:cl100k_base",
                             tenants=tenants, activity={"root": str(tmp_path / "activity")},
                             access={"grants": {}})
    with ServerThread(create_app(settings)) as server:
        alice = USER_KEYS["alice"]
        assert call(server, "POST", "/v1/activity", h(KEYS["acme"]),
                    {"what": "tenant acted"}).status_code == 201
        r = call(server, "GET", "/v1/memory/facts?namespace=acme", h(alice))
        assert r.status_code == 404 and r.json()["error"]["code"] == "namespace_not_found"
        assert call(server, "POST", "/v1/activity", h(alice), {"what": "a"}).status_code == 201
        seen = call(server, "GET", "/v1/activity", h(alice)).json()
        assert [e["what"] for e in seen["data"]] == ["a"] and "acme" not in seen["heads"]
        # the tenant's key still reads every chain of its tenant
        seen = call(server, "GET", "/v1/activity", h(KEYS["acme"])).json()
        assert sorted(e["what"] for e in seen["data"]) == ["a", "tenant acted"]
