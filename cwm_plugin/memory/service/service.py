"""The memory façade the sidecar and the CLI call: ``MemoryService``.

The service owns the files, each folder's indexes, its lock per folder and the transcript
writer (``transcripts.py``: recording turns, which it delegates), and does the reading side:
search, selection, durable memories and summaries. Files are the truth
(``files/markdown.py``); each folder's indexes are derived from them and kept in step by
``folders.py`` (loaded from their saved copy or built, caught up with appends, rebuilt where a
file was edited). One lock a folder serialises index changes inside this process; file appends
are also locked across processes. Embeddings go through an on-disk cache under
``<root>/.cache/embeddings``; saved indexes live under ``<root>/.index``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
import time
from contextlib import AbstractContextManager
from datetime import datetime

import numpy as np
from tqdm import tqdm

from cwm_plugin.errors import InvalidInput
from cwm_plugin.memory.files.names import check_memory_name
from cwm_plugin.memory.files.pending import PendingTurns
from cwm_plugin.memory.index.chunks import ChunkIndex
from cwm_plugin.memory.index.embeddings import CachedEmbedder, Embedder
from cwm_plugin.memory.index.pg import open_indexes
from cwm_plugin.memory.index.ratios import TokenRatios
from cwm_plugin.memory.index.search import search_index
from cwm_plugin.memory.metrics import MemoryMetrics
from cwm_plugin.memory.models import Hit, Memory, MemoryConfig, Selection, Turn
from cwm_plugin.memory.postgres import open_truth
from cwm_plugin.memory.selection.history import prefix_length, split_current
from cwm_plugin.memory.selection.lines import Line, LineCorpus, rank_lines
from cwm_plugin.memory.selection.rerank import Reranker, RerankStage
from cwm_plugin.memory.selection.select import Candidates, select
from cwm_plugin.memory.service.background import FolderJobs
from cwm_plugin.memory.service.facts_file import FactStore, Merged
from cwm_plugin.memory.service.transcripts import TranscriptWriter
from cwm_plugin.memory.tokens import TokenCounter, content_text
from cwm_plugin.timing import Stages

log = logging.getLogger(__name__)
__all__ = ["Hit", "Memory", "MemoryConfig", "MemoryService", "Selection"]
CHAT_ROLES = ("user", "assistant")
SEARCH_K = 10


class MemoryService:
    def __init__(self, config: MemoryConfig, embedder: Embedder, counter: TokenCounter,
                 metrics: MemoryMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or MemoryMetrics()
        self._rerank = RerankStage(self.metrics.degraded)
        self.files = open_truth(config)
        if not isinstance(embedder, CachedEmbedder):
            embedder = CachedEmbedder(embedder, config.root / ".cache" / "embeddings",
                                      self.metrics)
        self.embedder = embedder
        self.counter = counter  # chunk sizes; budgets may use the served model's counter
        self.indexes = open_indexes(self.files, config, embedder, counter, self.metrics)
        self.facts = FactStore(self.files, self._similar, self.lock)
        self._locks: dict[str, threading.RLock] = {}
        self._guard = threading.Lock()
        self.pending = PendingTurns()  # appended with defer_index, not indexed yet
        self._lines: dict[str, tuple[ChunkIndex, LineCorpus]] = {}  # per folder, per index
        self.writer = TranscriptWriter(self.files, embedder, self.indexes, self.pending,
                                       self.lock, self._catch_up)
        self.ratios = TokenRatios()  # index tokens -> a served model's, per folder
        self.syncs = FolderJobs()  # looks for other writers a selection found due

    # --- internals -----------------------------------------------------------------------------

    def lock(self, folder: str) -> threading.RLock:
        """The folder's re-entrant lock (hold it to keep several appends adjacent)."""
        with self._guard:
            return self._locks.setdefault(folder, threading.RLock())

    # --- transcripts: the writer's ---------------------------------------------------------

    def record_turn(self, folder: str, session: str, role: str, content: str, *,
                    turn_id: str | None = None, ts: datetime | None = None) -> str:
        """Append one turn to the session's file (durably), then index it; returns its id."""
        return self.writer.record_turn(folder, session, role, content, turn_id=turn_id, ts=ts)

    def record_turns(self, folder: str, session: str, turns: list[tuple[str, str]], *,
                     turn_ids: list[str | None] | None = None,
                     ts: datetime | None = None, defer_index: bool = False) -> list[str]:
        """Append turns in one durable write, then index them (``defer_index``: later, by
        :meth:`index_pending`); returns their ids (:meth:`TranscriptWriter.record_turns`)."""
        return self.writer.record_turns(folder, session, turns, turn_ids=turn_ids, ts=ts,
                                        defer_index=defer_index)

    def index_pending(self, folder: str) -> int:
        """Index the turns appended with ``defer_index``; returns how many batches (with
        the index in the database: its sessions caught up, one batch)."""
        if getattr(self.indexes, "in_database", False):
            with self.lock(folder):
                self.indexes.get(folder)
            return 1
        return self.writer.index_pending(folder)

    def transcript(self, folder: str, session: str) -> list[dict]:
        """Turns read back from the file: ``turn_id`` (also ``id``), role, content, ts."""
        return self.writer.transcript(folder, session)

    def _catch_up(self, folder: str) -> None:
        """After an indexing, or in the background when a selection found it due: the look for
        other writers (when a ``sync_interval_s`` has passed; the scan of the files made
        before taking the lock) and the line corpus."""
        try:
            stats = self.files.session_stats(folder) if self.indexes.due(folder) else None
            with self.lock(folder):
                idx = self.indexes.refresh(folder, stats)
                got = self._lines.get(folder)
                if got is not None and got[0] is idx:
                    got[1].sync(idx)
        except Exception as exc:  # noqa: BLE001 - the next search looks again, and says
            log.debug("folder %s: catching up after an indexing failed: %s", folder, exc)

    def index(self, folder: str) -> ChunkIndex:
        """The folder's chunk index, caught up with its files."""
        check_memory_name("folder", folder)
        self.writer.index_pending(folder)  # (an index in a database: the look below)
        with self.lock(folder):
            return self.indexes.refresh(folder)

    def _embed_one(self, text: str) -> np.ndarray:
        return self.embedder.embed([text])[0]

    # --- search and selection ---------------------------------------------------------------

    def warm(self, folder: str) -> None:
        """Get a folder's first selection ready: its index loaded, its line corpus built and
        scored once (keyword side: no embedding needed), its chunks' centroids computed, then
        the embedder's query path compiled past its cache; an embedder that is down is
        logged, the rest stays warm."""
        self.select_context(folder, None, [{"role": "user", "content": "warm up"}], 64,
                            bump=False, mode="bm25")
        with self.lock(folder):
            self.indexes.get(folder).warm_centroids()
        try:
            getattr(self.embedder, "inner", self.embedder).embed(["warm up"])
        except Exception as exc:  # noqa: BLE001 - a request will embed (or answer without)
            log.warning("folder %s: the query embedder did not warm up (%s)", folder, exc)

    def search(self, folder: str, query: str, k: int = 10, *, mode: str = "hybrid",
               session: str | None = None) -> list[Hit]:
        """The ``k`` best chunks of the folder's transcripts (one session's, if given)."""
        check_memory_name("folder", folder)
        if session is not None:
            check_memory_name("session", session)
        t0 = time.perf_counter()
        qvec = self._embed_one(query) if mode != "bm25" else None
        self.writer.index_pending(folder)  # (an index in a database: the look below)
        with self.lock(folder):
            idx = self.indexes.refresh(folder)
            with self._reading():
                hits = search_index(idx, query, qvec, k, self.config, mode=mode,
                                    session=session)
        self.metrics.retrieval.labels(mode).observe(time.perf_counter() - t0)
        return hits

    def search_memories(self, folder: str, query: str, k: int = 8, *,
                        mode: str = "hybrid") -> list[Hit]:
        """The ``k`` best durable memories (``Hit.source == "memory"``, ``chunk_id`` = id)."""
        check_memory_name("folder", folder)
        qvec = self._embed_one(query) if mode != "bm25" and query.strip() else None
        with self.lock(folder):
            return self._memory_hits(folder, query, qvec, k, mode, Stages())

    def _memory_hits(self, folder: str, query: str, qvec: np.ndarray | None, k: int,
                     mode: str, stages: Stages) -> list[Hit]:
        """Durable memories for ``query`` (the caller holds the folder's lock)."""
        t0 = time.perf_counter()
        with stages("files"):
            mems = self.indexes.memories(folder)
        if not query.strip():  # nothing to match: the most important first
            ranked = sorted(mems.memories.values(), key=lambda m: (-m.importance, m.id))
            return [mems.hit(m.id, m.importance, {}) for m in ranked[:k]]
        hits = search_index(mems, query, qvec, k, self.config, mode=mode, stages=stages)
        self.metrics.retrieval.labels(f"memories-{mode}").observe(time.perf_counter() - t0)
        return hits

    def select_context(self, folder: str, session: str | None, messages: list[dict],
                       budget_tokens: int, *, query: str | None = None,
                       counter: TokenCounter | None = None, recent_turns: int | None = None,
                       summary: bool = True, bump: bool = True,
                       present: list[dict] | None = None,
                       stages: Stages | None = None, mode: str = "hybrid",
                       shared: list[str] | tuple[str, ...] = (),
                       passages: bool = True, reranker: Reranker | None = None) -> Selection:
        """Recent turns verbatim plus memories, summary and hits, within ``budget_tokens``.

        ``messages`` are the request's chat messages: the leading system/developer messages
        are the caller's stable prefix and are ignored here (``history.py``); the *current
        exchange* (from the last user message on: the question and any tool calls answering
        it) is the caller's too, and its text is never repeated as memory. What comes before
        it is the history the ``recent_turns`` (default: the configured number) most recent
        messages are kept from; if the request carries none, they come from the session's
        transcript. ``session=None`` is a stateless caller (no transcript, no summary).
        ``summary=False`` leaves the session summary out; ``bump=False`` leaves the memories'
        access counts to a later :meth:`bump` (a derived file under ``.index``, off the
        request's path; a selection never writes a markdown file). ``present``: more
        messages the caller sends anyway (its whole history): chunks made only of their text
        are skipped. ``counter`` counts the budget (the served model's
        tokenizer; default: the service's); time spent is added to ``stages``; ``mode``: how
        the conversation is searched (hybrid, bm25, vector); ``shared``: more folders (the
        caller's namespaces it may read) whose durable memories compete for the facts;
        ``passages=False``: the quick view, no conversation is searched (facts and summary);
        ``reranker``: orders the best lines again (``selection/rerank.py``; off when None).
        """
        check_memory_name("folder", folder)
        if session is not None:
            check_memory_name("session", session)
        if budget_tokens < 0:
            raise InvalidInput("budget_tokens must be >= 0")
        stages = stages or Stages()
        conv = messages[prefix_length(messages):]
        history, current = split_current(conv)
        recent_ids: set[str] = set()
        n = self.config.recent_turns if recent_turns is None else recent_turns
        if not history and session is not None and n > 0:
            with stages("files"):
                turns = self.files.read_turns(folder, session)[-n:]
            history = [_as_message(t) for t in turns]
            recent_ids = {t.turn_id for t in turns}
        if query is None:
            query = content_text(current[0]) if current else ""
        cands = self._candidates(folder, session if summary else None, query or "", stages,
                                 mode, shared, passages)
        if reranker is not None and cands.lines:  # (no folder lock held: it may ask a server)
            with stages("rerank"):
                cands.lines = self._rerank(cands.lines, query or "", reranker)
        counter = counter or self.counter
        with stages("count"):
            known: dict[str, int] | None = cands.line_tokens
            scale = 1.0 if counter.name == self.counter.name else \
                self.ratios.of(folder, counter, known.items())
            sel = select(counter, history, n, budget_tokens, cands, recent_ids,
                         self.config.max_facts, present=[*current, *(present or [])],
                         known=known if scale is not None else None, scale=scale or 1.0)
        if sel.facts and bump:
            self.bump(folder, [m.id for m in sel.facts])
        return sel

    def ranked_lines(self, folder: str, query: str, *, mode: str = "hybrid") -> list[Line]:
        """Every candidate line for ``query`` scored as a selection scores it, best first
        (``selection/lines.py``): what the packer chooses from (``bench/memory.py`` measures it)."""
        check_memory_name("folder", folder)
        qvec = self._embed_one(query) if mode != "bm25" and query.strip() else None
        self.writer.index_pending(folder)  # (an index in a database: the look below)
        with self.lock(folder):
            idx = self._searchable(folder)
            with self._reading():
                return rank_lines(idx, self._line_corpus(folder, idx), query, qvec,
                                  self.config, mode=mode)

    def bump(self, folder: str, ids: list[str]) -> None:
        """Count one more use of each of these durable memories (never in memories.md)."""
        self.facts.bump(folder, ids)

    def _candidates(self, folder: str, session: str | None, query: str, stages: Stages,
                    mode: str = "hybrid", shared: tuple | list = (),
                    passages: bool = True) -> Candidates:
        """Everything a selection may take, the query embedded once."""
        qvec = None
        if query.strip() and mode != "bm25":
            with stages("embed"):
                qvec = self._embed_one(query)
        t0 = time.perf_counter()
        with stages("files"):
            # this process's turns: all of them, once (an index in a database: the look below)
            self.writer.index_pending(folder)
        with self.lock(folder):
            fact_hits = self._memory_hits(folder, query, qvec, self.config.max_facts,
                                          "hybrid", stages)
            by_id = self.indexes.memories(folder).memories
            fact_hits = [h for h in fact_hits if h.chunk_id in by_id]
            with stages("files"):
                idx = self._searchable(folder)
            lines, hits, line_scores = None, [], []
            search = passages and bool(query.strip())  # (the quick view searches none)
            with self._reading():
                if search and self.config.retrieval_unit == "turn":
                    lines = rank_lines(idx, self._line_corpus(folder, idx), query, qvec,
                                       self.config, mode=mode, stages=stages)
                elif search:
                    hits = search_index(idx, query, qvec, SEARCH_K, self.config, mode=mode,
                                        stages=stages)
                    with stages("vector"):
                        line_scores = [idx.line_scores(qvec, h.chunk_id) if qvec is not None
                                       else None for h in hits]
        facts = [(h, by_id[h.chunk_id]) for h in fact_hits]
        for other in shared:  # one folder's lock at a time: never two held together
            if self.files.memories_signature(check_memory_name("folder", other)) is not None:
                with self.lock(other):
                    got = self.indexes.memories(other).memories
                    facts += [(h, got[h.chunk_id]) for h in self._memory_hits(
                        other, query, qvec, self.config.max_facts, "hybrid", stages)
                        if h.chunk_id in got]
        if shared:  # (otherwise the search's own order: MMR may have re-ranked it)
            facts = sorted(facts, key=lambda p: -p[0].score)[:self.config.max_facts]
        if qvec is not None:
            self.metrics.retrieval.labels("hybrid").observe(time.perf_counter() - t0)
        with stages("files"):
            summary = self.summary(folder, session) if session is not None else None
        return Candidates(facts=[m for _, m in facts], fact_hits=[h for h, _ in facts],
                          summary=summary, hits=hits, hit_line_scores=line_scores, lines=lines,
                          rows_of=functools.cache(idx.session_units),  # (a read each)
                          neighbours=self.config.turn_neighbours)

    def _searchable(self, folder: str) -> ChunkIndex:
        """A selection's index (the folder's lock held). With ``sync_interval_s`` > 0 a look
        for other writers that is due is not made here but queued for the background (the
        next selection sees what it found, and no turn waits for the scan of a large folder);
        with 0 every selection looks first."""
        if self.config.sync_interval_s > 0 and self.indexes.due(folder):
            self.syncs.soon(folder, self._catch_up)
            return self.indexes.get(folder)
        return self.indexes.refresh(folder)

    def _reading(self) -> AbstractContextManager[object]:
        """One consistent view for a search's reads, where the index is in a database."""
        reading = getattr(self.indexes, "reading", None)
        return reading() if reading is not None else contextlib.nullcontext()

    def _line_corpus(self, folder: str, idx: ChunkIndex) -> LineCorpus:
        """The folder's line BM25 (``selection/lines.py``), new when its index was rebuilt or
        reloaded."""
        if getattr(self.indexes, "in_database", False):
            return self.indexes.lines(folder)
        got = self._lines.get(folder)
        if got is None or got[0] is not idx:
            got = self._lines[folder] = (idx, LineCorpus())
        return got[1]

    # --- durable memories and summaries --------------------------------------------------------

    def add_memory(self, folder: str, text: str, category: str, importance: float = 0.5, *,
                   key: str = "", source: str = "") -> Memory:
        """Add a durable memory: a duplicate only raises the importance of the one kept, a
        newer fact on the same topic (``key``) replaces it (``facts_file.py``)."""
        return self.add_fact(folder, text, category, importance, key=key, source=source).memory

    def add_fact(self, folder: str, text: str, category: str, importance: float = 0.5, *,
                 key: str = "", source: str = "") -> Merged:
        """:meth:`add_memory`, saying what happened (added, duplicate, updated)."""
        check_memory_name("folder", folder)
        return self.facts.add(folder, text, category, importance, key=key, source=source)

    def _similar(self, text: str, others: list[str]) -> np.ndarray:
        vecs = self.embedder.embed([text, *others])
        return vecs[1:] @ vecs[0]

    def memories(self, folder: str, *, history: bool = False) -> list[Memory]:
        """The memories in force (``history``: the replaced ones too), with their use counts."""
        return self.facts.with_counts(folder, self.files.read_memories(folder, history=history))

    def summary(self, folder: str, session: str) -> str | None:
        got = self.files.read_summary(folder, session)
        return got[0] if got else None

    def summary_state(self, folder: str, session: str) -> tuple[str | None, str]:
        """``(summary text or None, id of the last turn it covers or "")``."""
        got = self.files.read_summary(folder, session)
        return (got[0], got[1]) if got else (None, "")

    def set_summary(self, folder: str, session: str, text: str, *, upto_turn: str) -> None:
        if not isinstance(text, str) or not text.strip():
            raise InvalidInput("a summary must be non-empty text")
        self.files.write_summary(folder, session, text, upto_turn)

    # --- maintenance ---------------------------------------------------------------------------

    def reindex(self, folder: str | None = None, progress: bool = True) -> int:
        """Rebuild the indexes of one folder (or all) from the files and save them to disk;
        returns the number of chunks. ``progress`` shows a tqdm bar (sessions) on stderr."""
        folders = [check_memory_name("folder", folder)] if folder else self.files.folders()
        total_sessions = sum(len(self.files.sessions(t)) for t in folders)
        chunks = 0
        with tqdm(total=total_sessions, desc="reindex", unit="session",
                  disable=not progress) as bar:
            for t in folders:
                with self.lock(t):
                    chunks += len(self.indexes.rebuild(t, bar).chunks)
        return chunks

    def save(self, folder: str | None = None) -> int:
        """Save the indexes changed since they were loaded or saved; returns how many."""
        with self._guard:
            names = [folder] if folder else list(self._locks)
        n = 0
        for t in names:
            with self.lock(t):
                n += self.indexes.save(t)
        return n

    def close(self) -> None:
        self.syncs.close()
        for folder in self.pending.folders():
            self.index_pending(folder)
        self.save()
        if isinstance(self.embedder, CachedEmbedder):
            self.embedder.close()
        self.files.close()
        gc.unfreeze()  # what the indexes froze (folders.py) is garbage like the rest now


def _as_message(t: Turn) -> dict:
    if t.role in CHAT_ROLES:
        return {"role": t.role, "content": t.content}
    return {"role": "user", "content": f"{t.role}: {t.content}"}
