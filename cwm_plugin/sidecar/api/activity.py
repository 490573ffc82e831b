"""The activity log on the sidecar: ``POST /v1/activity`` appends, ``GET /v1/activity`` reads.

``POST /v1/activity`` ``{"what", "output"?, "session"?, "project"?, "model"?,
"used_tokens"?, "limit_tokens"?}`` appends one entry (201) whose principal is the caller's
(the authenticated tenant, or ``tenant/u-...`` for a request acting for a user: never a field
of the body; a provider's model and context limit are
the defaults of ``model`` and ``limit_tokens``); the session is the body's or
``X-Session-Id``, the project the body's or ``X-CWM-Project``; the context use, when the body
gives none, is the session's last turn through this sidecar. ``GET /v1/activity?view=quick``
(the last ``hours`` (24) hours, at most ``limit`` (10) entries) or ``view=full`` (every entry,
oldest first, ``offset`` / ``limit`` (100) to page) answers entries, ``heads`` (the last hash
of each chain it reads: a principal's entries, a tenant's and each of its users' apart, chain
only among themselves, so no ``prev``, ``hash`` or head tells of another principal's entries)
and ``head`` (the caller's own chain's). It reads
the caller's own entries and, with ``activity.read: shared`` (the default), those of the principals
whose namespace it may read (``identity/access.py``: providers each other's; a tenant only its own
unless a rule grants more); ``own``: its own only; ``all``: every entry. A request acting for
a user sees its principal's own entries and that user's, never another user's; one acting for
no user sees its principal's and all its users' (the key's holder). A read looks only at the
chains it may read (``activity/log.py``). A user's entry past its tenant's
``activity.max_user_chains`` users with a chain is refused: 507 ``activity_users_full``.
No route rewrites or deletes an entry: ``PUT``, ``PATCH`` and ``DELETE`` on ``/v1/activity``
(and below it) answer 405. With ``activity.log_turns`` each chat turn is appended too
(:func:`log_turn`, in the background; a failure is counted and logged, never the turn's).
The log is file I/O under a lock: it runs on a worker thread.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from cwm_plugin.activity.log import GENESIS, MAX_NAME, MAX_TEXT, ActivityLog, Entry, Who
from cwm_plugin.errors import CWMError, InvalidInput
from cwm_plugin.salts import tenant_of
from cwm_plugin.sidecar.api.schema import body_doc
from cwm_plugin.sidecar.http.errors import error_response
from cwm_plugin.sidecar.identity.authenticator import Identity, owner_of, validate_session
from cwm_plugin.sidecar.identity.caller import identity_of, model_body, principal_of
from cwm_plugin.sidecar.identity.tenant_bounds import TenantBound, TenantPool
from cwm_plugin.sidecar.settings import Settings

log = logging.getLogger(__name__)
THREADS = 1  # a principal's activity log calls at once ...
WAITING = 64  # ... and waiting for one of those
PROJECT_HEADER = "x-cwm-project"
PROJECT = re.compile(r"^[^\x00-\x1f\x7f]{1,128}$")


class ActivityUnavailable(CWMError):
    code = "activity_unavailable"
    http_status = 503


class ActivityBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    what: str = Field(min_length=1, max_length=MAX_TEXT)
    output: str = Field(default="", max_length=MAX_TEXT)
    session: str | None = Field(default=None, max_length=64)
    project: str | None = Field(default=None, max_length=128)
    model: str | None = Field(default=None, max_length=MAX_NAME)
    used_tokens: int | None = Field(default=None, ge=0)
    limit_tokens: int | None = Field(default=None, ge=1)


def open_activity(settings: Settings) -> Any:
    """The deployment's log (files, or PostgreSQL shared by replicas), or None when not
    configured or its folder cannot be made."""
    if settings.activity is None:
        return None
    a = settings.activity
    if a.backend == "postgres" and a.postgres_url is not None:
        from cwm_plugin.activity.postgres import PostgresActivityLog

        return PostgresActivityLog(a.postgres_url.get_secret_value(),
                                   max_user_chains=a.max_user_chains,
                                   pool_size=a.postgres_pool_size)
    try:
        return ActivityLog(a.root, max_user_chains=a.max_user_chains)
    except OSError as exc:
        log.error("the activity log is off: cannot use %s: %s", settings.activity.root,
                  exc.strerror)
        return None


def project_of(value: str | None) -> str | None:
    if value is None or not value.strip():
        return None
    value = value.strip()
    if not PROJECT.fullmatch(value):
        raise InvalidInput("invalid project", hint="1-128 characters, no control characters")
    return value


def preview(text: str, chars: int) -> str:
    return " ".join(text.split())[:chars] if chars else ""


def turn_entry(settings: Settings, *, principal: str, session: str | None,
               project: str | None, model: str, question: str, answer: str,
               used: int | None, limit: int | None) -> Entry:
    """The entry for one chat turn: who, where, a one-line what and output, context use."""
    chars = settings.activity.turn_preview_chars if settings.activity else 0
    asked = preview(question, chars)
    return Entry(principal=principal, session=session, project=project, model=model,
                 what=f"chat: {asked}" if asked else "chat turn",
                 output=preview(answer, chars), used_tokens=used, limit_tokens=limit)


def activity_threads(principals: int, counter: Any) -> TenantPool:
    """The threads the log's file work runs on: ``THREADS`` of a principal's at once and
    ``WAITING`` more waiting (past it: 429, or a turn's entry counted as failed), so one
    principal's reads and appends never hold up another's (nor anything else's threads)."""
    return TenantPool("cwm-activity", TenantBound("activity", "activity log calls", THREADS,
                                                  WAITING, counter), principals)


async def log_turn(sc: Any, entry: Entry) -> None:
    """Append a turn's entry (in the background); a failure is counted, never raised."""
    try:
        await sc.activity_pool.run(tenant_of(entry.principal),
                                   lambda: sc.activity.append(entry))
    except Exception as exc:
        sc.failopen.failed(tenant_of(entry.principal), "activity", exc)


def activity_router(sidecar: Any, activity: ActivityLog | None) -> APIRouter:
    """The routes over ``activity`` (None: 503), authenticated like every other."""
    router = APIRouter(prefix="/v1")
    settings: Settings = sidecar.settings

    perms = sidecar.auth.perms

    def caller(request: Request, op: str) -> Identity:
        """The caller, its principal allowed ``op`` on the ``activity`` namespace."""
        ident = identity_of(request)
        perms.require(ident, perms.namespace("activity"), op)
        return ident

    def readable(ident: Identity) -> Who:
        """Whose entries the caller reads (None: everyone's; see the module docstring): its
        tenant's chain and its own user's (for no user: every user's of its tenant), and the
        chains of the principals it shares (not their users')."""
        read = settings.activity.read if settings.activity else "shared"
        if read == "all":
            return None
        readable = set(perms.readable_principals(ident))
        if read == "own":
            readable &= {ident.tenant}
        if ident.tenant not in readable:    # a user key kept from its principal's chain
            return owner_of(ident)
        return {ident.tenant: None if ident.user is None else frozenset({ident.folder}),
                **{other: frozenset() for other in readable - {ident.tenant}}}

    def need() -> ActivityLog:
        if activity is None:
            raise ActivityUnavailable("the activity log is not configured on this sidecar",
                                      hint="add an `activity: {root: DIR}` section to the "
                                           "sidecar config")
        return activity

    @router.post("/activity", status_code=201, openapi_extra=body_doc(ActivityBody))
    async def append(request: Request) -> dict[str, Any]:
        ident = caller(request, "append")
        who = principal_of(request)
        body = await model_body(request, ActivityBody)
        tenant, act = owner_of(ident), need()
        session = body.session or request.headers.get("x-session-id") or None
        if session is not None:
            session = validate_session(session)
        used, limit = body.used_tokens, body.limit_tokens
        if used is None and limit is None and session is not None:
            state = sidecar.tracker.peek(owner_of(ident), session)
            if state is not None and state.last_prompt_tokens:
                used, limit = state.last_prompt_tokens, state.last_limit
        if used is not None and limit is None:  # a provider's own context limit
            limit = getattr(who, "context_limit", None)
        entry = Entry(principal=tenant, what=body.what, output=body.output, session=session,
                      project=project_of(body.project or request.headers.get(PROJECT_HEADER)),
                      model=body.model or getattr(who, "model", None), used_tokens=used,
                      limit_tokens=limit)
        done = await sidecar.activity_pool.run(ident.tenant, lambda: act.append(entry))
        return {"object": "activity.entry", **done.public()}

    @router.get("/activity")
    async def read(request: Request, view: str = "quick", hours: float = 24.0,
                   limit: int | None = None, offset: int = 0) -> dict[str, Any]:
        act = need()
        ident = caller(request, "read")
        own = readable(ident)
        if view not in ("quick", "full") or offset < 0 or hours <= 0 \
                or not 0 < (limit or 1) <= 1000:
            raise InvalidInput("bad activity parameters",
                               hint="view quick|full, hours > 0, 1 <= limit <= 1000, "
                                    "offset >= 0")
        def look() -> tuple[list[Entry], int, dict[str, str]]:
            if view == "quick":
                found = act.quick(hours=hours, limit=limit or 10, principal=own)
                return found, len(found), act.heads(own)
            found, total = act.page(offset=offset, limit=limit or 100, principal=own)
            return found, total, act.heads(own)

        entries, total, heads = await sidecar.activity_pool.run(ident.tenant, look)
        return {"object": "list", "view": view, "data": [e.public() for e in entries],
                "total": total, "offset": offset if view == "full" else 0,
                "head": heads.get(owner_of(ident), GENESIS), "heads": heads}

    async def refuse(request: Request) -> JSONResponse:
        return error_response(405, "the activity log is append-only: entries cannot be "
                                   "changed or deleted", "append_only",
                              headers={"Allow": "GET, POST"})

    for path in ("/activity", "/activity/{rest:path}"):
        router.add_api_route(path, refuse, methods=["PUT", "PATCH", "DELETE"])
    return router
