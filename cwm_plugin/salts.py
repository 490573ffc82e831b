"""Cache salts: HMAC-SHA256 under the server secret, so a session's KV is unguessable; and
owners: whose windows, sessions, activity chain and usage rows a thing is.

The sidecar derives every request's ``cache_salt`` here (who the caller is, and which of the
secret's versions apply, is :mod:`cwm_plugin.sidecar.identity.authenticator`'s business; its
docstring spells out every message and why no two collide); tools that hold the store and the
secret but no request (``cwm window --store``) derive the same salts without the sidecar.

An *owner* is a tenant (its name) or one of its users (``tenant/u-...``: the tenant, a slash,
the user's folder from :func:`user_session`). :func:`owner_of`, :func:`tenant_of` and
:func:`user_of` are the one place that rule is written.
"""

from __future__ import annotations

import hashlib
import hmac


def derive_salt(secret: bytes, tenant: str, session: str, uid: str | None = None) -> str:
    """A session's ``cache_salt``; ``uid``: its user's ``u-`` name under the same secret."""
    msg = f"{tenant}\x00{session}" if uid is None else \
        f"kv-user\x00{tenant}\x00{session}\x00{uid}"
    return hmac.new(secret, msg.encode(), hashlib.sha256).hexdigest()


def owner_of(tenant: str, user_folder: str | None = None) -> str:
    """The owner of a tenant's own things (``user_folder`` None), or of one of its users'."""
    return tenant if user_folder is None else f"{tenant}/{user_folder}"


def tenant_of(owner: str) -> str:
    """The tenant of an owner: the owner itself, or ``tenant`` of ``tenant/u-...``."""
    return owner.partition("/")[0]


def user_of(owner: str) -> str | None:
    """The user folder of an owner (``u-...``), None for a tenant's own."""
    return owner.partition("/")[2] or None


def owner_salt(owner: str, session: str) -> tuple[str, str, str | None]:
    """:func:`derive_salt`'s (tenant, session, uid) for a session of an owner, for tools that
    have the store and the secret but no request (``cwm window --store``)."""
    return tenant_of(owner), session, user_of(owner)


def user_session(secret: bytes, tenant: str, user: str) -> str:
    """The session name (and namespace folder) of a tenant's user as an OpenAI ``user`` value
    names it: ``u-`` + HMAC, so no user id is ever a file name."""
    mac = hmac.new(secret, f"user\x00{tenant}\x00{user}".encode(), hashlib.sha256)
    return "u-" + mac.hexdigest()[:32]


def route_key(salt: str) -> str:
    """What a session's requests tell a balancer in front of several vLLMs (the routing
    settings' ``session_header``) so that its turns stay on one of them: derived from its salt
    (as unguessable, one per session), never equal to it, so the header reveals neither the
    salt (a capability for the session's KV) nor the client's session name."""
    return hmac.new(salt.encode(), b"cwm-route", hashlib.sha256).hexdigest()[:32]


def background_salt(salt: str) -> str:
    """The salt of the sidecar's own work for a session (summaries, fact extraction): derived
    from the session's (as unguessable), never equal to it, so that work never shares the
    session's prefix cache, stored KV or context records (a window is the conversation)."""
    return hmac.new(salt.encode(), b"cwm-background", hashlib.sha256).hexdigest()
