"""``cwm window freeze|thaw|clone|ls|status|update|rm|export|import`` and ``cwm session clear``:
context windows from the command line.

By default the commands talk to a running sidecar (``--url``, ``--api-key`` or the
``CWM_SIDECAR_URL`` / ``CWM_API_KEY`` environment): the tenant is the key's, and ``--user``
(``$CWM_USER``) acts as one of its users (that user's windows and sessions). With
``--store FILE.yaml --tenant NAME`` they open the KV store directly: FILE is the sidecar's config
(its ``windows:`` section: the store, ``keep_turns``, the tenant quota, ``max_ttl_s``, as the
sidecar applies them; :mod:`.opening`) or a bare store file, and the sidecar's secret from
``$CWM_SIDECAR_SECRET`` derives the sessions' salts and the user's name, as the sidecar does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from cwm_plugin.errors import ConfigError

if TYPE_CHECKING:  # the client imports torch (through the store): `cwm --help`, `cwm store gc`
    from cwm_plugin.windows.client import WindowsClient  # and friends start without it


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("window", help="freeze, thaw, clone and inspect context "
                                                 "windows")
    sub = group.add_subparsers(dest="window_command", required=True)

    def cmd(name: str, help_: str, fn, parent: Any = sub) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help_)
        client_options(p)
        p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(func=fn)
        return p

    p = cmd("freeze", "freeze a session's context under a name", _freeze)
    p.add_argument("name")
    p.add_argument("--session", required=True)
    p.add_argument("--tag", action="append", default=[])
    p.add_argument("--description", default="")
    p.add_argument("--turn", type=int, help="an earlier client turn of the session (one of its "
                                            "last few; default: the latest)")
    p.add_argument("--ttl", type=float, dest="ttl_s", help="delete it after this many seconds")
    p = cmd("thaw", "restore a window into a session (default: its own)", _thaw)
    p.add_argument("name")
    p.add_argument("--into", dest="session")
    p.add_argument("--warm", action="store_true", help="prefill through vLLM now")
    p.add_argument("--model", help="refuse unless the window fits this served model")
    p = cmd("clone", "branch a window under a new name (no KV copied)", _clone)
    p.add_argument("name")
    p.add_argument("new_name")
    p = cmd("ls", "list windows", _ls)
    p.add_argument("--tag")
    p.add_argument("--model")
    p.add_argument("--session")
    p.add_argument("-q", "--query", dest="q")
    p.add_argument("--sort", default="created",
                   choices=("created", "updated", "name", "tokens", "size"))
    p.add_argument("--limit", type=int, default=50)
    p = cmd("status", "blocks, bytes and restorable tokens of a window", _status)
    p.add_argument("name")
    p = cmd("update", "rename a window, or replace its tags or description", _update)
    p.add_argument("name")
    p.add_argument("--rename", dest="new_name")
    p.add_argument("--tag", action="append", dest="tags", help="the new tags (repeat)")
    p.add_argument("--description")
    p = cmd("rm", "delete a window (blobs a clone still uses stay)", _rm)
    p.add_argument("name")
    p = cmd("export", "write a window to one portable file", _export)
    p.add_argument("name")
    p.add_argument("file")
    p = cmd("import", "import a window file (same model on this server)", _import)
    p.add_argument("file")
    p.add_argument("--name", help="import it under this name")
    session = subparsers.add_parser("session", help="a session's stored KV")
    ssub = session.add_subparsers(dest="session_command", required=True)
    p = cmd("clear", "erase a session's stored KV and records (its windows keep theirs)",
            _clear, ssub)
    p.add_argument("session")


def client_options(p: argparse.ArgumentParser) -> None:
    """How a command reaches windows (``cwm window ...``, ``cwm mcp``)."""
    p.add_argument("--url", default=os.environ.get("CWM_SIDECAR_URL", "http://127.0.0.1:8080"),
                   help="the sidecar to talk to (with --api-key or $CWM_API_KEY)")
    p.add_argument("--api-key", default=os.environ.get("CWM_API_KEY"))
    p.add_argument("--user", default=os.environ.get("CWM_USER"),
                   help="act as this user of the tenant (its own windows and sessions)")
    p.add_argument("--store", help="open the KV store directly: the sidecar's config (its "
                                   "windows: section) or a store's YAML settings")
    p.add_argument("--tenant", help="the tenant, with --store")
    p.add_argument("--secret-env", default="CWM_SIDECAR_SECRET",
                   help="environment variable holding the sidecar's secret (--store)")


def client_from_args(args: argparse.Namespace) -> WindowsClient:
    if args.store:
        from cwm_plugin.salts import derive_salt, owner_of, owner_salt, user_session
        from cwm_plugin.windows.client import LocalWindows
        from cwm_plugin.windows.opening import open_engine, windows_settings

        if not args.tenant:
            raise ConfigError("--store needs --tenant")
        secret = os.environ.get(args.secret_env, "").encode()
        if not secret:
            raise ConfigError(f"${args.secret_env} is not set",
                              hint="export the sidecar's secret to derive session salts")
        owner = owner_of(args.tenant, None if args.user is None else
                         user_session(secret, args.tenant, args.user))
        return LocalWindows(open_engine(*windows_settings(args.store)), owner,
                            lambda owner, s: derive_salt(secret, *owner_salt(owner, s)))
    if not args.api_key:
        raise ConfigError("no API key", hint="pass --api-key or set CWM_API_KEY (or use "
                                             "--store FILE --tenant NAME)")
    from cwm_plugin.windows.client import HttpWindows

    return HttpWindows(args.url, args.api_key, user=args.user)


def _out(args: argparse.Namespace, data: dict[str, Any], line: str) -> int:
    print(json.dumps(data, indent=2) if args.json else line)
    return 0


def _freeze(args: argparse.Namespace) -> int:
    w = client_from_args(args).freeze(args.name, args.session, tags=args.tag,
                                      description=args.description, turn=args.turn,
                                      ttl_s=args.ttl_s)
    return _out(args, w, f"frozen {w['name']}: {w['pinned_tokens']} of {w['tokens']} tokens "
                         f"pinned in {w['blocks']} blocks (session {w['session']})")


def _thaw(args: argparse.Namespace) -> int:
    r = client_from_args(args).thaw(args.name, args.session, warm=args.warm, model=args.model)
    warm = f"; vLLM restored {r['warm'].get('hits')} tokens" if r.get("warm") else ""
    return _out(args, r, f"thawed {r['name']} into session {r['session']}: "
                         f"{r['restorable_tokens']} of {r['tokens']} tokens restorable{warm}")


def _clone(args: argparse.Namespace) -> int:
    w = client_from_args(args).clone(args.name, args.new_name)
    return _out(args, w, f"cloned {args.name} -> {w['name']} ({w['blocks']} blocks shared)")


def _ls(args: argparse.Namespace) -> int:
    res = client_from_args(args).list(tag=args.tag, model=args.model, session=args.session,
                                      q=args.q, sort=args.sort, limit=args.limit)
    if args.json:
        return _out(args, res, "")
    print(f"{'name':32s} {'session':20s} {'tokens':>8s} {'model':16s} {'created':19s} tags")
    for w in res["data"]:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(w["created"]))
        print(f"{w['name']:32s} {w['session']:20s} {w['tokens']:>8d} {w['model'][:16]:16s} "
              f"{created} {','.join(w['tags'])}")
    print(f"{res['total']} window(s)", file=sys.stderr)
    return 0


def _status(args: argparse.Namespace) -> int:
    s = client_from_args(args).status(args.name)
    tiers = ", ".join(f"{t}: {v['blocks']} blocks ({v['pinned']} pinned, {v['bytes']:,} B)"
                      for t, v in s["tiers"].items())
    return _out(args, s, f"{s['name']}: {s['restorable_tokens']} of {s['tokens']} tokens "
                         f"restorable; {tiers}; ratio {s['compression_ratio']}; parent "
                         f"{s['parent'] or '-'}; children {', '.join(s['children']) or '-'}")


def _update(args: argparse.Namespace) -> int:
    w = client_from_args(args).update(args.name, new_name=args.new_name, tags=args.tags,
                                      description=args.description)
    return _out(args, w, f"updated {w['name']}: tags {','.join(w['tags']) or '-'}")


def _export(args: argparse.Namespace) -> int:
    r = client_from_args(args).export(args.name, args.file)
    return _out(args, r, f"exported {args.name} to {args.file} ({r['bytes']:,} bytes)")


def _import(args: argparse.Namespace) -> int:
    w = client_from_args(args).import_file(args.file, args.name)
    return _out(args, w, f"imported {w['name']}: {w['pinned_tokens']} of {w['tokens']} tokens "
                         f"in {w['blocks']} blocks")


def _clear(args: argparse.Namespace) -> int:
    r = client_from_args(args).clear_session(args.session)
    return _out(args, r, f"session {args.session}: {r['keys_deleted']} stored keys erased")


def _rm(args: argparse.Namespace) -> int:
    client_from_args(args).delete(args.name)
    return _out(args, {"deleted": args.name}, f"deleted {args.name}")
