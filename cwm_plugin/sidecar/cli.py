"""``cwm serve``: run the memory sidecar in front of a vLLM OpenAI server."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible memory sidecar",
                              description=__doc__)
    p.add_argument("--config", required=True, help="sidecar YAML (see configs/sidecar.yaml)")
    p.add_argument("--upstream", help="vLLM base URL, e.g. http://127.0.0.1:8000 "
                                      "(overrides upstream.url in the config)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from cwm_plugin.errors import ConfigError
    from cwm_plugin.sidecar.app import create_app
    from cwm_plugin.sidecar.server_limits import uvicorn_config
    from cwm_plugin.sidecar.settings import load_settings

    settings = load_settings(args.config)
    if args.upstream:
        if settings.upstreams:
            raise ConfigError("--upstream replaces upstream.url, but this config lists "
                              "`upstreams`", hint="set each one's url in the config")
        settings.upstream.url = args.upstream
    app = create_app(settings)
    log.info("cwm sidecar on http://%s:%d -> %s (%d tenants, memory at %s)", args.host,
             args.port, ", ".join(f"{u.name}={u.url}" for u in settings.endpoints()),
             len(settings.tenants), settings.memory.root)
    uvicorn.Server(uvicorn_config(app, host=args.host, port=args.port, limits=settings.server,
                                  log_level=args.log_level, access_log=False,
                                  timeout_graceful_shutdown=10)).run()
    return 0
