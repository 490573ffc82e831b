"""Durable memories as a search corpus: BM25 over their texts and their vectors in hnswlib.

``memories.md`` is rewritten as a whole (a memory is added, its importance or access count
changes), so this index is rebuilt whenever the file's signature (size, mtime) changes and the
memories it indexes differ (a rewrite that only bumped access counts, as every selection of a
memory does, just refreshes them in place); the vectors come from the embedding cache, so a
rebuild of a few hundred memories embeds only new texts. Memories are searched with the same
hybrid code as chunks (``search.py``) in a corpus of their own, with ``0.5 + importance`` as the
prior: a memory's score is its normalised hybrid relevance scaled by how important it was
judged (0.5x to 1.5x).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from cwm_plugin.memory.index.bm25 import BM25Corpus
from cwm_plugin.memory.index.chunks import knn_labels, new_hnsw
from cwm_plugin.memory.index.embeddings import Embedder
from cwm_plugin.memory.models import Hit, Memory


class FactIndex:
    """One folder's durable memories, searchable like chunks (``source="memory"``)."""

    def __init__(self, embedder: Embedder, memories: list[Memory],
                 signature: tuple[int, int] | None = None) -> None:
        self.signature = signature
        self.memories = {m.id: m for m in memories}
        self._ids = list(self.memories)
        self._row = {mid: i for i, mid in enumerate(self._ids)}
        self.vectors = embedder.embed([m.text for m in memories]) if memories else \
            np.zeros((0, embedder.dims), dtype=np.float32)
        self.hnsw = new_hnsw(embedder.dims, max(16, len(memories))) if memories else None
        if self.hnsw is not None:  # (none for a namespace without memories: megabytes each)
            self.hnsw.add_items(self.vectors, np.arange(len(memories)))
        self._bm25 = BM25Corpus()
        for m in memories:
            self._bm25.add(m.id, m.text)

    def same_corpus(self, memories: list[Memory]) -> bool:
        """Whether ``memories`` index exactly as these do (ids, texts, importance in order):
        a rewrite that only bumped access counts needs no rebuild."""
        return [m.id for m in memories] == self._ids and all(
            (m.text, m.importance) == (self.memories[m.id].text, self.memories[m.id].importance)
            for m in memories)

    def refresh(self, memories: list[Memory], signature: tuple[int, int] | None) -> None:
        """Take the file's new signature and the memories' new bookkeeping (same corpus)."""
        self.memories = {m.id: m for m in memories}
        self.signature = signature

    @property
    def n_vectors(self) -> int:
        return len(self._ids)

    @property
    def n_docs(self) -> int:
        return len(self._ids)

    def doc_ids(self, session: str | None = None) -> list[str]:
        return list(self._ids)

    def bm25_top(self, query: str, n: int, also: Iterable[str] = (),
                 allowed: set[str] | None = None) -> dict[str, float]:
        return self._bm25.top(query, n, also, allowed)

    def vector_candidates(self, qvec: np.ndarray, n: int) -> list[str]:
        if self.hnsw is None:
            return []
        return [self._ids[i] for i in sorted(knn_labels(self.hnsw, qvec, n, len(self._ids)))]

    def vector_score(self, qvec: np.ndarray, doc_id: str) -> float:
        return float(self.vectors[self._row[doc_id]] @ qvec)

    def doc_vector(self, doc_id: str) -> np.ndarray:
        return self.vectors[self._row[doc_id]]

    def ts(self, doc_id: str) -> str:
        return self.memories[doc_id].created

    def prior(self, doc_id: str) -> float:
        return 0.5 + float(self.memories[doc_id].importance)

    def hit(self, doc_id: str, score: float, reasons: dict[str, float]) -> Hit:
        m = self.memories[doc_id]
        return Hit(text=m.text, score=score, source="memory", chunk_id=m.id, turn_ids=[],
                   reasons={**reasons, "importance": m.importance})
