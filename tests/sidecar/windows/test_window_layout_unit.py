"""A user's window stored in the former layout (a manifest group and salt of the user's own,
written by hand: ``window_helpers.to_former_layout``) is the user's through the sidecar's
routes: listed, shown and thawed, its blocks restored. A real sidecar over real HTTP in front of
``cwm_plugin.testing.fake_upstream``, on a real disk store; no vLLM."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from sidecar_helpers import KEYS, SECRET, make_settings, salt
from window_helpers import BS, converse, to_former_layout

from cwm_plugin.salts import user_session
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.windows.engine import WindowEngine

pytestmark = pytest.mark.unit
ALICE = "alice@example.com"


def test_a_users_window_in_the_former_layout_is_listed_and_thawed_over_http(tmp_path: Path):
    owner = "acme/" + user_session(SECRET.encode(), "acme", ALICE)
    store = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0),
                    registry=CollectorRegistry())
    try:
        session_salt = salt("acme", "s1", user=ALICE)
        converse(store, session_salt, 3 * BS + 5)
        WindowEngine(store, wait_s=0).freeze(owner, "plan", session="s1", salt=session_salt,
                                             tags=["trip"])
        key, _ = to_former_layout(store, owner, "plan")
    finally:
        store.close()
    with ServerThread(FakeUpstream(model="tiny").app) as up:
        settings = make_settings(up.url, tmp_path / "mem", "tiktoken:cl100k_base",
                                 windows={"store": {"disk_path": str(tmp_path / "kv")}})
        with ServerThread(create_app(settings)) as srv:
            alice = {"Authorization": f"Bearer {KEYS['acme']}", "X-CWM-User": ALICE}
            r = httpx.get(f"{srv.url}/v1/windows", headers=alice, timeout=60)
            assert r.status_code == 200, r.text
            assert [(w["name"], w["tags"]) for w in r.json()["data"]] == [("plan", ["trip"])]
            r = httpx.get(f"{srv.url}/v1/windows/plan", headers=alice, timeout=60)
            assert r.status_code == 200 and r.json()["cache_complete"] is True, r.text
            r = httpx.post(f"{srv.url}/v1/windows/plan/thaw", headers=alice, timeout=60,
                           json={"session": "s2"})
            assert r.status_code == 200 and r.json()["restorable_tokens"] == 3 * BS, r.text
            bob = {"Authorization": f"Bearer {KEYS['acme']}", "X-CWM-User": "bob@example.com"}
            r = httpx.get(f"{srv.url}/v1/windows", headers=bob, timeout=60)
            assert r.json()["data"] == []                     # still only alice's
            assert srv.app.state.sidecar.windows.store.contains_many([key]) == [False]
