"""Where the memory's truth lives (:func:`open_truth`): markdown files, or PostgreSQL shared by
every sidecar replica (``truth.py``, with the versioned schema it needs in ``schema.py``).
Nothing here imports psycopg unless ``postgres_url`` is set."""

from __future__ import annotations

from cwm_plugin.errors import ConfigError
from cwm_plugin.memory.files.markdown import MemoryFiles
from cwm_plugin.memory.files.truth import MemoryTruth
from cwm_plugin.memory.models import MemoryConfig


def open_truth(config: MemoryConfig) -> MemoryTruth:
    """Where the memory's truth lives: markdown files under ``root`` (the default), or the
    PostgreSQL at ``postgres_url`` (imported only then: psycopg is needed only there)."""
    if not config.postgres_url:
        return MemoryFiles(config.root)
    try:
        from cwm_plugin.memory.postgres.truth import PostgresTruth
    except ImportError as exc:
        raise ConfigError(f"memory.backend postgres needs psycopg ({exc})",
                          hint="pip install 'cwm-plugin[postgres]'") from exc
    return PostgresTruth(config.postgres_url, config.root, pool_size=config.postgres_pool_size,
                         timeout_s=config.postgres_timeout_s)
