"""The write side of ``MemoryService``: turns appended to their session's file, then indexed.

:class:`TranscriptWriter` works on the service's files and indexes, under the service's folder
locks (``service.py`` owns them and makes the writer): appends are durable first
(``files/markdown.py``), indexing follows under the folder's lock, or later with
``defer_index`` (``pending.py``: a caller answering a client embeds the new lines after it
answered; the next search of the folder indexes them first).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime

from cwm_plugin.memory.files.names import check_memory_name
from cwm_plugin.memory.files.pending import Batch, PendingTurns, turn_records
from cwm_plugin.memory.files.truth import MemoryTruth
from cwm_plugin.memory.index.chunking import Unit
from cwm_plugin.memory.index.embeddings import Embedder
from cwm_plugin.memory.index.folders import FolderIndexes

log = logging.getLogger(__name__)


class TranscriptWriter:
    """Recording turns and indexing them (see the module docstring); ``lock(folder)``: the
    folder's lock, ``caught_up(folder)``: what follows an indexing (the service's look for
    other writers)."""

    def __init__(self, files: MemoryTruth, embedder: Embedder, indexes: FolderIndexes,
                 pending: PendingTurns, lock: Callable[[str], threading.RLock],
                 caught_up: Callable[[str], None]) -> None:
        self.files = files
        self.embedder = embedder
        self.indexes = indexes
        self.pending = pending
        self.lock = lock
        self.caught_up = caught_up
        self._unindexed: set[str] = set()  # folders whose last inline indexing failed

    def record_turn(self, folder: str, session: str, role: str, content: str, *,
                    turn_id: str | None = None, ts: datetime | None = None) -> str:
        """Append one turn to the session's file (durably), then index it; returns its id."""
        return self.record_turns(folder, session, [(role, content)], turn_ids=[turn_id],
                                 ts=ts)[0]

    def record_turns(self, folder: str, session: str, turns: list[tuple[str, str]], *,
                     turn_ids: list[str | None] | None = None,
                     ts: datetime | None = None, defer_index: bool = False) -> list[str]:
        """Append ``(role, content)`` turns to the session's file in one durable write
        (adjacent, one fsync), then index them; returns their ids. ``defer_index`` leaves the
        indexing (embedding the new lines) to :meth:`index_pending`, which the next search of
        the folder runs first anyway: a caller answering a client can do it afterwards."""
        check_memory_name("folder", folder)
        check_memory_name("session", session)
        records = turn_records(turns, turn_ids, ts)
        if not records:
            return []
        if defer_index:  # no wait on the folder's lock (a search or an indexing may hold it)
            loaded = self.indexes.loaded(folder)
            start, end = self.files.append_turns(folder, session, records)
            if loaded:  # (an index loaded later reads these turns from the file)
                self.pending.add(folder, (session, records, start, end))
            return [t.turn_id for t in records]
        with self.lock(folder):
            loaded = self.indexes.loaded(folder)
            start, end = self.files.append_turns(folder, session, records)
            try:
                if loaded:
                    self.indexes.appended(folder, session, records, start, end)
                else:
                    self.indexes.get(folder)  # loads or builds, these turns included
            except Exception as exc:  # noqa: BLE001 - stored is what was asked; indexing is
                # derived: the next look at the files (a search, a build) indexes these turns
                # A caller told "failed" would send them again: stored twice.
                self.indexes.metrics.degraded.labels("indexing").inc()
                (log.debug if folder in self._unindexed else log.warning)(
                    "folder %s: %d turn(s) stored in session %s but not indexed yet (%s); the "
                    "next sync with the files indexes them", folder, len(records), session, exc)
                self._unindexed.add(folder)  # (logged once a folder, counted every time)
            else:
                self._unindexed.discard(folder)
        return [t.turn_id for t in records]

    def index_pending(self, folder: str) -> int:
        """Index the turns appended with ``defer_index``, in order; returns how many batches.
        Their lines are embedded without holding the folder's lock (appends and searches go
        on meanwhile); a search calls this first, so it waits for an indexing under way and
        sees every turn this process appended. On failure the batches stay queued."""
        with self.pending.take(folder) as todo:
            if todo:
                self._index_batches(folder, todo)
                self.caught_up(folder)
        return len(todo)

    def _index_batches(self, folder: str, todo: list[Batch]) -> None:
        with self.lock(folder):
            idx = self.indexes.get(folder)
            units = [idx.units(records) for _, records, _, _ in todo]
            last: dict[str, Unit | None] = {}
            prevs = []
            for (session, _, _, _), us in zip(todo, units, strict=True):
                prevs.append(last.get(session, idx.last_unit(session)))
                last[session] = us[-1] if us else prevs[-1]
        inputs = [idx.embed_inputs(p, us) for p, us in zip(prevs, units, strict=True)]
        embedded = self.embedder.embed([t for ins in inputs for t in ins])
        with self.lock(folder):
            at = 0
            for (session, records, start, end), us, p, ins in zip(todo, units, prevs, inputs,
                                                                  strict=True):
                vecs = idx.line_vectors(p, us, embedded[at:at + len(ins)])
                self.indexes.appended(folder, session, records, start, end,
                                      prepared=(us, vecs))
                at += len(ins)

    def transcript(self, folder: str, session: str) -> list[dict]:
        """Turns read back from the file: ``turn_id`` (also ``id``), role, content, ts."""
        return [t.as_dict() for t in self.files.read_turns(folder, session)]
