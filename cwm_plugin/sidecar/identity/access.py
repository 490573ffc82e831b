"""Principals, namespaces and the permission matrix; every memory, window and admin route and
retrieval itself ask :class:`Permissions` (the settings: ``settings/access.py``).

A *principal* is who holds the API key: a tenant (``tenants:``) or a provider (``providers:``,
an agent sharing the deployment's memory with the others). A *namespace* is where memory lives
(:class:`MemoryNamespace`): the principal's own (its folder under the memory root), the
user's within it (``<principal>/user``: the folder ``u-<HMAC(secret, principal, user)>``, so
only requests for that user ever reach it), ``global`` (folder ``global``), a project
(``project:<name>``, folder ``project.<name>``) or the activity log (``activity``). A request
acts as one principal for at most one user: its memory is written to the user's namespace when
it names a user, else to the principal's, and a selection reads that one plus every other
namespace the principal may read (:meth:`Permissions.shared`: their durable memories).

Every decision is about a *caller* (:class:`Caller`: the request's identity): its principal,
the user it acts for, and whether its key is one of the principal's ``user_keys``, *bound* to
that user. A bound key is a credential of one user, not of its principal: it writes only its
user's namespace (and appends to the activity log, under its user's chain); everywhere else it
has at most RO, and on its principal's own namespace -- whose memory every other user's
selection reads -- what the principal's ``user_keys_access`` says (``RO``, the default: the
principal's facts still serve its users; ``none``). It holds none of the principal's grants.

A refusal is a :class:`PermissionDenied` (HTTP 403, ``permission_denied``) that names the rule:
"principal `claude` has RO on namespace `llama` (default: a provider reads the other
providers' namespaces): writes need RW". A name that is no namespace here and one the principal
has no access to at all answer alike (:meth:`Permissions.open`: 404 ``namespace_not_found``,
the same message), so an answer never tells which principals exist.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Protocol

from cwm_plugin.errors import Forbidden, InvalidInput, NotFound
from cwm_plugin.sidecar.settings.access import NAMESPACE, Access, AccessSettings

ACTIVITY, GLOBAL, PROJECT, USER = "activity", "global", "project:", "/user"
NEEDS = {"read": "RO, APPEND or RW", "append": "APPEND or RW", "write": "RW"}
UserFolder = Callable[[str, str], str]  # (principal, user) -> the user's memory folder


class Caller(Protocol):
    """Who asks (the request's identity, ``authenticator.Identity``)."""

    @property
    def tenant(self) -> str: ...  # the principal

    @property
    def user(self) -> str | None: ...  # the user it acts for

    @property
    def bound(self) -> bool: ...  # its key is bound to that user (user_keys)


class PermissionDenied(Forbidden):
    """The matrix refuses an operation, or a grant is missing (HTTP 403)."""

    code = "permission_denied"


class NamespaceNotFound(NotFound):
    """No such namespace, or none the principal may use (HTTP 404, alike on purpose)."""

    code = "namespace_not_found"


@dataclass(frozen=True)
class MemoryNamespace:
    """A namespace: its ``name`` (as rules and errors say it), what kind it is, the principal
    owning it (a principal's or a user's) and its memory folder (None: the activity log)."""

    name: str
    kind: str  # principal | user | global | project | activity
    owner: str | None = None
    folder: str | None = None


@dataclass(frozen=True)
class AccessDecision:
    """What the matrix grants a principal on a namespace, and the rule that decided it."""

    access: Access
    rule: str  # what decided: "access.rules[0]" or "default: ..."


class Permissions:
    """The permission matrix of one deployment (see the module docstring)."""

    def __init__(self, settings: AccessSettings, tenants: list[str], providers: list[str],
                 user_folder: UserFolder, user_keys_access: Mapping[str, Access] | None = None,
                 ) -> None:
        """``user_keys_access``: principal -> what its bound keys may do in its own namespace
        (absent: RO)."""
        self.settings = settings
        self.providers = set(providers)
        self.principals = [*tenants, *providers]
        self._user_folder = user_folder
        self._user_keys_access = dict(user_keys_access or {})

    # --- namespaces ---------------------------------------------------------------------------

    def _named(self, name: str) -> MemoryNamespace | None:
        """The namespace ``name`` stands for (a user's without its folder), None when it
        names no principal here; 400 when it is no namespace name at all."""
        if not isinstance(name, str) or not NAMESPACE.fullmatch(name):
            raise InvalidInput(f"invalid namespace {str(name)[:80]!r}",
                               hint="<principal>, <principal>/user, global, project:<name> "
                                    "or activity")
        if name == ACTIVITY:
            return MemoryNamespace(ACTIVITY, "activity")
        if name == GLOBAL:
            return MemoryNamespace(GLOBAL, "global", folder=GLOBAL)
        if name.startswith(PROJECT):
            return MemoryNamespace(name, "project", folder="project." + name[len(PROJECT):])
        owner = name.removesuffix(USER)
        if owner not in self.principals:
            return None
        if owner == name:
            return MemoryNamespace(name, "principal", owner, owner)
        return MemoryNamespace(name, "user", owner)

    def namespace(self, name: str, user: str | None = None) -> MemoryNamespace:
        """The namespace called ``name`` for a request acting for ``user`` (400 if unknown)."""
        ns = self._named(name)
        if ns is None:
            raise InvalidInput(f"no namespace {name!r}")
        if ns.kind != "user":
            return ns
        if user is None:
            raise InvalidInput(f"namespace {name!r} is a user's: the request names no user",
                               hint="send the OpenAI `user` field or an X-CWM-User header")
        return replace(ns, folder=self._user_folder(str(ns.owner), user))

    def open(self, who: Caller, name: str, op: str) -> MemoryNamespace:
        """The namespace ``name`` for ``who``, ``op`` allowed there: 404 alike for no such
        namespace and one it has no access to at all, 403 naming the rule for one it may use
        but not for ``op``."""
        ns = self._named(name)
        if ns is None or self.decide(who, ns).access is Access.NONE:
            raise NamespaceNotFound(f"no namespace `{name}` is open to principal "
                                    f"`{who.tenant}`",
                                    hint="GET /v1/memory/namespaces lists yours; the operator "
                                         "grants more under access.rules")
        ns = self.namespace(name, who.user)
        self.require(who, ns, op)
        return ns

    def readable_principals(self, who: Caller) -> list[str]:
        """The principals whose own namespace ``who`` may read."""
        return [p for p in self.principals if self.allows(who, self.namespace(p), "read")]

    def home(self, principal: str, user: str | None) -> MemoryNamespace:
        """Where a request's memory is written: its user's namespace, else its principal's."""
        return self.namespace(principal + USER if user is not None else principal, user)

    # --- the matrix ----------------------------------------------------------------------------

    def decide(self, who: Caller, ns: MemoryNamespace) -> AccessDecision:
        """The first rule matching (principal, namespace), else the default; for a bound key,
        no more than a key of one user may (see the module docstring)."""
        d = self._ruled(who.tenant, ns)
        if not who.bound or ns.kind == "activity" or \
                (ns.kind == "user" and ns.owner == who.tenant):
            return d
        if ns.kind == "principal" and ns.owner == who.tenant:
            cap = self._user_keys_access.get(who.tenant, Access.RO)
            why = f"a user key: {cap.value} at most on its principal's own namespace " \
                  f"(user_keys_access of `{who.tenant}`)"
        else:
            cap, why = Access.RO, "a user key: RO at most outside its user's namespace"
        access = d.access.at_most(cap)
        return d if access is d.access else AccessDecision(access, f"{d.rule}; {why}")

    def _ruled(self, principal: str, ns: MemoryNamespace) -> AccessDecision:
        for i, r in enumerate(self.settings.rules):
            if r.principal in ("*", principal) and fnmatchcase(ns.name, r.namespace):
                return AccessDecision(r.access, f"access.rules[{i}]: {r.principal} "
                                                f"{r.access.value} on {r.namespace}")
        return self._default(principal, ns)

    def _default(self, principal: str, ns: MemoryNamespace) -> AccessDecision:
        if ns.kind == "activity":
            return AccessDecision(Access.APPEND, "default: the activity log is APPEND for all")
        if ns.kind == "global":
            if principal == self.settings.global_owner:
                return AccessDecision(Access.RW, "default: `global` is RW for its owner")
            return AccessDecision(Access.RO, "default: `global` is RO but for access.global_owner")
        if ns.kind == "project":
            return AccessDecision(Access.NONE, "default: a project is open only through "
                                               "access.rules")
        if ns.owner == principal:
            return AccessDecision(Access.RW, "default: a principal's own namespace")
        if principal in self.providers and ns.owner in self.providers:
            return AccessDecision(Access.RO, "default: a provider reads the other "
                                             "providers' namespaces")
        return AccessDecision(Access.NONE, "default: a tenant's namespace is its own")

    def allows(self, who: Caller, ns: MemoryNamespace, op: str) -> bool:
        return self.decide(who, ns).access.allows(op)

    def require(self, who: Caller, ns: MemoryNamespace, op: str) -> AccessDecision:
        """The decision, or :class:`PermissionDenied` naming the rule that refused."""
        d = self.decide(who, ns)
        if not d.access.allows(op):
            holder = f"a user key of principal `{who.tenant}`" if who.bound else \
                f"principal `{who.tenant}`"
            hint = "use a key of the principal (key_sha256) for the principal's own memory" \
                if who.bound else "ask the operator for a rule under access.rules in the " \
                                  "sidecar config"
            raise PermissionDenied(f"{holder} has {d.access.value} on namespace `{ns.name}` "
                                   f"({d.rule}): {op}s need {NEEDS[op]}", hint=hint)
        return d

    def shared(self, who: Caller, project: str | None = None) -> list[MemoryNamespace]:
        """The namespaces besides the request's home (:meth:`home`) a selection reads: every
        principal's and (for the same user) every user's namespace ``who`` may read,
        ``global``, and the request's project when it may read it."""
        home = self.home(who.tenant, who.user)
        names = [GLOBAL, *self.principals]
        if who.user is not None:
            names += [p + USER for p in self.principals]
        if project is not None and NAMESPACE.fullmatch(PROJECT + project):
            names.append(PROJECT + project)
        out = []
        for name in names:
            ns = self.namespace(name, who.user)
            if ns.name != home.name and self.allows(who, ns, "read"):
                out.append(ns)
        return out

    # --- grants ------------------------------------------------------------------------------

    def granted(self, principal: str | None, grant: str, *, bound: bool) -> bool:
        """Whether a key of ``principal`` holds ``grant`` (``bound``: a user key, never)."""
        g = self.settings.grants
        return principal is not None and not bound and (grant in g.get(principal, ()) or
                                                        grant in g.get("*", ()))

    def require_grant(self, principal: str, grant: str, what: str, *, bound: bool) -> None:
        if bound:
            raise PermissionDenied(f"a user key of principal `{principal}` holds none of the "
                                   f"principal's grants, and {what} needs `{grant}`",
                                   hint="use a key of the principal (key_sha256)")
        if not self.granted(principal, grant, bound=bound):
            raise PermissionDenied(f"principal `{principal}` lacks the `{grant}` grant, "
                                   f"which {what} needs",
                                   hint=f"add {grant} under access.grants.{principal} in the "
                                        "sidecar config")
