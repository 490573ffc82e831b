"""``cwm memory``: reindex, search, add and show a tenant's file-first memory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cwm_plugin.memory.models import CATEGORIES


def _service(args: argparse.Namespace):
    from cwm_plugin.memory.factory import make_service

    return make_service(args.root, tokenizer=args.tokenizer, embedder=args.embedder,
                        embedder_url=args.embedder_url, embedder_model=args.embedder_model)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, required=True, help="memory root folder")
    p.add_argument("--tokenizer", default="tiktoken:cl100k_base",
                   help="tiktoken:<encoding>, a tokenizer folder, or heuristic")
    p.add_argument("--embedder", default="local", choices=("local", "openai", "hashing"))
    p.add_argument("--embedder-url")
    p.add_argument("--embedder-model")


def cmd_reindex(args: argparse.Namespace) -> int:
    svc = _service(args)
    n = svc.reindex(args.tenant, progress=True)
    print(f"{n} chunks indexed")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    svc = _service(args)
    hits = svc.search(args.tenant, args.query, args.k, mode=args.mode, session=args.session)
    if args.json:
        print(json.dumps([h.__dict__ for h in hits], indent=2))
        return 0
    for i, h in enumerate(hits, 1):
        print(f"#{i} score {h.score:.3f} {h.source} turns {','.join(h.turn_ids)}")
        print("   " + h.text.replace("\n", "\n   "))
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    svc = _service(args)
    m = svc.add_memory(args.tenant, args.text, args.category, args.importance)
    print(f"{m.id} ({m.category}, {m.importance:.2f}) {m.text}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from cwm_plugin.memory.files import MemoryFiles

    files = MemoryFiles(args.root)
    if args.session:
        for t in files.read_turns(args.tenant, args.session):
            print(f"[{t.ts}] {t.turn_id} {t.role}: {t.content}")
        got = files.read_summary(args.tenant, args.session)
        if got:
            print(f"\nsummary (up to {got[1] or '?'}): {got[0]}")
        return 0
    print(f"sessions: {', '.join(files.sessions(args.tenant)) or '(none)'}")
    for m in files.read_memories(args.tenant):
        print(f"- {m.id} [{m.category} {m.importance:.2f} used {m.access_count}x] {m.text}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("memory", help="file-first memory: reindex, search, add, show")
    sub = group.add_subparsers(dest="memory_cmd", required=True)

    p = sub.add_parser("reindex", help="rebuild the indexes from the markdown files")
    _common(p)
    p.add_argument("--tenant")
    p.set_defaults(func=cmd_reindex)

    p = sub.add_parser("search", help="search a tenant's memory")
    _common(p)
    p.add_argument("--tenant", required=True)
    p.add_argument("query")
    p.add_argument("-k", type=int, default=5)
    p.add_argument("--mode", default="hybrid", choices=("hybrid", "bm25", "vector"))
    p.add_argument("--session")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("add", help="add a durable memory")
    _common(p)
    p.add_argument("--tenant", required=True)
    p.add_argument("--category", required=True, choices=CATEGORIES)
    p.add_argument("--importance", type=float, default=0.5)
    p.add_argument("text")
    p.set_defaults(func=cmd_add)

    p = sub.add_parser("show", help="show a tenant's sessions and memories, or one transcript")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--tenant", required=True)
    p.add_argument("--session")
    p.set_defaults(func=cmd_show)
