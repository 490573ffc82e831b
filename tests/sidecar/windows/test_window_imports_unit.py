"""Windows against a careless or hostile client, over real HTTP in front of a fake upstream, on a
real disk store laid out as vLLM's connector leaves it: the pin quota is the tenant's whatever
users the client names, also when they import at once; a forged import file is a
``bad_window_file`` that pins nothing, and sizes come from the blobs pinned, never the file;
with ``windows.export_key`` only files signed under it are imported; and any bytes or any
manifest posted to the import route answer without a 5xx (hypothesis)."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from sidecar_helpers import KEYS, make_settings, runtime, salt
from window_helpers import BS, NS, converse, rewritten, serve

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.windows.engine import WindowEngine
from cwm_plugin.windows.portable import export_window

pytestmark = pytest.mark.unit
ACME = {"Authorization": f"Bearer {KEYS['acme']}"}
EXPORT_KEY = "export-key-0123456789abcdef"


def prepare(kv: Path) -> tuple[int, bytes]:
    """What vLLM's connector left (acme's session "alice", the model it serves); the bytes a
    window of that session pins, and an unsigned export file of one."""
    store = KVStore(StoreConfig(disk_path=str(kv), memory_bytes=0), registry=CollectorRegistry())
    try:
        converse(store, salt("acme", "alice"), 3 * BS + 5)
        serve(store, NS)
        eng = WindowEngine(store, wait_s=0)
        size = eng.freeze("acme", "probe", session="alice",
                          salt=salt("acme", "alice")).stored_bytes
        buf = io.BytesIO()
        export_window(eng, "acme", "probe", buf)
        eng.delete("acme", "probe")
        return size, buf.getvalue()
    finally:
        store.close()


@pytest.fixture
def upstream():
    with ServerThread(FakeUpstream(model="tiny", max_model_len=4096).app) as up:
        yield up


def start(up: ServerThread, tmp_path: Path, **windows) -> ServerThread:
    settings_ = make_settings(up.url, tmp_path / "memory", "tiktoken:cl100k_base",
                              windows={"store": {"disk_path": str(tmp_path / "kv")},
                                       "wait_s": 2, "settle_s": 0, **windows})
    return ServerThread(create_app(settings_)).start()


def keys(srv: ServerThread) -> int:
    return sum(len(v) for v in runtime(srv).windows.store.list_keys(limit=100_000).values())


def post_file(srv: ServerThread, data: bytes, name: str | None = None,
              user: str | None = None) -> httpx.Response:
    headers = {**ACME, **({"X-CWM-User": user} if user else {})}
    return httpx.post(f"{srv.url}/v1/windows/import", params={"name": name} if name else {},
                      content=data, headers=headers, timeout=60)


def test_the_pin_quota_is_the_tenants_whatever_users_it_names(upstream, tmp_path):
    size, exported = prepare(tmp_path / "kv")
    # four imports of one tenant at once (the default lets one run): the quota is what holds
    srv = start(upstream, tmp_path, tenant_quota_bytes=int(size * 2.5), imports_per_tenant=4,
                max_import_bytes=1 << 20)
    try:
        r = httpx.post(f"{srv.url}/v1/windows", headers=ACME, timeout=60,
                       json={"name": "plan", "session": "alice"})
        assert r.status_code == 200, r.text
        users = [f"user-{i}@example.com" for i in range(4)]
        with ThreadPoolExecutor(4) as pool:     # four "users" import at once: one fits
            answers = list(pool.map(lambda u: post_file(srv, exported, "mine", u), users))
        assert sorted(a.status_code for a in answers) == [200, 507, 507, 507]
        assert {a.json()["error"]["code"] for a in answers if a.status_code == 507} == \
            {"pin_quota_exceeded"}
        r = httpx.post(f"{srv.url}/v1/windows", headers=ACME, timeout=60,
                       json={"name": "plan-2", "session": "alice"})
        assert r.status_code == 507
        r = httpx.post(f"{srv.url}/v1/windows/plan/clone", headers=ACME, timeout=60,
                       json={"name": "plan-3"})
        assert r.status_code == 507
        winner = next(u for u, a in zip(users, answers, strict=True) if a.status_code == 200)
        mine = httpx.get(f"{srv.url}/v1/windows", headers={**ACME, "X-CWM-User": winner})
        assert [w["name"] for w in mine.json()["data"]] == ["mine"]
        assert runtime(srv).windows.tenant_bytes("acme") == 2 * size
    finally:
        srv.stop()


def test_a_forged_import_is_refused_pinning_nothing_and_sizes_are_measured(upstream,
                                                                           tmp_path):
    size, exported = prepare(tmp_path / "kv")
    srv = start(upstream, tmp_path, tenant_quota_bytes=int(size * 1.5))
    try:
        def swap_ranks(h: dict) -> None:   # block 0 of rank 0 under rank 1's key, and back
            h["blobs"][0]["worker"], h["blobs"][3]["worker"] = 1, 0

        forged = {
            "tags that are not strings": lambda h: h["manifest"].update(tags=[{"x": 1}]),
            "a turn that is a string": lambda h: h["manifest"].update(turn="7"),
            "a hash algorithm vLLM has not": lambda h: h["manifest"].update(hash_algo="md5"),
            "a session with a newline": lambda h: h["manifest"].update(session="a\nb"),
            "a blob of another rank": swap_ranks,
        }
        before = keys(srv)
        for what, change in forged.items():
            r = post_file(srv, rewritten(exported, change), "w")
            assert r.status_code == 400, (what, r.text)
            assert r.json()["error"]["code"] == "bad_window_file", what
            assert keys(srv) == before, what
        assert httpx.get(f"{srv.url}/v1/windows", headers=ACME).status_code == 200
        # the file's size is never taken: a negative one bypasses nothing
        cheat = rewritten(exported, lambda h: h["manifest"].update(stored_bytes=-10 ** 15))
        r = post_file(srv, cheat, "first")
        assert r.status_code == 200 and r.json()["total_size_bytes"] == size, r.text
        r = post_file(srv, cheat, "second")
        assert r.status_code == 507 and keys(srv) == before + 2 * 3 + 1   # blocks, manifest
        listed = httpx.get(f"{srv.url}/v1/windows", headers=ACME).json()["data"]
        assert [(w["name"], w["total_size_bytes"]) for w in listed] == [("first", size)]
    finally:
        srv.stop()


def test_with_an_export_key_only_files_signed_under_it_are_imported(upstream, tmp_path,
                                                                     monkeypatch):
    _, unsigned = prepare(tmp_path / "kv")
    monkeypatch.setenv("CWM_WINDOW_EXPORT_KEY", EXPORT_KEY)
    srv = start(upstream, tmp_path)
    try:
        before = keys(srv)
        r = post_file(srv, unsigned, "w")
        assert r.status_code == 400 and "not signed" in r.json()["error"]["message"]
        assert httpx.post(f"{srv.url}/v1/windows", headers=ACME, timeout=60,
                          json={"name": "plan", "session": "alice"}).status_code == 200
        signed = httpx.get(f"{srv.url}/v1/windows/plan/export", headers=ACME, timeout=60)
        assert signed.status_code == 200 and b'"signature":"hmac-sha256"' in signed.content
        before = keys(srv)
        other = io.BytesIO()   # a server with another key, on the same store
        export_window(WindowEngine(runtime(srv).windows.store, export_key=b"k" * 32), "acme",
                      "plan", other)
        refused = {
            "tokens changed, sums recomputed": rewritten(
                signed.content, lambda h: h["manifest"].update(tokens=h["manifest"]["tokens"]
                                                               [::-1])),
            "signature taken off, sums recomputed": rewritten(
                signed.content, lambda h: h.pop("signature")),
            "signed under another key": other.getvalue(),
        }
        for what, data in refused.items():
            r = post_file(srv, data, "w")
            assert r.status_code == 400, (what, r.text)
            assert r.json()["error"]["code"] == "bad_window_file", what
            assert keys(srv) == before, what
        r = post_file(srv, signed.content, "plan-copy")
        assert r.status_code == 200 and r.json()["blocks"] == 3
    finally:
        srv.stop()


def test_an_unsigned_file_of_blocks_not_bound_to_their_tokens_is_refused(upstream, tmp_path,
                                                                          monkeypatch):
    """Blocks saved naming no content (an older connector): their export, unsigned, is a
    ``bad_window_file`` that writes nothing; the same window signed under the export key is
    imported (the signature vouches for the blocks)."""
    import window_helpers

    monkeypatch.setattr(window_helpers, "contents", lambda tokens, n: [None] * n)
    _, unbound = prepare(tmp_path / "kv")
    srv = start(upstream, tmp_path)
    try:
        before = keys(srv)
        r = post_file(srv, unbound, "w")
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "bad_window_file" and "names no content" in error["message"]
        assert keys(srv) == before
    finally:
        srv.stop()
    monkeypatch.setenv("CWM_WINDOW_EXPORT_KEY", EXPORT_KEY)
    srv = start(upstream, tmp_path)
    try:
        assert httpx.post(f"{srv.url}/v1/windows", headers=ACME, timeout=60,
                          json={"name": "plan", "session": "alice"}).status_code == 200
        signed = httpx.get(f"{srv.url}/v1/windows/plan/export", headers=ACME, timeout=60)
        r = post_file(srv, signed.content, "plan-copy")
        assert r.status_code == 200 and r.json()["blocks"] == 3, r.text
    finally:
        srv.stop()


def test_by_default_a_tenant_pins_only_its_share_of_the_pin_quota(upstream, tmp_path):
    """The windows' default settings (the tenant quota ``auto``) and three principals: acme
    pins at most a third of the store's pin quota (half of disk_bytes), so beta pins too."""
    size, _ = prepare(tmp_path / "probe")
    store = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0),
                    registry=CollectorRegistry())
    try:
        for i, (tenant, session) in enumerate([("acme", "a0"), ("acme", "a1"), ("acme", "a2"),
                                               ("beta", "b0")]):
            converse(store, salt(tenant, session), 3 * BS + 5, seed=i)   # distinct blocks
    finally:
        store.close()
    # a pin quota of 7.5 windows (2.5 a principal): without a tenant quota acme could take it
    srv = start(upstream, tmp_path, store={"disk_path": str(tmp_path / "kv"),
                                           "disk_bytes": 15 * size})
    try:
        def freeze(key: str, session: str) -> httpx.Response:
            return httpx.post(f"{srv.url}/v1/windows", timeout=60, json={
                "name": session, "session": session},
                headers={"Authorization": f"Bearer {KEYS[key]}"})

        assert [freeze("acme", s).status_code for s in ("a0", "a1")] == [200, 200]
        r = freeze("acme", "a2")
        assert r.status_code == 507 and r.json()["error"]["code"] == "pin_quota_exceeded"
        assert "tenant's quota" in r.json()["error"]["message"], r.text
        assert freeze("beta", "b0").status_code == 200
    finally:
        srv.stop()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
    | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
FIELDS = ["name", "session", "tokens", "block_size", "hash_block_size", "hash_algo", "workers",
          "namespace", "lora", "num_blocks", "messages", "tags", "description", "turn",
          "prompt", "stored_bytes", "version", "parent", "x"]


def test_any_bytes_or_manifest_posted_to_import_answers_without_a_5xx(upstream, tmp_path):
    size, exported = prepare(tmp_path / "kv")
    srv = start(upstream, tmp_path, tenant_quota_bytes=size * 4)

    def changed(fields: list[tuple[str, object]]) -> bytes:
        return rewritten(exported, lambda h: h["manifest"].update(dict(fields)))

    files = st.binary(max_size=1024) | st.lists(st.tuples(st.sampled_from(FIELDS), JSON),
                                                min_size=1, max_size=3).map(changed)

    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=files)
    def post(data: bytes) -> None:
        before = keys(srv)
        r = post_file(srv, data)
        assert r.status_code < 500, r.text
        if r.status_code != 200:
            assert keys(srv) == before and json.loads(r.text)["error"]["code"]
            return
        name = r.json()["name"]
        assert httpx.get(f"{srv.url}/v1/windows", headers=ACME).status_code == 200
        assert httpx.get(f"{srv.url}/v1/windows/{name}", headers=ACME).status_code == 200
        assert httpx.delete(f"{srv.url}/v1/windows/{name}", headers=ACME).status_code == 200

    try:
        post()
    finally:
        srv.stop()
