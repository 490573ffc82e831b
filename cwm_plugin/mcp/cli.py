"""``cwm mcp``: serve the window tools over stdio to an MCP client (an agent)."""

from __future__ import annotations

import argparse
import logging
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    from cwm_plugin.windows.cli import client_options

    p = subparsers.add_parser("mcp", help="MCP server (stdio) with the context-window tools")
    client_options(p)
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from cwm_plugin.mcp.server import build_server
    from cwm_plugin.windows.cli import client_from_args

    # stdout carries the protocol: every log line goes to stderr
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, force=True)
    build_server(client_from_args(args)).run("stdio")
    return 0
