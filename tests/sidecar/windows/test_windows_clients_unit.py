"""REST, the CLI and MCP agree, over a real sidecar (real HTTP, a fake upstream, a real disk
store laid out as the connector leaves it): the HTTP client raises the sidecar's error codes
and its export errors, acts as a user, ``--store`` applies the sidecar's windows settings, a
warm-up goes to the served model, and names are matched whole."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry
from sidecar_helpers import KEYS, SECRET, make_settings, salt

from cwm_plugin.cli import build_parser, main
from cwm_plugin.connector import records
from cwm_plugin.errors import CWMError
from cwm_plugin.sidecar.app import create_app
from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread
from cwm_plugin.windows.cli import client_from_args
from cwm_plugin.windows.client import HttpWindows
from cwm_plugin.windows.engine import WindowEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from window_helpers import BS, NS, converse  # noqa: E402

pytestmark = pytest.mark.unit
ACME = {"Authorization": f"Bearer {KEYS['acme']}"}


@pytest.fixture
def fake() -> Iterator[ServerThread]:
    with ServerThread(FakeUpstream(model="tiny").app) as up:
        yield up


def store_at(path: Path) -> KVStore:
    return KVStore(StoreConfig(disk_path=str(path), memory_bytes=0), registry=CollectorRegistry())


def start(up_url: str, tmp_path: Path, tiny_model: Path, **over) -> ServerThread:
    return ServerThread(create_app(make_settings(up_url, tmp_path / "memory", tiny_model,
                                                 **over))).start()


def windows(tmp_path: Path, **more) -> dict:
    return {"windows": {"store": {"disk_path": str(tmp_path / "kv")}, "wait_s": 1,
                        "settle_s": 0, **more}}


def code_of(fn, *args) -> tuple[str, str]:
    """The code and message of the error ``fn(*args)`` raises."""
    with pytest.raises(CWMError) as exc:
        fn(*args)
    return exc.value.code, str(exc.value)


def test_the_http_client_raises_the_sidecars_codes_and_export_errors(fake, tmp_path,
                                                                    tiny_model):
    store = store_at(tmp_path / "kv")
    converse(store, salt("acme", "s"), 3 * BS + 2)
    store.close()
    for over, call, code in (
            ({}, lambda c: c.list(), "windows_unavailable"),
            (windows(tmp_path, tenant_quota_bytes=1), lambda c: c.freeze("w", "s"),
             "pin_quota_exceeded")):
        srv = start(fake.url, tmp_path, tiny_model, **over)
        try:
            assert code_of(call, HttpWindows(srv.url, KEYS["acme"]))[0] == code
        finally:
            srv.stop()
    srv = start(fake.url, tmp_path, tiny_model, **windows(tmp_path))
    try:
        acme = HttpWindows(srv.url, KEYS["acme"])
        assert acme.freeze("plan", "s")["blocks"] == 3
        assert code_of(HttpWindows(srv.url, KEYS["beta"]).stats)[0] == "permission_denied"
        lost = store_at(tmp_path / "kv")        # a block of the window is gone from the store
        gone = WindowEngine(lost).window_keys(WindowEngine(lost).get("acme", "plan"))[0][1:2]
        lost.unpin_many(gone)
        lost.delete_many(gone)
        lost.close()
        code, message = code_of(lambda: acme.export("plan", str(tmp_path / "plan.cwmw")))
        assert code == "window_incomplete" and "no longer stored" in message
    finally:
        srv.stop()


def test_the_cli_and_mcp_act_as_a_user_over_http(fake, tmp_path, tiny_model):
    store = store_at(tmp_path / "kv")
    converse(store, salt("acme", "work", user="carol@example.com"), 2 * BS + 1)
    store.close()
    srv = start(fake.url, tmp_path, tiny_model, **windows(tmp_path))
    try:
        args = build_parser().parse_args(["mcp", "--url", srv.url, "--api-key", KEYS["acme"],
                                          "--user", "carol@example.com"])
        carol = client_from_args(args)
        assert carol.freeze("mine", "work")["blocks"] == 2
        assert [w["name"] for w in carol.list()["data"]] == ["mine"]
        assert HttpWindows(srv.url, KEYS["acme"]).list()["data"] == []   # the tenant's own
    finally:
        srv.stop()


def test_window_store_cli_applies_the_sidecars_windows_settings(tmp_path, capsys,
                                                                monkeypatch):
    store = store_at(tmp_path / "kv")
    converse(store, salt("acme", "s"), 3 * BS, turn=1, keep=2)
    converse(store, salt("acme", "s"), 4 * BS, turn=2, keep=2)
    converse(store, salt("acme", "other"), 2 * BS)
    store.close()
    monkeypatch.setenv("CWM_SIDECAR_SECRET", SECRET)

    def cli(*argv: str, **settings) -> int:
        cfg = tmp_path / "sidecar.yaml"
        cfg.write_text(yaml.safe_dump({"tenants": [], **windows(tmp_path, **settings)}))
        return main(["window", *argv, "--store", str(cfg), "--tenant", "acme", "--json"])

    # keep_turns 2, as vLLM was told: turn 2 sits in slot 0 (with 8, looked for in slot 2)
    assert cli("freeze", "w1", "--session", "s", "--turn", "2", keep_turns=2) == 0
    w1 = json.loads(capsys.readouterr().out)
    assert w1["turn"] == 2 and w1["tokens"] == 4 * BS
    assert cli("freeze", "w2", "--session", "s", "--turn", "1", keep_turns=2,
               max_ttl_s=60) == 0
    w2 = json.loads(capsys.readouterr().out)
    assert w2["turn"] == 1 and 0 < w2["expires"] - w2["created"] <= 60   # max_ttl_s
    assert cli("freeze", "w3", "--session", "other", tenant_quota_bytes=1) == 2
    assert "pin_quota_exceeded" in capsys.readouterr().err          # the tenant quota


def test_a_warm_up_goes_to_the_served_model_not_the_model_paths_basename(tmp_path,
                                                                         tiny_model):
    other, tiny = FakeUpstream(model="other"), FakeUpstream(model="tiny")
    store = store_at(tmp_path / "kv")
    converse(store, salt("acme", "s"), 2 * BS + 1, served="tiny",
             namespace={**NS, "model": "tiny-weights"})
    records.write_record(store, records.served_key("tiny"), {
        "model": "tiny", "namespace": NS, "workers": []}, records.SERVED_LAYOUT, what="x")
    store.close()
    with ServerThread(other.app) as up1, ServerThread(tiny.app) as up2:
        srv = start(up1.url, tmp_path, tiny_model, upstreams=[
            {"name": "first", "url": up1.url}, {"name": "second", "url": up2.url}],
            **windows(tmp_path))
        try:
            w = httpx.post(f"{srv.url}/v1/windows", headers=ACME, timeout=60,
                           json={"name": "w", "session": "s"})
            assert w.status_code == 200 and w.json()["model"] == "tiny", w.text
            r = httpx.post(f"{srv.url}/v1/windows/w/thaw", headers=ACME, timeout=60,
                           json={"session": "t", "warm": True})
            assert r.status_code == 200 and r.json()["warm"]["model"] == "tiny", r.text
            assert tiny.bodies("/v1/completions") and not other.bodies("/v1/completions")
        finally:
            srv.stop()


def test_names_and_tags_are_matched_whole(fake, tmp_path, tiny_model):
    store = store_at(tmp_path / "kv")
    converse(store, salt("acme", "s"), 2 * BS)
    store.close()
    srv = start(fake.url, tmp_path, tiny_model, **windows(tmp_path))
    try:
        for body in ({"name": "plan\n", "session": "s"},
                     {"name": "plan", "session": "s", "tags": ["ok", "x\n"]}):
            r = httpx.post(f"{srv.url}/v1/windows", headers=ACME, timeout=30, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_input"
        r = httpx.get(f"{srv.url}/v1/windows/plan%0A/export", headers=ACME, timeout=30)
        assert r.status_code == 400
        assert httpx.get(f"{srv.url}/v1/windows", headers=ACME).json()["data"] == []
    finally:
        srv.stop()
