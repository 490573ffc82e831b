"""The cross-tenant matrix, over real HTTP: for every route and verb of the app, tenant B's key
(alone, and claiming user X's name) and user Y of tenant A try user X's objects -- memory,
facts, transcripts, windows, sessions and their KV (by guessed session id), usage, the
activity log. Nothing of X's is read (no secret of X's in any answer, nor in what reaches the
upstream), nothing of X's is written (X's files, windows, KV and entries are unchanged after),
and where an object is named, the answer for X's object and for one that does not exist are
the same. The upstream is ``cwm_plugin.testing.fake_upstream``; the KV store a real disk
store holding what the connector leaves (``window_helpers.py``)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry
from sidecar_helpers import KEYS, SECRET, make_settings, salt, wait_idle
from window_helpers import NS, converse, session_blocks

from cwm_plugin import pg_scope
from cwm_plugin.connector import records
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
X = {"Authorization": f"Bearer {KEYS['acme']}", "X-CWM-User": "xavier"}
ATTACKERS = {
    "beta": {"Authorization": f"Bearer {KEYS['beta']}"},
    "beta-as-xavier": {"Authorization": f"Bearer {KEYS['beta']}", "X-CWM-User": "xavier"},
    "acme-yvonne": {"Authorization": f"Bearer {KEYS['acme']}", "X-CWM-User": "yvonne"},
}
SECRETS = ["VAULT-1234", "PASS-5678", "TOKEN-X-42", "ACT-X-9"]
VICTIM_SALT = salt("acme", "vs", "xavier")
# what a route names, for X's object and for one that does not exist
NAMES = {"victim": {"session": "vs", "window": "plan", "ns": "acme/user", "tns": "acme"},
         "absent": {"session": "zz", "window": "nope", "ns": "nobody/user", "tns": "nobody"}}
Call = Callable[[str, dict[str, str], dict[str, str]], httpx.Response]
Compare = bool | str


def plan(url: str) -> dict[tuple[str, str], tuple[Call, Compare]]:
    """(method, route) -> (call(method, headers, names), compare the answers for X's object
    and an absent one: for every caller (True), for another tenant's ("tenant": a namespace
    name means the caller's own to a user of X's tenant), or not (False: nothing named))."""
    def req(path: str, **kw):
        def call(method: str, h: dict[str, str], n: dict[str, str]) -> httpx.Response:
            args = {k: (json.loads(json.dumps(v).replace("{S}", n["session"])
                                   .replace("{W}", n["window"]).replace("{NS}", n["ns"])
                                   .replace("{T}", n["tns"])) if k in ("json", "params")
                        else v) for k, v in kw.items()}
            hdrs = {**h, **({"X-Session-Id": n["session"]} if kw.pop("_session", False)
                            else {})}
            p = path.replace("{S}", n["session"]).replace("{W}", n["window"])
            return httpx.request(method, f"{url}{p}", headers=hdrs, timeout=60, **args)
        return call

    def chatty(path: str, body: dict) -> Call:
        def call(method: str, h: dict[str, str], n: dict[str, str]) -> httpx.Response:
            return httpx.post(f"{url}{path}", headers={**h, "X-Session-Id": n["session"]},
                              json=body, timeout=60)
        return call

    ask = [{"role": "user", "content": "What is my vault code and passport?"}]
    return {
        ("GET", "/v1/usage"): (req("/v1/usage"), False),
        ("GET", "/v1/sessions"): (req("/v1/sessions"), False),
        ("GET", "/v1/activity"): (req("/v1/activity", params={"view": "full"}), False),
        ("GET", "/v1/memory/namespaces"): (req("/v1/memory/namespaces"), False),
        ("GET", "/v1/memory/facts"): (req("/v1/memory/facts", params={"namespace": "{NS}"}),
                                      "tenant"),
        ("GET", "/v1/memory/search"): (req("/v1/memory/search", params={
            "namespace": "{T}", "q": "vault passport token"}), "tenant"),
        ("GET", "/v1/memory/view"): (req("/v1/memory/view", params={"namespace": "{NS}"}),
                                     "tenant"),
        ("GET", "/v1/windows"): (req("/v1/windows", params={"session": "{S}"}), True),
        ("GET", "/v1/windows/{name}"): (req("/v1/windows/{W}"), True),
        ("GET", "/v1/windows/{name}/export"): (req("/v1/windows/{W}/export"), True),
        ("POST", "/v1/windows/{name}/thaw"): (req("/v1/windows/{W}/thaw",
                                                  json={"session": "mine"}), True),
        ("POST", "/v1/windows/{name}/clone"): (req("/v1/windows/{W}/clone",
                                                   json={"name": "copy"}), True),
        ("PATCH", "/v1/windows/{name}"): (req("/v1/windows/{W}", json={"tags": ["x"]}), True),
        ("DELETE", "/v1/windows/{name}"): (req("/v1/windows/{W}"), True),
        ("POST", "/v1/windows"): (req("/v1/windows", json={"name": "steal",
                                                          "session": "{S}"}), True),
        ("POST", "/v1/windows/import"): (req("/v1/windows/import", content=b"junk"), True),
        ("DELETE", "/v1/sessions/{session}/kv"): (req("/v1/sessions/{S}/kv"), True),
        ("POST", "/v1/auto_freeze/check"): (req("/v1/auto_freeze/check",
                                                json={"session": "{S}", "model": "tiny"}),
                                            True),
        ("GET", "/v1/auto_freeze"): (req("/v1/auto_freeze"), False),
        ("POST", "/v1/auto_freeze"): (req("/v1/auto_freeze", json={}), False),
        ("GET", "/v1/cache/stats"): (req("/v1/cache/stats"), False),
        ("POST", "/v1/memory/facts"): (req("/v1/memory/facts", json={
            "namespace": "{NS}", "text": "planted by an attacker"}), "tenant"),
        ("POST", "/v1/memory/turns"): (req("/v1/memory/turns", json={
            "namespace": "{NS}", "session": "{S}", "role": "user", "content": "planted"}),
            "tenant"),
        ("POST", "/v1/activity"): (req("/v1/activity", json={"what": "attacker", "session":
                                                             "{S}"}), False),
        ("POST", "/v1/chat/completions"): (chatty("/v1/chat/completions", {
            "model": "tiny", "max_tokens": 4, "messages": ask}), False),
        ("POST", "/v1/completions"): (chatty("/v1/completions", {
            "model": "tiny", "prompt": "my vault code is"}), False),
        ("POST", "/v1/responses"): (chatty("/v1/responses", {
            "model": "tiny", "input": "my vault code is"}), False),
        ("POST", "/v1/embeddings"): (req("/v1/embeddings", json={"model": "tiny",
                                                                 "input": "vault"}), False),
        ("POST", "/tokenize"): (req("/tokenize", json={"model": "tiny", "prompt": "x"}), False),
        ("POST", "/detokenize"): (req("/detokenize", json={"model": "tiny", "tokens": [1]}),
                                  False),
        ("GET", "/v1/models"): (req("/v1/models"), False),
        ("GET", "/v1/models/{model_id}"): (req("/v1/models/tiny"), False),
        ("GET", "/health"): (req("/health"), False),
        ("GET", "/metrics"): (req("/metrics"), False),
        ("GET", "/openapi.json"): (req("/openapi.json"), False),
        **{(m, "/v1/activity"): (req("/v1/activity", json={"what": "x"}), False)
           for m in ("PUT", "PATCH", "DELETE")},
        **{(m, "/v1/activity/{rest}"): (req("/v1/activity/{S}"), True)
           for m in ("PUT", "PATCH", "DELETE")},
        **{(m, "/{path}"): (req("/v1/secrets/{S}"), True)
           for m in ("GET", "POST", "PUT", "DELETE", "PATCH")},
    }


X_FOLDER = "u-" + hmac.new(SECRET.encode(), b"user\x00acme\x00xavier",
                           hashlib.sha256).hexdigest()[:32]  # X's memory


def memory_state(root: Path, pg_url: str | None) -> dict:
    """X's memory and its tenant's: the files, or the rows of a PostgreSQL memory."""
    if pg_url is None:
        assert (root / X_FOLDER).is_dir()
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted([*(root / X_FOLDER).rglob("*"), *(root / "acme").rglob("*")])
                if p.is_file()}
    from cwm_plugin.memory.postgres.truth import PostgresTruth

    truth = PostgresTruth(pg_url, root)
    try:
        with pg_scope.scoped(pg_scope.EVERYTHING):  # (the test's own look: every row)
            assert truth.sessions(X_FOLDER)
            return {f: ({s: (truth.session_data(f, s), truth.read_summary(f, s))
                         for s in truth.sessions(f)},
                        [m.__dict__ for m in truth.read_memories(f, history=True)])
                    for f in (X_FOLDER, "acme")}
    finally:
        truth.close()


def victim_state(srv: ServerThread, root: Path, store: KVStore, tokens: list[int],
                 pg_url: str | None = None) -> dict:
    files = memory_state(root, pg_url)
    windows = httpx.get(f"{srv.url}/v1/windows", headers=X, timeout=30).json()["data"]
    entries = [e for e in httpx.get(f"{srv.url}/v1/activity?view=full", headers=X,
                                    timeout=30).json()["data"] if "ACT-X" in e["what"]]
    blocks = [t is not None for ts in session_blocks(store, tokens, VICTIM_SALT, 3) for t in ts]
    return {"files": files, "windows": [(w["name"], w["blocks"]) for w in windows],
            "entries": [e["hash"] for e in entries], "blocks": blocks}


def normal(r: httpx.Response, names: dict[str, str]) -> tuple[int, str]:
    text = r.text
    for v in sorted(names.values(), key=len, reverse=True):
        text = text.replace(v, "<N>")
    return r.status_code, re.sub(r'"(created|id|time|hash|head)":\s*[^,}]+', "", text)


@pytest.mark.parametrize("replicas", [False, pytest.param(True, marks=pytest.mark.postgres)],
                         ids=["one-sidecar", "two-replicas"])
def test_no_tenant_or_user_reaches_another_users_objects(tmp_path, tiny_model, replicas,
                                                         request):
    """With ``replicas``: X's objects are made on replica A, the attacks go to replica B (one
    PostgreSQL memory, session state and jobs in one Redis, one KV store)."""
    pg_url = request.getfixturevalue("postgres_url") if replicas else None
    shared = {"memory": {"backend": "postgres", "postgres_url": pg_url},
              "sessions": {"shared_url": request.getfixturevalue("redis_server").url}} \
        if replicas else {}
    kv = tmp_path / "kv"
    store = KVStore(StoreConfig(disk_path=str(kv), memory_bytes=0), registry=CollectorRegistry())
    tokens = converse(store, VICTIM_SALT, 3 * 16 + 5)
    records.write_record(store, records.served_key("tiny"), {"model": "tiny", "namespace": NS},
                         records.SERVED_LAYOUT, what="served")
    store.close()
    fake = FakeUpstream(model="tiny", max_model_len=4096)
    root = tmp_path / "memory"

    def replica(name: str) -> ServerThread:
        return ServerThread(create_app(make_settings(
            up.url, root if name == "a" else tmp_path / f"memory-{name}", tiny_model,
            activity={"root": str(tmp_path / "act"), "log_turns": True},
            windows={"store": {"disk_path": str(kv)}, "wait_s": 0.5, "settle_s": 0.1},
            access={"grants": {"acme": ["debug", "metrics", "admin"],
                               "beta": ["debug", "metrics", "admin"],
                               "gamma": ["debug"]}},
            rate_limits={"rate_limit": "none"}, **shared)))  # every route in a burst

    with ServerThread(fake.app) as up, replica("a") as srv, \
            (replica("b") if replicas else contextlib.nullcontext(srv)) as attacked:
        # X's objects: a conversation, a fact, a transcript line, an entry, a window
        post = {"timeout": 60, "headers": {**X, "X-Session-Id": "vs"}}
        assert httpx.post(f"{srv.url}/v1/chat/completions", **post, json={
            "model": "tiny", "max_tokens": 4, "messages": [
                {"role": "user", "content": "My vault code is VAULT-1234."}]}).status_code == 200
        x_salt = fake.last()["cache_salt"]  # what X's own requests are salted with
        assert x_salt == VICTIM_SALT
        for path, body in (("/v1/memory/facts", {"text": "Xavier's passport is PASS-5678."}),
                           ("/v1/memory/turns", {"session": "vs", "role": "user",
                                                 "content": "my token is TOKEN-X-42"}),
                           ("/v1/activity", {"what": "xavier did ACT-X-9"})):
            assert httpx.post(f"{srv.url}{path}", json=body, **post).status_code == 201, path
        r = httpx.post(f"{srv.url}/v1/windows", json={"name": "plan", "session": "vs"}, **post)
        assert r.status_code == 200, r.text
        wait_idle(srv)
        check = KVStore(StoreConfig(disk_path=str(kv), memory_bytes=0),
                        registry=CollectorRegistry())
        before = victim_state(srv, root, check, tokens, pg_url)
        assert all(before["blocks"]) and before["windows"] and before["entries"]

        table = plan(attacked.url)
        routes = {(m, re.sub(r":\w+}", "}", r.path)) for r in attacked.app.routes
                  if isinstance(r, APIRoute) for m in r.methods}
        assert routes == set(table), routes ^ set(table)  # every route and verb is tried
        tried = 0
        for (method, route), (call, compare) in table.items():
            for who, headers in ATTACKERS.items():
                t0 = time.monotonic()
                got = {t: call(method, headers, NAMES[t]) for t in NAMES}
                if time.monotonic() - t0 > 2:
                    print("slow", method, route, who, round(time.monotonic() - t0, 1))
                for t, r in got.items():
                    tried += 1
                    assert r.status_code < 500, (method, route, who, t, r.text)
                    assert not any(s in r.text for s in SECRETS), (method, route, who, t)
                    assert x_salt not in r.text
                    if route in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
                        sent = fake.last(route)  # a guessed session id reaches no KV of X's
                        assert sent["cache_salt"] != x_salt, (route, who, t)
                        assert not any(s in json.dumps(sent) for s in SECRETS), (route, who)
                if route == "/v1/usage":  # before any request of its own: nothing at all
                    assert got["victim"].json()["total"]["requests"] == 0, who
                if compare is True or (compare == "tenant" and who.startswith("beta")):
                    assert normal(got["victim"], NAMES["victim"]) == \
                        normal(got["absent"], NAMES["absent"]), (method, route, who)
        wait_idle(srv)
        wait_idle(attacked)
        assert victim_state(srv, root, check, tokens, pg_url) == before  # nothing changed
        check.close()
        print(f"cross-tenant matrix: {len(table)} route x verb, {len(ATTACKERS)} callers, "
              f"{tried} requests")
