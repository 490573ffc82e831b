"""Build embedders and services from plain settings or from :class:`MemorySettings` (used by
the CLI and the sidecar)."""

from __future__ import annotations

import os
from pathlib import Path

from cwm_plugin.errors import ConfigError
from cwm_plugin.memory.index.embeddings import (
    Embedder,
    HashingEmbedder,
    MiniLMEmbedder,
    OpenAIEmbedder,
)
from cwm_plugin.memory.metrics import MemoryMetrics
from cwm_plugin.memory.models import MemoryConfig
from cwm_plugin.memory.service.service import MemoryService
from cwm_plugin.memory.settings import MemorySettings, service_kwargs
from cwm_plugin.memory.tokens import make_counter


def make_embedder(kind: str = "local", *, url: str | None = None, model: str | None = None,
                  dims: int = 384, api_key_env: str = "CWM_EMBEDDINGS_API_KEY",
                  threads: int | None = None, dtype: str = "auto") -> Embedder:
    """``local`` (MiniLM from the installed package, or the model folder ``model``, on
    ``threads`` torch threads, in ``dtype``), ``openai`` (url + model), ``hashing``."""
    if kind == "local":
        return MiniLMEmbedder(local_folder(model), threads=threads, dtype=dtype)
    if kind == "openai":
        if not url or not model:
            raise ConfigError("the openai embedder needs a url and a model name",
                              hint="set embedder.url and embedder.model")
        return OpenAIEmbedder(url, model, api_key=os.environ.get(api_key_env), dims=dims)
    if kind == "hashing":
        return HashingEmbedder(dims)
    raise ConfigError(f"unknown embedder kind {kind!r}", hint="use local, openai or hashing")


def local_folder(model: str | None) -> Path | None:
    """The folder of the local embedder's ``model``: None (the packaged all-MiniLM-L6-v2) when
    unset or named so; a folder that exists; anything else is a configuration error, not a
    silent fall back to MiniLM (a mistyped path would have searched with the wrong model)."""
    if not model or model.lower().removeprefix("sentence-transformers/") == "all-minilm-l6-v2":
        return None
    if Path(model).is_dir():
        return Path(model)
    raise ConfigError(f"the local embedder's model {model!r} is not a folder",
                      hint="set embedder.model to a sentence-transformers model folder "
                           "(config.json, weights, tokenizer), or leave it unset for the "
                           "packaged all-MiniLM-L6-v2")


def make_service(root: Path, *, tokenizer: str | None = "tiktoken:cl100k_base",
                 embedder: str = "local", embedder_url: str | None = None,
                 embedder_model: str | None = None, dims: int = 384,
                 embedder_threads: int | None = None, embedder_dtype: str = "auto",
                 metrics: MemoryMetrics | None = None, **config: object) -> MemoryService:
    """A ``MemoryService`` from settings; extra keywords go to :class:`MemoryConfig`."""
    cfg = MemoryConfig(root=Path(root), **config)  # type: ignore[arg-type]
    return MemoryService(cfg, make_embedder(embedder, url=embedder_url, model=embedder_model,
                                            dims=dims, threads=embedder_threads,
                                            dtype=embedder_dtype),
                         make_counter(tokenizer), metrics)


def service_from_settings(cfg: MemorySettings, metrics: MemoryMetrics | None = None
                          ) -> MemoryService:
    """The ``MemoryService`` these settings describe; its metrics on ``metrics`` when given."""
    kw = service_kwargs(cfg)
    return make_service(kw.pop("root"), metrics=metrics, **kw)
