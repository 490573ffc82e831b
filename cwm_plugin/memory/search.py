"""BM25, vector and hybrid search over one tenant's index, with optional MMR and recency decay.

Candidates: ``k * candidate_multiplier`` chunks from each method (BM25's best by score; for
vectors, the chunks holding the nearest ``k * candidate_multiplier * 2`` lines in hnswlib).
Every candidate is then scored *exactly* by both methods (BM25 scores exist for every chunk; the
vector score is the max cosine over the chunk's stored line vectors), so hybrid never has to
guess a missing score.

Normalisation (hybrid): min-max per query over the candidate set, per method:
``n(s) = (s - min) / (max - min)``; a method whose candidates all score the same contributes 1
to each if its scores are positive, else 0. BM25 scores are unbounded and their scale depends on
the query's length and term rarity, cosine similarities sit in a narrow band (0.2-0.7 for
MiniLM); min-max puts both on [0, 1] *within this query*, so the weights (0.3 BM25, 0.7 vector
by default, the usual choice when a dense model is decent and BM25 is there to rescue exact
names, numbers and rare words) mean what they say.

Recency (optional): the score is multiplied by ``0.5 ** (age_days / half_life)``, the age taken
from the tenant's newest chunk (not the wall clock), so an idle tenant's memory does not fade.
MMR (optional): greedy re-ranking by ``lambda * score - (1 - lambda) * max_sim_to_picked``, the
similarity between chunks being the cosine of their mean line vectors.
"""

from __future__ import annotations

from datetime import datetime

import numpy as np

from cwm_plugin.errors import InvalidInput
from cwm_plugin.memory.index import TenantIndex
from cwm_plugin.memory.models import Hit, MemoryConfig

MODES = ("hybrid", "bm25", "vector")


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


def search_index(index: TenantIndex, query: str, qvec: np.ndarray | None, k: int,
                 cfg: MemoryConfig, *, mode: str = "hybrid",
                 session: str | None = None) -> list[Hit]:
    """The ``k`` best chunks for ``query`` (``qvec``: its embedding, needed unless bm25)."""
    if mode not in MODES:
        raise InvalidInput(f"search mode {mode!r} is unknown", hint=f"use one of {MODES}")
    if k <= 0 or not index.chunks:
        return []
    allowed = set(index.chunk_ids(session))
    if not allowed:
        return []
    n_cand = max(k, k * max(1, cfg.candidate_multiplier))
    bm25: dict[str, float] = {}
    vec: dict[str, float] = {}
    cands: set[str] = set()
    if mode in ("bm25", "hybrid"):
        bm25 = {c: s for c, s in index.bm25_scores(query).items() if c in allowed}
        cands.update(c for c in sorted(bm25, key=bm25.__getitem__, reverse=True)[:n_cand]
                     if bm25[c] > 0 or mode == "bm25")
    if mode in ("vector", "hybrid") and qvec is not None:
        lines = n_cand * 2 if session is None else len(index.vectors)
        vc = [c for c in index.vector_candidates(qvec, lines) if c in allowed]
        vec = {c: index.vector_score(qvec, c) for c in vc}
        cands.update(sorted(vec, key=vec.__getitem__, reverse=True)[:n_cand])
    if not cands:
        return []
    reasons: dict[str, dict[str, float]] = {c: {} for c in cands}
    if mode == "hybrid":
        b = {c: bm25.get(c, 0.0) for c in cands}
        v = {c: vec[c] if c in vec else index.vector_score(qvec, c) for c in cands} \
            if qvec is not None else dict.fromkeys(cands, 0.0)
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
    if cfg.recency_half_life_days:
        newest = max(_days(index.chunks[c].ts) for c in index.chunks)
        for c in cands:
            decay = 0.5 ** (max(0.0, newest - _days(index.chunks[c].ts))
                            / cfg.recency_half_life_days)
            score[c] *= decay
            reasons[c]["recency"] = decay
    ranked = sorted(cands, key=lambda c: (-score[c], c))
    if cfg.mmr_lambda is not None and len(ranked) > 1:
        ranked = _mmr(index, ranked, score, k, cfg.mmr_lambda)
    out = []
    for c in ranked[:k]:
        ch = index.chunks[c]
        out.append(Hit(text=ch.text, score=float(score[c]), source=f"session:{ch.session}",
                       chunk_id=c, turn_ids=list(ch.turn_ids), reasons=reasons[c]))
    return out


def _mmr(index: TenantIndex, ranked: list[str], score: dict[str, float], k: int,
         lam: float) -> list[str]:
    vecs = {c: index.chunk_vector(c) for c in ranked}
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
