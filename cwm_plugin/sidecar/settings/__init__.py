"""The sidecar's one settings object, read from a YAML file (see ``configs/sidecar.yaml``).

Tenants carry only the sha256 of their API keys. The server secret that derives every
``cache_salt`` comes from the file or, better, from an environment variable named in it; it is
kept in a ``SecretStr`` so that it never shows in a repr or a log line.
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from cwm_plugin.errors import ConfigError
from cwm_plugin.sidecar.identity.secret_versions import SecretVersion, in_grace
from cwm_plugin.sidecar.settings.access import AccessSettings
from cwm_plugin.sidecar.settings.limits import RateLimitSettings, ServerSettings, check_rate
from cwm_plugin.sidecar.settings.routing import DEFAULT_RULES as DEFAULT_RULES
from cwm_plugin.sidecar.settings.routing import NAME as NAME
from cwm_plugin.sidecar.settings.routing import UPSTREAM_OWN, RoutingSettings
from cwm_plugin.sidecar.settings.routing import HealthSettings as HealthSettings
from cwm_plugin.sidecar.settings.routing import RouteRule as RouteRule
from cwm_plugin.sidecar.settings.routing import Strict as _Strict
from cwm_plugin.sidecar.settings.routing import UpstreamConfig as UpstreamConfig

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class TenantConfig(_Strict):
    """One tenant: its name (a folder name under the memory root), its keys' sha256, and what
    it shares: ``users_share_kv`` (requests of different users naming one session share its
    KV and prefix cache; default: the user is part of the salt), ``stateless_memory`` (a
    request naming neither session nor user gets memory selected from the tenant's; default:
    none, since one key often serves many people). Its own ``rate_limit`` / ``token_quota``
    (``settings/limits.py``) replace ``rate_limits``' defaults."""

    name: str
    key_sha256: list[str] = Field(min_length=1)
    allow_client_cache_salt: bool = False  # HMAC'd with the tenant before it is forwarded
    history: Literal["full", "recent"] | None = None  # None: prompt.history
    users_share_kv: bool = False
    stateless_memory: bool = False
    rate_limit: str | None = None  # None: rate_limits.rate_limit
    token_quota: str | None = None  # None: rate_limits.token_quota

    @field_validator("rate_limit", "token_quota")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        return check_rate(v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.fullmatch(v) or ".." in v:
            raise ValueError(f"tenant name {v!r} must match {NAME.pattern}")
        return v

    @field_validator("key_sha256")
    @classmethod
    def _hashes(cls, v: list[str]) -> list[str]:
        out = [h.strip().lower() for h in v]
        for h in out:
            if not SHA256_HEX.match(h):
                raise ValueError("key_sha256 entries must be 64 hex digits (sha256 of the key)")
        return out


class ProviderConfig(TenantConfig):
    """A provider: a principal that shares the deployment's memory with the other providers
    (RO on theirs by default, ``settings/access.py``), with the model it runs and that model's
    context limit: the 70% warning and the 85% checkpoint of its sessions use the smaller of
    that limit and the answering upstream's, and its activity entries default to both."""

    model: str | None = None
    context_limit: int | None = Field(default=None, ge=1)


RESERVED = re.compile(r"^(global|activity|project\..*|u-[0-9a-f]{32})$")




class Price(_Strict):
    """Prices a million tokens; cached prompt tokens (vLLM's ``cached_tokens``) at
    ``cached_input_per_1m`` when set, else at ``input_per_1m``."""

    input_per_1m: float = Field(default=0.0, ge=0)
    output_per_1m: float = Field(default=0.0, ge=0)
    cached_input_per_1m: float | None = Field(default=None, ge=0)


class PricingSettings(_Strict):
    currency: str = "USD"
    default: Price = Price()
    models: dict[str, Price] = Field(default_factory=dict)

    def for_model(self, model: str) -> Price:
        return self.models.get(model, self.default)


class ActivitySettings(_Strict):
    """The append-only activity log (``cwm_plugin/activity``): ``POST|GET /v1/activity``.
    ``log_turns`` appends one line a chat turn (its first ``turn_preview_chars`` characters of
    question and answer; 0: none). ``read``: ``shared`` (a principal reads its own entries
    and those of the principals whose namespace it may read: by default providers each
    other's, a tenant only its own; ``access.rules`` grant more), ``own`` (only its own) or
    ``all`` (every principal reads the whole log)."""

    root: Path = Path("./cwm-activity")
    log_turns: bool = False
    turn_preview_chars: int = Field(default=120, ge=0, le=500)
    read: Literal["shared", "own", "all"] = "shared"


class EmbedderConfig(_Strict):
    """``local`` (MiniLM, offline), ``openai`` (an embeddings endpoint; its API key, if any, in
    ``$CWM_EMBEDDINGS_API_KEY``) or ``hashing`` (tests)."""

    kind: Literal["local", "openai", "hashing"] = "local"
    url: str | None = None
    model: str | None = None
    dims: int = 384
    threads: int | None = Field(default=1, ge=1)  # local: torch threads (None: every core)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # local: the model's precision


class SearchSettings(_Strict):
    """Hybrid search (see ``cwm_plugin/memory/search.py`` for what each one does)."""

    bm25_weight: float = Field(default=0.5, ge=0)
    vector_weight: float = Field(default=0.5, ge=0)
    chunk_vector_weight: float = Field(default=1.0, ge=0)  # chunk centroid's cosine, vector score
    candidate_multiplier: int = Field(default=4, ge=1)
    mmr_lambda: float | None = Field(default=None, ge=0, le=1)  # None: no MMR re-ranking
    recency_half_life_days: float | None = Field(default=None, gt=0)  # None: no decay
    max_facts: int = Field(default=8, ge=0)  # durable memories offered to a selection
    # what a selection packs (cwm_plugin/memory/turns.py, pack.py): the best lines or chunks
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


class MemorySettings(_Strict):
    """The memory package's settings plus what the sidecar decides about them."""

    root: Path = Path("./cwm-memory")
    # Counts chunk sizes in the index (any local tokenizer; part of the saved index's identity).
    index_tokenizer: str = "tiktoken:cl100k_base"
    # Counts budgets and prompts: the served model's tokenizer (see cwm_plugin.sidecar.turn.counting).
    tokenizer: str = "auto"
    tokenizers: dict[str, str] = Field(default_factory=dict)  # per served model name
    embedder: EmbedderConfig = EmbedderConfig()
    search: SearchSettings = SearchSettings()
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
    background_workers: int = Field(default=1, ge=1)  # model calls for background work at once
    warm_on_start: bool = True  # load every tenant's index when the app starts
    sync_interval_s: float = Field(default=1.0, ge=0)  # look for other writers (background)


class PromptSettings(_Strict):
    """How the prompt sent upstream is built (``cwm_plugin/sidecar/turn/prompt.py``, ``plan.py``).

    ``history``: ``full`` sends every message the client sent (nothing dropped while it fits
    under the compaction threshold); ``recent`` is the token-saving mode (memory plus the last
    ``memory.recent_turns`` history messages). Per tenant (``tenants[].history``) and per
    request (header ``X-CWM-History: full|recent``). ``placement``: where the memory text is
    merged. ``refresh``: ``conversation`` selects memory once per conversation (and after each
    compaction) and reuses it verbatim, so the prefix cache keeps hitting; ``turn`` selects it
    again every turn. ``sessionless``: a request with neither ``X-Session-Id`` nor ``user`` is
    ``stateless`` (nothing recorded, no history from the server) or goes to one ``shared``
    session named ``default`` (the old behaviour). ``memory_view``: ``full`` merges the whole
    selection; ``quick`` only its short forms (durable facts and the session summary, no
    transcript passages); per request (header ``X-CWM-Memory-View: quick|full``).
    """

    history: Literal["full", "recent"] = "full"
    memory_view: Literal["quick", "full"] = "full"
    placement: Literal["system", "last_user"] = "system"
    refresh: Literal["conversation", "turn"] = "conversation"
    sessionless: Literal["stateless", "shared"] = "stateless"


class ThresholdConfig(_Strict):
    """Fractions of ``max_model_len``; the last ``keep_turns`` user/assistant exchanges (a
    user message and everything up to the next one) survive a compaction."""

    warn: float = Field(default=0.70, gt=0, le=1)
    checkpoint: float = Field(default=0.85, gt=0, le=1)
    keep_turns: int = Field(default=2, ge=0)

    @model_validator(mode="after")
    def _order(self) -> ThresholdConfig:
        if self.warn > self.checkpoint:
            raise ValueError("warn must not exceed checkpoint")
        return self


class CheckpointConfig(_Strict):
    default: ThresholdConfig = ThresholdConfig()
    models: dict[str, ThresholdConfig] = Field(default_factory=dict)

    def for_model(self, model: str) -> ThresholdConfig:
        return self.models.get(model, self.default)


class WindowsSettings(_Strict):
    """Context windows (``/v1/windows``): the KV store vLLM's connector writes (its
    ``kv_connector_extra_config.store``: the same disk path and/or Redis), and auto-freeze."""

    store: dict[str, Any] = Field(default_factory=dict)   # StoreConfig fields
    wait_s: float = Field(default=30.0, ge=0)   # a freeze waits this long for pending saves
    # ... of which this long for write-behind, before copying a block a durable tier lacks
    settle_s: float = Field(default=3.0, ge=0)
    auto_freeze: bool = True                    # freeze for real at the checkpoint threshold
    auto_freeze_cooldown_s: float = Field(default=600.0, ge=0)
    auto_keep: int = Field(default=3, ge=1)     # auto-checkpoint windows kept per session
    keep_turns: int = Field(default=8, ge=1, le=256)  # client turns a session can freeze
    # the client's messages travel with a window up to this size (JSON), else they are left out
    max_message_bytes: int = Field(default=1 << 20, ge=0)
    tenant_quota_bytes: int | None = Field(default=None, ge=0)  # blob bytes a tenant may pin
    max_ttl_s: float | None = Field(default=None, gt=0)  # windows' longest TTL (None: any)
    max_import_bytes: int = Field(default=1 << 30, ge=1024)  # an imported window file's size
    imports_per_tenant: int = Field(default=1, ge=1)  # window imports of one tenant at once
    imports_at_once: int = Field(default=2, ge=1)  # ... and of everyone (each spools to disk)


class Settings(_Strict):
    """Everything ``create_app`` needs."""

    secret: SecretStr | None = None
    secret_env: str = "CWM_SIDECAR_SECRET"
    secrets: list[SecretVersion] = Field(default_factory=list)  # newest first; see
    # identity/secret_versions.py (empty: `secret` / `secret_env` is the one version)
    tenants: list[TenantConfig] = Field(default_factory=list)
    providers: list[ProviderConfig] = Field(default_factory=list)
    access: AccessSettings = AccessSettings()
    upstream: UpstreamConfig = UpstreamConfig()
    upstreams: list[UpstreamConfig] = Field(default_factory=list)  # empty: [upstream]
    routing: RoutingSettings = RoutingSettings()
    pricing: PricingSettings = PricingSettings()
    activity: ActivitySettings | None = None    # None: /v1/activity answers 503
    memory: MemorySettings = MemorySettings()
    checkpoint: CheckpointConfig = CheckpointConfig()
    prompt: PromptSettings = PromptSettings()
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # a route's own limit, by its path as the API lists it ("/v1/memory/turns": 1048576)
    max_body_bytes_by_route: dict[str, int] = Field(default_factory=dict)
    rate_limits: RateLimitSettings = RateLimitSettings()
    server: ServerSettings = ServerSettings()  # headers, slow clients, connections
    max_json_depth: int = Field(default=64, ge=4, le=1000)  # deeper bodies get 400
    debug_header_max_bytes: int = Field(default=4096, ge=256)
    memory_enabled: bool = True
    windows: WindowsSettings | None = None      # None: /v1/windows answers 503

    @model_validator(mode="before")
    @classmethod
    def _inherit(cls, raw: Any) -> Any:
        """Each ``upstreams:`` entry takes the fields it does not set from ``upstream:``."""
        if not isinstance(raw, dict) or not isinstance(raw.get("upstreams"), list):
            return raw
        base = raw.get("upstream") or {}
        if not isinstance(base, dict):
            return raw
        shared = {k: v for k, v in base.items() if k not in UPSTREAM_OWN}
        return {**raw, "upstreams": [{**shared, **u} if isinstance(u, dict) else u
                                     for u in raw["upstreams"]]}

    @model_validator(mode="after")
    def _unique(self) -> Settings:
        names = [t.name for t in self.principals()]
        if len(names) != len(set(names)):
            raise ValueError("tenant and provider names must be unique (one principal each)")
        for name in names:
            if RESERVED.fullmatch(name):
                raise ValueError(f"principal name {name!r} is reserved (global, activity, "
                                 "project.*, u-<32 hex>: namespace folders)")
        known = {*names, "*"}
        acc = self.access
        for who in [r.principal for r in acc.rules] + list(acc.grants) + \
                [x for x in [acc.global_owner] if x is not None]:
            if who not in known:
                raise ValueError(f"access: principal {who!r} is not a tenant or provider "
                                 f"(known: {', '.join(sorted(names)) or 'none'})")
        ids = [v.id for v in self.secrets]
        if len(ids) != len(set(ids)):
            raise ValueError("secret ids must be unique")
        ups = [u.name for u in self.upstreams]
        if len(ups) != len(set(ups)):
            raise ValueError("upstream names must be unique")
        return self

    def principals(self) -> list[TenantConfig]:
        """Every principal: the tenants, then the providers."""
        return [*self.tenants, *self.providers]

    def context_limit(self, principal: str, upstream: int | None) -> int | None:
        """The context a principal's prompts must fit: the upstream's limit, or a provider's
        own ``context_limit`` when that is smaller (None: neither is known)."""
        own = next((p.context_limit for p in self.providers if p.name == principal), None)
        limits = [x for x in (upstream, own) if x]
        return min(limits) if limits else None

    def body_limit(self, route: str) -> int:
        """The most bytes a request body of ``route`` (its path template) may have."""
        if route in self.max_body_bytes_by_route:
            return self.max_body_bytes_by_route[route]
        if route == "/v1/windows/import" and self.windows is not None:
            return self.windows.max_import_bytes
        return self.max_body_bytes

    def endpoints(self) -> list[UpstreamConfig]:
        """The upstreams, in order: ``upstreams`` when given, else ``[upstream]``."""
        return list(self.upstreams) or [self.upstream]

    def server_secret(self) -> bytes:
        """The HMAC key for salts and user names: the newest of ``secrets``, else the file's
        ``secret``, else ``$<secret_env>``."""
        return self.server_secrets()[0]

    def server_secrets(self, now: datetime | None = None) -> list[bytes]:
        """Every version still in its grace period, newest first (``identity/secret_versions.py``)."""
        if self.secrets:
            return in_grace(self.secrets, now)
        value = self.secret.get_secret_value() if self.secret else os.environ.get(self.secret_env)
        if not value or len(value) < 16:
            raise ConfigError(
                "no server secret for cache salts",
                hint=f"set {self.secret_env} (or `secret:` in the config) to 16+ random characters",
            )
        return [value.encode()]


def load_settings(path: str | os.PathLike[str], **overrides: object) -> Settings:
    """Read and validate a YAML settings file; ``overrides`` replace top-level keys."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{p} must hold a mapping at the top level")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        settings = Settings.model_validate(raw)
    except ValidationError as exc:
        # Never echo inputs: a misplaced secret must not end up in a log line.
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                             for e in exc.errors(include_input=False))
        raise ConfigError(f"{p}: {problems}") from None
    root = settings.memory.root
    if not root.is_absolute():
        settings.memory.root = (p.parent / root).resolve()
    if settings.activity is not None and not settings.activity.root.is_absolute():
        settings.activity.root = (p.parent / settings.activity.root).resolve()
    return settings
