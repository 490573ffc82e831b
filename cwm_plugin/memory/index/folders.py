"""Each folder's derived indexes over time: loaded from disk or built, kept in step with files.

The markdown files are the truth; this module makes each folder's ``ChunkIndex`` agree with
them. On first use the saved index (``persist.py``) is loaded if it was built with the same
settings, else the index is built from the files and saved. Each session file then has a mark
(bytes indexed, size, mtime, sha256 of the indexed bytes); whenever a file's size or mtime
differs from its mark, the file is read again: if its indexed bytes are unchanged, only the
turns appended after them are indexed (another process wrote); otherwise (edited or truncated
by hand) the session is dropped from the index and indexed again from the file. A removed file
drops its session. When another process (``cwm memory reindex``) makes a new saved generation
current, it is loaded in place of the one in memory. Callers hold the folder's lock.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from cwm_plugin.memory.files.markdown import decode_turns_at, encode_turn
from cwm_plugin.memory.files.truth import MemoryTruth
from cwm_plugin.memory.index import persist
from cwm_plugin.memory.index.chunks import ChunkIndex
from cwm_plugin.memory.index.embeddings import Embedder
from cwm_plugin.memory.index.fact_index import FactIndex
from cwm_plugin.memory.metrics import MemoryMetrics
from cwm_plugin.memory.models import MemoryConfig, Turn
from cwm_plugin.memory.tokens import TokenCounter

log = logging.getLogger(__name__)


@dataclass
class LiveMark:
    """A ``FileMark`` with the running sha256 of the indexed bytes."""

    offset: int = 0
    size: int = -1
    mtime_ns: int = -1
    hasher: Any = field(default_factory=hashlib.sha256)  # or a _Digest until verified

    def frozen(self) -> persist.FileMark:
        return persist.FileMark(self.offset, self.size, self.mtime_ns, self.hasher.hexdigest())


@dataclass
class _Folder:
    index: ChunkIndex
    marks: dict[str, LiveMark]
    generation: str | None
    dirty: bool = False
    memories: FactIndex | None = None
    synced_at: float = -1e9  # monotonic time of the last look at the files
    signature: Any = None  # the truth's folder signature at the last full look, if it has one


def new_chunk_index(c: MemoryConfig, embedder: Embedder, counter: TokenCounter) -> ChunkIndex:
    """An empty folder index with these settings (``index/pg`` takes one as its shape)."""
    return ChunkIndex(embedder, counter, c.chunk_tokens, c.chunk_overlap,
                      c.vector_context_lines, c.chunk_vector_weight, c.vector_context_mode)


class FolderIndexes:
    def __init__(self, files: MemoryTruth, config: MemoryConfig, embedder: Embedder,
                 counter: TokenCounter, metrics: MemoryMetrics) -> None:
        self.files = files
        self.config = config
        self.embedder = embedder
        self.counter = counter
        self.metrics = metrics
        self._unsaved: set[str] = set()  # folders whose last save failed (logged once)
        self._folders: dict[str, _Folder] = {}

    def _new_index(self) -> ChunkIndex:
        return new_chunk_index(self.config, self.embedder, self.counter)

    # --- loading, building, saving ---------------------------------------------------------------

    def loaded(self, folder: str) -> bool:
        return folder in self._folders

    def get(self, folder: str, bar: tqdm | None = None) -> ChunkIndex:
        """The folder's index: in memory, else loaded from disk, else built from the files."""
        t = self._folders.get(folder)
        if t is None:
            t = self._load(folder, bar) or self._build(folder, bar)
            self._folders[folder] = t
            # An index is millions of long-lived objects: frozen, Python's full collections
            # leave them alone (else each walks them all, inside whichever request is
            # allocating). Cycles among them are never garbage.
            gc.freeze()
        return t.index

    def _load(self, folder: str, bar: tqdm | None) -> _Folder | None:
        idx = self._new_index()
        got = persist.load(idx, self.files.root, folder)
        if got is None:
            return None
        frozen, gen = got
        t = _Folder(idx, {}, gen)
        for session, fm in frozen.items():
            mark = LiveMark(fm.offset, fm.size, fm.mtime_ns)
            mark.hasher = _Digest(fm.digest, fm.offset)  # verified when the file differs
            t.marks[session] = mark
        self._sync(folder, t)
        if bar is not None:
            bar.update(len(self.files.sessions(folder)))
        return t

    def _build(self, folder: str, bar: tqdm | None, strict: bool = False) -> _Folder:
        t = _Folder(self._new_index(), {}, None)
        for session in self.files.sessions(folder):
            self._sync_session(folder, t, session)
            if bar is not None:
                bar.update(1)
        if t.index.chunks or strict:
            self._save(folder, t, strict)
        return t

    def rebuild(self, folder: str, bar: tqdm | None = None) -> ChunkIndex:
        """Build the folder's index from its files, ignoring what is saved, and save it (a
        save that fails raises here: this is what ``cwm memory reindex`` was asked for)."""
        self._folders.pop(folder, None)
        t = self._build(folder, bar, strict=True)
        self._folders[folder] = t
        return t.index

    def _save(self, folder: str, t: _Folder, strict: bool = False) -> bool:
        """Save ``t``; a save that fails (a full disk, a read-only or damaged ``.index``)
        keeps the index in memory and dirty (a later save tries again), logged once and
        counted: the saved copy only spares a rebuild, so a request never fails for it."""
        marks = {s: m.frozen() for s, m in t.marks.items()}
        try:
            t.generation = persist.save(t.index, marks, self.files.root, folder)
        except OSError as exc:
            if strict:
                raise
            self.metrics.degraded.labels("index_save").inc()
            if folder not in self._unsaved:
                log.warning("folder %s: its index could not be saved (%s); kept in memory, "
                            "rebuilt from the files after a restart until a save succeeds",
                            folder, exc)
            self._unsaved.add(folder)
            t.dirty = True
            return False
        self._unsaved.discard(folder)
        t.dirty = False
        return True

    def save(self, folder: str | None = None) -> int:
        """Save the indexes changed since they were last saved; returns how many."""
        n = 0
        for name, t in list(self._folders.items()):
            if (folder is None or name == folder) and t.dirty:
                n += self._save(name, t)
        return n

    # --- keeping up with the files -------------------------------------------------------------

    def due(self, folder: str) -> bool:
        """Whether the folder is loaded and its look for other writers is due
        (``sync_interval_s`` passed since the last)."""
        t = self._folders.get(folder)
        return t is not None and time.monotonic() - t.synced_at >= self.config.sync_interval_s

    def refresh(self, folder: str, stats: dict[str, tuple[int, int]] | None = None
                ) -> ChunkIndex:
        """The folder's index after catching up with every change to its files. ``stats``:
        ``MemoryFiles.session_stats`` taken before the caller took the lock (the scan of a
        folder's files then blocks nobody); a session it does not list is dropped only if its
        file is gone now, one it missed is seen next time."""
        idx = self.get(folder)
        t = self._folders[folder]
        now = time.monotonic()
        if now - t.synced_at < self.config.sync_interval_s:
            return idx  # this process's own appends are indexed as they happen
        t.synced_at = now
        gen = persist.current_generation(self.files.root, folder)
        if gen is not None and gen != t.generation:  # e.g. `cwm memory reindex` ran
            fresh = self._load(folder, None)
            if fresh is not None:
                self._folders[folder] = fresh
                return fresh.index
            t.generation = gen  # unusable: keep ours, do not try again
        self._sync(folder, t, stats)
        return idx

    def _sync(self, folder: str, t: _Folder, stats: dict | None = None) -> None:
        # a truth that can tell in one cheap answer that no session moved (a database) spares
        # the look at every session; taken before that look, so a write in between moves it
        sig = self.files.folder_signature(folder) if stats is None else None
        if sig is not None and sig == t.signature:
            return
        on_disk = self.files.session_stats(folder) if stats is None else stats  # one scan
        for session in sorted(set(t.marks) - set(on_disk)):
            if stats is not None and self.files.session_stat(folder, session) is not None:
                continue  # written after the scan: not removed
            log.info("session %s of folder %s was removed: dropping it from the index",
                     session, folder)
            t.index.drop_session(session)
            t.marks.pop(session)
            t.dirty = True
        for session, seen in sorted(on_disk.items()):
            mark = t.marks.get(session)
            if mark is None or seen != (mark.size, mark.mtime_ns):
                self._sync_session(folder, t, session)
        t.signature = sig

    def _sync_session(self, folder: str, t: _Folder, session: str) -> None:
        got = self.files.session_data(folder, session)  # (never half another's append)
        if got is None:
            return
        data, version = got
        mark = t.marks.get(session)
        if mark is not None and (len(data), version) == (mark.size, mark.mtime_ns):
            return
        before = t.index.added
        if mark is not None and len(data) >= mark.offset and \
                _same(mark, data[:mark.offset]):
            turns, used = decode_turns_at(data[mark.offset:])
        else:
            if mark is not None:
                log.info("session %s of folder %s changed on disk: indexing it again",
                         session, folder)
                t.index.drop_session(session)
            mark = t.marks[session] = LiveMark()
            turns, used = decode_turns_at(data)
        t.index.add_turns(session, turns)
        mark.hasher.update(data[mark.offset:mark.offset + used])
        mark.offset += used
        t.index.offsets[session] = mark.offset
        mark.size, mark.mtime_ns = len(data), version
        t.dirty = True
        self.metrics.chunks.inc(t.index.added - before)

    def appended(self, folder: str, session: str, turns: list[Turn], start: int,
                 end: int, prepared: Any = None) -> None:
        """Index turns this process just appended at ``[start, end)`` of the session file
        (``prepared``: their units and vectors, see ``ChunkIndex.add_turns``)."""
        t = self._folders.get(folder)
        if t is None:
            return
        mark = t.marks.get(session)
        if (mark.offset if mark else 0) != start:  # another process wrote in between
            self._sync_session(folder, t, session)
            return
        if mark is None:
            mark = t.marks[session] = LiveMark()
        before = t.index.added
        t.index.add_turns(session, turns, prepared)
        _running(mark, self.files, folder, session).update(
            b"".join(encode_turn(turn) for turn in turns))
        mark.offset = t.index.offsets[session] = end
        seen = self.files.session_stat(folder, session)
        mark.size, mark.mtime_ns = seen if seen is not None and seen[0] == end else (-1, -1)
        t.dirty = True
        self.metrics.chunks.inc(t.index.added - before)

    # --- durable memories ------------------------------------------------------------------------

    def memories(self, folder: str) -> FactIndex:
        """The folder's memory index, rebuilt whenever memories.md changed."""
        self.get(folder)
        t = self._folders[folder]
        t.memories = memory_index(self.files, self.embedder, folder, t.memories)
        return t.memories


def memory_index(files: MemoryTruth, embedder: Embedder, folder: str,
                 have: FactIndex | None) -> FactIndex:
    """The folder's memory index: ``have`` while the memories did not change, refreshed in
    place when only their access counts moved, else built anew."""
    sig = files.memories_signature(folder)
    if have is None or have.signature != sig:
        mems = files.read_memories(folder)
        if have is not None and have.same_corpus(mems):
            have.refresh(mems, sig)   # only access counts moved: no re-index
        else:
            have = FactIndex(embedder, mems, sig)
    return have


class _Digest:
    """A sha256 known only by its hex digest (from a saved mark) until the file is read."""

    def __init__(self, digest: str, offset: int) -> None:
        self.digest = digest
        self.offset = offset

    def hexdigest(self) -> str:
        return self.digest


def _same(mark: LiveMark, prefix: bytes) -> bool:
    """Whether ``prefix`` (the file's first ``mark.offset`` bytes) is what was indexed; a
    mark loaded from disk becomes a running sha256 of the prefix when it matches."""
    h = hashlib.sha256(prefix)
    if h.hexdigest() != mark.hasher.hexdigest():
        return False
    mark.hasher = h
    return True


def _running(mark: LiveMark, files: MemoryTruth, folder: str, session: str) -> Any:
    """The running sha256 of a mark; a saved digest is replaced by hashing the session's
    first ``mark.offset`` bytes."""
    if isinstance(mark.hasher, _Digest):
        got = files.session_data(folder, session)
        mark.hasher = hashlib.sha256((got[0] if got else b"")[:mark.offset])
    return mark.hasher
