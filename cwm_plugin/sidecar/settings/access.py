"""The ``access:`` section of the sidecar's config: who may read and write which namespace, and who
may see debug output, metrics and admin routes (the rules are applied by ``identity/access.py``).

Namespaces, by name (``NAMESPACE``): a principal's own (its name), the acting user's within a
principal (``<principal>/user``: only ever the user the request acts for), ``global``,
projects (``project:<name>``) and the activity log (``activity``). Access is ``RW`` (read,
append, write), ``APPEND`` (read and append: the activity log), ``RO`` (read) or ``none``.

Defaults (``identity/access.py``): every principal RW on its own namespace and its users'; each
provider RO on the other providers' (and, for the same user, their users'); a tenant nothing
on any other principal's; ``global`` RW for ``global_owner``, RO for the rest; projects none;
the activity log APPEND for all. ``rules`` come first, in order, the first match wins
(``principal``: a name or ``*``; ``namespace``: a name or a shell pattern, ``project:*``).

Who a key acts for (``identity/authenticator.py``): a principal's own keys (``key_sha256``) act
for the user a request names (``X-CWM-User``, else its ``user``) with ``users: any`` (the
default: the principal's app vouches for its users) and for none with ``users: none`` (naming
one is a 403); a key in ``user_keys`` (:class:`UserKey`) acts for its one user whatever the
request names (naming another is a 403). Such a key is its user's credential, not the
principal's: it writes only its user's namespace, reads at most RO elsewhere -- on the
principal's own namespace what the principal's ``user_keys_access`` says (``RO`` by default,
or ``none``) -- and holds none of the principal's grants.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Literal

from pydantic import Field, field_validator

from cwm_plugin.config_file import Strict

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
GRANTS = ("debug", "metrics", "admin", "priority")
Grant = Literal["debug", "metrics", "admin", "priority"]
NAMESPACE = re.compile(r"^(global|activity|project:[A-Za-z0-9][A-Za-z0-9_.-]{0,55}"
                       r"|[A-Za-z0-9][A-Za-z0-9_.-]{0,63}(/user)?)$")
PATTERN = re.compile(r"^[A-Za-z0-9_.:/*?\[\]-]{1,80}$")


class Access(StrEnum):
    """What a principal may do in a namespace."""

    NONE = "none"
    RO = "RO"
    APPEND = "APPEND"
    RW = "RW"

    def allows(self, op: str) -> bool:
        return op in OPS_ALLOWED[self]

    def at_most(self, cap: Access) -> Access:
        """This access, or ``cap`` where this allows more."""
        return self if len(OPS_ALLOWED[self]) <= len(OPS_ALLOWED[cap]) else cap


OPS = ("read", "append", "write")
OPS_ALLOWED: dict[Access, tuple[str, ...]] = {
    Access.NONE: (), Access.RO: ("read",), Access.APPEND: ("read", "append"),
    Access.RW: OPS,
}


def key_digests(v: list[str]) -> list[str]:
    """API keys' sha256 hex digests, normalised (ValueError for one that is not a digest)."""
    out = [h.strip().lower() for h in v]
    for h in out:
        if not SHA256_HEX.match(h):
            raise ValueError("key_sha256 entries must be 64 hex digits (sha256 of the key)")
    return out


class UserKey(Strict):
    """Keys bound to one user of their principal: a request with one acts for ``user`` (the
    same user a principal key naming it reaches: its memory, windows, activity, usage)."""

    user: str = Field(min_length=1, max_length=1024)
    key_sha256: list[str] = Field(min_length=1)

    @field_validator("key_sha256")
    @classmethod
    def _digests(cls, v: list[str]) -> list[str]:
        return key_digests(v)


class AccessRule(Strict):
    """``principal`` (a name or ``*``) has ``access`` on the namespaces ``namespace`` names
    (a name or a shell pattern)."""

    principal: str = "*"
    namespace: str
    access: Access

    @field_validator("namespace")
    @classmethod
    def _pattern(cls, v: str) -> str:
        if not PATTERN.fullmatch(v):
            raise ValueError(f"namespace pattern {v!r} may hold letters, digits, _ . : / - and "
                             "the wildcards * ? [ ]")
        return v


class AccessSettings(Strict):
    """Permissions per principal x namespace, and the grants (see the module docstring)."""

    global_owner: str | None = None  # RW on `global`; None: RO for every principal
    rules: list[AccessRule] = Field(default_factory=list)
    # principal (or "*") -> grants: debug (X-CWM-Debug), metrics (/metrics, cache stats),
    # admin (/health details, POST /v1/auto_freeze)
    grants: dict[str, list[Grant]] = Field(default_factory=dict)
    metrics_public: bool = False  # True: /metrics without a key (a Prometheus without one)
