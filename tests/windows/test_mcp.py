"""Every MCP tool through a real MCP client session over stdio: ``cwm mcp --store`` as a
subprocess, the official SDK's stdio client, a real store holding blocks as the connector
leaves them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys

import pytest
from window_helpers import NS, WORKERS, converse

from cwm_plugin.connector import records
from cwm_plugin.salts import derive_salt

pytestmark = pytest.mark.unit
SECRET = "ab" * 32
TOOLS = {"window_freeze", "window_thaw", "window_clone", "window_list", "window_status",
         "window_delete", "session_list", "cache_stats", "health_check",
         "auto_freeze_config", "auto_freeze_check"}


def _field(result, snake: str, camel: str):
    """The SDK 2.x name, else the 1.x one."""
    return getattr(result, snake) if hasattr(result, snake) else getattr(result, camel, None)


def _payload(result) -> dict:
    sc = _field(result, "structured_content", "structuredContent")
    if sc:
        return sc.get("result", sc) if isinstance(sc, dict) and len(sc) == 1 else sc
    return json.loads(result.content[0].text)


@contextlib.asynccontextmanager
async def _mcp(args: list[str], env: dict):
    """``cwm mcp ARGS`` over stdio with the official SDK's client; yields (session, call):
    ``call(tool, **args)`` answers the tool's payload, or ("error", text)."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "cwm_plugin.cli", "mcp", *args],
                                   env={**os.environ, **env})
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()

        async def call(tool: str, **a):
            res = await session.call_tool(tool, a)
            if _field(res, "is_error", "isError"):
                return ("error", res.content[0].text)
            return _payload(res)

        yield session, call


async def _session_calls(store_yaml: str) -> dict:
    out: dict = {}
    async with _mcp(["--store", store_yaml, "--tenant", "acme"],
                    {"CWM_SIDECAR_SECRET": SECRET}) as (session, call):
        out["tools"] = {t.name for t in (await session.list_tools()).tools}
        out["freeze"] = await call("window_freeze", name="plan", session="alice",
                                   tags=["demo"])
        out["dup"] = await call("window_freeze", name="plan", session="alice")
        out["clone"] = await call("window_clone", name="plan", new_name="plan-b")
        out["list"] = await call("window_list", tag="demo")
        out["status"] = await call("window_status", name="plan-b")
        out["thaw"] = await call("window_thaw", name="plan-b", session="bob")
        out["unknown"] = await call("window_thaw", name="nope", session="bob")
        out["sessions"] = await call("session_list")
        out["stats"] = await call("cache_stats")
        out["health"] = await call("health_check")
        out["config"] = await call("auto_freeze_config", cooldown_s=0, checkpoint=0.8)
        out["check"] = await call("auto_freeze_check", session="alice", used_tokens=900,
                                  max_tokens=1000)
        out["delete"] = await call("window_delete", name="plan")
        out["after"] = await call("window_list")
    return out


def _a_conversation(tmp_path, serve: bool = True) -> None:
    """A disk store under tmp_path/kv holding alice's conversation (then served once)."""
    from prometheus_client import CollectorRegistry

    from cwm_plugin.store.config import StoreConfig
    from cwm_plugin.store.kv_store import KVStore

    store = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0),
                    registry=CollectorRegistry())
    converse(store, derive_salt(SECRET.encode(), "acme", "alice"), 3 * 16 + 5)
    if serve:
        serve_tiny(store)
    store.close()


def test_every_tool_through_a_real_mcp_client_over_stdio(tmp_path):
    _a_conversation(tmp_path, serve=False)
    (tmp_path / "store.yaml").write_text(f"store:\n  disk_path: {tmp_path / 'kv'}\n")
    out = asyncio.run(_session_calls(str(tmp_path / "store.yaml")))
    assert out["tools"] >= TOOLS
    assert out["freeze"]["name"] == "plan" and out["freeze"]["pinned_tokens"] == 48
    assert out["dup"][0] == "error" and "already_exists" in out["dup"][1]
    assert out["clone"]["parent"] == "plan"
    assert [w["name"] for w in out["list"]["data"]] == ["plan-b", "plan"]   # tags inherited
    assert out["status"]["restorable_tokens"] == 48 and out["status"]["parent"] == "plan"
    assert out["thaw"]["session"] == "bob" and out["thaw"]["restorable_tokens"] == 48
    assert out["unknown"][0] == "error" and "no window named 'nope'" in out["unknown"][1]
    assert {s["session"] for s in out["sessions"]["data"]} == {"alice"}
    assert out["stats"]["tiers"]["disk"]["blobs"] >= 6
    assert out["health"]["status"] == "ok"
    assert out["config"]["checkpoint"] == 0.8 and out["config"]["cooldown_s"] == 0
    assert out["check"]["level"] == "checkpoint" and out["check"]["frozen"].startswith(
        "auto-alice-")
    assert out["delete"]["deleted"]
    assert sorted(w["name"] for w in out["after"]["data"])[1:] == ["plan-b"]


async def _cwm_calls(args: list[str], env: dict, export: str) -> dict:
    """The context-window-manager's own parameter names, as an agent written for it calls."""
    out: dict = {}
    async with _mcp(args, env) as (_, call):
        out["freeze"] = await call("window_freeze", session_id="alice", window_name="plan",
                                   description="the plan", tags=["demo"], prompt_prefix="p")
        out["clone"] = await call("window_clone", source_window="plan",
                                  new_window_name="plan-b", description="a branch")
        out["list"] = await call("window_list", tags=["demo"], session_id="alice",
                                 search="PLA", sort_by="created_at", sort_order="asc",
                                 limit=10, offset=0)
        out["bad_sort"] = await call("window_list", sort_by="bogus")
        out["status"] = await call("window_status", window_name="plan-b",
                                   include_cache_stats=True, include_lineage=True)
        out["session"] = await call("window_status", session_id="alice",
                                    include_cache_stats=True)
        out["neither"] = await call("window_status")
        out["thaw"] = await call("window_thaw", window_name="plan-b", new_session_id="bob",
                                 warm_cache=False)
        out["renamed"] = await call("window_update", name="plan-b", new_name="plan-c",
                                    tags=["x"])
        out["delete"] = await call("window_delete", window_name="plan", delete_blocks=True)
        out["clear"] = await call("session_clear", session_id="bob")
        out["export"] = await call("window_export", name="plan-c", path=export)
        out["import"] = await call("window_import", path=export, name="plan-d")
        out["after"] = await call("window_list", sort_by="name", sort_order="asc")
    return out


def serve_tiny(store) -> None:
    """The served-model record a vLLM with the connector leaves (an import checks it)."""
    records.write_record(store, records.served_key("tiny"), {"model": "tiny", "namespace": NS, "workers": [list(w) for w in WORKERS]},
                         records.SERVED_LAYOUT, what="the served-model record")
    store.flush()


def _check_cwm_answers(out: dict) -> None:
    f = out["freeze"]
    assert f["success"] and f["window_name"] == "plan" and f["session_id"] == "alice"
    assert f["block_count"] == 3 and f["total_size_bytes"] > 0 and f["token_count"] == 53
    assert out["clone"]["lineage"] == ["plan"] and out["clone"]["description"] == "a branch"
    assert [w["window_name"] for w in out["list"]["windows"]] == ["plan", "plan-b"]
    assert out["list"]["has_next"] is False and out["list"]["total"] == 2
    assert out["bad_sort"][0] == "error" and "cannot sort by 'bogus'" in out["bad_sort"][1]
    st = out["status"]
    assert st["blocks_expected"] == 3 and st["blocks_found"] == 3 and st["warnings"] == []
    assert st["cache_stats"]["cache_complete"] and st["lineage"]["ancestors"] == ["plan"]
    assert out["session"]["window_count"] == 2
    assert out["session"]["cache_stats"]["total_blocks"] == 6
    assert out["neither"][0] == "error" and "window_name or session_id" in out["neither"][1]
    t = out["thaw"]
    assert t["session_id"] == "bob" and t["blocks_found"] == t["blocks_expected"] == 3
    assert out["renamed"]["name"] == "plan-c" and out["renamed"]["tags"] == ["x"]
    assert out["delete"]["blocks_deleted"] and out["clear"]["keys_deleted"] > 0
    assert out["export"]["bytes"] > 0 and out["import"]["blocks"] == 3
    assert [w["name"] for w in out["after"]["windows"]] == ["plan-c", "plan-d"]


def test_the_context_window_managers_parameters_over_stdio_on_the_store(tmp_path):
    _a_conversation(tmp_path)
    (tmp_path / "store.yaml").write_text(f"store:\n  disk_path: {tmp_path / 'kv'}\n")
    _check_cwm_answers(asyncio.run(_cwm_calls(
        ["--store", str(tmp_path / "store.yaml"), "--tenant", "acme"],
        {"CWM_SIDECAR_SECRET": SECRET}, str(tmp_path / "plan.cwmw"))))


def test_the_context_window_managers_parameters_over_stdio_through_a_running_sidecar(tmp_path):
    from cwm_plugin.sidecar.app import create_app
    from cwm_plugin.sidecar.identity.authenticator import hash_key
    from cwm_plugin.sidecar.settings import Settings
    from cwm_plugin.testing.fake_upstream import FakeUpstream
    from cwm_plugin.testing.server_thread import ServerThread

    _a_conversation(tmp_path)
    settings = Settings.model_validate({
        "secret": SECRET, "memory_enabled": False,
        "tenants": [{"name": "acme", "key_sha256": [hash_key("k-acme")]}],
        "windows": {"store": {"disk_path": str(tmp_path / "kv")}, "wait_s": 5}})
    fake = FakeUpstream(model="tiny")
    with ServerThread(fake.app) as up:
        settings.upstream.url = up.url
        with ServerThread(create_app(settings)) as srv:
            out = asyncio.run(_cwm_calls(["--url", srv.url], {"CWM_API_KEY": "k-acme"},
                                         str(tmp_path / "plan.cwmw")))
    _check_cwm_answers(out)
