"""A folder's index in PostgreSQL, read as search and selection read the in-process one: the
chunks (``search.py``'s ``Corpus``: :class:`PgChunks`) and the lines (``selection/lines.py``'s
line corpus: :class:`PgLines`).

Candidates come from the database: BM25's best from the postings (``bm25.py``), the nearest
lines from pgvector's HNSW index over the space's line vectors (inner product of unit vectors:
the cosine), with an iterative scan so a small folder in a large table still gets its ``k``.
The scores a candidate needs come from there too, computed where the vectors are: a chunk's
vector score is the best cosine of its lines plus ``chunk_weight`` times its centroid's (the
mean of its line vectors, normalised), as ``ChunkIndex.vector_score`` computes it. What the
ranking does with them (normalisation, fusion, priors, the pack) is unchanged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

import numpy as np
import psycopg
from psycopg import sql

from cwm_plugin import pg_scope
from cwm_plugin.errors import CWMError
from cwm_plugin.memory.index.chunking import Unit
from cwm_plugin.memory.index.pg.bm25 import CHUNKS, CONTEXT, LINES, Connect, PgBM25
from cwm_plugin.memory.index.pg.writer import line_key, vector_text
from cwm_plugin.memory.models import Hit
from cwm_plugin.pg_pool import STATEMENT_TIMEOUT_S

log = logging.getLogger(__name__)
T = TypeVar("T")
_NOTHING = object()  # (no spare connection was free)
SEP = "\x1f"
EXACT_LINES = 20_000  # a folder with up to this many lines is searched exactly
MAX_SCAN_TUPLES = 200_000  # the most lines a graph walk visits (pgvector's default: 20,000)


class Reader:
    """The connections a replica's searches read through. Inside :meth:`snapshot` every read
    of this thread goes through one connection, in one ``REPEATABLE READ`` read-only
    transaction: a search sees one state of the index however other replicas write meanwhile
    (a chunk re-made under it is never half there), and takes one pooled connection, not one
    a query. Outside a snapshot each read takes its own. :meth:`alongside` runs a read on a
    second connection, in the same snapshot, while the search goes on (its keyword side
    while its vector side runs: on two cores, a search's latency is the longer of the two,
    not their sum), when the pool has a connection free at once."""

    def __init__(self, connect: Connect,
                 spare: Callable[[], AbstractContextManager[psycopg.Connection | None]]
                 | None = None, threads: int = 4) -> None:
        self._connect = connect
        self._spare = spare
        self._local = threading.local()
        self._threads = ThreadPoolExecutor(max_workers=threads,
                                           thread_name_prefix="cwm-pg-alongside") \
            if spare is not None else None
        self._slots = threading.BoundedSemaphore(threads)

    def alongside(self, read: Callable[[psycopg.Connection], T]) -> Callable[[], T]:
        """Start ``read`` on a spare connection that sees this thread's snapshot (exported
        with ``pg_export_snapshot``); returns a function waiting for its answer. Outside a
        snapshot, or with no connection free, or if the spare one fails, ``read`` runs on
        this thread's connection when the answer is asked for: the same answer, later."""
        conn = getattr(self._local, "conn", None)
        if conn is None or self._threads is None or not self._slots.acquire(blocking=False):
            return lambda: self._here(read)  # (every thread busy: no queue behind them)
        try:
            snapshot = conn.execute("SELECT pg_export_snapshot()").fetchone()[0]
            job = self._threads.submit(pg_scope.carried(lambda: self._on_spare(snapshot, read)))
        except BaseException:
            self._slots.release()
            raise
        job.add_done_callback(lambda _: self._slots.release())

        def answer() -> T:
            try:
                got = job.result(timeout=STATEMENT_TIMEOUT_S)
            except (psycopg.Error, CWMError, TimeoutError) as exc:
                log.info("a second reader failed (%s): reading on the first", exc)
                got = _NOTHING
            return self._here(read) if got is _NOTHING else got  # type: ignore[return-value]
        return answer

    def _here(self, read: Callable[[psycopg.Connection], T]) -> T:
        with self.connection() as conn:
            return read(conn)

    def _on_spare(self, snapshot: str, read: Callable[[psycopg.Connection], T]) -> object:
        assert self._spare is not None
        with self._spare() as conn:
            if conn is None:
                return _NOTHING
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(
                    sql.Literal(snapshot)))
                return read(conn)

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            yield conn
            return
        with self._connect() as conn:
            yield conn

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        if getattr(self._local, "conn", None) is not None:  # (one already: it holds)
            yield
            return
        with self._connect() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            self._local.conn = conn
            try:
                yield
            finally:
                self._local.conn = None


def _split(key: str) -> tuple[str, int]:
    session, _, row = key.rpartition(SEP)
    return session, int(row)


class PgChunks:
    """The chunks of one space (``search.Corpus``)."""

    def __init__(self, connect: Connect, space: str, dims: int, chunk_weight: float,
                 alongside: Callable[[Callable[[psycopg.Connection], T]], Callable[[], T]]
                 | None = None) -> None:
        self.connect = connect
        self.alongside = alongside
        self.space = space
        self.dims = int(dims)
        self.chunk_weight = chunk_weight
        self.bm25 = PgBM25(connect, space, CHUNKS)
        self._hits: dict[str, tuple] = {}
        self._near: tuple[tuple, list[tuple[str, int]]] | None = None  # the last query's

    def _count(self, corpus: int) -> int:
        with self.connect() as conn:
            row = conn.execute("SELECT n FROM cwm_index_corpora WHERE space = %s AND "
                               "corpus = %s", (self.space, corpus)).fetchone()
        return int(row[0]) if row else 0

    @property
    def n_vectors(self) -> int:
        return self._count(LINES)

    @property
    def n_docs(self) -> int:
        return self._count(CHUNKS)

    def doc_ids(self, session: str | None = None) -> list[str]:
        sql, args = ("SELECT chunk_id FROM cwm_index_chunks WHERE space = %s ORDER BY seq",
                     (self.space,)) if session is None else (
            "SELECT chunk_id FROM cwm_index_chunks WHERE space = %s AND session = %s "
            "ORDER BY first_row", (self.space, session))
        with self.connect() as conn:
            return [r[0] for r in conn.execute(sql, args).fetchall()]  # type: ignore[arg-type]

    def bm25_top(self, query: str, n: int, also: Iterable[str] = (),
                 allowed: set[str] | None = None) -> dict[str, float]:
        return self.bm25.top(query, n, also, allowed)

    def bm25_top_soon(self, query: str, n: int, allowed: set[str] | None = None
                      ) -> Callable[[Iterable[str]], dict[str, float]]:
        """``bm25_top`` begun now on a second connection (``Reader.alongside``) while the
        caller reads its vector candidates; the function returned takes the ``also`` those
        gave and answers what ``bm25_top`` would."""
        if self.alongside is None:
            return lambda also: self.bm25_top(query, n, also, allowed)
        best = self.alongside(lambda conn: self.bm25.best(conn, query, n, allowed))

        def finish(also: Iterable[str]) -> dict[str, float]:
            also = list(also)
            with self.connect() as conn:  # (while the best are still read on the other)
                scored = self.bm25.scores_in(conn, query, also)
            got = best()  # (no connection held here: outside a snapshot it takes one)
            with self.connect() as conn:
                return self.bm25.with_also(conn, query, got, also, allowed, scored) \
                    if n > 0 else {}
        return finish

    def nearest_lines(self, qvec: np.ndarray, k: int) -> list[tuple[str, int]]:
        """The ``k`` lines nearest ``qvec``, nearest first: exact over a folder of up to
        ``EXACT_LINES`` lines (its rows are one index range: a scan of them costs less than a
        graph walk, and a graph walk filtered to a small folder in a large table could stop
        before it found ``k``), else pgvector's HNSW with an iterative scan, approximate as
        hnswlib's is (``ef_search`` as ``chunks.knn_ordered`` sets ``ef``). A selection asks
        twice for one query: the second is the head of the first answer while the folder's
        line count is the same."""
        if k <= 0:
            return []
        d, q = self.dims, vector_text(qvec)
        with self.connect() as conn:
            n = conn.execute("SELECT n FROM cwm_index_corpora WHERE space = %s AND corpus = %s",
                             (self.space, LINES)).fetchone()
            n = int(n[0]) if n else 0
            key = (qvec.tobytes(), n)
            if self._near is not None and self._near[0] == key and \
                    len(self._near[1]) >= min(k, n):
                return self._near[1][:k]
            if n <= EXACT_LINES or k >= n:  # the expression the HNSW index is not on
                rows = conn.execute(
                    "SELECT session, row, vec <#> %s::vector FROM cwm_index_lines WHERE "
                    "space = %s ORDER BY 3, session, row LIMIT %s", (q, self.space, k)).fetchall()
            else:
                with conn.transaction():
                    # the graph walk, not a sort of the folder's rows (the planner's choice on
                    # a table it has no fresh statistics of), walking far enough for a folder
                    # that is a small part of the table; relaxed order: sorted here. The
                    # settings end with the savepoint (rolled back: it wrote nothing).
                    conn.execute("SELECT set_config('hnsw.iterative_scan', 'relaxed_order', "
                                 "true), set_config('hnsw.ef_search', %s, true), "
                                 "set_config('hnsw.max_scan_tuples', %s, true), "
                                 "set_config('enable_sort', 'off', true)",
                                 (str(min(max(2 * k, 64), 1000)), str(MAX_SCAN_TUPLES)))
                    rows = conn.execute(
                        f"SELECT session, row, vec::vector({d}) <#> %(q)s::vector({d}) FROM "  # noqa: S608 - an int
                        f"cwm_index_lines WHERE space = %(space)s AND dims = {d} "
                        f"ORDER BY vec::vector({d}) <#> %(q)s::vector({d}) LIMIT %(k)s",
                        {"q": q, "space": self.space, "k": k}).fetchall()
                    raise psycopg.Rollback()
        got = [(s, int(r)) for s, r, _ in sorted(rows, key=lambda x: (x[2], x[0], x[1]))]
        self._near = (key, got)
        return got

    def vector_candidates(self, qvec: np.ndarray, n_lines: int) -> list[str]:
        """Chunks holding one of the ``n_lines`` nearest lines, in the order they were made
        (a line is in one chunk, or two where chunks overlap: the few chunks of its session
        starting at or before it are looked at, newest first)."""
        near = self.nearest_lines(qvec, n_lines)
        if not near:
            return []
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT DISTINCT c.chunk_id, c.seq FROM unnest(%s::text[], %s::int[]) AS "
                "n(session, row) CROSS JOIN LATERAL (SELECT chunk_id, seq, end_row FROM "
                "cwm_index_chunks WHERE space = %s AND session = n.session AND "
                "first_row <= n.row ORDER BY first_row DESC LIMIT 8) c "
                "WHERE n.row < c.end_row ORDER BY c.seq",
                ([s for s, _ in near], [r for _, r in near], self.space)).fetchall()
        return [r[0] for r in rows]

    def vector_candidates_in(self, session: str) -> list[str]:
        """A search within one session: every chunk of it (``search_index`` asks for every
        line then, which over the database is one index range, not a graph walk)."""
        return self.doc_ids(session)

    def vector_scores(self, qvec: np.ndarray, cids: list[str]) -> dict[str, float]:
        """Best line cosine plus ``chunk_weight`` x the centroid's cosine, of each chunk."""
        out = dict.fromkeys(cids, 0.0)
        if not cids:
            return out
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT c.chunk_id, max(-(l.vec <#> %(q)s::vector)), "
                "-(avg(l.vec) <#> %(q)s::vector) / greatest(vector_norm(avg(l.vec)), 1e-12) "
                "FROM cwm_index_chunks c JOIN cwm_index_lines l ON l.space = c.space AND "
                "l.session = c.session AND l.row >= c.first_row AND l.row < c.end_row "
                "WHERE c.space = %(space)s AND c.chunk_id = ANY(%(ids)s) GROUP BY c.chunk_id",
                {"q": vector_text(qvec), "space": self.space, "ids": list(cids)}).fetchall()
        for cid, best, cent in rows:
            out[cid] = float(best) + (float(cent) * self.chunk_weight if self.chunk_weight
                                      else 0.0)
        return out

    def vector_score(self, qvec: np.ndarray, doc_id: str) -> float:
        return self.vector_scores(qvec, [doc_id])[doc_id]

    def line_scores(self, qvec: np.ndarray, cid: str) -> np.ndarray | None:
        """The cosine of each of the chunk's lines, in order."""
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT -(l.vec <#> %s::vector) FROM cwm_index_chunks c JOIN cwm_index_lines l "
                "ON l.space = c.space AND l.session = c.session AND l.row >= c.first_row AND "
                "l.row < c.end_row WHERE c.space = %s AND c.chunk_id = %s ORDER BY l.row",
                (vector_text(qvec), self.space, cid)).fetchall()
        return np.array([float(r[0]) for r in rows], dtype=np.float32) if rows else None

    def doc_vector(self, doc_id: str) -> np.ndarray:
        """The chunk's centroid (for MMR)."""
        with self.connect() as conn:
            row = conn.execute(
                "SELECT avg(l.vec)::text FROM cwm_index_chunks c JOIN cwm_index_lines l ON "
                "l.space = c.space AND l.session = c.session AND l.row >= c.first_row AND "
                "l.row < c.end_row WHERE c.space = %s AND c.chunk_id = %s",
                (self.space, doc_id)).fetchone()
        v = np.array(row[0].strip("[]").split(","), dtype=np.float32) if row and row[0] \
            else np.zeros(self.dims, dtype=np.float32)
        return v / max(float(np.linalg.norm(v)), 1e-12)

    def prefetch(self, ids: list[str]) -> None:
        """Read these chunks' text and place in one query (a search's hits, or its
        candidates' times for recency) instead of one query each."""
        todo = [c for c in ids if c not in self._hits]
        if not todo:
            return
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT chunk_id, text, session, turn_ids, ts, first_row, end_row FROM "
                "cwm_index_chunks WHERE space = %s AND chunk_id = ANY(%s)",
                (self.space, todo)).fetchall()
        if len(self._hits) + len(rows) > 4096:
            self._hits.clear()
        for r in rows:
            self._hits[r[0]] = tuple(r[1:])

    def newest_ts(self) -> str:
        """The newest chunk's time (recency decays from it)."""
        with self.connect() as conn:
            row = conn.execute("SELECT max(ts) FROM cwm_index_chunks WHERE space = %s",
                               (self.space,)).fetchone()
        return row[0] if row and row[0] else ""

    def _chunk(self, cid: str) -> tuple:
        if cid not in self._hits:
            self.prefetch([cid])
        return self._hits.get(cid)  # type: ignore[return-value]

    def ts(self, doc_id: str) -> str:
        return self._chunk(doc_id)[3]

    def prior(self, doc_id: str) -> float:
        return 1.0

    def hit(self, doc_id: str, score: float, reasons: dict[str, float]) -> Hit:
        text, session, turn_ids, _, _, _ = self._chunk(doc_id)
        return Hit(text=text, score=score, source=f"session:{session}", chunk_id=doc_id,
                   turn_ids=list(turn_ids), reasons=reasons)

    def chunk_sizes(self) -> list[tuple[int, int]]:
        """``(tokens, turns)`` of every chunk (what a bench reports of the chunking)."""
        with self.connect() as conn:
            rows = conn.execute("SELECT tokens, cardinality(turn_ids) FROM cwm_index_chunks "
                                "WHERE space = %s", (self.space,)).fetchall()
        return [(int(t), int(n)) for t, n in rows]

    def warm_centroids(self) -> int:
        return 0  # computed by the database with each search

    def session_units(self, session: str) -> list[Unit]:
        """Every line of a session, in order (the pack's neighbours)."""
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT text, turn_id, ts, tokens FROM cwm_index_lines WHERE space = %s AND "
                "session = %s ORDER BY row", (self.space, session)).fetchall()
        return [Unit(*r) for r in rows]


class PgLines:
    """The lines of one space, as ``selection/lines.py`` reads its ``LineCorpus``."""

    def __init__(self, connect: Connect, space: str) -> None:
        self.connect = connect
        self.space = space
        self.alone = PgBM25(connect, space, LINES)
        self.context = PgBM25(connect, space, CONTEXT)

    def sync(self, index: object) -> None:
        """Nothing to follow: the database's lines are the index's."""

    def speakers(self) -> set[str]:
        with self.connect() as conn:
            rows = conn.execute("SELECT speaker FROM cwm_index_speakers WHERE space = %s",
                                (self.space,)).fetchall()
        return {r[0] for r in rows} - {""}

    def nearest(self, index: PgChunks, qvec: np.ndarray, n: int) -> list[str]:
        return [line_key(s, r) for s, r in index.nearest_lines(qvec, n)]

    def chunk_keys(self, index: PgChunks, hit: Hit) -> list[str]:
        got = index._chunk(hit.chunk_id)
        if got is None:
            return []
        session = hit.source.removeprefix("session:")
        return [line_key(session, r) for r in range(got[4], got[5])]

    def units_of(self, index: PgChunks, keys: list[str]) -> list[Unit]:
        rows = self._rows(keys, "text, turn_id, ts, tokens")
        return [Unit(*rows[k]) for k in keys]

    def vector_scores(self, index: PgChunks, qvec: np.ndarray, keys: list[str]) -> np.ndarray:
        rows = self._rows(keys, "-(vec <#> %(q)s::vector)", q=vector_text(qvec))
        return np.array([float(rows[k][0]) for k in keys])

    def _rows(self, keys: list[str], what: str, **args: object) -> dict[str, tuple]:
        pairs = [_split(k) for k in keys]
        with self.connect() as conn:
            rows = conn.execute(
                f"SELECT l.session, l.row, {what} FROM unnest(%(s)s::text[], %(r)s::int[]) AS "  # noqa: S608 - constants
                "k(session, row) JOIN cwm_index_lines l ON l.space = %(space)s AND "
                "l.session = k.session AND l.row = k.row",
                {"s": [s for s, _ in pairs], "r": [r for _, r in pairs], "space": self.space,
                 **args}).fetchall()
        return {line_key(r[0], int(r[1])): tuple(r[2:]) for r in rows}
