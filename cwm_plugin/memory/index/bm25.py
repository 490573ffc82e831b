"""BM25 text side: tokenisation (lower case, stop words, a light suffix stemmer) and scoring.

The stemmer strips a few English inflections (``-ies -> -y``, ``-s``, ``-es``, ``-ing``, ``-ed``,
``-ly``) from words that keep at least three letters, so "painted" finds "painting" and
"hikes" finds "hiking". It is deliberately light (no Porter rules: a fuller stemmer finds no
more evidence, ``bench/memory_retrieval.md``), and the same tokens are used everywhere BM25
runs (the BM25-only mode included).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable

import numpy as np
from rank_bm25 import BM25Okapi

_STOP = """a about above after again against all am an and any are as at be because
been before being below between both but by can did do does doing down during each few for from
further had has have having he her here hers herself him himself his how i if in into is it its
itself just me more most my myself no nor not now of off on once only or other our ours ourselves
out over own same she should so some such than that the their theirs them themselves then there
these they this those through to too under until up very was we were what when where which while
who whom why will with would you your yours yourself yourselves s t don ll m re ve d"""
STOPWORDS = frozenset(_STOP.split())
_SUFFIXES = (("ies", "y"), ("sses", "ss"), ("ing", ""), ("ed", ""), ("es", ""), ("s", ""),
             ("ly", ""))


def stem(word: str) -> str:
    """A light English suffix stripper (see the module docstring)."""
    if word.endswith("ss"):
        return word
    for suffix, repl in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)] + repl
    return word


def bm25_tokens(text: str) -> list[str]:
    """Lower-cased, stemmed word tokens without English stop words."""
    return [stem(w) for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in STOPWORDS]


class LuceneBM25(BM25Okapi):
    """BM25 with Lucene's idf ``log(1 + (N - n + 0.5) / (n + 0.5))``: always positive.

    rank-bm25's Okapi idf is zero for a term in half the documents and negative (floored to a
    constant) above that, so a new folder with two chunks scores every query 0, and frequent
    words all get the same floor. Lucene's form keeps the ordering and stays positive.
    """

    def _calc_idf(self, nd: dict[str, int]) -> None:
        for word, freq in nd.items():
            self.idf[word] = math.log(1.0 + (self.corpus_size - freq + 0.5) / (freq + 0.5))
        self.average_idf = sum(self.idf.values()) / max(len(self.idf), 1)


class BM25Corpus:
    """BM25 over ``{doc_id: text}``, kept up to date one document at a time.

    Each document is tokenised once when added; the statistics BM25 needs (term frequencies
    per document, document lengths, document frequencies, their total) are updated as
    documents come and go, and a query's idf values are computed for its own terms only
    (Lucene's form, as ``LuceneBM25``): nothing is recomputed for the whole corpus after a
    change, which at ten thousand chunks would cost more than a search. Each term's postings
    are also kept as numpy arrays (rows, frequencies; rebuilt for a term when a document
    holding it comes or goes), so a query adds its terms' contributions vectorised, several
    times faster than dict postings in Python or SQLite FTS5's ``bm25()`` (which also ranks
    differently); the scores are exactly ``LuceneBM25``'s (k1 1.5, b 0.75) for the same
    documents. The postings are keyed by row, so a term's arrays are built from them at C speed
    the first time a query uses it (keyed by document id, the lookups would dominate a
    first-turn line search).
    """

    K1 = 1.5
    B = 0.75

    def __init__(self) -> None:
        self._ids: list[str | None] = []          # row -> document (None: removed)
        self._row: dict[str, int] = {}            # live documents only
        self._freqs: list[Counter[str] | None] = []  # row -> term frequencies
        self._dl = np.zeros(1024, dtype=np.float64)  # row -> length (grows by doubling)
        self._postings: dict[str, dict[int, int]] = {}  # term -> {row: tf}, live rows
        # term -> (rows, tfs) as numpy arrays (may still hold rows removed since: they are
        # zeroed after scoring) and the (row, tf) pairs added since they were built
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._tails: dict[str, list[tuple[int, int]]] = {}
        self._built = False  # every term's arrays built (by the first query)
        self._dead: list[int] = []                # removed rows, until the next compaction
        self._dead_rows: np.ndarray | None = None  # the same, as an index array (cached)
        self._total = 0
        self._last: tuple[str, np.ndarray] | None = None  # the last query's scores

    def __len__(self) -> int:
        return len(self._row)

    def add(self, doc_id: str, text: str) -> None:
        if doc_id in self._row:
            return
        self._last = None
        freqs = Counter(bm25_tokens(text) or ["_"])
        row = len(self._ids)          # rows only ever grow: a term's arrays stay valid
        if row >= self._dl.shape[0]:
            self._dl = np.concatenate([self._dl, np.zeros_like(self._dl)])
        self._row[doc_id] = row
        self._ids.append(doc_id)
        self._freqs.append(freqs)
        self._dl[row] = length = sum(freqs.values())
        for term, tf in freqs.items():
            self._postings.setdefault(term, {})[row] = tf
            if term in self._arrays:
                self._tails.setdefault(term, []).append((row, tf))
        self._total += length

    def remove(self, doc_id: str) -> None:
        """Forget a document: its row is marked removed (scored 0) until enough rows are,
        then the live ones are renumbered in one pass."""
        row = self._row.pop(doc_id, None)
        if row is None:
            return
        self._last = None
        freqs = self._freqs[row] or {}
        for term in freqs:
            docs = self._postings[term]
            del docs[row]
            if not docs:
                del self._postings[term]
                self._arrays.pop(term, None)
                self._tails.pop(term, None)
        self._total -= int(self._dl[row])
        self._ids[row] = self._freqs[row] = None
        self._dead.append(row)
        if len(self._dead) > max(1024, len(self._row) // 8):
            self._compact()
        self._dead_rows = None

    def _compact(self) -> None:
        live = [r for r, d in enumerate(self._ids) if d is not None]
        renumber = {old: new for new, old in enumerate(live)}
        self._ids = [self._ids[r] for r in live]
        self._freqs = [self._freqs[r] for r in live]
        dl = np.zeros(max(1024, self._dl.shape[0]), dtype=np.float64)
        dl[:len(live)] = self._dl[live]
        self._dl = dl
        self._row = {d: i for i, d in enumerate(self._ids)}
        self._postings = {t: {renumber[r]: tf for r, tf in docs.items()}
                          for t, docs in self._postings.items()}
        self._arrays.clear()
        self._tails.clear()
        self._dead.clear()
        self._built = False

    def _term(self, term: str) -> tuple[float, np.ndarray, np.ndarray] | None:
        """``(idf, rows, tfs)`` of a term, or None when no document holds it."""
        docs = self._postings.get(term)
        if not docs:
            return None
        got = self._arrays.get(term)
        if got is None:  # postings keyed by row: both arrays built at C speed
            rows = np.fromiter(docs.keys(), dtype=np.int64, count=len(docs))
            tfs = np.fromiter(docs.values(), dtype=np.float64, count=len(docs))
            got = self._arrays[term] = (rows, tfs)
            self._tails.pop(term, None)
        else:
            tail = self._tails.pop(term, None)
            if tail:  # documents added since: appended (a copy at memory speed)
                add = np.array(tail, dtype=np.int64)
                got = self._arrays[term] = (np.concatenate([got[0], add[:, 0]]),
                                            np.concatenate([got[1], add[:, 1].astype(np.float64)]))
        n = len(docs)
        return math.log(1.0 + (len(self._row) - n + 0.5) / (n + 0.5)), got[0], got[1]

    def _accumulate(self, query: str) -> np.ndarray:
        """Every document's score (read-only: the last query's are kept, as a search asks
        for the best documents and then for the scores of more candidates)."""
        if self._last is not None and self._last[0] == query:
            return self._last[1]
        if not self._built:  # every term at once, not one first-time term per query
            for term in self._postings:
                self._term(term)
            self._built = True
        acc = np.zeros(len(self._ids), dtype=np.float64)
        avgdl = self._total / max(1, len(self._row))
        k1, b = self.K1, self.B
        for term in bm25_tokens(query):  # a repeated query term counts again, as in rank-bm25
            found = self._term(term)
            if found is not None:
                idf, rows, tfs = found
                acc[rows] += idf * tfs * (k1 + 1) / (tfs + k1 * (1 - b + b * self._dl[rows]
                                                                / avgdl))
        if self._dead:  # removed rows may still be in a term's arrays
            if self._dead_rows is None:
                self._dead_rows = np.array(self._dead, dtype=np.int64)
            acc[self._dead_rows] = 0.0
        acc.flags.writeable = False
        self._last = (query, acc)
        return acc

    def scores(self, query: str) -> dict[str, float]:
        """BM25 score of every document sharing a term with the query (the others score 0
        and are left out)."""
        if not self._row:
            return {}
        acc = self._accumulate(query)
        return {self._ids[r]: float(acc[r]) for r in np.flatnonzero(acc)}

    def top(self, query: str, n: int, also: Iterable[str] = (),
            allowed: set[str] | None = None) -> dict[str, float]:
        """The ``n`` best documents sharing a term with the query (of ``allowed`` ones, when
        given), plus the exact score (0 if none) of each document in ``also``. Only the rows
        the query scored are partitioned (a few thousand of tens of thousands of lines, not
        every row)."""
        if not self._row or n <= 0:
            return {}
        acc = self._accumulate(query)
        rows = np.flatnonzero(acc)
        if allowed is not None:
            keep = np.zeros(len(acc), dtype=bool)
            keep[[self._row[d] for d in allowed if d in self._row]] = True
            rows = rows[keep[rows]]
        if len(rows) > n:
            rows = rows[np.argpartition(-acc[rows], n - 1)[:n]]
        out = {self._ids[r]: float(acc[r]) for r in rows.tolist()}
        for d in also:
            row = self._row.get(d)
            if row is not None and d not in out:
                out[d] = float(acc[row]) if allowed is None or d in allowed else 0.0
        return out

    def scores_of(self, query: str, ids: Iterable[str]) -> dict[str, float]:
        """The exact score of each of ``ids`` (0 if it shares no term; left out when it is
        not in the corpus)."""
        if not self._row:
            return {}
        acc = self._accumulate(query)
        return {d: float(acc[row]) for d in ids if (row := self._row.get(d)) is not None}
