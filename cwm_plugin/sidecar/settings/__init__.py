"""The sidecar's one settings object, read from a YAML file (see ``configs/sidecar.yaml``).

Tenants carry only the sha256 of their API keys. The server secret that derives every
``cache_salt`` comes from the file or, better, from an environment variable named in it; it is
kept in a ``SecretStr`` so that it never shows in a repr or a log line. The sections other
packages own (``memory``, ``activity``, ``windows``) are their models, composed here; the file
is read and checked by :mod:`cwm_plugin.config_file`, which their CLIs use for their section.
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from cwm_plugin.activity.settings import ActivitySettings
from cwm_plugin.config_file import Strict as _Strict
from cwm_plugin.config_file import validate
from cwm_plugin.errors import ConfigError
from cwm_plugin.memory.settings import MemorySettings
from cwm_plugin.sidecar.settings.access import AccessSettings, UserKey, key_digests
from cwm_plugin.sidecar.settings.limits import (
    AUTO,
    NO_LIMIT,
    InFlight,
    RateLimitSettings,
    ServerSettings,
    check_in_flight,
    check_rate,
)
from cwm_plugin.sidecar.settings.routing import DEFAULT_RULES as DEFAULT_RULES
from cwm_plugin.sidecar.settings.routing import NAME as NAME
from cwm_plugin.sidecar.settings.routing import UPSTREAM_OWN, RoutingSettings
from cwm_plugin.sidecar.settings.routing import HealthSettings as HealthSettings
from cwm_plugin.sidecar.settings.routing import RouteRule as RouteRule
from cwm_plugin.sidecar.settings.routing import UpstreamConfig as UpstreamConfig
from cwm_plugin.sidecar.settings.secret_versions import SecretVersion, in_grace
from cwm_plugin.sidecar.settings.sessions import SessionSettings
from cwm_plugin.typed_config import read_yaml
from cwm_plugin.windows.settings import WindowsSettings


class TenantConfig(_Strict):
    """One tenant: its name (a folder name under the memory root), its keys' sha256, and what
    it shares: ``users_share_kv`` (requests of different users naming one session share its
    KV and prefix cache; default: the user is part of the salt), ``stateless_memory`` (a
    request naming neither session nor user gets memory selected from the tenant's; default:
    none, since one key often serves many people). ``users``: whether its keys may act for
    the user a request names (``any``: its app vouches for its users; ``none``: naming one is
    refused); ``user_keys``: keys each bound to one user (``settings/access.py``), which may
    read the principal's own namespace with ``user_keys_access: RO`` (the default) and not at
    all with ``none`` (never write it). Its own ``rate_limit`` / ``token_quota`` /
    ``max_in_flight`` (``settings/limits.py``) replace ``rate_limits``' defaults."""

    name: str
    key_sha256: list[str] = Field(min_length=1)
    allow_client_cache_salt: bool = False  # HMAC'd with the tenant before it is forwarded
    history: Literal["full", "recent"] | None = None  # None: prompt.history
    users_share_kv: bool = False
    stateless_memory: bool = False
    users: Literal["any", "none"] = "any"  # may its keys act for a user a request names?
    user_keys: list[UserKey] = Field(default_factory=list)  # keys each bound to one user
    user_keys_access: Literal["RO", "none"] = "RO"  # theirs on the principal's own namespace
    rate_limit: str | None = None  # None: rate_limits.rate_limit ("auto": a share)
    token_quota: str | None = None  # None: rate_limits.token_quota
    max_in_flight: InFlight | None = None  # None: rate_limits.max_in_flight

    @field_validator("rate_limit")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        return check_rate(v, auto=True)

    @field_validator("token_quota")
    @classmethod
    def _quota(cls, v: str | None) -> str | None:
        return check_rate(v)

    @field_validator("max_in_flight")
    @classmethod
    def _in_flight(cls, v: InFlight | None) -> InFlight | None:
        return check_in_flight(v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.fullmatch(v) or ".." in v:
            raise ValueError(f"tenant name {v!r} must match {NAME.pattern}")
        return v

    @field_validator("key_sha256")
    @classmethod
    def _hashes(cls, v: list[str]) -> list[str]:
        return key_digests(v)

    def digests(self) -> list[tuple[str, str | None]]:
        """Every key's digest with the user it is bound to (None: a key of the principal)."""
        return [(h, None) for h in self.key_sha256] + \
            [(h, k.user) for k in self.user_keys for h in k.key_sha256]


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


class Settings(_Strict):
    """Everything ``create_app`` needs."""

    secret: SecretStr | None = None
    secret_env: str = "CWM_SIDECAR_SECRET"
    secrets: list[SecretVersion] = Field(default_factory=list)  # newest first; see
    # settings/secret_versions.py (empty: `secret` / `secret_env` is the one version)
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
    sessions: SessionSettings = SessionSettings()
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
        seen: set[str] = set()
        for digest in (h for t in self.principals() for h, _ in t.digests()):
            if digest in seen:
                raise ValueError(f"the key with sha256 {digest[:12]}... is listed twice: a "
                                 "key belongs to one principal and at most one of its users")
            seen.add(digest)
        if self.session_share() * len(names) > self.sessions.max_tracked:
            raise ValueError(
                f"sessions: {len(names)} principals x tenant_share {self.session_share()} is "
                f"over max_tracked ({self.sessions.max_tracked}): raise sessions.max_tracked "
                "or lower sessions.tenant_share")
        share, limit = self.memory.background_tenant_share, self.memory.background_queue_limit
        if share is not None and share * len(names) > limit:
            raise ValueError(
                f"memory: {len(names)} principals x background_tenant_share {share} is over "
                f"background_queue_limit ({limit}): raise memory.background_queue_limit or "
                "lower memory.background_tenant_share")
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

    def in_flight(self) -> dict[str, int | None]:
        """Each principal's bound on its requests in flight (None: no bound)."""
        out: dict[str, int | None] = {}
        share = max(1, self.server.max_connections // max(1, len(self.principals())))
        for p in self.principals():
            own = p.max_in_flight if p.max_in_flight is not None \
                else self.rate_limits.max_in_flight
            out[p.name] = None if own == NO_LIMIT else share if own == AUTO else int(own)
        return out

    def session_share(self) -> int:
        """The tracked sessions each principal is sure of (``SessionSettings``)."""
        return self.sessions.tenant_share or \
            max(1, self.sessions.max_tracked // max(1, len(self.principals())))

    def background_share(self) -> int:
        """The waiting background jobs each principal is sure of (``background/queue.py``)."""
        return self.memory.background_tenant_share or \
            max(1, self.memory.background_queue_limit // max(1, len(self.principals())))

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
        """Every version still in its grace period, newest first (``secret_versions.py``)."""
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
    raw = read_yaml(p)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    settings = validate(Settings, raw, p)
    settings.memory.resolve_root(p)
    if settings.activity is not None:
        settings.activity.resolve_root(p)
    return settings
