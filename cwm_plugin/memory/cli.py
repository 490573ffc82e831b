"""``cwm memory``: reindex, import, search, add, check and show a folder's file-first memory;
migrate it into PostgreSQL and export it back.

Settings come from ``--config`` (the sidecar's YAML: its ``memory`` section, so that an index
written here is the one the sidecar loads) and from flags, which win over the file. Without
``--config`` the defaults are the sidecar's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cwm_plugin import pg_scope
from cwm_plugin.errors import ConfigError
from cwm_plugin.memory.models import CATEGORIES

# flag -> MemoryConfig field, for the search and chunking settings
TUNING = {"chunk_tokens": int, "chunk_overlap": int, "bm25_weight": float,
          "vector_weight": float, "chunk_vector_weight": float, "candidate_multiplier": int,
          "mmr_lambda": float, "recency_half_life_days": float, "max_facts": int}


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """``make_service`` keywords: the config file's memory section, then the flags."""
    kw: dict[str, Any] = {"tokenizer": "tiktoken:cl100k_base", "embedder": "local"}
    if args.config:
        from cwm_plugin.memory.settings import load_memory_settings, service_kwargs

        kw = service_kwargs(load_memory_settings(args.config))
    if args.root is not None:
        kw["root"] = args.root
    if "root" not in kw:
        raise ConfigError("no memory root", hint="pass --root or --config")
    for flag in ("tokenizer", "embedder", "embedder_url", "embedder_model",
                 *TUNING):
        value = getattr(args, flag, None)
        if value is not None:
            kw[flag] = value
    return kw


def _service(args: argparse.Namespace):
    from cwm_plugin.memory.service.factory import make_service

    kw = _settings(args)
    return make_service(kw.pop("root"), **kw)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="the sidecar's YAML (its memory section)")
    p.add_argument("--root", type=Path, help="memory root folder (overrides --config)")
    p.add_argument("--tokenizer", help="counts chunk sizes: tiktoken:<encoding>, a tokenizer "
                                       "folder, or heuristic (default tiktoken:cl100k_base)")
    p.add_argument("--embedder", choices=("local", "openai", "hashing"),
                   help="default local (MiniLM)")
    p.add_argument("--embedder-url")
    p.add_argument("--embedder-model")
    g = p.add_argument_group("search and chunking (default: the sidecar's defaults)")
    for name, kind in TUNING.items():
        g.add_argument("--" + name.replace("_", "-"), type=kind, dest=name)


def _folder(p: argparse.ArgumentParser, required: bool = False) -> None:
    # --tenant: another name for it (a tenant's memory is the folder of its name)
    p.add_argument("--folder", "--tenant", dest="folder", metavar="FOLDER", required=required,
                   help="the memory folder under the root: a tenant's name, a user's "
                        "u-<32 hex>, global or project.<name>"
                        + ("" if required else " (default: all)"))


def cmd_reindex(args: argparse.Namespace) -> int:
    svc = _service(args)
    n = svc.reindex(args.folder, progress=True)
    print(f"{n} chunks indexed")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    svc = _service(args)
    hits = svc.search(args.folder, args.query, args.k, mode=args.mode, session=args.session)
    if args.memories:
        hits = svc.search_memories(args.folder, args.query, args.k, mode=args.mode) + hits
    if args.json:
        print(json.dumps([h.__dict__ for h in hits], indent=2))
        return 0
    for i, h in enumerate(hits, 1):
        print(f"#{i} score {h.score:.3f} {h.source} turns {','.join(h.turn_ids)}")
        print("   " + h.text.replace("\n", "\n   "))
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    svc = _service(args)
    m = svc.add_memory(args.folder, args.text, args.category, args.importance)
    print(f"{m.id} ({m.category}, {m.importance:.2f}) {m.text}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from cwm_plugin.memory.files.markdown import MemoryFiles
    from cwm_plugin.memory.service.facts_file import access_counts

    files = MemoryFiles(args.root)
    if args.session:
        for t in files.read_turns(args.folder, args.session):
            print(f"[{t.ts}] {t.turn_id} {t.role}: {t.content}")
        got = files.read_summary(args.folder, args.session)
        if got:
            print(f"\nsummary (up to {got[1] or '?'}): {got[0]}")
        return 0
    print(f"sessions: {', '.join(files.sessions(args.folder)) or '(none)'}")
    counts = access_counts(args.root, args.folder)
    for m in files.read_memories(args.folder, history=True):
        m.access_count += counts.get(m.id, 0)
        where = f" ({m.source})" if m.source else ""
        if m.active:
            print(f"- {m.id} [{m.category} {m.importance:.2f} used {m.access_count}x] "
                  f"{m.text}{where}")
        else:
            print(f"- {m.id} replaced by {m.replaced_by} on {m.until[:10]}: {m.text}{where}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from cwm_plugin.memory.service.importer import import_sessions, read_conversations

    conversations = [c for path in args.files for c in read_conversations(path)]
    svc = _service(args)
    try:
        stats = import_sessions(svc, args.folder, conversations, progress=True,
                                workers=args.workers)
    finally:
        svc.close()
    print(f"imported {stats.sessions} sessions ({stats.turns} turns, {stats.chunks} chunks, "
          f"{stats.tokens} tokens) in {stats.seconds:.1f} s: {stats.tokens_per_s:.0f} tokens/s")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from cwm_plugin.memory.files.check import check
    from cwm_plugin.memory.files.markdown import MemoryFiles

    problems = check(MemoryFiles(args.root), args.folder)
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s) in {args.folder or 'all folders'}")
    return 1 if problems else 0


def _postgres_url(args: argparse.Namespace) -> str:
    """``--postgres-url``, else the ``--config`` file's memory.postgres_url, else
    ``$CWM_POSTGRES_URL``."""
    if args.postgres_url:
        return args.postgres_url
    from cwm_plugin.memory.settings import POSTGRES_URL_ENV, load_memory_settings

    if args.config:
        url = load_memory_settings(args.config).postgres_url
        if url is not None:
            return url.get_secret_value()
    if os.environ.get(POSTGRES_URL_ENV):
        return os.environ[POSTGRES_URL_ENV]
    raise ConfigError("no PostgreSQL to copy with",
                      hint=f"pass --postgres-url, or --config with memory.postgres_url, or set "
                           f"${POSTGRES_URL_ENV}")


def _copy(args: argparse.Namespace, into_postgres: bool) -> int:
    from cwm_plugin.memory.files.markdown import MemoryFiles
    from cwm_plugin.memory.postgres.transfer import copy_memory
    from cwm_plugin.memory.postgres.truth import PostgresTruth

    root = args.root
    if root is None and args.config:
        from cwm_plugin.memory.settings import load_memory_settings

        root = load_memory_settings(args.config).root
    if root is None:
        raise ConfigError("no memory root", hint="pass --root or --config")
    files = MemoryFiles(root)
    url = _postgres_url(args)
    pg = PostgresTruth(url, root)
    try:
        src, dst = (files, pg) if into_postgres else (pg, files)
        report = copy_memory(src, dst, [args.folder] if args.folder else None)
    finally:
        pg.close()
    print(report.line())
    for c in report.conflicts:
        print(f"conflict: {c}")
    if into_postgres:
        _index_in_database(args, url, [args.folder] if args.folder else files.folders())
    return 1 if report.conflicts else 0


def _index_in_database(args: argparse.Namespace, url: str, folders: list[str]) -> None:
    """After a migrate: build the search index in the database (``memory.candidates:
    database``) with the embedder and chunking of ``--config``, so no replica's first
    search of a folder embeds all of it; without ``--config`` the first search does."""
    from pydantic import SecretStr
    from tqdm import tqdm

    from cwm_plugin.memory.service.factory import service_from_settings
    from cwm_plugin.memory.settings import load_memory_settings

    if not args.config:
        print("the search index in the database is built by each folder's first search "
              "(pass --config to build it now, with the sidecar's embedder)")
        return
    settings = load_memory_settings(args.config)
    if settings.candidates != "database":
        return
    settings = settings.model_copy(update={"backend": "postgres",
                                           "postgres_url": SecretStr(url)})
    svc = service_from_settings(settings)
    try:
        total = sum(len(svc.files.sessions(f)) for f in folders)
        with tqdm(total=total, desc="index in the database", unit="session") as bar:
            chunks = sum(svc.indexes.get(f, bar).n_docs for f in folders)
    finally:
        svc.close()
    print(f"indexed in the database: {len(folders)} folder(s), {chunks} chunks")


def cmd_migrate(args: argparse.Namespace) -> int:
    return _copy(args, into_postgres=True)


def cmd_export(args: argparse.Namespace) -> int:
    return _copy(args, into_postgres=False)


def _operator(cmd: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``cmd`` as the operator's: every folder in scope (``pg_scope``: the database's
    row-level security), as the markdown files under --root are to whoever can read them."""
    def run(args: argparse.Namespace) -> int:
        with pg_scope.scoped(pg_scope.EVERYTHING):
            return cmd(args)
    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser(
        "memory", help="file-first memory: reindex, import, search, add, check, show, "
                       "migrate (into PostgreSQL), export")
    sub = group.add_subparsers(dest="memory_cmd", required=True)

    p = sub.add_parser("reindex", help="rebuild the indexes from the markdown files and save "
                                       "them (a running sidecar on this root loads them)")
    _common(p)
    _folder(p)
    p.set_defaults(func=_operator(cmd_reindex))

    p = sub.add_parser("import", help="import past conversations in bulk: OpenAI messages "
                                      "(.jsonl, one conversation a line) or LoCoMo (.json)")
    _common(p)
    _folder(p, required=True)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="processes embedding a large import (local MiniLM; default: one a core)")
    p.add_argument("files", nargs="+", type=Path)
    p.set_defaults(func=_operator(cmd_import))

    p = sub.add_parser("search", help="search a folder's memory")
    _common(p)
    _folder(p, required=True)
    p.add_argument("query")
    p.add_argument("-k", type=int, default=5)
    p.add_argument("--mode", default="hybrid", choices=("hybrid", "bm25", "vector"))
    p.add_argument("--session")
    p.add_argument("--memories", action="store_true",
                   help="also search the durable memories (listed first)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_operator(cmd_search))

    p = sub.add_parser("add", help="add a durable memory")
    _common(p)
    _folder(p, required=True)
    p.add_argument("--category", required=True, choices=CATEGORIES)
    p.add_argument("--importance", type=float, default=0.5)
    p.add_argument("text")
    p.set_defaults(func=_operator(cmd_add))

    p = sub.add_parser("check", help="list damaged lines in the memory files (they are "
                                     "skipped when read); exit 1 if there are any")
    p.add_argument("--root", type=Path, required=True)
    _folder(p)
    p.set_defaults(func=_operator(cmd_check))

    for name, func, what in (
            ("migrate", cmd_migrate, "copy a file memory (markdown under --root) into "
                                     "PostgreSQL, for memory.backend: postgres"),
            ("export", cmd_export, "write a PostgreSQL memory out as markdown files under "
                                   "--root")):
        p = sub.add_parser(name, help=f"{what}; run again, it resumes (a session that "
                                      "differs is reported, never overwritten; exit 1)")
        p.add_argument("--config", type=Path, help="the sidecar's YAML (its memory section)")
        p.add_argument("--root", type=Path, help="the markdown memory root (overrides --config)")
        p.add_argument("--postgres-url", help="default: --config's memory.postgres_url, else "
                                              "$CWM_POSTGRES_URL")
        _folder(p)
        p.set_defaults(func=_operator(func))

    p = sub.add_parser("show", help="show a folder's sessions and memories, or one transcript")
    p.add_argument("--root", type=Path, required=True)
    _folder(p, required=True)
    p.add_argument("--session")
    p.set_defaults(func=_operator(cmd_show))
