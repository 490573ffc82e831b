"""Limits settings (``rate_limits:`` in the sidecar's config): per-tenant request rates and
token quotas, applied by ``identity/ratelimit.py`` with the ``limits`` package.

A rate is written in that package's notation, several separated by ``;``: ``"10/second;
600/minute"`` (requests), ``"2000000/hour"`` (tokens). ``rate_limit`` and ``token_quota``
here are every principal's defaults (on unless set to ``none``); a tenant or provider sets
its own (``tenants[].rate_limit``, ``tenants[].token_quota``; ``"none"``: no limit for it).
``storage``: where the counts live, ``memory://`` (this process) or a ``redis://`` URL that
every sidecar of a deployment shares (one quota however many processes serve the tenant);
``storage_timeout_s`` bounds each call to it and ``storage_retry_s`` how long the counts stay
in this process after it failed.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from cwm_plugin.sidecar.settings.routing import Strict

NO_LIMIT = "none"


def check_rate(value: str | None) -> str | None:
    """A rate in the ``limits`` package's notation (or ``none``), else a clear error."""
    if value is None or value == NO_LIMIT:
        return value
    from limits import parse_many

    try:
        parse_many(value)
    except ValueError:
        raise ValueError(f"rate {value!r} is not like '10/second' or '600/minute;"
                         "10000/day' (the limits package's notation)") from None
    return value


DEFAULT_RATE = "20/second;600/minute"  # requests a principal, any route
DEFAULT_QUOTA = "2000000/hour"  # prompt + completion tokens a principal


class RateLimitSettings(Strict):
    """Defaults for every principal and where the counts are kept (see the module docstring)."""

    storage: str = "memory://"
    rate_limit: str | None = DEFAULT_RATE  # requests, any route (None or "none": none)
    token_quota: str | None = DEFAULT_QUOTA  # tokens, client and background work (ditto)
    storage_timeout_s: float = Field(default=0.25, gt=0)  # a call to a Redis storage
    storage_retry_s: float = Field(default=5.0, gt=0)  # after it failed, counted here this long

    @field_validator("rate_limit", "token_quota")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        return check_rate(v)

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str) -> str:
        if not v.startswith(("memory://", "redis://", "rediss://", "redis+sentinel://",
                             "redis+cluster://")):
            raise ValueError("rate_limits.storage must be memory:// or a redis:// URL")
        return v

