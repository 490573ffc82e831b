"""Building the memory package's ``MemoryService`` from the sidecar's settings."""

from __future__ import annotations

import os
from typing import Any

from cwm_plugin.errors import ConfigError
from cwm_plugin.sidecar.settings import EmbedderConfig, MemorySettings


def make_embedder(cfg: EmbedderConfig) -> Any:
    from cwm_plugin.memory import embeddings

    if cfg.kind == "hashing":
        return embeddings.HashingEmbedder(cfg.dims)
    if cfg.kind == "local":
        return embeddings.MiniLMEmbedder()
    if not cfg.url or not cfg.model:
        raise ConfigError("the openai embedder needs memory.embedder.url and .model")
    key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
    return embeddings.OpenAIEmbedder(cfg.url, cfg.model, api_key=key, dims=cfg.dims)


def make_service(cfg: MemorySettings) -> tuple[Any, Any]:
    """``(MemoryService, TokenCounter)`` for these settings."""
    from cwm_plugin.memory.models import MemoryConfig
    from cwm_plugin.memory.service import MemoryService
    from cwm_plugin.memory.tokens import make_counter

    counter = make_counter(cfg.tokenizer)
    config = MemoryConfig(root=cfg.root, chunk_tokens=cfg.chunk_tokens,
                          chunk_overlap=cfg.chunk_overlap, recent_turns=cfg.recent_turns)
    return MemoryService(config, make_embedder(cfg.embedder), counter), counter
