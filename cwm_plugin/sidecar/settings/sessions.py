"""The ``sessions:`` section of the sidecar's config: how many sessions' state the sidecar
keeps, in all and for each principal (applied by ``turn/session.py``'s tracker)."""

from __future__ import annotations

from pydantic import Field, SecretStr

from cwm_plugin.config_file import Strict


class SessionSettings(Strict):
    """The state the sidecar keeps per session (``turn/session.py``: the memory pinned to its
    conversation, its compaction, its context use), lost on eviction (the session then selects
    its memory anew, and its prompt prefix changes once): ``max_tracked`` sessions in all, of
    which each principal is sure of ``tenant_share`` (None: an even share, ``max_tracked`` //
    the number of principals), its users' sessions included. A principal may use what the
    others leave free; past the total, one over its share evicts its own least recently used,
    and one within its share the excess of the principal holding the most."""

    max_tracked: int = Field(default=100_000, ge=1)
    tenant_share: int | None = Field(default=None, ge=1)
    # Replicas sharing session state (turn/shared_state.py): a Redis URL (None: each process
    # keeps its own). A password in it is never logged (a SecretStr).
    shared_url: SecretStr | None = None
    shared_ttl_s: int = Field(default=7 * 24 * 3600, ge=60)  # after a session's last write
    shared_timeout_s: float = Field(default=0.25, gt=0)  # a slower Redis: the replica's own
    # background jobs across replicas (background/shared_jobs.py): a new one is its replica's
    # alone for grace_s; a claim lasts lease_s unless renewed (a dead replica's job is taken
    # over once its lease has passed)
    shared_job_grace_s: float = Field(default=5.0, ge=0)
    shared_job_lease_s: float = Field(default=30.0, ge=1)
