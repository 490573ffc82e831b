"""BM25 over documents kept in PostgreSQL: the scores of ``index/bm25.py``'s ``BM25Corpus``
(the same tokens; Lucene's idf; k1 1.5, b 0.75; a repeated query term counted again), computed by
the database from the postings of the query's terms alone.

Three corpora live side by side in ``cwm_index_postings`` (``corpus``: the chunks, the lines,
the lines with their neighbours). A posting holds its document's length, so a query reads one
index range per term (the primary key ``(space, corpus, term, no)`` with ``tf`` and ``len``
included: an index-only scan; ``no`` is the document's number in ``cwm_index_docs``, its text id
looked up for the best alone); a term's document frequency is kept in ``cwm_index_terms`` and
each corpus's document count and total length in ``cwm_index_corpora``. A full-text
``tsvector`` with a GIN index would find the same documents, but BM25 needs each match's term
frequency and length, which its ranking functions do not give the way ours are computed: the
postings answer both in one pass. Writes take the caller's connection, inside its transaction.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import psycopg

from cwm_plugin.memory.index.bm25 import BM25Corpus, bm25_tokens

CHUNKS, LINES, CONTEXT = 0, 1, 2  # the corpora
Connect = Callable[[], AbstractContextManager[psycopg.Connection]]

K1P1, K1, B = BM25Corpus.K1 + 1, BM25Corpus.K1, BM25Corpus.B
# one term's share of a document's score (a term's weight, ``w.idf``: its idf times how often
# the query holds it); double precision throughout, as numpy
_SHARE = (f"w.idf * p.tf * {K1P1}::float8 / (p.tf + {K1}::float8 * ({1 - B}::float8 + "
          f"{B}::float8 * p.len / %(avgdl)s::float8))")
# every step driven from the query's terms, ``OFFSET 0`` keeping each lateral scan one index
# range a term, whatever the planner's statistics of a table that grew since it last looked say
_SCORES = f"""
SELECT p.no, sum({_SHARE}) AS s
FROM unnest(%({{terms}})s::text[], %({{weights}})s::float8[]) AS w(term, idf) CROSS JOIN LATERAL (
  SELECT no, tf, len FROM cwm_index_postings p
  WHERE p.space = %(space)s AND p.corpus = %(corpus)s AND p.term = w.term {{docs}} OFFSET 0) p
GROUP BY p.no"""
# documents named by their text ids, as numbers (``docs`` of a query: one index range)
_NOS = ("ARRAY(SELECT no FROM cwm_index_docs WHERE space = %(space)s AND corpus = %(corpus)s "
        "AND doc = ANY(%({})s))")
_NAMED = "SELECT d.doc, t.s FROM ({}) t JOIN cwm_index_docs d ON d.no = t.no"
_ALL = _SCORES.format(terms="terms", weights="weights", docs="{docs}")
_TOP = _NAMED.format(_ALL.format(docs="{where}") + " ORDER BY s DESC, p.no LIMIT %(n)s") + \
    " ORDER BY t.s DESC, t.no"
_OF = _NAMED.format(_ALL.format(docs=f"AND p.no = ANY({_NOS.format('ids')})"))
# MaxScore: the documents holding one of the rarer (``essential``) terms, their partial scores;
# theta, the n-th best of those, is a floor of the n-th best full score. A document holding
# only common terms scores under ``bound`` (their most: weight x (k1 + 1)), so when ``bound``
# < theta none of them can be among the best; of the others only those whose partial score
# plus ``bound`` reaches theta can, and just their postings of the common terms are read
# (index probes, not the terms' whole ranges).
_PRUNED = f"""
WITH part AS MATERIALIZED ({_SCORES.format(terms="terms", weights="weights", docs="")}),
th AS MATERIALIZED (SELECT s FROM part ORDER BY s DESC LIMIT 1 OFFSET %(n1)s),
cand AS MATERIALIZED (SELECT no, s FROM part WHERE s >= (SELECT s FROM th) - %(bound)s),
more AS ({_SCORES.format(terms="common", weights="common_weights",
                         docs="AND p.no = ANY(ARRAY(SELECT no FROM cand))")}),
best AS (SELECT c.no, c.s + coalesce(m.s, 0::float8) AS s FROM cand c
         LEFT JOIN more m ON m.no = c.no ORDER BY 2 DESC, 1 LIMIT %(n)s)
SELECT d.doc, b.s, (SELECT s FROM th) FROM best b JOIN cwm_index_docs d ON d.no = b.no
ORDER BY b.s DESC, b.no"""
PRUNE_POSTINGS = 5_000  # a query reading fewer postings than this reads them all


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
        nos = dict(conn.execute(
            "SELECT doc, no FROM cwm_index_docs WHERE space = %s AND corpus = %s AND "
            "doc = ANY(%s)", (space, corpus, [d for d, _ in rows])).fetchall())
        cols: tuple[list[str], list[int], list[int], list[int]] = ([], [], [], [])
        for d, freqs in rows:
            n = sum(freqs.values())
            total += n
            for term, tf in freqs.items():
                for col, v in zip(cols, (term, nos[d], tf, n), strict=True):
                    col.append(v)  # type: ignore[arg-type]
        # (one INSERT of arrays, not COPY: PostgreSQL refuses COPY FROM into a table under
        # row-level security; the arrays cost about what COPY's rows do)
        cur.execute("INSERT INTO cwm_index_postings (space, corpus, term, no, tf, len) "
                    "SELECT %s, %s, * FROM unnest(%s::text[], %s::bigint[], %s::int[], "
                    "%s::int[])", (space, corpus, *cols))
    conn.execute("INSERT INTO cwm_index_corpora AS c (space, corpus, n, total) VALUES "
                 "(%s, %s, %s, %s) ON CONFLICT (space, corpus) DO UPDATE SET "
                 "n = c.n + excluded.n, total = c.total + excluded.total",
                 (space, corpus, len(rows), total))
    _count_terms(conn, space, corpus, Counter(t for _, freqs in rows for t in freqs))
    return len(rows)


def remove_docs(conn: psycopg.Connection, space: str, corpus: int, ids: Iterable[str]) -> int:
    """Forget documents (unknown ids are skipped); returns how many were removed."""
    gone = conn.execute(
        "DELETE FROM cwm_index_docs WHERE space = %s AND corpus = %s AND doc = ANY(%s) "
        "RETURNING no, terms", (space, corpus, list(ids))).fetchall()
    if not gone:
        return 0
    pairs = [(t, no) for no, terms in gone for t in terms]
    lens = conn.execute(
        "DELETE FROM cwm_index_postings p USING unnest(%s::text[], %s::bigint[]) AS g(term, no) "
        "WHERE p.space = %s AND p.corpus = %s AND p.term = g.term AND p.no = g.no "
        "RETURNING p.no, p.tf", ([t for t, _ in pairs], [no for _, no in pairs], space,
                                 corpus)).fetchall()
    conn.execute("UPDATE cwm_index_corpora SET n = n - %s, total = total - %s "
                 "WHERE space = %s AND corpus = %s",
                 (len(gone), sum(int(tf) for _, tf in lens), space, corpus))
    _count_terms(conn, space, corpus, Counter({t: -k for t, k in Counter(
        t for _, terms in gone for t in terms).items()}))
    return len(gone)


def _count_terms(conn: psycopg.Connection, space: str, corpus: int, change: Counter) -> None:
    """Move the terms' document frequencies by ``change``. Always after the corpus's row in
    ``cwm_index_corpora`` was written in this transaction: that row's lock keeps writers of
    one corpus one at a time, so the terms' rows are never locked in two orders."""
    terms = sorted(t for t, k in change.items() if k)
    if terms:
        conn.execute(
            "INSERT INTO cwm_index_terms AS t (space, corpus, term, df) SELECT %s, %s, c.term, "
            "c.df FROM unnest(%s::text[], %s::bigint[]) AS c(term, df) ORDER BY c.term "
            "ON CONFLICT (space, corpus, term) DO UPDATE SET df = t.df + excluded.df",
            (space, corpus, terms, [change[t] for t in terms]))


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

    def _weights(self, conn: psycopg.Connection, query: str
                 ) -> tuple[dict[str, float], dict[str, int], float]:
        """Each query term's weight (Lucene's idf from its document frequency, times how
        often the query holds it) and frequency, of the terms some document holds; and the
        corpus's mean document length."""
        k = Counter(bm25_tokens(query))
        row = conn.execute("SELECT n, total FROM cwm_index_corpora WHERE space = %s AND "
                           "corpus = %s", (self.space, self.corpus)).fetchone()
        n, total = (int(row[0]), int(row[1])) if row else (0, 0)
        df = {t: int(d) for t, d in conn.execute(
            "SELECT term, df FROM cwm_index_terms WHERE space = %s AND corpus = %s AND "
            "term = ANY(%s) AND df > 0", (self.space, self.corpus, sorted(k))).fetchall()}
        w = {t: k[t] * math.log(1 + (n - d + 0.5) / (d + 0.5)) for t, d in df.items()}
        return w, df, total / max(n, 1)

    def _args(self, w: dict[str, float], avgdl: float, **more: object) -> dict[str, object]:
        return {"terms": list(w), "weights": list(w.values()), "avgdl": avgdl,
                "space": self.space, "corpus": self.corpus, **more}

    def top(self, query: str, n: int, also: Iterable[str] = (),
            allowed: set[str] | None = None) -> dict[str, float]:
        """The ``n`` best documents sharing a term with the query (of ``allowed`` ones, when
        given), plus the score (0 if none) of each document in ``also``."""
        if n <= 0:
            return {}
        with self.connect() as conn:
            return self.with_also(conn, query, self.best(conn, query, n, allowed), also,
                                  allowed)

    def best(self, conn: psycopg.Connection, query: str, n: int,
             allowed: set[str] | None = None) -> dict[str, float] | None:
        """:meth:`top`'s ``n`` best, read through ``conn`` (None: nothing can score)."""
        if n <= 0 or not bm25_tokens(query) or (allowed is not None and not allowed):
            return None
        w, df, avgdl = self._weights(conn, query)
        if not w:
            return None
        if allowed is not None:
            rows = conn.execute(_TOP.format(where=f"AND p.no = ANY({_NOS.format('allowed')})"),
                                self._args(w, avgdl, n=n, allowed=sorted(allowed))).fetchall()
        else:
            rows = self._best(conn, w, df, avgdl, n)
        return {d: float(s) for d, s in rows}

    def with_also(self, conn: psycopg.Connection, query: str, best: dict[str, float] | None,
                  also: Iterable[str], allowed: set[str] | None,
                  scored: dict[str, float] | None = None) -> dict[str, float]:
        """``best`` (from :meth:`best`) with the score of each document of ``also`` added
        (``scored``: their scores read already, :meth:`scores_in`)."""
        if best is None:
            return dict.fromkeys(also, 0.0)
        out = dict(best)
        more = [d for d in also if d not in out]
        if more:
            got = scored if scored is not None else self.scores_in(conn, query, more)
            for d in more:
                out[d] = got.get(d, 0.0) if allowed is None or d in allowed else 0.0
        return out

    def _best(self, conn: psycopg.Connection, w: dict[str, float], df: dict[str, int],
              avgdl: float, n: int) -> list[tuple[str, float]]:
        """The ``n`` best of the whole corpus: with the common terms left out of the scan
        where they cannot matter (``_PRUNED``), else every posting of every term."""
        common = _common_terms(w, df, PRUNE_POSTINGS)
        if common:
            rare = {t: x for t, x in w.items() if t not in common}
            bound = sum(w[t] for t in common) * K1P1
            rows = conn.execute(_PRUNED, {  # type: ignore[arg-type]
                **self._args(rare, avgdl, n=n, n1=n - 1, bound=bound),
                "common": common, "common_weights": [w[t] for t in common]}).fetchall()
            if rows and rows[0][2] is not None and bound < float(rows[0][2]):
                return [(d, s) for d, s, _ in rows]
        return conn.execute(_TOP.format(where=""),  # type: ignore[arg-type]
                            self._args(w, avgdl, n=n)).fetchall()

    def scores_of(self, query: str, ids: Iterable[str]) -> dict[str, float]:
        """The score of each of ``ids`` (0 when it shares no term with the query)."""
        ids = list(ids)
        if not ids:
            return {}
        with self.connect() as conn:
            got = self.scores_in(conn, query, ids)
        return {d: got.get(d, 0.0) for d in ids}

    def scores_in(self, conn: psycopg.Connection, query: str, ids: list[str]
                  ) -> dict[str, float]:
        """:meth:`scores_of` through ``conn``, leaving out the documents that score 0."""
        w, _, avgdl = self._weights(conn, query) if bm25_tokens(query) and ids else \
            ({}, {}, 1.0)
        return self._of(conn, w, avgdl, ids) if w else {}

    def _of(self, conn: psycopg.Connection, w: dict[str, float], avgdl: float,
            ids: list[str]) -> dict[str, float]:
        rows = conn.execute(_OF, self._args(w, avgdl, ids=ids)).fetchall()  # type: ignore[arg-type]
        return {d: float(s) for d, s in rows}


def _common_terms(w: dict[str, float], df: dict[str, int], budget: int) -> list[str]:
    """The commonest terms a pruned search leaves out of its scan: taken commonest first
    while the most they could add to a document stays under half the weight of the rarest
    term, so that the documents still worth scoring in full (those within that much of the
    floor) are few. None when the query's postings are few anyway. (A floor measured first
    from the rarest terms alone lets more terms go, but on the generated conversations the
    documents left to score by probing then cost more than the postings saved.)"""
    if sum(df.values()) <= budget or len(w) < 2:
        return []
    by_df = sorted(w, key=lambda t: (-df[t], t))
    limit = 0.5 * max(w.values())
    out: list[str] = []
    added = 0.0
    for t in by_df[:-1]:
        if (added + w[t]) * K1P1 >= limit:
            break
        out.append(t)
        added += w[t]
    return out
