"""``FolderIndexes``' surface over the index in PostgreSQL (``memory.candidates: database``):
what the service asks of its indexes, answered from the database instead of an index held in
this process. A look at a folder catches its sessions up first (``writer.py``: one query when
nothing moved); nothing is loaded, saved or kept here but the folders' durable-memory indexes
(a few hundred facts at most: they stay in process, built from the truth as before)."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass

from tqdm import tqdm

from cwm_plugin.memory.index.embeddings import Embedder
from cwm_plugin.memory.index.fact_index import FactIndex
from cwm_plugin.memory.index.folders import memory_index, new_chunk_index
from cwm_plugin.memory.index.pg.corpus import PgChunks, PgLines, Reader
from cwm_plugin.memory.index.pg.writer import PgIndexWriter
from cwm_plugin.memory.metrics import MemoryMetrics
from cwm_plugin.memory.models import MemoryConfig
from cwm_plugin.memory.postgres.truth import PostgresTruth
from cwm_plugin.memory.tokens import TokenCounter

log = logging.getLogger(__name__)


@dataclass
class Rebuilt:
    """What ``rebuild`` answers (as ``FolderIndexes.rebuild``'s index: its chunks)."""

    chunks: list[str]


class PgFolderIndexes:
    in_database = True

    def __init__(self, files: PostgresTruth, config: MemoryConfig, embedder: Embedder,
                 counter: TokenCounter, metrics: MemoryMetrics) -> None:
        self.files = files
        self.config = config
        self.embedder = embedder
        self.metrics = metrics
        self.writer = PgIndexWriter(files, new_chunk_index(config, embedder, counter))
        self._chunks: dict[str, PgChunks] = {}
        self._lines: dict[str, PgLines] = {}
        self._memories: dict[str, FactIndex] = {}
        self._seen: dict[str, object] = {}  # the truth's folder signature last caught up
        self.reader = Reader(files.connection, files.spare_connection,
                             threads=max(1, config.postgres_pool_size // 2))

    def loaded(self, folder: str) -> bool:
        return False  # nothing held: an append is indexed at the folder's next look

    def due(self, folder: str) -> bool:
        return False  # every look catches up (one query when nothing moved)

    def get(self, folder: str, bar: tqdm | None = None) -> PgChunks:
        """The folder's chunks, its sessions caught up with the truth first (unless no
        session of the truth or of the index moved since the last look: one small query). A
        session another replica is indexing right now is left to it (a search does not wait
        for it), unless a ``bar`` says an operator's command is waiting for everything."""
        sig = self.writer.signature(folder)
        if sig != self._seen.get(folder):
            made, complete = self.writer.catch_up(folder, bar, wait=bar is not None)
            if made:
                self.metrics.chunks.inc(made)
            if complete:  # (else the next look tries the sessions left again)
                self._seen[folder] = sig
        got = self._chunks.get(folder)
        if got is None:
            got = self._chunks[folder] = PgChunks(
                self.reader.connection, self.writer.space(folder), self.embedder.dims,
                self.config.chunk_vector_weight, self.reader.alongside)
        return got

    def refresh(self, folder: str, stats: dict | None = None) -> PgChunks:
        return self.get(folder)

    def reading(self) -> AbstractContextManager[None]:
        """One consistent view of the database for a search's reads (``Reader.snapshot``)."""
        return self.reader.snapshot()

    def lines(self, folder: str) -> PgLines:
        got = self._lines.get(folder)
        if got is None:
            got = self._lines[folder] = PgLines(self.reader.connection,
                                                self.writer.space(folder))
        return got

    def memories(self, folder: str) -> FactIndex:
        got = self._memories[folder] = memory_index(self.files, self.embedder, folder,
                                                    self._memories.get(folder))
        return got

    def rebuild(self, folder: str, bar: tqdm | None = None) -> Rebuilt:
        """Index the folder again from its truth (its sessions dropped first)."""
        self.writer.drop_folder(folder)
        self._seen.pop(folder, None)
        return Rebuilt(self.get(folder, bar).doc_ids())

    def save(self, folder: str | None = None) -> int:
        return 0  # the database holds it
