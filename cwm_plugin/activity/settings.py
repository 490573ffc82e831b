"""The activity log's settings (the ``activity`` section of the settings file)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator

from cwm_plugin.activity.log import MAX_USER_CHAINS
from cwm_plugin.config_file import Strict, beside, load_section, postgres_url_or_env


class ActivitySettings(Strict):
    """The append-only activity log (``cwm_plugin/activity``): ``POST|GET /v1/activity``.
    ``log_turns`` appends one line a chat turn (its first ``turn_preview_chars`` characters of
    question and answer; 0: none). ``read``: ``shared`` (a principal reads its own entries
    and those of the principals whose namespace it may read: by default providers each
    other's, a tenant only its own; ``access.rules`` grant more), ``own`` (only its own) or
    ``all`` (every principal reads the whole log). ``max_user_chains``: the users of one
    tenant with a chain of their own (a new user's entry past it: 507
    ``activity_users_full``, nothing written), so a tenant naming ever new users grows the
    log's folders, and what its own reads look at, only so far."""

    root: Path = Path("./cwm-activity")
    log_turns: bool = False
    turn_preview_chars: int = Field(default=120, ge=0, le=500)
    read: Literal["shared", "own", "all"] = "shared"
    max_user_chains: int = Field(default=MAX_USER_CHAINS, ge=1)
    # files: chains under ``root`` (one machine, or a shared file system) | postgres: one
    # PostgreSQL every sidecar replica appends to and reads (``activity/postgres.py``)
    backend: Literal["files", "postgres"] = "files"
    postgres_url: SecretStr | None = None  # unset: $CWM_POSTGRES_URL; never logged
    postgres_pool_size: int = Field(default=4, ge=1)  # connections per replica

    @model_validator(mode="after")
    def _postgres_url(self) -> ActivitySettings:
        if self.backend == "postgres":
            self.postgres_url = postgres_url_or_env(self.postgres_url, "activity")
        return self

    def resolve_root(self, config_file: str | os.PathLike[str]) -> None:
        """Take a relative ``root`` from the folder of the settings file it was read from."""
        self.root = beside(self.root, config_file)


def load_activity_settings(config_file: str | os.PathLike[str]) -> ActivitySettings | None:
    """The file's ``activity`` section (None: it has none, the log is off)."""
    settings = load_section(ActivitySettings, config_file, "activity")
    if settings is not None:
        settings.resolve_root(config_file)
    return settings
