"""MCP tools for agents: context windows and cache health over stdio (``cwm mcp``)."""
