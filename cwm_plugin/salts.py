"""Cache salts: HMAC-SHA256 under the server secret, so a session's KV is unguessable.

The sidecar derives every request's ``cache_salt`` here (who the caller is, and which of the
secret's versions apply, is :mod:`cwm_plugin.sidecar.identity.authenticator`'s business; its
docstring spells out every message and why no two collide); tools that hold the store and the
secret but no request (``cwm window --store``) derive the same salts without the sidecar.
"""

from __future__ import annotations

import hashlib
import hmac


def derive_salt(secret: bytes, tenant: str, session: str, uid: str | None = None) -> str:
    """A session's ``cache_salt``; ``uid``: its user's ``u-`` name under the same secret."""
    msg = f"{tenant}\x00{session}" if uid is None else \
        f"kv-user\x00{tenant}\x00{session}\x00{uid}"
    return hmac.new(secret, msg.encode(), hashlib.sha256).hexdigest()


def owner_salt(owner: str, session: str) -> tuple[str, str, str | None]:
    """:func:`derive_salt`'s (tenant, session, uid) for a session of a windows owner (a tenant,
    or ``tenant/u-...``: a user's, see
    :func:`~cwm_plugin.sidecar.identity.authenticator.owner_of`), for tools that have the store
    and the secret but no request (``cwm window --store``)."""
    tenant, _, uid = owner.partition("/")
    return tenant, session, uid or None


def background_salt(salt: str) -> str:
    """The salt of the sidecar's own work for a session (summaries, fact extraction): derived
    from the session's (as unguessable), never equal to it, so that work never shares the
    session's prefix cache, stored KV or context records (a window is the conversation)."""
    return hmac.new(salt.encode(), b"cwm-background", hashlib.sha256).hexdigest()
