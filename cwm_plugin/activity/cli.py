"""``cwm activity show [--quick] | verify``: the activity log from the command line.

The log's folder is ``--root DIR``, else ``activity.root`` of the sidecar config given with
``--config``. ``show`` prints the markdown lines (``--quick``: the last ``--hours`` hours, at
most ``--limit`` entries; else the whole log, ``--offset``/``--limit`` to page; ``--json`` for
JSONL), every principal's chain merged by time; ``verify`` checks each principal's hash chain
and the markdown beside it (and the single-chain files a move kept) and exits 1 naming every
problem, 0 when the log is intact, printing each chain's head (what to record elsewhere).
Opening a single-chain log moves it first (``log.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cwm_plugin.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("activity", help="show or verify the append-only activity "
                                                   "log")
    sub = group.add_subparsers(dest="activity_command", required=True)
    for name, fn, help_ in (("show", _show, "print the log (or its last hours: --quick)"),
                            ("verify", _verify, "check the hash chain and the markdown")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--root", help="the log's folder")
        p.add_argument("--config", help="a sidecar YAML whose activity.root names the folder")
        p.set_defaults(func=fn)
        if name == "show":
            p.add_argument("--quick", action="store_true", help="only the last --hours hours")
            p.add_argument("--hours", type=float, default=24.0)
            p.add_argument("--limit", type=int, default=None,
                           help="at most this many entries (--quick: 10)")
            p.add_argument("--offset", type=int, default=0)
            p.add_argument("--json", action="store_true", help="one JSON entry a line")


def root_of(args: argparse.Namespace) -> Path:
    if args.root:
        return Path(args.root)
    if args.config:
        from cwm_plugin.activity.settings import load_activity_settings

        settings = load_activity_settings(args.config)
        if settings is None:
            raise ConfigError(f"{args.config} has no `activity` section")
        return settings.root
    raise ConfigError("say where the log is", hint="--root DIR or --config sidecar.yaml")


def _open(args: argparse.Namespace):
    from cwm_plugin.activity.log import ActivityLog

    if args.config and not args.root:  # a log in PostgreSQL, as the sidecar's settings say
        from cwm_plugin.activity.settings import load_activity_settings

        settings = load_activity_settings(args.config)
        if settings is not None and settings.backend == "postgres" and settings.postgres_url:
            from cwm_plugin.activity.postgres import PostgresActivityLog

            return PostgresActivityLog(settings.postgres_url.get_secret_value())
    root = root_of(args)
    if not root.is_dir():
        raise ConfigError(f"no activity log at {root}")
    return ActivityLog(root)


def _show(args: argparse.Namespace) -> int:
    log = _open(args)
    if args.quick:
        entries = log.quick(hours=args.hours, limit=args.limit or 10)
    else:
        entries, _ = log.page(offset=max(0, args.offset), limit=args.limit or 10**9)
    for e in entries:
        print(json.dumps(e.public(), sort_keys=True) if args.json else e.markdown())
    return 0


def _verify(args: argparse.Namespace) -> int:
    log = _open(args)
    problems = log.verify()
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"activity log at {log.root}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    heads = log.heads()
    print(f"activity log at {log.root}: intact, {len(log.entries())} entries in "
          f"{len(heads)} chain(s)")
    for principal, head in heads.items():
        print(f"  {principal}: head {head}")
    return 0
