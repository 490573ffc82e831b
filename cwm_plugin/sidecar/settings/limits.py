"""Limits settings (``rate_limits:`` in the sidecar's config): per-tenant request rates and
token quotas, applied by ``identity/ratelimit.py`` with the ``limits`` package.

A rate is written in that package's notation, several separated by ``;``: ``"10/second;
600/minute"`` (requests), ``"2000000/hour"`` (tokens). ``rate_limit`` and ``token_quota``
here are every principal's defaults; a tenant or provider sets its own
(``tenants[].rate_limit``, ``tenants[].token_quota``; ``"none"``: no limit for it).
``storage``: where the counts live, ``memory://`` (this process) or a ``redis://`` URL that
every sidecar of a deployment shares (one quota however many processes serve the tenant).
"""

from __future__ import annotations

from pydantic import field_validator

from cwm_plugin.config_file import Strict

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


class RateLimitSettings(Strict):
    """Defaults for every principal and where the counts are kept (see the module docstring)."""

    storage: str = "memory://"
    rate_limit: str | None = None  # requests, any route (None: none)
    token_quota: str | None = None  # prompt + completion tokens, client and background work

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
