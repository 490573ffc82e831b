"""Limits settings: ``rate_limits:`` (per-tenant request rates and token quotas, applied by
``identity/ratelimit.py`` with the ``limits`` package) and ``server:`` (the HTTP server's own
bounds against careless or hostile clients, ``server_limits.py``).

A rate is written in that package's notation, several separated by ``;``: ``"10/second;
600/minute"`` (requests), ``"2000000/hour"`` (tokens). ``rate_limit`` and ``token_quota``
here are every principal's defaults (on unless set to ``none``); a tenant or provider sets
its own (``tenants[].rate_limit``, ``tenants[].token_quota``; ``"none"``: no limit for it).
A request rate of ``auto`` (the default) is the principal's share of ``server_rate``, the
requests the whole sidecar is sized for, divided by the principals: one tenant alone may use
all of it, and of nine none more than a ninth, which is what keeps a tenant sending as fast as
it is allowed from slowing the others on a small machine (``bench/tenancy.py``).
``storage``: where the counts live, ``memory://`` (this process) or a ``redis://`` URL that
every sidecar of a deployment shares (one quota however many processes serve the tenant);
``storage_timeout_s`` bounds each call to it and ``storage_retry_s`` how long the counts stay
in this process after it failed. ``max_in_flight``: a principal's requests in flight at once
(``identity/in_flight.py``; a tenant's own ``tenants[].max_in_flight``; ``auto``, the default:
its share of ``server.max_connections``, those divided by the principals; ``none``: no bound).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from cwm_plugin.config_file import Strict

NO_LIMIT = "none"
AUTO = "auto"


def check_rate(value: str | None, *, auto: bool = False) -> str | None:
    """A rate in the ``limits`` package's notation (or ``none``; ``auto`` where ``auto``),
    else a clear error."""
    if value is None or value == NO_LIMIT or (auto and value == AUTO):
        return value
    from limits import parse_many

    try:
        parse_many(value)
    except ValueError:
        raise ValueError(f"rate {value!r} is not like '10/second' or '600/minute;"
                         "10000/day' (the limits package's notation)") from None
    return value


def share_of(rate: str, parts: int) -> str:
    """``rate`` divided among ``parts`` (each item's amount, at least 1)."""
    from limits import parse_many

    def one(item) -> str:
        amount, unit = max(1, item.amount // max(1, parts)), item.GRANULARITY.name
        return f"{amount}/{item.multiples} {unit}s" if item.multiples != 1 else f"{amount}/{unit}"
    return ";".join(one(item) for item in parse_many(rate))


# A principal is a whole tenant (an app and all its users). The sidecar is sized for bursts of
# 200 requests a second and 100 a second sustained (one process: 2 cores keep up with that
# mix of routes); tokens about a fifth of what one GPU prefills with an 8B model
DEFAULT_SERVER_RATE = "200/second;6000/minute"  # requests, all principals together
DEFAULT_QUOTA = "10000000/hour"  # prompt + completion tokens a principal
# requests of a principal in flight: its share of the server's connections, so one principal
# never holds every connection with requests that wait (one principal alone: all of them)
InFlight = int | Literal["none", "auto"]  # a number of requests, no bound, or the share


def check_in_flight(value: InFlight | None) -> InFlight | None:
    if isinstance(value, int) and value < 1:
        raise ValueError("max_in_flight must be at least 1 (or none)")
    return value


class RateLimitSettings(Strict):
    """Defaults for every principal and where the counts are kept (see the module docstring)."""

    storage: str = "memory://"
    rate_limit: str | None = AUTO  # requests, any route ("auto": a share of server_rate;
    #                                 None or "none": none)
    server_rate: str = DEFAULT_SERVER_RATE  # what "auto" rates share
    token_quota: str | None = DEFAULT_QUOTA  # tokens, client and background work (ditto)
    storage_timeout_s: float = Field(default=0.25, gt=0)  # a call to a Redis storage
    storage_retry_s: float = Field(default=5.0, gt=0)  # after it failed, counted here this long
    max_in_flight: InFlight = AUTO  # a principal's requests at once ("none": any)
    refusal_delay_s: float = Field(default=0.5, ge=0, le=10)  # a 429 of rate or quota waits

    @field_validator("rate_limit")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        return check_rate(v, auto=True)

    @field_validator("token_quota")
    @classmethod
    def _quota(cls, v: str | None) -> str | None:
        return check_rate(v)

    @field_validator("server_rate")
    @classmethod
    def _server_rate(cls, v: str) -> str:
        if v in (NO_LIMIT, AUTO):
            raise ValueError("rate_limits.server_rate is a rate, like '200/second;6000/minute' "
                             "(to turn rates off, set rate_limit: none)")
        return str(check_rate(v))

    def rate_of(self, own: str | None, principals: int) -> str | None:
        """A principal's request rate: its own (``own``), else the default; ``auto``: its share
        of ``server_rate`` among ``principals``."""
        rate = own or self.rate_limit
        return share_of(self.server_rate, principals) if rate == AUTO else rate

    @field_validator("max_in_flight")
    @classmethod
    def _in_flight(cls, v: InFlight) -> InFlight:
        return check_in_flight(v)  # type: ignore[return-value]

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str) -> str:
        if not v.startswith(("memory://", "redis://", "rediss://", "redis+sentinel://",
                             "redis+cluster://")):
            raise ValueError("rate_limits.storage must be memory:// or a redis:// URL")
        return v


class ServerSettings(Strict):
    """The HTTP server's bounds (``server:``; see ``cwm_plugin/sidecar/server_limits.py``)."""

    max_header_bytes: int = Field(default=32 * 1024, ge=1024)  # request line + headers
    header_timeout_s: float = Field(default=10.0, gt=0)  # for a request's headers to arrive
    body_timeout_s: float = Field(default=20.0, gt=0)  # for its body, ...
    body_min_rate: int = Field(default=4096, ge=1)  # ... plus a second for each this many
    keep_alive_s: int = Field(default=5, ge=1)  # an idle connection between requests
    max_connections: int = Field(default=512, ge=2)  # past it a request gets 503
