"""The re-ranking seam: a model that reads the question and a candidate line together orders
the best candidates again, before they are packed.

The line score (``lines.py``) weighs words and a sentence vector; what it cannot see is a line
that shares neither with the question ("What activities does Melanie partake in?" -> "I'm off
to go swimming with the kids"). A learned combination of the same features did not find more
(``bench/memory_retrieval.md``, fifth pass); a model reading both texts can. This module is the
memory side of it, independent of where the scores come from: a :class:`Reranker` (the sidecar's
asks the served model, ``cwm_plugin/sidecar/turn/rerank.py``) scores the ``top_n`` best lines,
and :func:`rerank_lines` orders those by ``weight`` x the re-ranker's score plus ``1 - weight``
x the line score (each min-max normalised over the ``top_n``); lines below them keep their
place after them. Off unless a reranker is given. A reranker that fails or answers the wrong
number of scores raises; the caller (``MemoryService``) then keeps the first ranking.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import numpy as np

from cwm_plugin.memory.selection.lines import Line

log = logging.getLogger(__name__)


class RerankFailed(RuntimeError):
    """The re-ranker gave no usable scores (the selection keeps its first ranking)."""


class Reranker(Protocol):
    name: str
    top_n: int  # lines re-scored, the best first
    weight: float  # the re-ranker's share of the new order, 0..1

    def scores(self, query: str, texts: list[str]) -> list[float]:
        """A relevance score for each text (higher: more relevant), in order."""
        ...


def _minmax(x: np.ndarray) -> np.ndarray:
    lo, hi = float(x.min()), float(x.max())
    return (x - lo) / (hi - lo) if hi - lo > 1e-12 else np.zeros_like(x)


def rerank_lines(lines: list[Line], query: str, reranker: Reranker) -> list[Line]:
    """``lines`` (best first) with the ``reranker.top_n`` best ordered again. Their scores are
    remapped into the span the first ranking gave them, so every score stays above the lines
    below them; ``reasons["rerank"]`` is the re-ranker's own score."""
    head, tail = lines[:max(0, reranker.top_n)], lines[max(0, reranker.top_n):]
    if len(head) < 2:
        return lines
    got = reranker.scores(query, [ln.unit.text for ln in head])
    if len(got) != len(head) or not all(np.isfinite(got)):
        raise RerankFailed(f"{reranker.name} gave {len(got)} scores for {len(head)} lines"
                           if len(got) != len(head) else f"{reranker.name} gave a score that "
                           "is not a finite number")
    first = np.array([ln.score for ln in head])
    w = min(1.0, max(0.0, reranker.weight))
    mixed = w * _minmax(np.asarray(got, dtype=float)) + (1 - w) * _minmax(first)
    lo, hi = float(first.min()), float(first.max())
    order = sorted(range(len(head)), key=lambda i: (-mixed[i], i))
    out = [dataclasses.replace(head[i], score=lo + float(mixed[i]) * (hi - lo),
                               reasons={**head[i].reasons, "rerank": float(got[i])})
           for i in order]
    return out + tail


class RerankStage:
    """:func:`rerank_lines` that never fails a selection: a re-ranker that fails (down, slow,
    a bad answer) leaves the first ranking, is counted
    (``cwm_memory_degraded_total{what="rerank"}``) and logged once per re-ranker until it
    works again."""

    def __init__(self, degraded: object) -> None:
        self._degraded = degraded  # MemoryMetrics.degraded (a labelled prometheus Counter)
        self._failing: set[str] = set()

    def __call__(self, lines: list[Line], query: str, reranker: Reranker | None) -> list[Line]:
        if reranker is None or not lines or not query.strip():
            return lines
        try:
            out = rerank_lines(lines, query, reranker)
        except Exception as exc:  # a cache's helper: recomputable, never the turn's failure
            self._degraded.labels("rerank").inc()  # type: ignore[attr-defined]
            if reranker.name not in self._failing:
                self._failing.add(reranker.name)
                log.warning("memory re-ranker %s failed (%s: %s); selections keep the first "
                            "ranking until it answers (check the model server it asks)",
                            reranker.name, type(exc).__name__, str(exc)[:200])
            return lines
        if reranker.name in self._failing:
            self._failing.discard(reranker.name)
            log.info("memory re-ranker %s answers again", reranker.name)
        return out
