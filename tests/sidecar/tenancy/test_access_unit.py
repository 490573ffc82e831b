"""The permission matrix over real HTTP: every principal x namespace x operation of one config
(generated, each allowed or a 403 naming the rule), retrieval that never returns what the
principal may not read (two users, two providers and a tenant), and the grants that guard debug
output, /metrics and /health's details. The upstream is ``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sidecar_helpers import make_settings, wait_idle

from cwm_plugin.errors import ConfigError
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.identity.authenticator import hash_key
from cwm_plugin.sidecar.settings import load_settings
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
KEYS = {"claude": "key-claude", "llama": "key-llama", "acme": "key-acme"}
ACCESS = {
    "global_owner": "claude",
    "rules": [{"principal": "llama", "namespace": "project:cwm", "access": "RW"},
              {"principal": "acme", "namespace": "project:*", "access": "APPEND"},
              {"namespace": "project:cwm", "access": "RO"}],
    "grants": {"claude": ["debug", "metrics", "admin"]},
}
# What the design's defaults and the rules above give, written out by hand (not computed by
# the code under test): own namespaces RW, providers RO on each other's, the tenant isolated,
# `global` RW for its owner, projects by rule, the activity log APPEND for all.
EXPECTED = {
    "claude": {"claude": "RW", "claude/user": "RW", "llama": "RO", "llama/user": "RO",
               "acme": "none", "acme/user": "none", "global": "RW", "project:cwm": "RO",
               "activity": "APPEND"},
    "llama": {"claude": "RO", "claude/user": "RO", "llama": "RW", "llama/user": "RW",
              "acme": "none", "acme/user": "none", "global": "RO", "project:cwm": "RW",
              "activity": "APPEND"},
    "acme": {"claude": "none", "claude/user": "none", "llama": "none", "llama/user": "none",
             "acme": "RW", "acme/user": "RW", "global": "RO", "project:cwm": "APPEND",
             "activity": "APPEND"},
}
ALLOWED = {"RW": {"read", "append", "write"}, "APPEND": {"read", "append"}, "RO": {"read"},
           "none": set()}
CASES = [(p, ns, op) for p in EXPECTED for ns in EXPECTED[p] for op in ("read", "append",
                                                                        "write")]


def auth(principal: str, user: str | None = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[principal]}",
            **({"X-CWM-User": user} if user is not None else {})}


def settings_for(upstream: str, root: Path, **over: Any):
    return make_settings(
        upstream, root / "memory", "tiktoken:cl100k_base",
        tenants=[{"name": "acme", "key_sha256": [hash_key(KEYS["acme"])]}],
        providers=over.pop("providers", [
            {"name": n, "key_sha256": [hash_key(KEYS[n])], "model": "tiny",
             "context_limit": 4096} for n in ("claude", "llama")]),
        access=over.pop("access", ACCESS), activity={"root": str(root / "activity")},
        # every principal, namespace and operation in a burst: the rate is not the point
        rate_limits={"rate_limit": "none"}, **over)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeUpstream]:
    yield FakeUpstream(model="tiny", max_model_len=4096)


@pytest.fixture(scope="module")
def srv(fake, tmp_path_factory) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("access")
    with ServerThread(fake.app) as up, \
            ServerThread(create_app(settings_for(up.url, root))) as sidecar:
        yield sidecar


def attempt(srv: ServerThread, principal: str, ns: str, op: str) -> httpx.Response:
    """The operation through the public API: the activity log's own routes, else memory's."""
    h, url = auth(principal), srv.url
    if ns == "activity":
        if op == "read":
            return httpx.get(f"{url}/v1/activity", headers=h, timeout=30)
        if op == "append":
            return httpx.post(f"{url}/v1/activity", headers=h, timeout=30,
                              json={"what": f"{principal} was here"})
        return httpx.put(f"{url}/v1/activity", headers=h, timeout=30, json={"what": "x"})
    if op == "read":
        return httpx.get(f"{url}/v1/memory/facts", params={"namespace": ns}, headers=h,
                         timeout=30)
    if op == "append":
        return httpx.post(f"{url}/v1/memory/turns", headers=h, timeout=30, json={
            "namespace": ns, "session": "s1", "role": "user", "content": f"{principal} said"})
    return httpx.post(f"{url}/v1/memory/facts", headers=h, timeout=30, json={
        "namespace": ns, "text": f"{principal} wrote into {ns}.", "category": "fact"})


@pytest.mark.parametrize(("principal", "ns", "op"), CASES,
                         ids=[f"{p}-{n}-{o}" for p, n, o in CASES])
def test_every_principal_namespace_and_operation(srv, principal, ns, op):
    access = EXPECTED[principal][ns]
    r = attempt(srv, principal, ns, op)
    if op in ALLOWED[access]:
        assert r.status_code in (200, 201), r.text
        return
    if ns == "activity" and op == "write":  # append-only whatever the matrix says
        assert r.status_code == 405, r.text
        return
    if access == "none":  # answered as if there were no such namespace (nothing tells)
        unknown = attempt(srv, principal, "nobody" + ns.removeprefix(ns.split("/")[0])
                          if not ns.startswith("project:") else "project:nothing-here", op)
        assert (r.status_code, unknown.status_code) == (404, 404), (r.text, unknown.text)
        assert r.json()["error"]["code"] == unknown.json()["error"]["code"] == \
            "namespace_not_found"
        assert r.json()["error"]["message"].replace(ns, "X") == \
            unknown.json()["error"]["message"].replace(unknown.request.url.params.get(
                "namespace") or json.loads(unknown.request.content)["namespace"], "X")
        return
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "permission_denied"
    assert err["message"].startswith(f"principal `{principal}` has {access} on namespace `{ns}`")
    need = {"read": "reads need RO, APPEND or RW", "append": "appends need APPEND or RW",
            "write": "writes need RW"}[op]
    assert need in err["message"] and ("default:" in err["message"]
                                              or "access.rules[" in err["message"])


def test_a_providers_model_and_context_limit_fill_its_activity_entries(srv):
    r = httpx.post(f"{srv.url}/v1/activity", headers=auth("llama", None), timeout=30,
                   json={"what": "refactored the parser", "used_tokens": 2048})
    assert r.status_code == 201, r.text
    e = r.json()
    assert (e["principal"], e["model"], e["limit_tokens"], e["percent"]) == \
        ("llama", "tiny", 4096, 50.0)


def test_namespaces_route_says_what_the_caller_may_do_and_why(srv):
    r = httpx.get(f"{srv.url}/v1/memory/namespaces", headers=auth("llama"), timeout=30)
    rows = {row["namespace"]: row for row in r.json()["data"]}
    assert {n: rows[n]["access"] for n in rows} == \
        {n: a for n, a in EXPECTED["llama"].items() if n in rows}
    assert rows["llama/user"]["home"] and not rows["llama"]["home"]
    assert rows["claude"]["rule"] == "default: a provider reads the other providers' namespaces"
    # no user: no user namespaces, and one named is a clear 400
    r = httpx.get(f"{srv.url}/v1/memory/facts", params={"namespace": "claude/user"},
                  headers=auth("claude", None), timeout=30)
    assert r.status_code == 400 and "names no user" in r.json()["error"]["message"]


MARKS = {("claude", "alice"): "TEAL-101", ("claude", "bob"): "RUST-202",
         ("llama", "alice"): "PLUM-303", ("claude", None): "GOLD-404",
         ("llama", None): "JADE-505", ("acme", None): "ONYX-606", ("acme", "alice"): "RUBY-707"}
SEES = {  # (principal, user) -> the marks its prompt may carry; every other mark never
    ("claude", "alice"): {"TEAL-101", "PLUM-303", "GOLD-404", "JADE-505", "SAGE-808"},
    ("claude", "bob"): {"RUST-202", "GOLD-404", "JADE-505", "SAGE-808"},
    ("llama", "alice"): {"PLUM-303", "TEAL-101", "GOLD-404", "JADE-505", "SAGE-808"},
    ("llama", "bob"): {"RUST-202", "GOLD-404", "JADE-505", "SAGE-808"},
    ("claude", None): {"GOLD-404", "JADE-505", "SAGE-808"},
    ("acme", "alice"): {"RUBY-707", "ONYX-606", "SAGE-808"},
    ("acme", None): {"ONYX-606", "SAGE-808"},
}


def ask(srv: ServerThread, fake: FakeUpstream, principal: str, user: str | None,
        text: str, session: str, **headers: str) -> str:
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                   headers={**auth(principal, user), "X-Session-Id": session, **headers},
                   json={"model": "tiny", "max_tokens": 4,
                         "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    return json.dumps(fake.last()["messages"])


def test_retrieval_returns_only_what_the_principal_and_user_may_read(fake, tmp_path):
    with ServerThread(fake.app) as up, \
            ServerThread(create_app(settings_for(up.url, tmp_path))) as srv:
        for (p, user), mark in MARKS.items():
            r = httpx.post(f"{srv.url}/v1/memory/facts", headers=auth(p, user), timeout=30,
                           json={"text": f"The codeword is {mark}.", "category": "fact"})
            assert r.status_code == 201, r.text
        r = httpx.post(f"{srv.url}/v1/memory/facts", headers=auth("claude", None), timeout=30,
                       json={"namespace": "global", "text": "The codeword is SAGE-808."})
        assert r.status_code == 201, r.text
        for (p, user), visible in SEES.items():
            sent = ask(srv, fake, p, user, "What is the codeword?", f"q-{p}-{user}")
            seen = {m for m in [*MARKS.values(), "SAGE-808"] if m in sent}
            assert seen == visible, (p, user)
        # transcripts: what alice told claude is in alice's namespace only
        ask(srv, fake, "claude", "alice", "My cat is called WHISKERS-999.", "chat-a")
        wait_idle(srv)
        assert "WHISKERS-999" in ask(srv, fake, "claude", "alice", "What is my cat called?",
                                     "chat-a2")
        for p, user in (("claude", "bob"), ("claude", None), ("acme", "alice")):
            assert "WHISKERS-999" not in ask(srv, fake, p, user, "What is my cat called?",
                                             f"chat-{p}-{user}")
        # a project's memories join a turn that names the project and may read it
        r = httpx.post(f"{srv.url}/v1/memory/facts", headers=auth("llama", None), timeout=30,
                       json={"namespace": "project:cwm", "text": "The codeword is MINT-909."})
        assert r.status_code == 201, r.text
        project = {"X-CWM-Project": "cwm"}
        assert "MINT-909" in ask(srv, fake, "claude", None, "What is the codeword?", "p1",
                                 **project)
        assert "MINT-909" not in ask(srv, fake, "claude", None, "What is the codeword?", "p2")
        assert "MINT-909" not in ask(srv, fake, "acme", None, "What is the codeword?", "p3",
                                     **{"X-CWM-Project": "other"})
        folders = {d.name for d in (tmp_path / "memory").iterdir() if not d.name.startswith(".")}
        assert {"claude", "llama", "acme", "global", "project.cwm"} <= folders
        users = [f for f in folders if f.startswith("u-")]
        assert len(users) == 5  # claude/alice, claude/bob, llama/alice, llama/bob, acme/alice
        # a principal that may only read its own namespace records nothing there
        ro = {**ACCESS, "rules": [{"principal": "llama", "namespace": "llama*",
                                    "access": "RO"}]}
        with ServerThread(create_app(settings_for(up.url, tmp_path, access=ro))) as srv2:
            before = sorted(p.name for p in (tmp_path / "memory").rglob("*.md"))
            ask(srv2, fake, "llama", "carol", "Remember ONLY-ONCE-1.", "ro")
            wait_idle(srv2)
            assert sorted(p.name for p in (tmp_path / "memory").rglob("*.md")) == before


def test_debug_metrics_and_health_need_their_grants(srv, fake, tmp_path):
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30,
                   headers={**auth("llama"), "X-CWM-Debug": "1"})
    assert r.status_code == 403
    assert r.json()["error"]["message"].startswith(
        "principal `llama` lacks the `debug` grant, which X-CWM-Debug: 1 needs")
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30,
                   headers={**auth("claude"), "X-CWM-Debug": "1"})
    assert r.status_code == 200 and "X-CWM-Memory" in r.headers
    # /health: a bare status to anyone without the admin grant (no tenant or upstream names)
    for headers in ({}, auth("llama"), {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{srv.url}/health", headers=headers, timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    details = httpx.get(f"{srv.url}/health", headers=auth("claude"), timeout=30).json()
    assert details["upstreams"][0]["name"] == "default"
    # /metrics: the metrics grant (metrics_public is off by default)
    assert httpx.get(f"{srv.url}/metrics", timeout=30).status_code == 401
    assert httpx.get(f"{srv.url}/metrics", headers=auth("llama"), timeout=30).status_code == 403
    r = httpx.get(f"{srv.url}/metrics", headers=auth("claude"), timeout=30)
    assert r.status_code == 200 and "cwm_sidecar_requests_total" in r.text
    public = {**ACCESS, "metrics_public": True}
    with ServerThread(fake.app) as up, \
            ServerThread(create_app(settings_for(up.url, tmp_path, access=public))) as open_:
        assert httpx.get(f"{open_.url}/metrics", timeout=30).status_code == 200


@pytest.mark.parametrize(("access", "says"), [
    ({"rules": [{"principal": "nobody", "namespace": "global", "access": "RO"}]},
     "principal 'nobody' is not a tenant or provider"),
    ({"grants": {"acme": ["root"]}}, "access.grants.acme.0"),
    ({"rules": [{"namespace": "global", "access": "READ"}]}, "access.rules.0.access"),
    ({"rules": [{"namespace": "a b", "access": "RO"}]}, "namespace pattern 'a b'"),
    ({"global_owner": "ghost"}, "principal 'ghost' is not a tenant or provider"),
])
def test_bad_access_config_is_a_clear_error(tmp_path, access, says):
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump({
        "tenants": [{"name": "acme", "key_sha256": [hash_key("k")]}], "access": access}))
    with pytest.raises(ConfigError) as exc:
        load_settings(path)
    assert says in str(exc.value)


def test_reserved_names_cannot_be_principals(tmp_path):
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump({"providers": [{"name": "global",
                                                   "key_sha256": [hash_key("k")]}]}))
    with pytest.raises(ConfigError, match="reserved"):
        load_settings(path)


def test_a_providers_own_context_limit_sets_its_warning_and_checkpoint(tmp_path):
    """The thresholds use the smaller of the provider's context_limit and the upstream's."""
    big = FakeUpstream(model="tiny", max_model_len=100_000)
    with ServerThread(big.app) as up, ServerThread(create_app(settings_for(
            up.url, tmp_path, providers=[
                {"name": "llama", "key_sha256": [hash_key(KEYS["llama"])], "context_limit": 400},
                {"name": "claude", "key_sha256": [hash_key(KEYS["claude"])]}]))) as srv:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 300}],
                "max_tokens": 8}
        warned = {}
        for who in ("llama", "acme"):
            r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30,
                           headers={**auth(who), "X-Session-Id": f"limit-{who}"})
            assert r.status_code == 200, r.text
            warned[who] = r.headers.get("X-CWM-Context-Warning")
        assert warned["llama"] and warned["acme"] is None, warned
