"""The MCP server (the official MCP Python SDK, stdio): context windows as agent tools.

Tool names follow the context-window-manager product, and every tool accepts its parameter
names as well as ours, so agents written for it work unchanged: ``window_freeze(session_id,
window_name, description, tags, prompt_prefix)``, ``window_thaw(window_name, new_session_id,
warm_cache, continuation_prompt)``, ``window_clone(source_window, new_window_name, ...)``,
``window_list(tags, model, session_id, search, sort_by, sort_order, limit, offset)``,
``window_status(window_name | session_id, include_cache_stats, include_lineage)``,
``window_delete(window_name, delete_blocks)``; and the answers carry its fields where we have
them (``block_count``, ``total_size_bytes``, ``cache_hit``, ``blocks_expected`` /
``blocks_found``, ``warnings``). Ours besides: ``window_update`` (rename, re-tag),
``window_export`` / ``window_import`` (a portable file), ``session_clear`` (erase a session's
stored KV), ``session_list``, ``cache_stats``, ``health_check``, ``auto_freeze_config``,
``auto_freeze_check``. Each calls a :class:`~cwm_plugin.windows.client.WindowsClient` -- a
running sidecar (a tenant's API key) or the store directly -- and a
:class:`~cwm_plugin.errors.CWMError` becomes a tool error whose message says what happened
and what to do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from cwm_plugin.errors import CWMError, InvalidInput
from cwm_plugin.windows.client import WindowsClient

INSTRUCTIONS = (
    "Context windows keep a conversation's exact KV cache under a name: freeze a session's "
    "context, thaw it later into any session (after a restart, on another server), clone it "
    "into branches, export it to a file. Thawing is a restore of the real KV tensors, not a "
    "replay of text; a thaw answers the conversation's messages so you can continue it.")


def _server_class() -> Any:
    try:
        from mcp.server.mcpserver import MCPServer
        from mcp.server.mcpserver.exceptions import ToolError
    except ImportError:                      # the SDK's 1.x names
        from mcp.server.fastmcp import FastMCP as MCPServer
        from mcp.server.fastmcp.exceptions import ToolError
    return MCPServer, ToolError


def one(ours: Any, theirs: Any, what: str, *, required: bool = True) -> Any:
    """The value given under either name (ours or the context-window-manager's)."""
    if ours is not None and theirs is not None and ours != theirs:
        raise InvalidInput(f"{what} given twice with different values")
    value = ours if ours is not None else theirs
    if value is None and required:
        raise InvalidInput(f"{what} is required")
    return value


def build_server(client: WindowsClient) -> Any:
    server_cls, tool_error = _server_class()
    server = server_cls(name="cwm", instructions=INSTRUCTIONS)

    def tool(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kw: Any) -> dict[str, Any]:
            try:
                return {"success": True, **fn(*args, **kw)}
            except CWMError as exc:
                raise tool_error(f"[{exc.code}] {exc}") from exc
        return server.tool()(wrapped)

    @tool
    def window_freeze(session_id: str | None = None, window_name: str | None = None,
                      description: str = "", tags: list[str] | None = None,
                      prompt_prefix: str = "", name: str | None = None,
                      session: str | None = None, turn: int | None = None,
                      ttl_s: float | None = None) -> dict[str, Any]:
        """Freeze a session's context (its KV blocks) under a name: its latest client turn,
        or ``turn`` (one of its last few); ``ttl_s``: gone after that many seconds."""
        return client.freeze(one(name, window_name, "window_name"),
                             one(session, session_id, "session_id"), tags=tags,
                             description=description, turn=turn, ttl_s=ttl_s,
                             prompt_prefix=prompt_prefix or None)

    @tool
    def window_thaw(window_name: str | None = None, new_session_id: str | None = None,
                    warm_cache: bool | None = None, continuation_prompt: str = "",
                    name: str | None = None, session: str | None = None,
                    warm: bool | None = None, model: str | None = None) -> dict[str, Any]:
        """Restore a window into a session (default: the one it was frozen from): the
        session's next request with the window's messages hits the restored KV. The answer
        holds those messages; ``continuation_prompt`` sends the next user message at once
        and answers the reply; ``warm_cache`` loads the KV into vLLM now and reports it."""
        target = one(session, new_session_id, "new_session_id", required=False)
        warm_up = one(warm, warm_cache, "warm_cache", required=False)
        if warm_up is None:  # the context-window-manager warms by default
            warm_up = window_name is not None
        out = client.thaw(one(name, window_name, "window_name"), target, warm=bool(warm_up),
                          model=model)
        if continuation_prompt:
            messages = [*(out.get("messages") or []),
                        {"role": "user", "content": continuation_prompt}]
            reply = client.continue_chat(out["session"], messages, model or out.get("model"))
            out["continuation"] = ((reply.get("choices") or [{}])[0].get("message") or {})
        out.setdefault("session_id", out.get("session"))
        return out

    @tool
    def window_clone(source_window: str | None = None, new_window_name: str | None = None,
                     description: str | None = None, tags: list[str] | None = None,
                     name: str | None = None, new_name: str | None = None) -> dict[str, Any]:
        """Branch a window under a new name; the KV blocks are shared, not copied."""
        out = client.clone(one(name, source_window, "source_window"),
                           one(new_name, new_window_name, "new_window_name"),
                           description=description, tags=tags)
        return {**out, "lineage": [out.get("parent")] if out.get("parent") else []}

    @tool
    def window_list(tags: list[str] | None = None, model: str | None = None,
                    session_id: str | None = None, search: str | None = None,
                    sort_by: str | None = None, sort_order: str | None = None,
                    limit: int = 20, offset: int = 0, tag: str | None = None,
                    session: str | None = None, query: str | None = None,
                    sort: str | None = None) -> dict[str, Any]:
        """List windows: filter by tags (all of them), model, session, text; sort by name,
        created(_at), tokens (token_count) or size (total_size_bytes); paginate."""
        wanted = [*(tags or []), *([tag] if tag else [])]
        out = client.list(tag=wanted or None, model=model,
                          session=one(session, session_id, "session_id", required=False),
                          q=one(query, search, "search", required=False),
                          sort=one(sort, sort_by, "sort_by", required=False) or "created",
                          order=sort_order or "desc", limit=max(1, min(limit, 1000)),
                          offset=offset)
        total = int(out.get("total", 0))
        return {**out, "windows": out.get("data", []), "limit": limit, "offset": offset,
                "has_next": offset + limit < total, "has_prev": offset > 0}

    @tool
    def window_status(window_name: str | None = None, session_id: str | None = None,
                      include_cache_stats: bool = False, include_lineage: bool = False,
                      name: str | None = None) -> dict[str, Any]:
        """Blocks per tier, bytes, compression, restorable tokens and lineage of a window; or
        a session's windows (``session_id``)."""
        window = one(name, window_name, "window_name", required=False)
        if (window is None) == (session_id is None):
            raise InvalidInput("give either window_name or session_id")
        if window is None:
            found = client.list(session=session_id, limit=1000)["data"]
            out: dict[str, Any] = {"type": "session", "session_id": session_id,
                                   "windows": found, "window_count": len(found)}
            if include_cache_stats:
                out["cache_stats"] = {"total_blocks": sum(w["block_count"] for w in found),
                                      "total_size_bytes": sum(w["total_size_bytes"]
                                                              for w in found)}
            return out
        st = client.status(window)
        out = {"type": "window", "window": st, **st}
        if include_cache_stats:
            out["cache_stats"] = {"tiers": st.get("tiers"), "stored": True,
                                  "blocks_available": st.get("blocks_found"),
                                  "cache_complete": st.get("cache_complete")}
        if include_lineage:
            ancestors = st.get("lineage") or []
            out["lineage"] = {"is_clone": bool(ancestors), "ancestors": ancestors,
                              "depth": len(ancestors), "children": st.get("children", []),
                              "parent_window": ancestors[-1] if ancestors else None}
        return out

    @tool
    def window_update(name: str, new_name: str | None = None, tags: list[str] | None = None,
                      description: str | None = None) -> dict[str, Any]:
        """Rename a window, or replace its tags or description."""
        return client.update(name, new_name=new_name, tags=tags, description=description)

    @tool
    def window_delete(window_name: str | None = None, delete_blocks: bool = True,
                      name: str | None = None) -> dict[str, Any]:
        """Delete a window. Its blocks are freed unless a clone or a session still uses them
        (``delete_blocks`` is accepted for compatibility: blocks are never left orphaned)."""
        out = client.delete(one(name, window_name, "window_name"))
        return {**out, "window_name": out.get("name"), "blocks_deleted": True}

    @tool
    def window_export(name: str, path: str) -> dict[str, Any]:
        """Write a window to one portable file (manifest, messages, blocks, checksums)."""
        return client.export(name, path)

    @tool
    def window_import(path: str, name: str | None = None) -> dict[str, Any]:
        """Import a window file exported on a server with the same model."""
        return client.import_file(path, name)

    @tool
    def session_clear(session: str | None = None, session_id: str | None = None
                      ) -> dict[str, Any]:
        """Erase a session's stored KV cache and records (its windows keep theirs)."""
        return client.clear_session(one(session, session_id, "session_id"))

    @tool
    def session_list() -> dict[str, Any]:
        """Sessions of this tenant that have windows or memory."""
        out = client.sessions()
        return {**out, "sessions": out.get("data", [])}

    @tool
    def cache_stats() -> dict[str, Any]:
        """Bytes, blobs, keys and pinned bytes per KV store tier."""
        return client.stats()

    @tool
    def health_check() -> dict[str, Any]:
        """Whether the service and its store tiers are reachable."""
        return client.health()

    @tool
    def auto_freeze_config(enabled: bool | None = None, warn: float | None = None,
                           checkpoint: float | None = None, cooldown_s: float | None = None,
                           model: str | None = None, token_threshold: float | None = None,
                           cooldown_seconds: float | None = None) -> dict[str, Any]:
        """Show or change automatic checkpoints (fractions of the model's context; per
        model when ``model`` is given)."""
        return client.auto_freeze_config(
            enabled=enabled, warn=warn,
            checkpoint=one(checkpoint, token_threshold, "token_threshold", required=False),
            cooldown_s=one(cooldown_s, cooldown_seconds, "cooldown_seconds", required=False),
            model=model)

    @tool
    def auto_freeze_check(session: str | None = None, used_tokens: int | None = None,
                          max_tokens: int | None = None, model: str | None = None,
                          session_id: str | None = None, token_count: int | None = None
                          ) -> dict[str, Any]:
        """How full a session's context is, and freeze it now if it is past the checkpoint
        threshold (and not cooling down)."""
        return client.auto_freeze_check(
            one(session, session_id, "session_id"),
            used_tokens=one(used_tokens, token_count, "token_count", required=False),
            max_tokens=max_tokens, model=model)

    return server
