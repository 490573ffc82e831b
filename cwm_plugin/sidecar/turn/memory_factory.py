"""Building the memory package's ``MemoryService`` from the sidecar's settings.

A translation of :class:`MemorySettings` into ``cwm_plugin.memory.service.factory.make_service``
keywords (``service_kwargs``, also used by ``cwm memory --config``, so the CLI builds exactly
the index the sidecar loads); the memory package owns the embedder and counter choices.
"""

from __future__ import annotations

from typing import Any

from cwm_plugin.sidecar.settings import MemorySettings


def service_kwargs(cfg: MemorySettings) -> dict[str, Any]:
    """``root`` and the keywords of ``cwm_plugin.memory.service.factory.make_service``."""
    emb = cfg.embedder
    return {"root": cfg.root, "tokenizer": cfg.index_tokenizer, "embedder": emb.kind,
            "embedder_url": emb.url, "embedder_model": emb.model, "dims": emb.dims,
            "embedder_threads": emb.threads, "embedder_dtype": emb.dtype,
            "chunk_tokens": cfg.chunk_tokens, "chunk_overlap": cfg.chunk_overlap,
            "vector_context_lines": cfg.vector_context_lines, "recent_turns": cfg.recent_turns,
            "sync_interval_s": cfg.sync_interval_s,
            "vector_context_mode": cfg.vector_context_mode,
            **cfg.search.model_dump()}


def make_service(cfg: MemorySettings, metrics: Any = None) -> Any:
    """The ``MemoryService`` these settings describe; its metrics on ``metrics`` (a
    ``MemoryMetrics``) when given."""
    from cwm_plugin.memory.service.factory import make_service as memory_service

    kw = service_kwargs(cfg)
    return memory_service(kw.pop("root"), metrics=metrics, **kw)
