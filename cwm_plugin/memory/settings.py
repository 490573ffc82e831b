"""The memory's settings (the ``memory`` section of the settings file), and the keywords of
:func:`~cwm_plugin.memory.service.factory.make_service` they give (:func:`service_kwargs`), so
``cwm memory --config`` builds exactly the index the sidecar loads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from cwm_plugin.config_file import (
    POSTGRES_URL_ENV as POSTGRES_URL_ENV,
)
from cwm_plugin.config_file import Strict, beside, load_section, postgres_url_or_env


class EmbedderConfig(Strict):
    """``local`` (MiniLM, offline), ``openai`` (an embeddings endpoint; its API key, if any, in
    ``$CWM_EMBEDDINGS_API_KEY``) or ``hashing`` (tests)."""

    kind: Literal["local", "openai", "hashing"] = "local"
    url: str | None = None
    model: str | None = None
    dims: int = 384
    threads: int | None = Field(default=1, ge=1)  # local: torch threads (None: every core)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # local: the model's precision


class SearchSettings(Strict):
    """Hybrid search (see ``cwm_plugin/memory/index/search.py`` for what each one does)."""

    bm25_weight: float = Field(default=0.5, ge=0)
    vector_weight: float = Field(default=0.5, ge=0)
    chunk_vector_weight: float = Field(default=1.0, ge=0)  # chunk centroid's cosine, vector score
    candidate_multiplier: int = Field(default=4, ge=1)
    mmr_lambda: float | None = Field(default=None, ge=0, le=1)  # None: no MMR re-ranking
    recency_half_life_days: float | None = Field(default=None, gt=0)  # None: no decay
    max_facts: int = Field(default=8, ge=0)  # durable memories offered to a selection
    # what a selection packs (memory/selection/lines.py, pack.py): the best lines or chunks
    retrieval_unit: Literal["turn", "chunk"] = "turn"
    turn_neighbours: int = Field(default=0, ge=0, le=3)  # lines around each line taken
    context_bm25_weight: float = Field(default=0.5, ge=0)  # BM25 of a line with its neighbours
    chunk_prior_weight: float = Field(default=0.5, ge=0)  # the best chunk's score, per line
    speaker_weight: float = Field(default=0.2, ge=0)  # the query names the line's speaker
    date_weight: float = Field(default=0.2, ge=0)  # the query names the line's day or month

    @model_validator(mode="after")
    def _some_weight(self) -> SearchSettings:
        if self.bm25_weight + self.vector_weight <= 0:
            raise ValueError("bm25_weight + vector_weight must be > 0")
        return self


class RerankSettings(Strict):
    """An optional stage that orders the best memory lines again with a model reading the
    question and each line together (``memory/selection/rerank.py``): ``completions`` asks the
    served model, one prompt a line, for the probability of "yes" (the instruction and the
    question first, shareable by vLLM's prefix cache where they fill a KV block; under the
    session's cache_salt); ``rerank`` asks a re-ranker the operator serves (vLLM's ``/v1/rerank``).
    Off by default: it adds a model call to every turn that selects memory, and a small chat
    model is no judge of relevance (``docs/sidecar.md``, Memory)."""

    kind: Literal["off", "completions", "rerank"] = "off"
    model: str | None = None  # None: the turn's own model
    top_n: int = Field(default=100, ge=2, le=400)  # the best lines scored again
    weight: float = Field(default=1.0, ge=0, le=1)  # the re-ranker's share of their order
    timeout_s: float = Field(default=5.0, gt=0, le=60)  # then the first ranking stands

    @field_validator("kind", mode="before")
    @classmethod
    def _yaml_off(cls, v: object) -> object:
        return "off" if v is False else v  # YAML reads a bare `off` as false


class MemorySettings(Strict):
    """The memory package's settings plus what the sidecar decides about them."""

    root: Path = Path("./cwm-memory")
    # Counts chunk sizes in the index (any local tokenizer; part of the saved index's identity).
    index_tokenizer: str = "tiktoken:cl100k_base"
    # Counts budgets and prompts: the served model's tokenizer (see cwm_plugin.sidecar.turn.counting).
    tokenizer: str = "auto"
    tokenizers: dict[str, str] = Field(default_factory=dict)  # per served model name
    embedder: EmbedderConfig = EmbedderConfig()
    search: SearchSettings = SearchSettings()
    rerank: RerankSettings = RerankSettings()
    budget_tokens: int = Field(default=1024, ge=0)
    budget_fraction: float = Field(default=0.25, gt=0, le=1)  # of max_model_len, the smaller wins
    recent_turns: int = Field(default=6, ge=0)
    chunk_tokens: int = Field(default=400, ge=16)
    chunk_overlap: int = Field(default=80, ge=0)
    vector_context_lines: int = Field(default=1, ge=0, le=1)  # the line before as context ...
    vector_context_mode: Literal["pair", "mix"] = "mix"  # ... embedded with it, or mixed in
    summary_every_turns: int = Field(default=8, ge=0)  # 0: never
    extract_facts: bool = True
    facts_every_turns: int = Field(default=4, ge=1)  # one extraction covers this many turns
    structured_facts: bool = True  # ask vLLM for schema-constrained JSON (structured outputs)
    background_max_tokens: int = 256
    background_queue_limit: int = Field(default=64, ge=1)  # sessions with work waiting
    # waiting jobs each principal is sure of (None: background_queue_limit // principals)
    background_tenant_share: int | None = Field(default=None, ge=1)
    background_workers: int = Field(default=1, ge=1)  # model calls for background work at once
    warm_on_start: bool = True  # load every tenant's index when the app starts
    sync_interval_s: float = Field(default=1.0, ge=0)  # look for other writers (background)
    # Where the truth lives: markdown files under ``root`` (one machine), or a PostgreSQL every
    # sidecar replica shares (``root`` then keeps this replica's derived data only).
    backend: Literal["files", "postgres"] = "files"
    # postgresql://user:password@host:port/db; unset: $CWM_POSTGRES_URL (a password kept out of
    # the file). Never logged or shown (a SecretStr).
    postgres_url: SecretStr | None = None
    postgres_pool_size: int = Field(default=8, ge=1)  # connections per replica
    postgres_timeout_s: float = Field(default=5.0, gt=0)  # to connect, or for a free connection
    # Where searches take their candidates with the postgres backend: ``database`` (the index
    # in PostgreSQL: pgvector HNSW and BM25 postings, written once by whichever replica sees a
    # turn first, so no replica holds or embeds every folder) or ``local`` (each replica's own
    # index under ``root``, built from the database). The files backend is always local.
    candidates: Literal["database", "local"] = "database"

    @model_validator(mode="after")
    def _postgres_url(self) -> MemorySettings:
        if self.backend == "postgres":
            self.postgres_url = postgres_url_or_env(self.postgres_url, "memory")
        return self

    def resolve_root(self, config_file: str | os.PathLike[str]) -> None:
        """Take a relative ``root`` from the folder of the settings file it was read from."""
        self.root = beside(self.root, config_file)


def load_memory_settings(config_file: str | os.PathLike[str]) -> MemorySettings:
    """The file's ``memory`` section (the defaults when it has none), as the sidecar reads it."""
    settings = load_section(MemorySettings, config_file, "memory") or MemorySettings()
    settings.resolve_root(config_file)
    return settings


def service_kwargs(cfg: MemorySettings) -> dict[str, Any]:
    """``root`` and the keywords of :func:`~cwm_plugin.memory.service.factory.make_service`."""
    emb = cfg.embedder
    return {"root": cfg.root, "tokenizer": cfg.index_tokenizer, "embedder": emb.kind,
            "embedder_url": emb.url, "embedder_model": emb.model, "dims": emb.dims,
            "embedder_threads": emb.threads, "embedder_dtype": emb.dtype,
            "chunk_tokens": cfg.chunk_tokens, "chunk_overlap": cfg.chunk_overlap,
            "vector_context_lines": cfg.vector_context_lines, "recent_turns": cfg.recent_turns,
            "sync_interval_s": cfg.sync_interval_s,
            "vector_context_mode": cfg.vector_context_mode,
            **({"postgres_url": cfg.postgres_url.get_secret_value(),
                "postgres_pool_size": cfg.postgres_pool_size,
                "postgres_timeout_s": cfg.postgres_timeout_s,
                "candidates": cfg.candidates}
               if cfg.backend == "postgres" and cfg.postgres_url else {}),
            **cfg.search.model_dump()}
