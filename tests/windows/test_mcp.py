"""Every MCP tool through a real MCP client session over stdio: ``cwm mcp --store`` as a
subprocess, the official SDK's stdio client, a real store holding blocks as the connector
leaves them."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
from window_helpers import converse

from cwm_plugin.sidecar.identity import derive_salt

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


async def _session_calls(store_yaml: str) -> dict:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(
        command=sys.executable, args=["-m", "cwm_plugin.cli", "mcp", "--store", store_yaml,
                                      "--tenant", "acme"],
        env={**os.environ, "CWM_SIDECAR_SECRET": SECRET})
    out: dict = {}
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        out["tools"] = {t.name for t in (await session.list_tools()).tools}

        async def call(tool: str, **args):
            res = await session.call_tool(tool, args)
            if _field(res, "is_error", "isError"):
                return ("error", res.content[0].text)
            return _payload(res)

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


def test_every_tool_through_a_real_mcp_client_over_stdio(tmp_path):
    from prometheus_client import CollectorRegistry

    from cwm_plugin.store.config import StoreConfig
    from cwm_plugin.store.tiered import KVStore

    store = KVStore(StoreConfig(disk_path=str(tmp_path / "kv"), memory_bytes=0),
                    registry=CollectorRegistry())
    converse(store, derive_salt(SECRET.encode(), "acme", "alice"), 3 * 16 + 5)
    store.close()
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
