"""``cwm mcp``: serve the window tools over stdio to an MCP client (an agent)."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("mcp", help="MCP server (stdio) with the context-window tools")
    p.add_argument("--url", default=os.environ.get("CWM_SIDECAR_URL", "http://127.0.0.1:8080"),
                   help="the sidecar to talk to (with --api-key or $CWM_API_KEY)")
    p.add_argument("--api-key", default=os.environ.get("CWM_API_KEY"))
    p.add_argument("--store", help="open this KV store (YAML settings) directly instead")
    p.add_argument("--tenant", help="the tenant, with --store")
    p.add_argument("--secret-env", default="CWM_SIDECAR_SECRET")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from cwm_plugin.mcp.server import build_server
    from cwm_plugin.windows.cli import client_from_args

    # stdout carries the protocol: every log line goes to stderr
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, force=True)
    build_server(client_from_args(args)).run("stdio")
    return 0
