"""The activity log through the sidecar, over real HTTP: appends name the authenticated tenant, the
quick and full views, a line per chat turn, and no route that rewrites or deletes an entry;
``cwm activity verify`` names an edited file. The upstream is
``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sidecar_helpers import KEYS, chat, make_settings, metric_value, runtime, wait_idle

from cwm_plugin.activity.log import ActivityLog
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit


def auth(tenant: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}", **extra}


@pytest.fixture(scope="module")
def upstream() -> Iterator[ServerThread]:
    with ServerThread(FakeUpstream(model="tiny", max_model_len=4096).app) as srv:
        yield srv


def sidecar(upstream: ServerThread, root: Path, **activity) -> ServerThread:
    settings = make_settings(upstream.url, root / "memory", "tiktoken:cl100k_base",
                             activity={"root": str(root / "activity"), **activity},
                             rate_limits={"rate_limit": "none"})  # bursts: not the point
    return ServerThread(create_app(settings)).start()


def test_appends_name_the_caller_and_read_back_quick_and_full(upstream, tmp_path):
    srv = sidecar(upstream, tmp_path, read="all")  # every principal reads the whole log
    try:
        url = f"{srv.url}/v1/activity"
        assert chat(srv, "acme", "Plan the release", session="s1").status_code == 200
        r = httpx.post(url, headers=auth("acme", **{"X-Session-Id": "s1",
                                                    "X-CWM-Project": "cwm plugin"}),
                       json={"what": "drafted the release notes", "output": "notes.md"})
        assert r.status_code == 201, r.text
        e = r.json()
        assert (e["principal"], e["session"], e["project"]) == ("acme", "s1", "cwm plugin")
        # no context use given: the session's last turn through the sidecar, and its limit
        state = runtime(srv).tracker.get("acme", "s1")
        assert (e["used_tokens"], e["limit_tokens"]) == (state.last_prompt_tokens, 4096)
        assert e["percent"] == round(100 * state.last_prompt_tokens / 4096, 1)
        for i in range(12):
            httpx.post(url, headers=auth("beta"), json={
                "what": f"step {i}", "project": "other", "used_tokens": i, "limit_tokens": 10})
        quick = httpx.get(url, headers=auth("acme")).json()
        assert quick["view"] == "quick" and len(quick["data"]) == 10
        assert quick["data"][-1]["what"] == "step 11" and quick["heads"]["beta"] == \
            quick["data"][-1]["hash"]
        assert quick["head"] == quick["heads"]["acme"] == e["hash"]
        full = httpx.get(f"{url}?view=full&offset=0&limit=5", headers=auth("gamma")).json()
        assert full["total"] == 13 and full["data"][0]["principal"] == "acme"
        assert len(full["data"]) == 5
        assert httpx.get(f"{url}?view=nope", headers=auth("acme")).status_code == 400
        assert httpx.get(url).status_code == 401
        assert httpx.post(url, json={"what": "x"}).status_code == 401
        # the principal is the key's, never the body's; bad fields are refused
        for bad in ({"what": "x", "principal": "beta"}, {"what": ""},
                    {"what": "x", "session": "../x"}, {"what": "x", "used_tokens": -1}):
            r = httpx.post(url, headers=auth("acme"), json=bad)
            assert r.status_code == 400 and r.json()["error"]["type"] == \
                "invalid_request_error", bad
        assert ActivityLog(tmp_path / "activity").verify() == []
    finally:
        srv.stop()


def test_read_own_shows_a_principal_only_its_entries(upstream, tmp_path):
    srv = sidecar(upstream, tmp_path, read="own")
    try:
        for tenant in ("acme", "beta", "acme"):
            httpx.post(f"{srv.url}/v1/activity", headers=auth(tenant), json={"what": tenant})
        for view in ("quick", "full"):
            got = httpx.get(f"{srv.url}/v1/activity?view={view}", headers=auth("beta")).json()
            assert [e["principal"] for e in got["data"]] == ["beta"]
    finally:
        srv.stop()


def test_by_default_a_tenant_reads_only_its_own_entries(upstream, tmp_path):
    """The log is per tenant unless the operator grants more: with ``log_turns`` another
    tenant never reads acme's chat previews; a rule giving beta RO on acme's namespace shares
    acme's entries with beta (and only with beta)."""
    srv = sidecar(upstream, tmp_path, log_turns=True)
    try:
        assert chat(srv, "acme", "my password is hunter2", session="s1").status_code == 200
        wait_idle(srv)
        httpx.post(f"{srv.url}/v1/activity", headers=auth("beta"), json={"what": "beta's"})
        for view in ("quick", "full"):
            got = httpx.get(f"{srv.url}/v1/activity?view={view}", headers=auth("beta")).json()
            assert [e["what"] for e in got["data"]] == ["beta's"], got
            assert "hunter2" not in json.dumps(got)
        mine = httpx.get(f"{srv.url}/v1/activity", headers=auth("acme")).json()["data"]
        assert [e["principal"] for e in mine] == ["acme"]
        assert "hunter2" in mine[0]["what"]
    finally:
        srv.stop()
    settings = make_settings(upstream.url, tmp_path / "memory", "tiktoken:cl100k_base",
                             activity={"root": str(tmp_path / "activity")},
                             access={"rules": [{"principal": "beta", "namespace": "acme",
                                                "access": "RO"}]})
    with ServerThread(create_app(settings)) as srv:
        seen = {t: [e["principal"] for e in httpx.get(
            f"{srv.url}/v1/activity?view=full", headers=auth(t)).json()["data"]]
            for t in ("beta", "gamma")}
        assert seen == {"beta": ["acme", "beta"], "gamma": []}


def test_no_read_tells_of_another_principals_entries(upstream, tmp_path):
    """Each principal's entries chain among themselves: what beta reads (its entries, their
    ``prev``, the heads) holds no hash of acme's, though acme wrote before, between and after
    beta; a user of acme reads its tenant's chain and its own, nothing of another user's."""
    srv = sidecar(upstream, tmp_path)
    try:
        url = f"{srv.url}/v1/activity"

        def post(tenant: str, what: str, **headers: str) -> dict:
            r = httpx.post(url, headers=auth(tenant, **headers), json={"what": what})
            assert r.status_code == 201, r.text
            return r.json()

        def read(tenant: str, view: str, **headers: str) -> dict:
            return httpx.get(f"{url}?view={view}", headers=auth(tenant, **headers)).json()

        acme = [post("acme", "a0"), post("acme", "a1")]
        beta = [post("beta", "b0")]
        acme.append(post("acme", "a2"))
        beta.append(post("beta", "b1"))
        alice = post("acme", "alice's", **{"X-CWM-User": "alice"})
        bob = post("acme", "bob's", **{"X-CWM-User": "bob"})
        acme.append(post("acme", "a3"))
        assert beta[0]["prev"] == "0" * 64 and beta[1]["prev"] == beta[0]["hash"]
        assert alice["prev"] == bob["prev"] == "0" * 64
        for view in ("quick", "full"):
            got = read("beta", view)
            assert [e["what"] for e in got["data"]] == ["b0", "b1"]
            assert got["head"] == beta[1]["hash"] and got["heads"] == {"beta": beta[1]["hash"]}
            text = json.dumps(got)
            assert not any(e["hash"] in text for e in [*acme, alice, bob])
            mine = read("acme", view, **{"X-CWM-User": "alice"})
            assert [e["what"] for e in mine["data"]] == ["a0", "a1", "a2", "alice's", "a3"]
            assert mine["head"] == alice["hash"] and bob["hash"] not in json.dumps(mine)
            assert mine["heads"]["acme"] == acme[-1]["hash"] and len(mine["heads"]) == 2
            # the key's holder, for no user: its own chain and each of its users'
            holder = read("acme", view)
            assert holder["head"] == acme[-1]["hash"] and len(holder["heads"]) == 3
        assert ActivityLog(tmp_path / "activity").verify() == []
    finally:
        srv.stop()


class Listings:
    """The names the process lists (``os.scandir``, ``os.listdir``) under ``root`` while it
    is on: what a read looks at."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root, self.names = str(root), 0
        scandir, listdir = os.scandir, os.listdir

        def counted(found: list, path: Any) -> list:
            if str(path).startswith(self.root):
                self.names += len(found)
            return found

        class Scanned(list):
            def __enter__(self) -> Scanned:
                return self

            def __exit__(self, *exc: Any) -> None:
                return None

        monkeypatch.setattr(os, "scandir", lambda path=".": Scanned(
            counted(list(scandir(path)), path)))
        monkeypatch.setattr(os, "listdir", lambda path=".": counted(listdir(path), path))


def test_a_read_looks_only_at_the_chains_its_reader_may_read(upstream, tmp_path, monkeypatch):
    """What a read lists does not grow with another tenant's users, nor, for a user, with
    its tenant's other users: one tenant naming ever new users slows no one else's reads."""
    srv = sidecar(upstream, tmp_path)
    try:
        url = f"{srv.url}/v1/activity"

        def post(tenant: str, user: str | None = None) -> None:
            headers = auth(tenant, **({"X-CWM-User": user} if user else {}))
            assert httpx.post(url, headers=headers, json={"what": "x"}).status_code == 201

        readers = {"acme": auth("acme"), "alice": auth("acme", **{"X-CWM-User": "alice"}),
                   "beta": auth("beta")}

        def looked_at() -> dict[str, int]:
            out = {}
            for name, headers in readers.items():
                with monkeypatch.context() as m:
                    listed = Listings(tmp_path / "activity", m)
                    got = httpx.get(f"{url}?view=full", headers=headers)
                    assert got.status_code == 200, got.text
                out[name] = listed.names
            return out

        for tenant, user in (("acme", None), ("acme", "alice"), ("beta", None)):
            post(tenant, user)
        alone = looked_at()
        for i in range(40):  # beta's user churn
            post("beta", f"b{i}")
        churned = looked_at()
        assert churned["beta"] > alone["beta"]  # its own users: it reads them
        assert (churned["acme"], churned["alice"]) == (alone["acme"], alone["alice"]), churned
        for i in range(40):  # acme's
            post("acme", f"a{i}")
        assert looked_at()["alice"] == alone["alice"]  # a user never its tenant's other users
    finally:
        srv.stop()


def test_a_tenant_past_max_user_chains_is_told_and_others_go_on(upstream, tmp_path):
    srv = sidecar(upstream, tmp_path, max_user_chains=2)
    try:
        url = f"{srv.url}/v1/activity"

        def post(tenant: str, user: str | None = None) -> httpx.Response:
            headers = auth(tenant, **({"X-CWM-User": user} if user else {}))
            return httpx.post(url, headers=headers, json={"what": f"{tenant} {user}"})

        assert [post("acme", u).status_code for u in ("a1", "a2")] == [201, 201]
        files = sorted((tmp_path / "activity").rglob("*"))
        r = post("acme", "a3")
        assert r.status_code == 507 and r.json()["error"]["code"] == "activity_users_full"
        assert "activity.max_user_chains" in r.json()["error"]["message"]
        assert sorted((tmp_path / "activity").rglob("*")) == files  # nothing written
        assert [post(t, u).status_code for t, u in (("acme", "a1"), ("acme", None),
                                                     ("beta", "b1"), ("beta", "b2"))] == \
            [201] * 4
        got = httpx.get(f"{url}?view=full", headers=auth("acme")).json()
        assert sorted(e["what"] for e in got["data"]) == \
            ["acme None", "acme a1", "acme a1", "acme a2"]
        assert ActivityLog(tmp_path / "activity").verify() == []
    finally:
        srv.stop()


def test_each_chat_turn_is_logged_with_its_context_use(upstream, tmp_path):
    srv = sidecar(upstream, tmp_path, log_turns=True, turn_preview_chars=20)
    try:
        r = chat(srv, "acme", "Summarise the meeting about the Bernina line, please",
                 session="t1", headers={"X-CWM-Project": "rail"})
        assert r.status_code == 200
        wait_idle(srv)
        (e,) = ActivityLog(tmp_path / "activity").entries()
        assert (e.principal, e.session, e.project, e.model) == ("acme", "t1", "rail", "tiny")
        assert e.what == "chat: Summarise the meetin" and e.output == "ok"
        assert (e.used_tokens, e.limit_tokens) == (r.json()["usage"]["prompt_tokens"], 4096)
        # a log that cannot be written never fails a turn: counted instead
        (tmp_path / "activity" / "chains" / "acme" / "_self" / "activity.jsonl").unlink()
        (tmp_path / "activity" / "chains" / "acme" / "_self" / "activity.jsonl").mkdir()
        assert chat(srv, "acme", "again", session="t1").status_code == 200
        wait_idle(srv)
        assert metric_value(srv, "cwm_sidecar_memory_failures_total", tenant="acme",
                            stage="activity") == 1
    finally:
        srv.stop()


def test_no_route_rewrites_or_deletes_an_entry(upstream, tmp_path):
    srv = sidecar(upstream, tmp_path)
    try:
        url = f"{srv.url}/v1/activity"
        first = httpx.post(url, headers=auth("acme"), json={"what": "one"}).json()
        httpx.post(url, headers=auth("acme"), json={"what": "two"})
        files = {p.name: p.read_bytes() for p in (tmp_path / "activity").rglob("activity.*")}
        # every route the app has under /v1/activity, with its path parameters filled in
        paths = {re.sub(r"\{[^}]+\}", first["hash"], r.path) for r in srv.app.routes
                 if getattr(r, "path", "").startswith("/v1/activity")}
        assert paths == {"/v1/activity", f"/v1/activity/{first['hash']}"}
        paths |= {"/v1/activity/0", "/v1/activity/entries/1"}
        for path in sorted(paths):
            for method in ("PUT", "PATCH", "DELETE"):
                r = httpx.request(method, f"{srv.url}{path}", headers=auth("acme"),
                                  json={"what": "rewritten", "hash": first["hash"]})
                assert r.status_code == 405, (method, path, r.text)
                assert r.json()["error"]["code"] == "append_only"
                assert r.headers["allow"] == "GET, POST"
            if path != "/v1/activity":  # no entry has a URL of its own
                for method in ("GET", "POST"):
                    r = httpx.request(method, f"{srv.url}{path}", headers=auth("acme"),
                                      json={"what": "rewritten"})
                    assert r.status_code == 404, (method, path)
        # nor can a new entry claim another's place in the chain
        for fields in ({"hash": "0" * 64}, {"prev": first["hash"]}, {"time": 1.0}):
            r = httpx.post(url, headers=auth("acme"), json={"what": "x", **fields})
            assert r.status_code == 400
        assert {p.name: p.read_bytes() for p in (tmp_path / "activity").rglob("activity.*")} \
            == files
        assert ActivityLog(tmp_path / "activity").verify() == []
    finally:
        srv.stop()


def test_without_an_activity_section_the_routes_answer_503(upstream, tmp_path):
    settings = make_settings(upstream.url, tmp_path, "tiktoken:cl100k_base")
    with ServerThread(create_app(settings)) as srv:
        r = httpx.post(f"{srv.url}/v1/activity", headers=auth("acme"), json={"what": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "activity_unavailable"


def cwm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cwm_plugin.cli", *args], capture_output=True,
                          text=True, env={**os.environ}, timeout=120)


def test_the_cli_shows_the_log_and_verify_names_an_edited_file(tmp_path):
    log = ActivityLog(tmp_path)
    from cwm_plugin.activity.log import Entry

    for i in range(12):
        log.append(Entry(principal="acme", what=f"step {i}", session="s"))
    shown = cwm("activity", "show", "--quick", "--root", str(tmp_path))
    assert shown.returncode == 0 and len(shown.stdout.splitlines()) == 10
    assert "**acme** (session s): step 11" in shown.stdout.splitlines()[-1]
    full = cwm("activity", "show", "--json", "--root", str(tmp_path), "--offset", "10")
    assert [json.loads(x)["what"] for x in full.stdout.splitlines()] == ["step 10", "step 11"]
    ok = cwm("activity", "verify", "--root", str(tmp_path))
    assert ok.returncode == 0 and "intact, 12 entries in 1 chain(s)" in ok.stdout
    assert f"acme: head {log.head('acme')}" in ok.stdout
    chain = log.chain("acme").jsonl
    chain.write_text(chain.read_text().replace('"step 5"', '"step five"'))
    bad = cwm("activity", "verify", "--root", str(tmp_path))
    assert bad.returncode == 1
    assert "chains/acme/_self/activity.jsonl line 6 was edited" in bad.stderr
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text("activity: {root: .}\n")
    assert cwm("activity", "verify", "--config", str(cfg)).returncode == 1
    nowhere = cwm("activity", "show")
    assert nowhere.returncode == 2 and "say where the log is" in nowhere.stderr


def test_the_logs_file_work_runs_on_each_principals_own_threads(upstream, tmp_path,
                                                                 monkeypatch):
    """Not on asyncio's default executor, which every tenant's memory work shares: appends
    and reads run on the activity threads within their principal's share."""
    srv = sidecar(upstream, tmp_path)
    try:
        log, threads = runtime(srv).activity, []
        for name in ("append", "quick", "page", "heads"):
            real = getattr(log, name)

            def spy(*a, real=real, **kw):
                threads.append(threading.current_thread().name)
                return real(*a, **kw)
            monkeypatch.setattr(log, name, spy)
        url = f"{srv.url}/v1/activity"
        assert httpx.post(url, headers=auth("acme"), json={"what": "x"}).status_code == 201
        assert httpx.get(url, headers=auth("beta")).status_code == 200
        assert httpx.get(url, params={"view": "full"}, headers=auth("beta")).status_code == 200
        assert len(threads) == 5 and all(t.startswith("cwm-activity") for t in threads), threads
    finally:
        srv.stop()
