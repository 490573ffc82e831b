"""Fixtures of the memory tests: one token counter and one MiniLM model for the whole run."""

from __future__ import annotations

from pathlib import Path

import pytest

from cwm_plugin.memory.index.embeddings import HashingEmbedder, MiniLMEmbedder
from cwm_plugin.memory.models import MemoryConfig
from cwm_plugin.memory.service.service import MemoryService
from cwm_plugin.memory.tokens import TiktokenCounter


@pytest.fixture(scope="session")
def counter(tmp_path_factory: pytest.TempPathFactory) -> TiktokenCounter:
    return TiktokenCounter("cl100k_base", tmp_path_factory.mktemp("tiktoken"))


@pytest.fixture(scope="session")
def minilm() -> MiniLMEmbedder:
    return MiniLMEmbedder()


@pytest.fixture
def new_service(tmp_path: Path, counter: TiktokenCounter):
    """``new_service(embedder=None, root=None, **config)``; hashing embedder by default."""
    made: list[MemoryService] = []

    def make(embedder=None, root: Path | None = None, metrics=None, **config) -> MemoryService:
        svc = MemoryService(MemoryConfig(root=root or tmp_path / "mem", **config),
                            embedder or HashingEmbedder(), counter, metrics)
        made.append(svc)
        return svc

    yield make
    for svc in made:
        svc.close()
