"""The windows routes and the turn records over real HTTP, in front of a fake upstream, on a
real disk store laid out as the connector leaves it: a continuing session keeps its memory
block across a sidecar restart; bodies are bounded and authenticated first; bad query values
are 400s; export/import round-trips over HTTP; a failed warm-up is a warning; per-user
windows are invisible to other users and to the tenant."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sidecar_helpers import KEYS, make_settings, runtime, salt

from cwm_plugin.connector import records
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from window_helpers import NS, WORKERS, converse  # noqa: E402

pytestmark = pytest.mark.unit
ACME = {"Authorization": f"Bearer {KEYS['acme']}"}


@pytest.fixture
def fake() -> Iterator[tuple[FakeUpstream, ServerThread]]:
    f = FakeUpstream(model="tiny", max_model_len=4096)
    with ServerThread(f.app) as up:
        yield f, up


def start(up: ServerThread, tmp_path: Path, tiny_model: Path, **over) -> ServerThread:
    settings = make_settings(up.url, tmp_path / "memory", tiny_model,
                             windows={"store": {"disk_path": str(tmp_path / "kv")},
                                      "wait_s": 2, "settle_s": 0}, **over)
    return ServerThread(create_app(settings)).start()


def ask(srv: ServerThread, messages: list[dict], session: str = "s1") -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                      headers={**ACME, "X-Session-Id": session},
                      json={"model": "tiny", "messages": messages, "max_tokens": 8})


def test_a_continuing_session_keeps_its_memory_block_across_a_sidecar_restart(
        fake, tmp_path, tiny_model):
    f, up = fake
    srv = start(up, tmp_path, tiny_model)
    mem = runtime(srv).memory.service
    mem.add_memory("acme", "The user's dog is called Fido and likes the river.", "fact", 0.9)
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "Where does my dog like to walk?"}]
    assert ask(srv, history).status_code == 200
    history += [{"role": "assistant", "content": "ok"},
                {"role": "user", "content": "And its name again?"}]
    assert ask(srv, history).status_code == 200
    system_before = f.last()["messages"][0]["content"]
    assert "Fido" in system_before and f.last()["kv_transfer_params"]["cwm"]["turn"] == 2
    srv.stop()
    srv = start(up, tmp_path, tiny_model)           # a restart: the tracker is empty ...
    runtime(srv).memory.service.add_memory(        # ... and fresh memory would differ now
        "acme", "The user's dog Fido has a favourite name tag and its name is engraved.",
        "fact", 1.0)
    history += [{"role": "assistant", "content": "ok"},
                {"role": "user", "content": "What is the dog's name?"}]
    assert ask(srv, history).status_code == 200
    assert f.last()["messages"][0]["content"] == system_before   # the prefix stays the same
    assert f.last()["kv_transfer_params"]["cwm"]["turn"] == 3
    srv.stop()


def test_window_routes_authenticate_first_bound_bodies_and_refuse_bad_values(
        fake, tmp_path, tiny_model):
    _, up = fake
    srv = start(up, tmp_path, tiny_model, max_body_bytes=64 * 1024)
    try:
        big = b'{"name": "w", "session": "s", "description": "' + b"x" * 200_000 + b'"}'
        r = httpx.post(f"{srv.url}/v1/windows", content=big, timeout=30,
                       headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401                          # the key first, before the body
        r = httpx.post(f"{srv.url}/v1/windows", content=big, timeout=30, headers=ACME)
        assert r.status_code == 413
        for params in ({"sort": "bogus"}, {"order": "up"}, {"limit": 0}, {"offset": -1},
                       {"limit": "many"}):
            r = httpx.get(f"{srv.url}/v1/windows", params=params, headers=ACME)
            assert r.status_code == 400, (params, r.text)
            assert r.json()["error"]["code"] == "invalid_input"
        r = httpx.post(f"{srv.url}/v1/windows", headers=ACME,
                       json={"name": "w", "session": "s", "turn": 0})
        assert r.status_code == 400
    finally:
        srv.stop()


def test_export_import_over_http_a_failed_warm_up_and_users_windows(fake, tmp_path,
                                                                    tiny_model):
    from prometheus_client import CollectorRegistry

    from cwm_plugin.store.config import StoreConfig
    from cwm_plugin.store.kv_store import KVStore

    _, up = fake
    store = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0),
                    registry=CollectorRegistry())
    converse(store, salt("acme", "alice"), 3 * 16 + 5)
    records.write_record(store, records.served_key("tiny"),
                         {"model": "tiny", "namespace": NS, "workers": [list(w) for w in WORKERS]}, records.SERVED_LAYOUT, what="x")
    store.close()
    srv = start(up, tmp_path, tiny_model)
    try:
        assert httpx.post(f"{srv.url}/v1/windows", headers=ACME, timeout=30,
                          json={"name": "plan", "session": "alice"}).status_code == 200
        exported = httpx.get(f"{srv.url}/v1/windows/plan/export", headers=ACME, timeout=30)
        assert exported.status_code == 200 and exported.content.startswith(b"CWMWIN")
        r = httpx.post(f"{srv.url}/v1/windows/import", params={"name": "plan-2"},
                       content=exported.content, headers=ACME, timeout=30)
        assert r.status_code == 200 and r.json()["blocks"] == 3, r.text
        bad = bytearray(exported.content)
        bad[100] ^= 1
        r = httpx.post(f"{srv.url}/v1/windows/import", params={"name": "plan-3"},
                       content=bytes(bad), headers=ACME, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_window_file"
        names = {w["name"] for w in httpx.get(f"{srv.url}/v1/windows",
                                              headers=ACME).json()["data"]}
        assert names == {"plan", "plan-2"}
        # a user's windows: only that user sees them (the tenant's key alone does not)
        as_user = {**ACME, "X-CWM-User": "carol@example.com"}
        r = httpx.post(f"{srv.url}/v1/windows/import", params={"name": "mine"},
                       content=exported.content, headers=as_user, timeout=30)
        assert r.status_code == 200
        assert [w["name"] for w in httpx.get(f"{srv.url}/v1/windows",
                                             headers=as_user).json()["data"]] == ["mine"]
        assert httpx.get(f"{srv.url}/v1/windows/mine", headers=ACME).status_code == 404
        other = {**ACME, "X-CWM-User": "dave@example.com"}
        assert httpx.get(f"{srv.url}/v1/windows/mine", headers=other).status_code == 404
        warmed = httpx.post(f"{srv.url}/v1/windows/plan/thaw", headers=ACME, timeout=60,
                            json={"session": "carl", "warm": True})
        assert warmed.status_code == 200 and "usage" not in warmed.json()["warm"]
        # the warm-up's prefill is the caller's usage (and spent from its quota)
        assert httpx.get(f"{srv.url}/v1/usage", headers=ACME).json()["total"][
            "prompt_tokens"] >= 3 * 16
        up.stop()                                     # the engine is gone: warm-up fails
        r = httpx.post(f"{srv.url}/v1/windows/plan/thaw", headers=ACME, timeout=60,
                       json={"session": "bob", "warm": True})
        assert r.status_code == 200, r.text          # the thaw stands
        body = r.json()
        assert body["warm"]["error"] and any("warm-up failed" in w for w in body["warnings"])
        assert body["blocks_found"] == 3
    finally:
        srv.stop()
