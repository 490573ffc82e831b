"""The memory façade the sidecar and the CLI call: ``MemoryService``.

Files are the truth (``files.py``); each tenant's index (``index.py``) is derived from them,
built lazily on first use and kept current by :meth:`MemoryService.record_turn`. One lock a
tenant serialises index changes inside this process; file appends are also locked across
processes. Embeddings go through an on-disk cache under ``<root>/.cache/embeddings``.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from datetime import datetime

import numpy as np
from tqdm import tqdm

from cwm_plugin.errors import InvalidInput
from cwm_plugin.memory.embeddings import CachedEmbedder, Embedder
from cwm_plugin.memory.files import MemoryFiles, utc_iso
from cwm_plugin.memory.index import TenantIndex
from cwm_plugin.memory.metrics import MemoryMetrics
from cwm_plugin.memory.models import (
    CATEGORIES,
    Hit,
    Memory,
    MemoryConfig,
    Selection,
    Turn,
)
from cwm_plugin.memory.names import check_name, check_role
from cwm_plugin.memory.search import search_index
from cwm_plugin.memory.select import Candidates, select
from cwm_plugin.memory.tokens import TokenCounter

__all__ = ["Hit", "Memory", "MemoryConfig", "MemoryService", "Selection"]

TURN_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
CHAT_ROLES = ("user", "assistant")
SEARCH_K = 10


class MemoryService:
    def __init__(self, config: MemoryConfig, embedder: Embedder, counter: TokenCounter,
                 metrics: MemoryMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or MemoryMetrics()
        self.files = MemoryFiles(config.root)
        if not isinstance(embedder, CachedEmbedder):
            embedder = CachedEmbedder(embedder, config.root / ".cache" / "embeddings",
                                      self.metrics)
        self.embedder = embedder
        self.counter = counter
        self._indexes: dict[str, TenantIndex] = {}
        self._locks: dict[str, threading.RLock] = {}
        self._guard = threading.Lock()

    # --- internals -----------------------------------------------------------------------------

    def _lock(self, tenant: str) -> threading.RLock:
        with self._guard:
            return self._locks.setdefault(tenant, threading.RLock())

    def _new_index(self) -> TenantIndex:
        return TenantIndex(self.embedder, self.counter, self.config.chunk_tokens,
                           self.config.chunk_overlap, self.config.vector_context_lines)

    def _index(self, tenant: str, bar: tqdm | None = None) -> TenantIndex:
        """The tenant's index, built from its files on first use (caller holds the lock)."""
        idx = self._indexes.get(tenant)
        if idx is None:
            idx = self._new_index()
            for session in self.files.sessions(tenant):
                self._catch_up(idx, tenant, session)
                if bar is not None:
                    bar.update(1)
            self._indexes[tenant] = idx
        return idx

    def _catch_up(self, idx: TenantIndex, tenant: str, session: str) -> None:
        """Index the turns of ``session`` past what ``idx`` has read of its file."""
        turns, end = self.files.read_turns_from(tenant, session, idx.offsets.get(session, 0))
        before = idx.added
        idx.add_turns(session, turns)
        idx.offsets[session] = end
        self.metrics.chunks.inc(idx.added - before)

    def _refresh(self, tenant: str) -> TenantIndex:
        """The tenant's index, first catching up with turns other processes appended."""
        idx = self._index(tenant)
        for session in self.files.sessions(tenant):
            if self.files.session_size(tenant, session) > idx.offsets.get(session, 0):
                self._catch_up(idx, tenant, session)
        return idx

    def _embed_one(self, text: str) -> np.ndarray:
        return self.embedder.embed([text])[0]

    # --- transcripts -----------------------------------------------------------------------------

    def record_turn(self, tenant: str, session: str, role: str, content: str, *,
                    turn_id: str | None = None, ts: datetime | None = None) -> str:
        """Append one turn to the session's file (durably), then index it; returns its id."""
        check_name("tenant", tenant)
        check_name("session", session)
        check_role(role)
        if not isinstance(content, str):
            raise InvalidInput("turn content must be a string")
        if turn_id is None:
            turn_id = f"t{int(time.time() * 1000):x}-{secrets.token_hex(3)}"
        elif not TURN_ID.match(turn_id):
            raise InvalidInput(f"turn id {turn_id!r} is not allowed",
                               hint="use 1-64 letters, digits, '_', '.', ':' or '-'")
        turn = Turn(turn_id=turn_id, role=role, content=content, ts=utc_iso(ts))
        with self._lock(tenant):
            loaded = tenant in self._indexes
            start, end = self.files.append_turn(tenant, session, turn)
            if not loaded:
                self._index(tenant)
            elif self._indexes[tenant].offsets.get(session, 0) == start:
                idx = self._indexes[tenant]  # nobody else wrote in between: index just this turn
                before = idx.added
                idx.add_turns(session, [turn])
                idx.offsets[session] = end
                self.metrics.chunks.inc(idx.added - before)
            else:  # another process appended too: read everything new, in file order
                self._catch_up(self._indexes[tenant], tenant, session)
        return turn_id

    def transcript(self, tenant: str, session: str) -> list[dict]:
        """Turns read back from the file: ``turn_id`` (also ``id``), role, content, ts."""
        return [t.as_dict() for t in self.files.read_turns(tenant, session)]

    # --- search and selection ----------------------------------------------------------------------

    def search(self, tenant: str, query: str, k: int = 10, *, mode: str = "hybrid",
               session: str | None = None) -> list[Hit]:
        check_name("tenant", tenant)
        if session is not None:
            check_name("session", session)
        t0 = time.perf_counter()
        qvec = self._embed_one(query) if mode != "bm25" else None
        with self._lock(tenant):
            hits = search_index(self._refresh(tenant), query, qvec, k, self.config, mode=mode,
                                session=session)
        self.metrics.retrieval.labels(mode).observe(time.perf_counter() - t0)
        return hits

    def select_context(self, tenant: str, session: str, messages: list[dict],
                       budget_tokens: int, *, query: str | None = None) -> Selection:
        """Recent turns verbatim plus facts, summary and hits, within ``budget_tokens``.

        ``messages`` are the request's chat messages; system messages are the caller's stable
        prefix and are ignored here, a final user message is the new turn (not "recent"). If
        the request carries no history, the recent turns come from the session's transcript.
        """
        check_name("tenant", tenant)
        check_name("session", session)
        if budget_tokens < 0:
            raise InvalidInput("budget_tokens must be >= 0")
        conv = [m for m in messages if m.get("role") != "system"]
        new = conv[-1] if conv and conv[-1].get("role") == "user" else None
        history = conv[:-1] if new is not None else conv
        recent_ids: set[str] = set()
        if not history:
            turns = self.files.read_turns(tenant, session)[-max(self.config.recent_turns, 0):] \
                if self.config.recent_turns else []
            history = [_as_message(t) for t in turns]
            recent_ids = {t.turn_id for t in turns}
        if query is None:
            query = _text(new) if new is not None else (_text(conv[-1]) if conv else "")
        cands = self._candidates(tenant, session, query or "")
        sel = select(self.counter, history, self.config.recent_turns, budget_tokens, cands,
                     recent_ids)
        if sel.facts:
            ids = {m.id for m in sel.facts}
            self.files.update_memories(tenant, lambda ms: [
                _bump(m) if m.id in ids else m for m in ms])
        return sel

    def _candidates(self, tenant: str, session: str, query: str) -> Candidates:
        hits = self.search(tenant, query, SEARCH_K) if query.strip() else []
        qvec = self._embed_one(query) if query.strip() else None
        facts = self.memories(tenant)
        scores: list[float] = []
        if facts:
            sims = (self.embedder.embed([m.text for m in facts]) @ qvec) if qvec is not None \
                else np.zeros(len(facts))
            scores = [0.5 * m.importance + 0.5 * max(0.0, float(s))
                      for m, s in zip(facts, sims, strict=True)]
        line_scores: list[np.ndarray | None] = []
        with self._lock(tenant):
            idx = self._index(tenant)
            for h in hits:
                labs = idx.chunk_labels.get(h.chunk_id)
                line_scores.append(idx.vectors[labs] @ qvec if labs and qvec is not None
                                   else None)
        return Candidates(facts=facts, fact_scores=scores, summary=self.summary(tenant, session),
                          hits=hits, hit_line_scores=line_scores)

    # --- durable memories and summaries --------------------------------------------------------

    def add_memory(self, tenant: str, text: str, category: str,
                   importance: float = 0.5) -> Memory:
        """Add a durable memory; the same text again only raises its importance."""
        check_name("tenant", tenant)
        if category not in CATEGORIES:
            raise InvalidInput(f"memory category {category!r} is unknown",
                               hint=f"use one of {', '.join(CATEGORIES)}")
        text = " ".join(str(text).split())
        if not text or len(text) > 2000:
            raise InvalidInput("memory text must be 1-2000 characters")
        if not 0.0 <= float(importance) <= 1.0:
            raise InvalidInput(f"importance {importance} is outside [0, 1]")
        made: list[Memory] = []

        def change(ms: list[Memory]) -> list[Memory]:
            for m in ms:
                if m.text.lower() == text.lower() and m.category == category:
                    m.importance = max(m.importance, float(importance))
                    made.append(m)
                    return ms
            m = Memory(id=f"m-{secrets.token_hex(6)}", text=text, category=category,
                       importance=float(importance), access_count=0, created=utc_iso())
            made.append(m)
            return [*ms, m]

        with self._lock(tenant):
            self.files.update_memories(tenant, change)
        return made[0]

    def memories(self, tenant: str) -> list[Memory]:
        return self.files.read_memories(tenant)

    def summary(self, tenant: str, session: str) -> str | None:
        got = self.files.read_summary(tenant, session)
        return got[0] if got else None

    def set_summary(self, tenant: str, session: str, text: str, *, upto_turn: str) -> None:
        if not isinstance(text, str) or not text.strip():
            raise InvalidInput("a summary must be non-empty text")
        self.files.write_summary(tenant, session, text, upto_turn)

    # --- maintenance ---------------------------------------------------------------------------

    def reindex(self, tenant: str | None = None, progress: bool = True) -> int:
        """Drop and rebuild the indexes of one tenant (or all) from the files; returns chunks."""
        tenants = [check_name("tenant", tenant)] if tenant else self.files.tenants()
        total_sessions = sum(len(self.files.sessions(t)) for t in tenants)
        chunks = 0
        with tqdm(total=total_sessions, desc="reindex", unit="session",
                  disable=not progress) as bar:
            for t in tenants:
                with self._lock(t):
                    self._indexes.pop(t, None)
                    chunks += len(self._index(t, bar).chunks)
        return chunks

    def close(self) -> None:
        if isinstance(self.embedder, CachedEmbedder):
            self.embedder.close()


def _text(m: dict | None) -> str:
    if not m:
        return ""
    c = m.get("content")
    if isinstance(c, list):
        return "\n".join(p.get("text", "") for p in c if isinstance(p, dict))
    return str(c or "")


def _as_message(t: Turn) -> dict:
    if t.role in CHAT_ROLES:
        return {"role": t.role, "content": t.content}
    return {"role": "user", "content": f"{t.role}: {t.content}"}


def _bump(m: Memory) -> Memory:
    m.access_count += 1
    return m


