"""One tenant's derived indexes: its chunks, a BM25 index over them, line vectors in hnswlib.

Everything here is rebuilt from the tenant's transcript files (``TenantIndex.build``) and kept
up to date turn by turn (``add_turn``): chunking is incremental (only the session's last, open
chunk changes), line vectors are appended (turns are never rewritten), and the BM25 index is
rebuilt lazily on the next search after a change (rank-bm25 is static; a tenant's chunks number
in the hundreds, so a rebuild costs milliseconds).

Vectors are per *line* (one turn, or one piece of an over-long turn), not per chunk: MiniLM
reads at most 256 word pieces, less than a 400-token chunk, so a whole-chunk vector would ignore
its tail, and a mean over a dozen turns blurs the one turn a question is about. A chunk's vector
score is therefore the best cosine similarity of any of its lines (a max-sim, late interaction).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import hnswlib
import numpy as np
from rank_bm25 import BM25Okapi

from cwm_plugin.memory.chunking import Unit, chunk_units, turn_units
from cwm_plugin.memory.embeddings import Embedder
from cwm_plugin.memory.models import Chunk, Turn
from cwm_plugin.memory.tokens import TokenCounter

_STOP = """a about above after again against all am an and any are as at be because
been before being below between both but by can did do does doing down during each few for from
further had has have having he her here hers herself him himself his how i if in into is it its
itself just me more most my myself no nor not now of off on once only or other our ours ourselves
out over own same she should so some such than that the their theirs them themselves then there
these they this those through to too under until up very was we were what when where which while
who whom why will with would you your yours yourself yourselves s t don ll m re ve d"""
STOPWORDS = frozenset(_STOP.split())


class LuceneBM25(BM25Okapi):
    """BM25 with Lucene's idf ``log(1 + (N - n + 0.5) / (n + 0.5))``: always positive.

    rank-bm25's Okapi idf is zero for a term in half the documents and negative (floored to a
    constant) above that, so a new tenant with two chunks scores every query 0, and frequent
    words all get the same floor. Lucene's form keeps the ordering and stays positive.
    """

    def _calc_idf(self, nd: dict[str, int]) -> None:
        for word, freq in nd.items():
            self.idf[word] = math.log(1.0 + (self.corpus_size - freq + 0.5) / (freq + 0.5))
        self.average_idf = sum(self.idf.values()) / max(len(self.idf), 1)


def bm25_tokens(text: str) -> list[str]:
    """Lower-cased word tokens without English stop words (question words add only noise)."""
    return [w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in STOPWORDS]


@dataclass
class SessionState:
    units: list[Unit] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)  # hnsw label of each unit
    spans: list[tuple[int, int, str]] = field(default_factory=list)  # (begin, end, chunk_id)


class TenantIndex:
    def __init__(self, embedder: Embedder, counter: TokenCounter, chunk_tokens: int,
                 overlap: int, context_lines: int = 1) -> None:
        self.context_lines = context_lines
        self.embedder = embedder
        self.counter = counter
        self.chunk_tokens = chunk_tokens
        self.overlap = overlap
        self.chunks: dict[str, Chunk] = {}
        self.chunk_labels: dict[str, list[int]] = {}
        self.sessions: dict[str, SessionState] = {}
        self.offsets: dict[str, int] = {}  # bytes of each session file already indexed
        self.vectors = np.zeros((0, embedder.dims), dtype=np.float32)
        self._hnsw = hnswlib.Index(space="cosine", dim=embedder.dims)
        self._hnsw.init_index(max_elements=1024, ef_construction=200, M=16)
        self._bm25: LuceneBM25 | None = None
        self._bm25_ids: list[str] = []
        self.added = 0  # chunks added since creation (for the metrics)

    # --- building ------------------------------------------------------------------------------

    def add_turns(self, session: str, turns: list[Turn]) -> None:
        """Index turns appended to ``session`` (in order); re-chunks only the open tail."""
        if not turns:
            return
        st = self.sessions.setdefault(session, SessionState())
        new_units = [u for t in turns for u in turn_units(t, self.counter, self.chunk_tokens)]
        self._add_vectors(st, new_units)
        start = 0
        if st.spans:  # drop the open last chunk, re-chunk from its first unit
            start, _, old = st.spans.pop()
            self._drop_chunk(old)
        st.units.extend(new_units)
        for b, e, chunk in chunk_units(session, st.units, self.counter, self.chunk_tokens,
                                       self.overlap, start):
            st.spans.append((b, e, chunk.chunk_id))
            self.chunks[chunk.chunk_id] = chunk
            self.chunk_labels[chunk.chunk_id] = st.labels[b:e]
            self.added += 1
        self._bm25 = None

    def _drop_chunk(self, cid: str) -> None:
        self.chunks.pop(cid, None)
        self.chunk_labels.pop(cid, None)

    def _add_vectors(self, st: SessionState, units: list[Unit]) -> None:
        if not units:
            return
        prev = st.units[-1].text if st.units else ""
        texts = []
        for u in units:  # each line with the line before it (see the module docstring)
            texts.append(f"{prev}\n{u.text}" if prev and self.context_lines else u.text)
            prev = u.text
        vecs = self.embedder.embed(texts)
        first = self.vectors.shape[0]
        labels = list(range(first, first + len(units)))
        self.vectors = np.concatenate([self.vectors, vecs]) if first else vecs
        need = first + len(units)
        if need > self._hnsw.get_max_elements():
            self._hnsw.resize_index(max(need, 2 * self._hnsw.get_max_elements()))
        self._hnsw.add_items(vecs, np.asarray(labels))
        st.labels.extend(labels)

    # --- scoring -------------------------------------------------------------------------------

    def chunk_ids(self, session: str | None = None) -> list[str]:
        if session is None:
            return list(self.chunks)
        return [c for _, _, c in self.sessions.get(session, SessionState()).spans]

    def bm25_scores(self, query: str) -> dict[str, float]:
        """BM25 score of every chunk (0 for chunks sharing no term with the query)."""
        if not self.chunks:
            return {}
        if self._bm25 is None:
            self._bm25_ids = list(self.chunks)
            self._bm25 = LuceneBM25([bm25_tokens(self.chunks[c].text) or ["_"]
                                    for c in self._bm25_ids])
        terms = bm25_tokens(query)
        if not terms:
            return dict.fromkeys(self._bm25_ids, 0.0)
        scores = self._bm25.get_scores(terms)
        return {c: float(s) for c, s in zip(self._bm25_ids, scores, strict=True)}

    def vector_candidates(self, qvec: np.ndarray, n_lines: int) -> list[str]:
        """Chunks holding one of the ``n_lines`` nearest lines (hnswlib, approximate)."""
        total = self._hnsw.get_current_count()
        if total == 0:
            return []
        k = min(n_lines, total)
        self._hnsw.set_ef(max(2 * k, 64))
        labels, _ = self._hnsw.knn_query(qvec.reshape(1, -1), k=k)
        wanted = {int(x) for x in labels[0]}
        return [c for c, labs in self.chunk_labels.items() if wanted.intersection(labs)]

    def vector_score(self, qvec: np.ndarray, cid: str) -> float:
        """Exact max cosine similarity between the query and the chunk's lines."""
        labs = self.chunk_labels.get(cid)
        if not labs:
            return 0.0
        return float(np.max(self.vectors[labs] @ qvec))

    def chunk_vector(self, cid: str) -> np.ndarray:
        v = self.vectors[self.chunk_labels[cid]].mean(0)
        return v / max(float(np.linalg.norm(v)), 1e-12)
