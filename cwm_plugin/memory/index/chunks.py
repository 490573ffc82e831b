"""One folder's derived chunk index: its chunks, BM25 over them, line and chunk vectors.

Everything here is rebuilt from the folder's transcript files and kept up to date turn by turn
(``add_turns``): chunking is incremental (only the session's last, open chunk changes), line
vectors are appended (turns are never rewritten), and BM25's statistics are updated chunk by
chunk (``bm25.py``). A session whose file was edited by hand is dropped (``drop_session``) and
indexed again from its file. ``persist.py`` writes and reads this state.

Vectors are per *line* (one turn, or one piece of an over-long turn, with the line before it
as context): MiniLM reads at most 256 word pieces, less than a 400-token chunk, so a whole-chunk
vector would see only its head, and a mean over a dozen turns blurs the one turn a question is
about. A chunk's vector score is the best cosine similarity of any of its lines (a max-sim,
late interaction) plus ``chunk_weight`` (1 by default: the two terms weigh the same) times the
cosine of the chunk's centroid (the normalised mean of its line vectors: what the chunk is
about as a whole): it finds as much more evidence as embedding the whole chunk text would,
without a 256-token forward pass on every turn (``bench/memory_retrieval.md``).

The context comes in two ways (``context_mode``). ``pair`` embeds each line with the line
before it (twice the tokens of the line); ``mix`` (default) embeds each line alone and adds the
previous line's vector to it, both weighted by their tokens (mean pooling over the two lines,
without the attention between them): half the embedding work, for every turn recorded and for
bulk imports, at nearly ``pair``'s recall and well above no context at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import hnswlib
import numpy as np

from cwm_plugin.memory.index.bm25 import BM25Corpus
from cwm_plugin.memory.index.chunking import Unit, chunk_units, turn_units
from cwm_plugin.memory.index.embeddings import Embedder
from cwm_plugin.memory.models import Chunk, Hit, Turn
from cwm_plugin.memory.tokens import TokenCounter


@dataclass
class SessionIndex:
    units: list[Unit] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)  # hnsw label of each unit
    spans: list[tuple[int, int, str]] = field(default_factory=list)  # (begin, end, chunk_id)


def new_hnsw(dims: int, capacity: int = 1024) -> hnswlib.Index:
    index = hnswlib.Index(space="cosine", dim=dims)
    index.init_index(max_elements=capacity, ef_construction=200, M=16)
    return index


def knn_ordered(index: hnswlib.Index, qvec: np.ndarray, k: int, live: int) -> list[int]:
    """Labels of the ``k`` nearest of ``live`` undeleted items, nearest first (hnswlib,
    approximate)."""
    k = min(k, live)
    if k <= 0:
        return []
    index.set_ef(max(2 * k, 64))
    try:
        labels, _ = index.knn_query(qvec.reshape(1, -1), k=k)
    except RuntimeError:
        # hnswlib found fewer than k: a graph of many identical vectors (the same short line
        # said again and again) can leave some unreachable. Search wider, then ask for fewer
        # (the other candidate sources still propose theirs) rather than fail the search.
        index.set_ef(max(2 * k, min(live, 10 * k), 64))  # (bounded: 75k lines is a folder)
        while True:
            try:
                labels, _ = index.knn_query(qvec.reshape(1, -1), k=k)
                break
            except RuntimeError:
                if k <= 1:
                    return []
                k //= 2
    return [int(x) for x in labels[0]]


def knn_labels(index: hnswlib.Index, qvec: np.ndarray, k: int, live: int) -> set[int]:
    """Labels of the ``k`` nearest of ``live`` undeleted items (hnswlib, approximate)."""
    return set(knn_ordered(index, qvec, k, live))


class ChunkIndex:
    """Chunks of every session of one folder, searchable by BM25 and vectors."""

    def __init__(self, embedder: Embedder, counter: TokenCounter, chunk_tokens: int,
                 overlap: int, context_lines: int = 1, chunk_weight: float = 1.0,
                 context_mode: str = "mix") -> None:
        self.context_lines = context_lines
        self.context_mode = context_mode
        self.chunk_weight = chunk_weight
        self.embedder = embedder
        self.counter = counter
        self.chunk_tokens = chunk_tokens
        self.overlap = overlap
        self.chunks: dict[str, Chunk] = {}
        self.chunk_labels: dict[str, list[int]] = {}
        self._label_chunks: dict[int, list[str]] = {}  # line vector -> chunks holding it
        self._seq: dict[str, int] = {}                  # chunk -> insertion order
        self._next_seq = 0
        self._centroids: dict[str, np.ndarray] = {}
        self.sessions: dict[str, SessionIndex] = {}
        self.offsets: dict[str, int] = {}  # bytes of each session file already indexed
        # grows by doubling from little, and hnswlib's index (megabytes of label locks alone)
        # is made on the first line: a namespace that is only read costs next to nothing
        self._vecs = np.zeros((64, embedder.dims), dtype=np.float32)
        self._n = 0
        self._hnsw: hnswlib.Index | None = None
        self.deleted = 0  # line vectors marked deleted in hnsw (sessions dropped)
        self._nearest: tuple[tuple, list[int]] | None = None  # the last nearest_lines
        self._bm25 = BM25Corpus()
        self.added = 0  # chunks added since creation (for the metrics)
        self.changes = 0  # sessions' lines appended or dropped (followers resync on a change)

    # --- building ------------------------------------------------------------------------------

    def units(self, turns: list[Turn]) -> list[Unit]:
        """The units (lines) these turns make."""
        return [u for t in turns for u in turn_units(t, self.counter, self.chunk_tokens)]

    def last_unit(self, session: str) -> Unit | None:
        """The session's last unit (None for a new session)."""
        st = self.sessions.get(session)
        return st.units[-1] if st is not None and st.units else None

    def embed_inputs(self, prev: Unit | None, units: list[Unit]) -> list[str]:
        """The texts to embed for ``units`` following ``prev`` (see the module docstring):
        ``pair``: each line with the line before it; ``mix``: each line alone, and the one
        before the first (its vector comes from the embedding cache)."""
        if not self.context_lines:
            return [u.text for u in units]
        if self.context_mode == "pair":
            out, before = [], prev.text if prev else ""
            for u in units:
                out.append(f"{before}\n{u.text}" if before else u.text)
                before = u.text
            return out
        return [u.text for u in ([prev] if prev else []) + units]

    def line_vectors(self, prev: Unit | None, units: list[Unit],
                     embedded: np.ndarray) -> np.ndarray:
        """The units' vectors from the embeddings of :meth:`embed_inputs`: ``mix`` adds each
        line's vector to the one before it, weighted by their tokens, and normalises."""
        if not self.context_lines or self.context_mode == "pair" or not units:
            return embedded
        lines = ([prev] if prev else []) + units
        weights = np.array([max(u.tokens, 1) for u in lines], dtype=np.float32)[:, None]
        weighted = embedded * weights
        mixed = weighted.copy()
        mixed[1:] += weighted[:-1]
        mixed = mixed[len(lines) - len(units):]
        return mixed / np.maximum(np.linalg.norm(mixed, axis=1, keepdims=True), 1e-12)

    def embed_units(self, prev: Unit | None, units: list[Unit]) -> np.ndarray:
        return self.line_vectors(prev, units, self.embedder.embed(self.embed_inputs(prev, units)))

    def add_turns(self, session: str, turns: list[Turn],
                  prepared: tuple[list[Unit], np.ndarray] | None = None) -> None:
        """Index turns appended to ``session`` (in order); re-chunks only the open tail.
        ``prepared``: their units and vectors, already computed (a bulk import embeds every
        session's lines in one sorted pass)."""
        if not turns:
            return
        st = self.sessions.setdefault(session, SessionIndex())
        new_units, vecs = prepared if prepared is not None else (self.units(turns), None)
        self._add_vectors(st, new_units, vecs)
        start = 0
        if st.spans:  # drop the open last chunk, re-chunk from its first unit
            start, _, old = st.spans.pop()
            self._drop_chunk(old)
        st.units.extend(new_units)
        self.changes += 1
        for b, e, chunk in chunk_units(session, st.units, self.counter, self.chunk_tokens,
                                       self.overlap, start):
            st.spans.append((b, e, chunk.chunk_id))
            self.chunks[chunk.chunk_id] = chunk
            self.set_chunk_labels(chunk.chunk_id, st.labels[b:e])
            self._bm25.add(chunk.chunk_id, chunk.text)
            self.added += 1

    def set_chunk_labels(self, cid: str, labels: list[int]) -> None:
        """Record which line vectors a chunk holds (both ways)."""
        self.chunk_labels[cid] = labels
        for label in labels:
            self._label_chunks.setdefault(label, []).append(cid)
        self._seq[cid] = self._next_seq
        self._next_seq += 1

    def drop_session(self, session: str) -> None:
        """Forget a session (its file was edited or removed); its line vectors are deleted."""
        st = self.sessions.pop(session, None)
        self.offsets.pop(session, None)
        if st is None:
            return
        self.changes += 1
        for _, _, cid in st.spans:
            self._drop_chunk(cid)
        for label in st.labels:
            self.hnsw.mark_deleted(label)
        self.deleted += len(st.labels)

    def restore_chunk(self, chunk: Chunk) -> None:
        """Add a chunk read back from a saved index (its lines' vectors are already there)."""
        self.chunks[chunk.chunk_id] = chunk
        self._bm25.add(chunk.chunk_id, chunk.text)

    def _drop_chunk(self, cid: str) -> None:
        self._bm25.remove(cid)
        self.chunks.pop(cid, None)
        for label in self.chunk_labels.pop(cid, ()):
            holders = self._label_chunks.get(label)
            if holders is not None and cid in holders:
                holders.remove(cid)
                if not holders:
                    del self._label_chunks[label]
        self._seq.pop(cid, None)
        self._centroids.pop(cid, None)

    def _add_vectors(self, st: SessionIndex, units: list[Unit],
                     vecs: np.ndarray | None = None) -> None:
        if not units:
            return
        if vecs is None:
            vecs = self.embed_units(st.units[-1] if st.units else None, units)
        first = self._n
        labels = list(range(first, first + len(units)))
        need = first + len(units)
        if need > self._vecs.shape[0]:
            grown = np.zeros((max(need, 2 * self._vecs.shape[0]), self._vecs.shape[1]),
                             dtype=np.float32)
            grown[:first] = self._vecs[:first]
            self._vecs = grown
        self._vecs[first:need] = vecs
        self._n = need
        if need > self.hnsw.get_max_elements():
            self.hnsw.resize_index(max(need, 2 * self.hnsw.get_max_elements()))
        self.hnsw.add_items(vecs, np.asarray(labels))
        st.labels.extend(labels)

    @property
    def hnsw(self) -> hnswlib.Index:
        if self._hnsw is None:
            self._hnsw = new_hnsw(self.embedder.dims, max(64, self._n))
        return self._hnsw

    @hnsw.setter
    def hnsw(self, value: hnswlib.Index) -> None:
        self._hnsw = value

    # --- the corpus protocol of search.py --------------------------------------------------------

    @property
    def vectors(self) -> np.ndarray:
        """The line vectors, row = hnsw label."""
        return self._vecs[:self._n]

    @vectors.setter
    def vectors(self, value: np.ndarray) -> None:
        self._vecs = np.ascontiguousarray(value, dtype=np.float32)
        self._n = value.shape[0]

    @property
    def n_vectors(self) -> int:
        return self._n

    @property
    def n_docs(self) -> int:
        return len(self.chunks)

    def doc_ids(self, session: str | None = None) -> list[str]:
        if session is None:
            return list(self.chunks)
        return [c for _, _, c in self.sessions.get(session, SessionIndex()).spans]

    def bm25_top(self, query: str, n: int, also: Iterable[str] = (),
                 allowed: set[str] | None = None) -> dict[str, float]:
        """BM25 scores of the ``n`` best chunks and of those in ``also`` (``BM25Corpus.top``)."""
        return self._bm25.top(query, n, also, allowed)

    def nearest_lines(self, qvec: np.ndarray, k: int) -> list[int]:
        """Labels of the ``k`` line vectors nearest ``qvec``, nearest first. A selection asks
        twice for one query (the chunks' candidates, then the lines'): the second is the head
        of the first answer while nothing was added or deleted (the wider search is the more
        exact)."""
        if self.n_vectors - self.deleted <= 0:
            return []
        key = (qvec.tobytes(), id(self.hnsw), self.n_vectors, self.deleted)
        memo = self._nearest
        if memo is not None and memo[0] == key and len(memo[1]) >= min(
                k, self.n_vectors - self.deleted):
            return memo[1][:k]
        labels = knn_ordered(self.hnsw, qvec, k, self.n_vectors - self.deleted)
        self._nearest = (key, labels)
        return labels

    def vector_candidates(self, qvec: np.ndarray, n_lines: int) -> list[str]:
        """Chunks holding one of the ``n_lines`` nearest lines (hnswlib, approximate)."""
        wanted = self.nearest_lines(qvec, n_lines)
        if not wanted:
            return []
        found = {c for label in wanted for c in self._label_chunks.get(label, ())}
        return sorted(found, key=self._seq.__getitem__)  # in the order chunks were added

    def line_scores(self, qvec: np.ndarray, cid: str) -> np.ndarray | None:
        labs = self.chunk_labels.get(cid)
        return self.vectors[labs] @ qvec if labs else None

    def vector_score(self, qvec: np.ndarray, cid: str) -> float:
        """Max cosine over the chunk's lines plus ``chunk_weight`` x its centroid's cosine."""
        lines = self.line_scores(qvec, cid)
        if lines is None:
            return 0.0
        extra = float(self.doc_vector(cid) @ qvec) * self.chunk_weight if self.chunk_weight \
            else 0.0
        return float(np.max(lines)) + extra

    def vector_scores(self, qvec: np.ndarray, cids: list[str]) -> dict[str, float]:
        """``vector_score`` of many chunks: one product over all their lines (a search scores
        a hundred or more candidate chunks)."""
        out = dict.fromkeys(cids, 0.0)  # a chunk without lines scores 0, as one at a time
        have = [c for c in cids if self.chunk_labels.get(c)]
        if not have:
            return out
        labs = [self.chunk_labels[c] for c in have]
        sims = self.vectors[np.fromiter((x for ls in labs for x in ls), dtype=np.int64)] @ qvec
        starts = np.cumsum([0, *(len(ls) for ls in labs[:-1])])
        best = np.maximum.reduceat(sims, starts)
        cent = np.stack([self.doc_vector(c) for c in have]) @ qvec if self.chunk_weight \
            else np.zeros(len(have))
        for c, b, v in zip(have, best.tolist(), cent.tolist(), strict=True):
            out[c] = b + (v * self.chunk_weight if self.chunk_weight else 0.0)
        return out

    def doc_vector(self, cid: str) -> np.ndarray:
        """The chunk's centroid: the normalised mean of its line vectors (cached)."""
        v = self._centroids.get(cid)
        if v is None:
            v = self.vectors[self.chunk_labels[cid]].mean(0)
            v = self._centroids[cid] = v / max(float(np.linalg.norm(v)), 1e-12)
        return v

    def warm_centroids(self) -> int:
        """Compute every chunk's centroid ahead (so a folder's first turn computes none);
        returns how many were computed."""
        todo = [c for c in self.chunk_labels if c not in self._centroids and self.chunk_labels[c]]
        for c in todo:
            self.doc_vector(c)
        return len(todo)

    def chunk_sizes(self) -> list[tuple[int, int]]:
        """``(tokens, turns)`` of every chunk (what a bench reports of the chunking)."""
        return [(c.tokens, len(c.turn_ids)) for c in self.chunks.values()]

    def session_units(self, session: str) -> list[Unit]:
        """Every line of a session, in order (the pack's neighbours)."""
        st = self.sessions.get(session)
        return st.units if st is not None else []

    def ts(self, cid: str) -> str:
        return self.chunks[cid].ts

    def prior(self, cid: str) -> float:
        return 1.0

    def hit(self, cid: str, score: float, reasons: dict[str, float]) -> Hit:
        ch = self.chunks[cid]
        return Hit(text=ch.text, score=score, source=f"session:{ch.session}", chunk_id=cid,
                   turn_ids=list(ch.turn_ids), reasons=reasons)
