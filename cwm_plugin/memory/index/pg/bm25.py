"""BM25 over documents kept in PostgreSQL: the scores of ``index/bm25.py``'s ``BM25Corpus``
(the same tokens; Lucene's idf; k1 1.5, b 0.75; a repeated query term counted again), computed by
the database from the postings of the query's terms alone.

Three corpora live side by side in ``cwm_index_postings`` (``corpus``: the chunks, the lines,
the lines with their neighbours). A posting holds its document's length, so a query reads one
index range per term (the primary key ``(space, corpus, term, doc)`` with ``tf`` and ``len``
included: an index-only scan); a term's document frequency is the size of its range and each
corpus keeps its document count and total length in ``cwm_index_corpora``. A full-text
``tsvector`` with a GIN index would find the same documents, but BM25 needs each match's term
frequency and length, which its ranking functions do not give the way ours are computed: the
postings answer both in one pass. Writes take the caller's connection, inside its transaction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import psycopg

from cwm_plugin.memory.index.bm25 import BM25Corpus, bm25_tokens

CHUNKS, LINES, CONTEXT = 0, 1, 2  # the corpora
Connect = Callable[[], AbstractContextManager[psycopg.Connection]]

_SCORES = f"""
WITH q AS MATERIALIZED (
  SELECT term, count(*) AS k FROM unnest(%(terms)s::text[]) AS term GROUP BY term),
st AS MATERIALIZED (
  SELECT n, total::float8 / greatest(n, 1)::float8 AS avgdl FROM cwm_index_corpora
  WHERE space = %(space)s AND corpus = %(corpus)s),
w AS MATERIALIZED (
  SELECT q.term, q.k * ln(1 + (st.n - d.df + 0.5::float8) / (d.df + 0.5::float8)) AS idf,
         st.avgdl
  FROM q CROSS JOIN st CROSS JOIN LATERAL (
    SELECT count(*) AS df FROM cwm_index_postings p
    WHERE p.space = %(space)s AND p.corpus = %(corpus)s AND p.term = q.term) d
  WHERE d.df > 0)
SELECT p.doc, sum(w.idf * p.tf * {BM25Corpus.K1 + 1}::float8 / (p.tf + {BM25Corpus.K1}::float8 * (
    {1 - BM25Corpus.B}::float8 + {BM25Corpus.B}::float8 * p.len / w.avgdl))) AS s
FROM w CROSS JOIN LATERAL (
  SELECT doc, tf, len FROM cwm_index_postings p
  WHERE p.space = %(space)s AND p.corpus = %(corpus)s AND p.term = w.term {{docs}} OFFSET 0) p
"""
# (every step driven from the query's terms, ``OFFSET 0`` keeping each lateral scan one index
# range a term, whatever the planner's statistics of a table that grew since it last looked
# say; double precision throughout, as numpy)
_TOP = _SCORES.format(docs="{where}") + " GROUP BY p.doc ORDER BY s DESC, p.doc LIMIT %(n)s"
_OF = _SCORES.format(docs="AND p.doc = ANY(%(ids)s)") + " GROUP BY p.doc"


def add_docs(conn: psycopg.Connection, space: str, corpus: int,
             docs: Iterable[tuple[str, str]]) -> int:
    """Index ``(doc id, text)`` pairs (a document already there is left as it is, as
    ``BM25Corpus.add`` does); returns how many were added."""
    wanted = {d: t for d, t in docs}
    if not wanted:
        return 0
    have = {r[0] for r in conn.execute(
        "SELECT doc FROM cwm_index_docs WHERE space = %s AND corpus = %s AND doc = ANY(%s)",
        (space, corpus, list(wanted))).fetchall()}
    rows = [(d, Counter(bm25_tokens(t) or ["_"])) for d, t in wanted.items() if d not in have]
    if not rows:
        return 0
    total = 0
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO cwm_index_docs (space, corpus, doc, terms) "
                        "VALUES (%s, %s, %s, %s)",
                        [(space, corpus, d, sorted(f)) for d, f in rows])
        with cur.copy("COPY cwm_index_postings (space, corpus, term, doc, tf, len) "
                      "FROM STDIN") as copy:
            for d, freqs in rows:
                n = sum(freqs.values())
                total += n
                for term, tf in freqs.items():
                    copy.write_row((space, corpus, term, d, tf, n))
    conn.execute("INSERT INTO cwm_index_corpora AS c (space, corpus, n, total) VALUES "
                 "(%s, %s, %s, %s) ON CONFLICT (space, corpus) DO UPDATE SET "
                 "n = c.n + excluded.n, total = c.total + excluded.total",
                 (space, corpus, len(rows), total))
    return len(rows)


def remove_docs(conn: psycopg.Connection, space: str, corpus: int, ids: Iterable[str]) -> int:
    """Forget documents (unknown ids are skipped); returns how many were removed."""
    gone = conn.execute(
        "DELETE FROM cwm_index_docs WHERE space = %s AND corpus = %s AND doc = ANY(%s) "
        "RETURNING doc, terms", (space, corpus, list(ids))).fetchall()
    if not gone:
        return 0
    pairs = [(t, d) for d, terms in gone for t in terms]
    lens = conn.execute(
        "DELETE FROM cwm_index_postings p USING unnest(%s::text[], %s::text[]) AS g(term, doc) "
        "WHERE p.space = %s AND p.corpus = %s AND p.term = g.term AND p.doc = g.doc "
        "RETURNING p.doc, p.tf", ([t for t, _ in pairs], [d for _, d in pairs], space,
                                  corpus)).fetchall()
    conn.execute("UPDATE cwm_index_corpora SET n = n - %s, total = total - %s "
                 "WHERE space = %s AND corpus = %s",
                 (len(gone), sum(int(tf) for _, tf in lens), space, corpus))
    return len(gone)


class PgBM25:
    """One corpus of one space, read through ``connect`` (``BM25Corpus``'s reading side)."""

    def __init__(self, connect: Connect, space: str, corpus: int) -> None:
        self.connect = connect
        self.space = space
        self.corpus = corpus

    def __len__(self) -> int:
        with self.connect() as conn:
            row = conn.execute("SELECT n FROM cwm_index_corpora WHERE space = %s AND "
                               "corpus = %s", (self.space, self.corpus)).fetchone()
        return int(row[0]) if row else 0

    def _args(self, query: str, **more: object) -> dict[str, object]:
        return {"terms": bm25_tokens(query), "space": self.space, "corpus": self.corpus, **more}

    def top(self, query: str, n: int, also: Iterable[str] = (),
            allowed: set[str] | None = None) -> dict[str, float]:
        """The ``n`` best documents sharing a term with the query (of ``allowed`` ones, when
        given), plus the score (0 if none) of each document in ``also``."""
        terms = bm25_tokens(query)
        if n <= 0 or not terms or (allowed is not None and not allowed):
            return dict.fromkeys(also, 0.0) if n > 0 else {}
        where = "AND p.doc = ANY(%(allowed)s)" if allowed is not None else ""
        with self.connect() as conn:
            rows = conn.execute(_TOP.format(where=where), self._args(  # type: ignore[arg-type]
                query, n=n, allowed=sorted(allowed or ()))).fetchall()
            out = {d: float(s) for d, s in rows}
            more = [d for d in also if d not in out]
            if more:
                got = self._of(conn, query, more)
                for d in more:
                    out[d] = got.get(d, 0.0) if allowed is None or d in allowed else 0.0
        return out

    def scores_of(self, query: str, ids: Iterable[str]) -> dict[str, float]:
        """The score of each of ``ids`` (0 when it shares no term with the query)."""
        ids = list(ids)
        if not ids:
            return {}
        with self.connect() as conn:
            got = self._of(conn, query, ids)
        return {d: got.get(d, 0.0) for d in ids}

    def _of(self, conn: psycopg.Connection, query: str, ids: list[str]) -> dict[str, float]:
        if not bm25_tokens(query):
            return {}
        rows = conn.execute(_OF, self._args(query, ids=ids)).fetchall()  # type: ignore[arg-type]
        return {d: float(s) for d, s in rows}
