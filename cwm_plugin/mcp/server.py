"""The MCP server (the official MCP Python SDK, stdio): context windows as agent tools.

Tool names follow the context-window-manager product, so its users can switch:
``window_freeze``, ``window_thaw``, ``window_clone``, ``window_list``, ``window_status``,
``window_delete``, ``session_list``, ``cache_stats``, ``health_check``,
``auto_freeze_config``, ``auto_freeze_check``. Each calls a
:class:`~cwm_plugin.windows.client.WindowsClient` -- a running sidecar (a tenant's API key) or
the store directly -- and a :class:`~cwm_plugin.errors.CWMError` becomes a tool error whose
message says what happened and what to do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from cwm_plugin.errors import CWMError
from cwm_plugin.windows.client import WindowsClient

INSTRUCTIONS = (
    "Context windows keep a conversation's exact KV cache under a name: freeze a session's "
    "context, thaw it later into any session (after a restart, on another server), clone it "
    "into branches. Thawing is a restore of the real KV tensors, not a replay of text.")


def _server_class() -> Any:
    try:
        from mcp.server.mcpserver import MCPServer
        from mcp.server.mcpserver.exceptions import ToolError
    except ImportError:                      # the SDK's 1.x names
        from mcp.server.fastmcp import FastMCP as MCPServer
        from mcp.server.fastmcp.exceptions import ToolError
    return MCPServer, ToolError


def build_server(client: WindowsClient) -> Any:
    server_cls, tool_error = _server_class()
    server = server_cls(name="cwm", instructions=INSTRUCTIONS)

    def tool(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kw: Any) -> dict[str, Any]:
            try:
                return fn(*args, **kw)
            except CWMError as exc:
                raise tool_error(f"[{exc.code}] {exc}") from exc
        return server.tool()(wrapped)

    @tool
    def window_freeze(name: str, session: str, tags: list[str] | None = None,
                      description: str = "") -> dict[str, Any]:
        """Freeze a session's context (its KV blocks) under a name."""
        return client.freeze(name, session, tags=tags, description=description)

    @tool
    def window_thaw(name: str, session: str | None = None, warm: bool = False,
                    model: str | None = None) -> dict[str, Any]:
        """Restore a window into a session (default: the one it was frozen from); the
        session's next request with the window's context hits the restored KV."""
        return client.thaw(name, session, warm=warm, model=model)

    @tool
    def window_clone(name: str, new_name: str) -> dict[str, Any]:
        """Branch a window under a new name; the KV blocks are shared, not copied."""
        return client.clone(name, new_name)

    @tool
    def window_list(tag: str | None = None, model: str | None = None,
                    session: str | None = None, query: str | None = None,
                    sort: str = "created", limit: int = 50, offset: int = 0
                    ) -> dict[str, Any]:
        """List windows (filter by tag, model, session, text; sort; paginate)."""
        return client.list(tag=tag, model=model, session=session, q=query, sort=sort,
                           limit=limit, offset=offset)

    @tool
    def window_status(name: str) -> dict[str, Any]:
        """Blocks per tier, bytes, compression, restorable tokens and lineage of a window."""
        return client.status(name)

    @tool
    def window_delete(name: str) -> dict[str, Any]:
        """Delete a window; blocks its clones or sessions still use are kept."""
        return client.delete(name)

    @tool
    def session_list() -> dict[str, Any]:
        """Sessions of this tenant that have windows or memory."""
        return client.sessions()

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
                           model: str | None = None) -> dict[str, Any]:
        """Show or change automatic checkpoints (fractions of the model's context; per
        model when ``model`` is given)."""
        return client.auto_freeze_config(enabled=enabled, warn=warn, checkpoint=checkpoint,
                                         cooldown_s=cooldown_s, model=model)

    @tool
    def auto_freeze_check(session: str, used_tokens: int | None = None,
                          max_tokens: int | None = None, model: str | None = None
                          ) -> dict[str, Any]:
        """How full a session's context is, and freeze it now if it is past the checkpoint
        threshold (and not cooling down)."""
        return client.auto_freeze_check(session, used_tokens=used_tokens,
                                        max_tokens=max_tokens, model=model)

    return server
