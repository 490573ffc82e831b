"""Who is asking: API key -> principal (a tenant or a provider), the user and session it acts
for, its home namespace (``access.py``), and the session's ``cache_salt``.

* Keys are stored as sha256 hex digests and compared with :func:`hmac.compare_digest` against
  every configured digest (no early exit, so timing does not tell which tenant came close).
* The user a request acts for is resolved here and only here (:meth:`Authenticator.identify`),
  so every route -- chat, relays, memory, windows, activity, usage -- obeys one rule: a key in
  its principal's ``user_keys`` acts for its own user (a request naming another is a 403)
  and is marked ``bound`` (``access.py``: it writes only its user's data); a
  principal's own key acts for the user the request names -- the ``X-CWM-User`` header, else
  its ``user`` field (any string up to 1024 characters) -- when the principal has
  ``users: any`` (the default: its app vouches for its users), and for none with
  ``users: none`` (naming one is a 403 that says what to configure). A request acting for a
  user keeps its memory in that user's namespace (folder ``u-`` + the HMAC below), which only
  requests for the same user ever read.
* The session comes from the ``X-Session-Id`` header, else the user (below), else
  there is none: the request is *stateless* (nothing recorded, no server-side history; its
  salt is the tenant's, HMAC(secret, tenant + NUL)), unless ``prompt.sessionless: shared`` puts
  it in one session named ``"default"``. Session names are file names under the memory root:
  ``X-Session-Id`` must already be one (letters, digits, ``_ . -``; no ``..``; at most 64;
  else 400), while ``user`` is OpenAI's free-form end-user id (an e-mail address, say), so any
  non-empty ``user`` string is mapped to ``u-`` + 32 hex digits of HMAC-SHA256(server secret,
  "user" NUL tenant NUL user) (the "user" label keeps it apart from the salts; the newest
  secret version's, a name from an older one in its grace period is moved to it, see
  ``settings/secret_versions.py``): stable, safe
  as a file name, and it does not reveal the user (a plain hash of an address could be
  reversed by guessing).
* ``cache_salt`` (:func:`derive_salt`, 64 hex digits: stable for a session, unguessable
  without the secret): for a request naming a user, HMAC-SHA256(server secret, "kv-user" NUL
  tenant NUL session NUL uid), where uid is the user's ``u-`` name above, so two users of one
  tenant sending the same ``X-Session-Id`` never share KV or prefix cache; without a user (or
  for a tenant with ``users_share_kv``: a tenant-wide shared prefix, configured on purpose)
  HMAC-SHA256(server secret, tenant NUL session). No two inputs give one
  message: a session name holds no NUL, so the per-user message (three NULs) is never a
  (tenant, session) one, and the labels keep it apart from the client salts below. A tenant
  allowed to choose its salt sends ``cache_salt``; what is forwarded is HMAC-SHA256(server
  secret, "client" NUL tenant NUL salt), or "client-user" NUL tenant NUL uid NUL salt for a
  user, so two tenants (or users) choosing the same string never share KV. Every salt --
  chat, relays, windows, salt moves after a rotation -- comes from
  :meth:`Authenticator.session_salt` / :meth:`Authenticator.salt_for`, for any secret version.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass

from cwm_plugin.errors import Forbidden, InvalidInput
from cwm_plugin.salts import derive_salt, user_session
from cwm_plugin.salts import owner_of as owner_name
from cwm_plugin.sidecar.identity.access import PermissionDenied, Permissions
from cwm_plugin.sidecar.settings import ProviderConfig, TenantConfig
from cwm_plugin.sidecar.settings.access import Access, AccessSettings
from cwm_plugin.sidecar.settings.secret_versions import Locate

# The memory package stores a session as a file: the same rule as cwm_plugin.memory.files.names.
SESSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DEFAULT_SESSION = "default"
USER_HEADER = "x-cwm-user"


class Unauthorized(Forbidden):
    """No key or an unknown key (HTTP 401)."""

    code = "invalid_api_key"
    http_status = 401


@dataclass(frozen=True)
class Identity:
    """The caller of one request."""

    tenant: str  # the principal
    session: str | None  # None: a stateless request
    cache_salt: str
    allow_client_cache_salt: bool = False
    user: str | None = None  # as the client named it, or its key's (never logged)
    users_share_kv: bool = False  # the tenant's: the user is not part of the salt
    bound: bool = False  # its key is bound to its user (user_keys): access.py's Caller
    sessionless: bool = False  # it named neither session nor user (identify)
    namespace: str = ""  # the home namespace's name: <principal> or <principal>/user
    folder: str = ""  # its memory folder: the principal's name, or u-<32 hex> for a user

    def __post_init__(self) -> None:
        if not self.folder:  # no user: the principal's own namespace
            object.__setattr__(self, "namespace", self.namespace or self.tenant)
            object.__setattr__(self, "folder", self.tenant)

    def __repr__(self) -> str:  # the salt is a capability for the session's KV: keep it out
        return f"Identity(tenant={self.tenant!r}, session={self.session!r})"


def owner_of(ident: Identity) -> str:
    """Whose context windows, sessions, activity chain and usage rows a request's are: its
    tenant's, or its user's inside the tenant (:func:`cwm_plugin.salts.owner_of`)."""
    return owner_name(ident.tenant, None if ident.user is None else ident.folder)


def hash_key(api_key: str) -> str:
    """The sha256 hex digest stored in the config for ``api_key``."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def validate_session(name: str) -> str:
    if not isinstance(name, str) or not SESSION.fullmatch(name) or ".." in name:
        raise InvalidInput(
            "invalid session id",
            hint="use 1-64 letters, digits, _ . - (starting with a letter or digit, no ..)",
        )
    return name


def bearer_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = headers.get("x-api-key")
    return key.strip() if key else None


class Authenticator:
    """Maps API keys to tenants and derives salts; holds the secret, never shows it."""

    def __init__(self, tenants: list[TenantConfig], secret: bytes,
                 shared_default: bool = False, *, providers: list[ProviderConfig] | None = None,
                 access: AccessSettings | None = None, previous: list[bytes] | None = None,
                 locate: Locate | None = None) -> None:
        """``secret``: the newest version; ``previous``: older ones still in their grace
        period, whose user names ``locate`` moves to the newest's
        (``settings/secret_versions.py``)."""
        providers = providers or []
        keys = [(h, t, user) for t in [*tenants, *providers] for h, user in t.digests()]
        self._entries = [(h.encode(), t) for h, t, _ in keys]
        self._key_user = {h: user for h, _, user in keys if user is not None}
        self._secret = secret
        self._previous = list(previous or [])
        self._locate = locate
        self._shared_default = shared_default
        self.perms = Permissions(access or AccessSettings(), [t.name for t in tenants],
                                 [p.name for p in providers], self.user_folder,
                                 {t.name: Access(t.user_keys_access)
                                  for t in [*tenants, *providers]})

    def __repr__(self) -> str:
        return f"Authenticator({len(self._entries)} keys)"

    def tenant_for(self, api_key: str | None) -> TenantConfig:
        if not api_key:
            raise Unauthorized("missing API key",
                               hint="send `Authorization: Bearer <key>`")
        digest = hash_key(api_key).encode()
        found: TenantConfig | None = None
        for stored, tenant in self._entries:  # compare with all, keep going after a match
            if hmac.compare_digest(stored, digest) and found is None:
                found = tenant
        if found is None:
            raise Unauthorized("invalid API key")
        return found

    def identify(self, tenant: TenantConfig, headers: Mapping[str, str],
                 body: Mapping[str, object] | None) -> Identity:
        """The identity of an authenticated request (``tenant`` from :meth:`tenant_for`)."""
        session = headers.get("x-session-id")
        user = headers.get(USER_HEADER)
        if user is None and body is not None and body.get("user") is not None:
            user = body["user"]
        if user is not None and (not isinstance(user, str) or not user or len(user) > 1024):
            raise InvalidInput("`user` must be a non-empty string of at most 1024 characters")
        bound = self.key_user(headers)
        user = self._acting_for(tenant, bound, user)
        sessionless = not session and user is None
        if not session and user is not None:
            session = self.user_folder(tenant.name, user)
        if not session and self._shared_default:
            session = DEFAULT_SESSION
        if session:
            session = validate_session(session)
        home = self.perms.home(tenant.name, user)
        ident = Identity(tenant=tenant.name, session=session or None, cache_salt="",
                         allow_client_cache_salt=tenant.allow_client_cache_salt, user=user,
                         users_share_kv=tenant.users_share_kv, sessionless=sessionless,
                         bound=bound is not None,
                         namespace=home.name, folder=home.folder or tenant.name)
        object.__setattr__(ident, "cache_salt", self.session_salt(ident, session or ""))
        return ident

    def key_user(self, headers: Mapping[str, str]) -> str | None:
        """The user the request's key is bound to (``user_keys``), None for a principal's."""
        key = bearer_key(headers)
        return self._key_user.get(hash_key(key)) if key else None

    def bound(self, headers: Mapping[str, str]) -> bool:
        """Whether the request's key is bound to a user (holds none of its principal's
        grants, ``access.py``)."""
        return self.key_user(headers) is not None

    def _acting_for(self, tenant: TenantConfig, bound: str | None,
                    named: str | None) -> str | None:
        """The user the request acts for: its key's own (``bound``: a user key's), else the
        one it names where ``tenant`` lets its keys act for users (see the module
        docstring)."""
        if bound is not None:
            if named is not None and named != bound:
                raise PermissionDenied(
                    f"this key of principal `{tenant.name}` acts for its own user only, and "
                    "the request names another",
                    hint="leave X-CWM-User and `user` out (or name the key's own user), or use "
                         "a key of the principal that may act for users")
            return bound
        if named is not None and tenant.users == "none":
            raise PermissionDenied(
                f"the keys of principal `{tenant.name}` act for no user (users: none), and "
                "the request names one (X-CWM-User or `user`)",
                hint=f"leave the user out; or give the user a key of its own under "
                     f"user_keys of `{tenant.name}`, or set `users: any` on `{tenant.name}` "
                     "in the sidecar config (its app vouches for every user it names)")
        return named

    def _uid(self, identity: Identity, secret: bytes) -> str | None:
        """The user's part of the caller's salts under ``secret`` (None: not per user)."""
        if identity.user is None or identity.users_share_kv:
            return None
        return self.user_session(identity.tenant, identity.user, secret)

    def session_salt(self, identity: Identity, session: str, secret: bytes | None = None) -> str:
        """The salt of ``session`` for this caller (the windows routes name sessions in their
        bodies: what that session's own chat requests are salted with), with the newest secret
        unless another version is given: the one derivation of every session salt."""
        secret = secret or self._secret
        return derive_salt(secret, identity.tenant, session, self._uid(identity, secret))

    def user_session(self, tenant: str, user: str, secret: bytes | None = None) -> str:
        """The session name for an OpenAI ``user`` value (see the module docstring), with the
        newest secret unless another version is given."""
        return user_session(secret or self._secret, tenant, user)

    def user_folder(self, tenant: str, user: str) -> str:
        """The user's namespace folder and default session: the newest secret's name, where
        the memory named with an older version in its grace period is moved first."""
        newest = self.user_session(tenant, user)
        if not self._previous or self._locate is None:
            return newest
        return self._locate([newest, *(self.user_session(tenant, user, s)
                                       for s in self._previous)])

    def salt_for(self, identity: Identity, body: Mapping[str, object]) -> str:
        """The salt to forward: ours, or the client's, HMAC'd with the tenant, where the tenant
        may set it (else 403)."""
        if "cache_salt" not in body:
            return identity.cache_salt
        if not identity.allow_client_cache_salt:
            raise Forbidden("this tenant may not set cache_salt",
                            hint="leave cache_salt out; the sidecar derives one per session")
        salt = body["cache_salt"]
        if not isinstance(salt, str) or not salt or len(salt) > 256:
            raise InvalidInput("cache_salt must be a non-empty string of at most 256 characters")
        return self.client_salt(identity.tenant, salt, uid=self._uid(identity, self._secret))

    def client_salt(self, tenant: str, salt: str, secret: bytes | None = None,
                    uid: str | None = None) -> str:
        """The salt forwarded for a client's own ``cache_salt`` (namespaced by the tenant and,
        with ``uid``, the user), with the newest secret unless another version is given."""
        msg = f"client\x00{tenant}\x00{salt}" if uid is None else \
            f"client-user\x00{tenant}\x00{uid}\x00{salt}"
        return hmac.new(secret or self._secret, msg.encode(), hashlib.sha256).hexdigest()

    def salts_under(self, secret: bytes, identity: Identity,
                    body: Mapping[str, object]) -> list[str]:
        """The salts this request's KV may have been stored under with another version of the
        secret (call after :meth:`salt_for`, which checks a client's ``cache_salt``), most
        likely first: the one this derivation gives under that version (a session named after
        the user had that version's name too); for the user's own session, also the salt
        without the user (HMAC(secret, tenant NUL session), which a user's own session may
        still be stored under: its name belongs to the user alone; a session named by
        ``X-Session-Id`` is not moved from it, since other users may have shared it)."""
        if "cache_salt" in body:
            return [self.client_salt(identity.tenant, str(body["cache_salt"]), secret,
                                     self._uid(identity, secret))]
        session = identity.session or ""
        own = identity.user is not None and \
            session == self.user_session(identity.tenant, identity.user)
        if own:
            session = self.user_session(identity.tenant, str(identity.user), secret)
        out = [self.session_salt(identity, session, secret)]
        if own and not identity.users_share_kv:
            out.append(derive_salt(secret, identity.tenant, session))
        return out
