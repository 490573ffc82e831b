"""The derived search index kept in PostgreSQL (``memory.candidates: database``), so sidecar
replicas take their candidates from the database instead of each holding every folder's index.
Nothing here imports psycopg until :func:`open_indexes` picks the database."""

from __future__ import annotations

from typing import Any

from cwm_plugin.memory.files.truth import MemoryTruth
from cwm_plugin.memory.index.embeddings import Embedder
from cwm_plugin.memory.index.folders import FolderIndexes
from cwm_plugin.memory.metrics import MemoryMetrics
from cwm_plugin.memory.models import MemoryConfig
from cwm_plugin.memory.tokens import TokenCounter


def open_indexes(files: MemoryTruth, config: MemoryConfig, embedder: Embedder,
                 counter: TokenCounter, metrics: MemoryMetrics) -> Any:
    """The folders' indexes: in the database with the postgres backend and ``candidates:
    database``, else this process's own (``FolderIndexes``)."""
    if config.postgres_url and config.candidates == "database":
        from cwm_plugin.memory.index.pg.folders import PgFolderIndexes

        return PgFolderIndexes(files, config, embedder, counter, metrics)  # type: ignore[arg-type]
    return FolderIndexes(files, config, embedder, counter, metrics)
