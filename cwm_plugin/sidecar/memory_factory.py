"""Building the memory package's ``MemoryService`` from the sidecar's settings.

A translation of :class:`MemorySettings` into ``cwm_plugin.memory.factory.make_service``; the
memory package owns the embedder and counter choices.
"""

from __future__ import annotations

from typing import Any

from cwm_plugin.sidecar.settings import MemorySettings


def make_service(cfg: MemorySettings) -> tuple[Any, Any]:
    """``(MemoryService, TokenCounter)`` for these settings."""
    from cwm_plugin.memory.factory import make_service as memory_service

    emb = cfg.embedder
    service = memory_service(
        cfg.root, tokenizer=cfg.tokenizer, embedder=emb.kind, embedder_url=emb.url,
        embedder_model=emb.model, dims=emb.dims, chunk_tokens=cfg.chunk_tokens,
        chunk_overlap=cfg.chunk_overlap, recent_turns=cfg.recent_turns)
    return service, service.counter
