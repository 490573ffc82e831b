"""Retrieval at turn granularity: every line (a turn, or a piece of an over-long one) scored.

What the model sees is what fits the memory budget (1,024 tokens by default), and with
400-token chunks two or three chunks fill it: one well-ranked but long chunk crowds out the
evidence. So a selection ranks *lines* and packs the best of them (``pack.py``); chunks stay
the unit of ``search`` (recall@k, the CLI) and lend each line their context.

A line's score, each part min-max normalised over the query's candidate lines (as in
``search.py``):

- ``bm25_weight`` x BM25 of the line, plus ``context_bm25_weight`` (0.5) times BM25 of the line
  with its neighbours (the turn before and after: "yes, we went last week" answers the
  question above it);
- ``vector_weight`` x the cosine of the line's vector (``index/chunks.py``: the line mixed with the
  one before it);
- ``chunk_prior_weight`` (0.5) x the hybrid score of the best chunk holding the line, over the
  ``k`` best chunks (``search_index``), divided by the best chunk's: the chunk's context;
- ``speaker_weight`` (0.2) when the query names the line's speaker (a role that is a name, as
  in an imported conversation) and no other speaker of the folder: BM25F's field boost for
  "who said it";
- ``date_weight`` (0.2) times how near the line's time stamp is to a day or month the query
  names ("on 16 June, 2023", "in August": ``dates.py``): 1 inside it, 0 a week away.

Candidates: the lines of the ``k`` best chunks, the ``n`` best lines by BM25 and the ``n``
nearest line vectors (hnswlib). Each part earns its place: without the chunk prior, the
neighbours' BM25 or the speaker match less evidence fits the budget (``bench/memory.py``; the
figures are in ``bench/memory_retrieval.md``).
"""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from cwm_plugin.memory.index.bm25 import BM25Corpus
from cwm_plugin.memory.index.chunking import Unit
from cwm_plugin.memory.index.chunks import ChunkIndex, SessionIndex
from cwm_plugin.memory.index.search import search_index
from cwm_plugin.memory.models import Hit, MemoryConfig
from cwm_plugin.memory.selection.dates import nearness, periods
from cwm_plugin.timing import Stages

SEP = "\x1f"  # between session and line number in a line's document id
# best lines taken from each method (BM25, vectors; the top chunks' lines come too): more find
# no more evidence within the budgets (a 2k block holds fewer lines than that), and a first
# turn fuses and prices every candidate
LINE_CANDIDATES = 100
FREEZE_AFTER = 5000  # lines added in one sync that make the corpus worth freezing (gc)


@dataclass
class Line:
    """A scored line of a session: ``row`` is its place in the session's units."""

    session: str
    row: int
    unit: Unit
    score: float
    reasons: dict[str, float]


def doc_id(session: str, row: int) -> str:
    return f"{session}{SEP}{row}"


def speaker(unit: Unit) -> str:
    return unit.text.split(": ", 1)[0] if ": " in unit.text else ""


class LineCorpus:
    """BM25 over a folder's lines, alone and with their neighbours, kept in step with its
    ``ChunkIndex`` (lines are appended; a dropped session's lines are removed)."""

    def __init__(self) -> None:
        self.alone = BM25Corpus()
        self.context = BM25Corpus()
        self._count: dict[str, int] = {}  # lines indexed per session
        self._units: dict[str, list[Unit]] = {}
        self.by_label: dict[int, str] = {}  # hnsw label -> line document id
        self._speakers: dict[str, set[str]] = {}  # per session
        self._synced: tuple[int, int] | None = None  # (index.changes, sessions) at last sync

    def sync(self, index: ChunkIndex) -> None:
        """Follow the index's appends and drops (nothing to walk when it has not changed, so
        a search does not walk every session)."""
        state = (index.changes, len(index.sessions))
        if state == self._synced:
            return
        for session in [s for s in self._count if s not in index.sessions]:
            self._drop(session)
        before = len(self.alone)
        for session, st in index.sessions.items():
            n = self._count.get(session, 0)
            if n > len(st.units) or (n and self._units[session][n - 1] is not st.units[n - 1]):
                self._drop(session)  # re-indexed from its file: start again
                n = 0
            if n == len(st.units):
                continue
            units = self._units[session] = list(st.units)
            if n:  # the old last line has a next neighbour now
                self.context.remove(doc_id(session, n - 1))
            for row in range(max(0, n - 1), len(units)):
                if row >= n:
                    self.alone.add(doc_id(session, row), units[row].text)
                    self.by_label[st.labels[row]] = doc_id(session, row)
                    self._speakers.setdefault(session, set()).add(speaker(units[row]))
                self.context.add(doc_id(session, row), _with_neighbours(units, row))
            self._count[session] = len(units)
        self._synced = state
        if len(self.alone) - before >= FREEZE_AFTER:
            gc.freeze()  # long-lived, like the index (``FolderIndexes.get``)

    def _drop(self, session: str) -> None:
        self.by_label = {lab: d for lab, d in self.by_label.items()
                         if not d.startswith(session + SEP)}
        for row in range(self._count.pop(session, 0)):
            self.alone.remove(doc_id(session, row))
            self.context.remove(doc_id(session, row))
        self._units.pop(session, None)
        self._speakers.pop(session, None)

    def speakers(self) -> set[str]:
        """Every speaker (the role before ": ") of the folder's lines."""
        return set().union(*self._speakers.values()) - {""}

    # what ``rank_lines`` asks of a line corpus (``index/pg/corpus.py``'s ``PgLines`` too)

    def nearest(self, index: ChunkIndex, qvec: np.ndarray, n: int) -> list[str]:
        """The ``n`` lines nearest ``qvec`` (their document ids), nearest first."""
        return [self.by_label[x] for x in index.nearest_lines(qvec, n) if x in self.by_label]

    def chunk_keys(self, index: ChunkIndex, hit: Hit) -> list[str]:
        """The lines of a chunk found by ``search_index``."""
        session = hit.source.removeprefix("session:")
        for b, e, cid in index.sessions.get(session, SessionIndex()).spans:
            if cid == hit.chunk_id:
                return [doc_id(session, r) for r in range(b, e)]
        return []

    def units_of(self, index: ChunkIndex, keys: list[str]) -> list[Unit]:
        out = []
        for key in keys:
            session, _, row = key.rpartition(SEP)
            out.append(index.sessions[session].units[int(row)])
        return out

    def vector_scores(self, index: ChunkIndex, qvec: np.ndarray, keys: list[str]) -> np.ndarray:
        rows = []
        for key in keys:
            session, _, row = key.rpartition(SEP)
            rows.append(index.sessions[session].labels[int(row)])
        return index.vectors[rows] @ qvec


def _with_neighbours(units: list[Unit], row: int) -> str:
    return "\n".join(u.text for u in units[max(0, row - 1):row + 2])


def _minmax(x: np.ndarray) -> np.ndarray:
    if x.size == 0:
        return x
    lo, hi = float(x.min()), float(x.max())
    if hi - lo < 1e-12:
        return np.full_like(x, 1.0 if hi > 0 else 0.0)
    return (x - lo) / (hi - lo)


def rank_lines(index: Any, corpus: Any, query: str, qvec: np.ndarray | None,
               cfg: MemoryConfig, *, mode: str = "hybrid", k_chunks: int = 20,
               stages: Stages | None = None) -> list[Line]:
    """The folder's lines scored for ``query`` (see the module docstring), best first.
    ``index``: a ``search.Corpus`` of chunks; ``corpus``: its lines (a ``LineCorpus``, or
    ``PgLines`` over the index in PostgreSQL)."""
    stages = stages or Stages()
    if not index.n_docs:
        return []
    if qvec is None:
        mode = "bm25"
    with stages("keyword"):
        corpus.sync(index)
    chunks = search_index(index, query, qvec, k_chunks, cfg, mode=mode, stages=stages)
    best_chunk = max((h.score for h in chunks), default=0.0)
    prior: dict[str, float] = {}
    for h in chunks:
        for key in corpus.chunk_keys(index, h):
            prior[key] = max(prior.get(key, 0.0), h.score / best_chunk if best_chunk > 0 else 0)
    cands = set(prior)
    use_bm25, use_vec = mode in ("bm25", "hybrid"), mode in ("vector", "hybrid")
    with stages("keyword"):
        if use_bm25:
            alone = corpus.alone.top(query, LINE_CANDIDATES)
            cands.update(alone)
    with stages("vector"):
        if use_vec:
            cands.update(corpus.nearest(index, qvec, LINE_CANDIDATES))
    if not cands:
        return []
    keys = sorted(cands)
    with stages("keyword"):
        if use_bm25:
            got_a = corpus.alone.scores_of(query, keys)
            got_c = corpus.context.scores_of(query, keys)
            bm = np.array([got_a.get(c, 0.0) + cfg.context_bm25_weight * got_c.get(c, 0.0)
                           for c in keys])
    units = corpus.units_of(index, keys)
    with stages("vector"):
        if use_vec:
            vec = corpus.vector_scores(index, qvec, keys)
    with stages("fusion"):
        score = np.zeros(len(keys))
        if use_bm25:
            score += (cfg.bm25_weight if mode == "hybrid" else 1.0) * _minmax(bm)
        if use_vec:
            score += (cfg.vector_weight if mode == "hybrid" else 1.0) * _minmax(vec)
        chunk = np.array([prior.get(c, 0.0) for c in keys])
        score += cfg.chunk_prior_weight * chunk
        boost = _speaker_boost(query, units, corpus, cfg.speaker_weight)
        score += boost
        when = _date_boost(query, units, cfg.date_weight)
        score += when
        out = []
        for i, key in enumerate(keys):
            session, _, row = key.rpartition(SEP)
            reasons = {"chunk": float(chunk[i])}
            if use_bm25:
                reasons["bm25"] = float(bm[i])
            if use_vec:
                reasons["vector"] = float(vec[i])
            if boost[i]:
                reasons["speaker"] = float(boost[i])
            if when[i]:
                reasons["date"] = float(when[i])
            out.append(Line(session, int(row), units[i], float(score[i]), reasons))
        out.sort(key=lambda ln: (-ln.score, ln.session, ln.row))
    return out


def _speaker_boost(query: str, units: list[Unit], corpus: Any,
                   weight: float) -> np.ndarray:
    out = np.zeros(len(units))
    if not weight:
        return out
    words = set(re.findall(r"[A-Za-z][\w'-]*", query))
    named = words & corpus.speakers()
    if len(named) != 1:
        return out
    who = next(iter(named))
    for i, u in enumerate(units):
        if speaker(u) == who:
            out[i] = weight
    return out


def _date_boost(query: str, units: list[Unit], weight: float) -> np.ndarray:
    found = periods(query) if weight else []
    return np.array([weight * nearness(found, u.ts) for u in units]) if found \
        else np.zeros(len(units))

