"""BM25, vector and hybrid search over a corpus (a folder's chunks or its durable memories).

Candidates: ``k * candidate_multiplier`` documents from each method (BM25's best by score; for
vectors, the documents holding the nearest ``k * candidate_multiplier * 2`` vectors in
hnswlib). Every candidate is then scored *exactly* by both methods (BM25 scores exist for every
document; the vector score is computed from the stored vectors), so hybrid never has to guess a
missing score.

Normalisation (hybrid): min-max per query over the candidate set, per method:
``n(s) = (s - min) / (max - min)``; a method whose candidates all score the same contributes 1
to each if its scores are positive, else 0. BM25 scores are unbounded and their scale depends
on the query's length and term rarity; cosine similarities sit in a narrow band (0.2-0.7 for
MiniLM). Min-max puts both on [0, 1] *within this query*, so the best candidate of each method
gets the full weight and the weights mean what they say. It finds at least as much evidence
as z-scores and more than reciprocal-rank fusion (``bench/memory_retrieval.md``), which throws
away how far ahead the best candidate is, most of BM25's signal on exact names. Weights:
0.5 / 0.5 by default, no preference between the methods once normalised; the often quoted
0.3 / 0.7 assumes a dense model much stronger than BM25, and MiniLM-L6 on conversation text is
the weaker of the two.

Priors: a document's hybrid score is multiplied by its corpus's ``prior`` (1 for chunks;
``0.5 + importance`` for durable memories, so importance still weighs in). Recency (optional):
the score is multiplied by ``0.5 ** (age_days / half_life)``, the age taken from the corpus's
newest document (not the wall clock), so an idle folder's memory does not fade. MMR (optional):
greedy re-ranking by ``lambda * score - (1 - lambda) * max_sim_to_picked``, the similarity
between documents being the cosine of their vectors.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from datetime import datetime
from typing import Protocol

import numpy as np

from cwm_plugin.errors import InvalidInput
from cwm_plugin.memory.models import Hit, MemoryConfig
from cwm_plugin.timing import Stages

MODES = ("hybrid", "bm25", "vector")


class Corpus(Protocol):
    """What search needs of an index (``ChunkIndex``, ``FactIndex``)."""

    @property
    def n_vectors(self) -> int: ...

    @property
    def n_docs(self) -> int: ...

    def doc_ids(self, session: str | None = None) -> list[str]: ...

    def bm25_top(self, query: str, n: int, also: Iterable[str] = (),
                 allowed: set[str] | None = None) -> dict[str, float]: ...

    def vector_candidates(self, qvec: np.ndarray, n: int) -> list[str]: ...

    def vector_score(self, qvec: np.ndarray, doc_id: str) -> float: ...

    def doc_vector(self, doc_id: str) -> np.ndarray: ...

    def ts(self, doc_id: str) -> str: ...

    def prior(self, doc_id: str) -> float: ...

    def hit(self, doc_id: str, score: float, reasons: dict[str, float]) -> Hit: ...


def _minmax(values: dict[str, float]) -> dict[str, float]:
    if not values:
        return {}
    lo, hi = min(values.values()), max(values.values())
    if hi - lo < 1e-12:
        return dict.fromkeys(values, 1.0 if hi > 0 else 0.0)
    return {c: (v - lo) / (hi - lo) for c, v in values.items()}


def _days(ts: str) -> float:
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() / 86400.0
    except ValueError:
        return 0.0


def search_index(index: Corpus, query: str, qvec: np.ndarray | None, k: int,
                 cfg: MemoryConfig, *, mode: str = "hybrid", session: str | None = None,
                 stages: Stages | None = None) -> list[Hit]:
    """The ``k`` best documents for ``query`` (``qvec``: its embedding, needed unless bm25);
    time spent is added to ``stages`` (``keyword``, ``vector``, ``fusion``)."""
    if mode not in MODES:
        raise InvalidInput(f"search mode {mode!r} is unknown", hint=f"use one of {MODES}")
    stages = stages or Stages()
    if k <= 0:
        return []
    allowed = set(index.doc_ids(session)) if session is not None else None
    if (allowed is not None and not allowed) or not index.n_docs:
        return []
    n_cand = max(k, k * max(1, cfg.candidate_multiplier))
    bm25: dict[str, float] = {}
    vec: dict[str, float] = {}
    cands: set[str] = set()
    # an index that can read its keyword side while the vector side runs (``index/pg``)
    soon = getattr(index, "bm25_top_soon", None)
    pending = soon(query, n_cand, allowed) if soon is not None and mode == "hybrid" and \
        qvec is not None else None
    if mode in ("vector", "hybrid") and qvec is not None:
        with stages("vector"):
            within = getattr(index, "vector_candidates_in", None)
            if session is not None and within is not None:  # (``index/pg``)
                vc = within(session)
            else:
                lines = n_cand * 2 if session is None else index.n_vectors
                vc = [c for c in index.vector_candidates(qvec, lines)
                      if allowed is None or c in allowed]
            vec = _vector_scores(index, qvec, vc)
            cands.update(heapq.nlargest(n_cand, vec, key=vec.__getitem__))
    if mode in ("bm25", "hybrid"):
        with stages("keyword"):  # the best n_cand, and the vector candidates' exact scores
            bm25 = pending(cands) if pending is not None else \
                index.bm25_top(query, n_cand, also=cands, allowed=allowed)
            cands.update(c for c, s in bm25.items() if s > 0)
    if not cands:
        return []
    with stages("fusion"):
        return _fuse(index, cands, bm25, vec, qvec, k, cfg, mode)


def _vector_scores(index: Corpus, qvec: np.ndarray, ids: list[str]) -> dict[str, float]:
    """``vector_score`` of each of ``ids``, all at once where the index can."""
    batch = getattr(index, "vector_scores", None)
    return batch(qvec, ids) if batch is not None else {c: index.vector_score(qvec, c)
                                                       for c in ids}


def _fuse(index: Corpus, cands: set[str], bm25: dict[str, float], vec: dict[str, float],
          qvec: np.ndarray | None, k: int, cfg: MemoryConfig, mode: str) -> list[Hit]:
    """Score the candidates by ``mode`` (see the module docstring) and keep the ``k`` best."""
    reasons: dict[str, dict[str, float]] = {c: {} for c in cands}
    if mode == "hybrid":
        b = {c: bm25.get(c, 0.0) for c in cands}
        if qvec is not None:
            more = _vector_scores(index, qvec, [c for c in cands if c not in vec])
            v = {c: vec[c] if c in vec else more[c] for c in cands}
        else:
            v = dict.fromkeys(cands, 0.0)
        nb, nv = _minmax(b), _minmax(v)
        score = {c: cfg.bm25_weight * nb[c] + cfg.vector_weight * nv[c] for c in cands}
        for c in cands:
            reasons[c].update(bm25=b[c], vector=v[c], bm25_norm=nb[c], vector_norm=nv[c])
    elif mode == "bm25":
        score = {c: bm25[c] for c in cands}
        for c in cands:
            reasons[c]["bm25"] = bm25[c]
    else:
        score = {c: vec[c] for c in cands}
        for c in cands:
            reasons[c]["vector"] = vec[c]
    for c in cands:
        p = index.prior(c)
        if p != 1.0:
            score[c] *= p
            reasons[c]["prior"] = p
    if cfg.recency_half_life_days:
        _prefetch(index, cands)
        newest = _days(index.newest_ts()) if hasattr(index, "newest_ts") else \
            max(_days(index.ts(c)) for c in index.doc_ids(None))
        for c in cands:
            decay = 0.5 ** (max(0.0, newest - _days(index.ts(c))) / cfg.recency_half_life_days)
            score[c] *= decay
            reasons[c]["recency"] = decay
    ranked = sorted(cands, key=lambda c: (-score[c], c))
    if cfg.mmr_lambda is not None and len(ranked) > 1:
        ranked = _mmr(index, ranked, score, k, cfg.mmr_lambda)
    _prefetch(index, ranked[:k])
    return [index.hit(c, float(score[c]), reasons[c]) for c in ranked[:k]]


def _prefetch(index: Corpus, ids: Iterable[str]) -> None:
    """Let an index that reads its documents from elsewhere (``index/pg``) read these at once."""
    fetch = getattr(index, "prefetch", None)
    if fetch is not None:
        fetch(list(ids))


def _mmr(index: Corpus, ranked: list[str], score: dict[str, float], k: int,
         lam: float) -> list[str]:
    vecs = {c: index.doc_vector(c) for c in ranked}
    picked: list[str] = []
    rest = list(ranked)
    while rest and len(picked) < k:
        def gain(c: str) -> float:
            sim = max((float(vecs[c] @ vecs[p]) for p in picked), default=0.0)
            return lam * score[c] - (1 - lam) * sim
        best = max(rest, key=gain)
        picked.append(best)
        rest.remove(best)
    return picked + rest
