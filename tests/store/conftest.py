"""Fixtures of the store tests: store factories that always close what they open."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from cwm_plugin.store.config import StoreConfig
from cwm_plugin.store.kv_store import KVStore


def make_kv_block(seed: int = 0, shape: tuple[int, ...] = (2, 3, 16, 32),
             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A small KV-like block (vLLM CPU layout per layer: heads, tokens, 2*head_size)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


@pytest.fixture
def kv_block() -> Callable[..., torch.Tensor]:
    """``kv_block(seed, shape=..., dtype=...)``: a deterministic small KV-like block."""
    return make_kv_block


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., KVStore]]:
    """``make_store(**config)``: a KVStore with a private metrics registry; closed after."""
    made: list[KVStore] = []

    def make(**kw) -> KVStore:
        kw.setdefault("fingerprint", "test-fp")
        kw.setdefault("memory_bytes", 1 << 20)
        store = KVStore(StoreConfig(**kw), registry=CollectorRegistry())
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
