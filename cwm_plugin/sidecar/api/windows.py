"""REST for context windows on the sidecar: routes only translate HTTP to the window engine.

``POST /v1/windows`` ``{"name", "session", "turn"?, "tags"?, "description"?, "messages"?,
"ttl_s"?, "prompt_prefix"?}`` freezes the session's latest client turn (or ``turn``: one of
its last ``windows.keep_turns``), ``POST /v1/windows/{name}/thaw`` ``{"session", "warm"?,
"model"?}`` thaws (``warm``: one ``max_tokens=1`` request through vLLM right away, returning
the tokens vLLM restored), ``POST /v1/windows/{name}/clone`` ``{"name", "tags"?,
"description"?}`` clones, ``GET /v1/windows`` lists (``tag`` (repeatable: all of them),
``model``, ``session``, ``q``, ``sort``, ``order``, ``limit``, ``offset``),
``GET /v1/windows/{name}`` shows the status, ``PATCH /v1/windows/{name}`` ``{"name"?,
"tags"?, "description"?}`` renames or re-tags, ``DELETE /v1/windows/{name}`` deletes;
export and import: :mod:`.window_files`. Beside them, for agents (the MCP tools):
``GET /v1/sessions``, ``DELETE /v1/sessions/{session}/kv`` (erase a session's stored KV),
``GET /v1/cache/stats``, ``GET|POST /v1/auto_freeze`` and ``POST /v1/auto_freeze/check``.

Every route authenticates the key before it reads a body (the app's dependency, ``caller.py``),
reads at most the route's limit (413) and asks the caller's permissions (``identity/access.py``):
reads need read access to its home namespace, changes write access; ``/v1/cache/stats`` needs the
``metrics`` grant and ``POST /v1/auto_freeze`` the ``admin`` grant. Windows belong to the caller's
home namespace: a tenant's, or a user's inside it (``X-CWM-User``), and no other namespace sees them
(a user's count toward the tenant's quota; after a secret rotation a user's windows move to its
newest name before the route runs: ``salt_move.py``). Sessions map to their ``cache_salt`` as in
chat requests, so a thaw into session S restores S's next request. Errors are OpenAI-shaped (the
app's handler). The engine is blocking (store I/O): it runs on the sidecar's window threads, within
the caller's tenant's share of them (``windows.tenant_threads`` at once, ``windows.tenant_waiting``
more waiting, past that 429 at once: ``identity/tenant_bounds.py``). A freeze waits only for the
session's turns this sidecar saw arrive whose records may still be on their way
(:mod:`~cwm_plugin.sidecar.turn.arrivals`); a turn that is not kept, or a session with nothing
stored, is refused at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from cwm_plugin.errors import CWMError, InvalidInput, UpstreamError
from cwm_plugin.sidecar.api.schema import body_doc
from cwm_plugin.sidecar.api.window_files import windows_files_router
from cwm_plugin.sidecar.api.window_warm import warm_up
from cwm_plugin.sidecar.identity.authenticator import Identity, owner_of, validate_session
from cwm_plugin.sidecar.identity.caller import identity_of, model_body, principal_of
from cwm_plugin.sidecar.turn.arrivals import Arrivals
from cwm_plugin.windows.auto import AutoFreeze
from cwm_plugin.windows.engine import WindowEngine
from cwm_plugin.windows.model import check_window_name

log = logging.getLogger(__name__)


class WindowsUnavailable(CWMError):
    code = "windows_unavailable"
    http_status = 503


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FreezeBody(_Body):
    name: str = Field(max_length=128)
    session: str = Field(max_length=64)
    turn: int | None = Field(default=None, ge=1)
    tags: list[str] = Field(default_factory=list, max_length=32)
    description: str = Field(default="", max_length=4096)
    messages: list[dict[str, Any]] | None = Field(default=None, max_length=10_000)
    ttl_s: float | None = Field(default=None, gt=0)
    prompt_prefix: str = Field(default="", max_length=4096)


class ThawBody(_Body):
    session: str = Field(max_length=64)
    warm: bool = False
    model: str | None = Field(default=None, max_length=256)


class CloneBody(_Body):
    name: str = Field(max_length=128)
    tags: list[str] | None = Field(default=None, max_length=32)
    description: str | None = Field(default=None, max_length=4096)


class PatchBody(_Body):
    name: str | None = Field(default=None, max_length=128)
    tags: list[str] | None = Field(default=None, max_length=32)
    description: str | None = Field(default=None, max_length=4096)


class AutoFreezeBody(_Body):
    enabled: bool | None = None
    warn: float | None = None
    checkpoint: float | None = None
    cooldown_s: float | None = None
    model: str | None = Field(default=None, max_length=256)


class CheckBody(_Body):
    session: str = Field(max_length=64)
    used_tokens: int | None = Field(default=None, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)
    model: str | None = Field(default=None, max_length=256)


@dataclass
class CheckpointThresholds:
    """The sidecar's per-model thresholds (``checkpoint`` settings) as auto-freeze reads and
    changes them: one source of truth for the context warning and the freeze."""

    cfg: Any   # settings.CheckpointConfig

    def get(self, model: str | None) -> tuple[float, float]:
        th = self.cfg.for_model(model) if model else self.cfg.default
        return th.warn, th.checkpoint

    def set(self, model: str | None, warn: float, checkpoint: float) -> None:
        base = self.cfg.for_model(model) if model else self.cfg.default
        new = base.model_copy(update={"warn": warn, "checkpoint": checkpoint})
        if model:
            self.cfg.models[model] = new
        else:
            self.cfg.default = new


TagQuery = Annotated[list[str] | None, Query()]


def session_of(name: str) -> str:
    try:
        return validate_session(name)
    except InvalidInput as exc:
        raise InvalidInput(f"invalid session {name[:64]!r}", hint=exc.hint) from exc


def windows_router(sidecar: Any, engine: WindowEngine | None,
                   auto: AutoFreeze | None) -> APIRouter:
    """The routes over ``sidecar`` (its auth, upstream and context tracker); ``engine`` None:
    windows are not configured (503)."""
    async def follow_rotation(request: Request) -> None:
        """After a secret rotation, the caller's windows first move to its newest name."""
        if sidecar.salt_mover is not None:
            await sidecar.salt_mover.move_windows(identity_of(request))

    router = APIRouter(prefix="/v1", dependencies=[Depends(follow_rotation)])
    auth = sidecar.auth
    settings = sidecar.settings
    pool = sidecar.window_pool

    def caller(request: Request, op: str = "read") -> Identity:
        """The caller, allowed ``op`` on its home namespace (windows are its KV)."""
        ident = identity_of(request)
        auth.perms.require(ident, auth.perms.namespace(ident.namespace, ident.user), op)
        return ident

    def granted(request: Request, grant: str, what: str) -> str:
        tenant = principal_of(request).name
        auth.perms.require_grant(tenant, grant, what,
                                 bound=auth.bound(request.headers))
        return tenant

    async def run(ident: Identity, fn: Callable[[WindowEngine], Any]) -> Any:
        """``fn(engine)`` on a window thread, within the caller's tenant's share."""
        eng = engine
        if eng is None:
            raise WindowsUnavailable("context windows are not configured on this sidecar",
                                     hint="add a `windows.store` section (the KV store vLLM's "
                                          "connector uses) to the sidecar config")
        return await pool.run(ident.tenant, lambda: fn(eng))

    @router.post("/windows", openapi_extra=body_doc(FreezeBody))
    async def freeze(request: Request) -> dict[str, Any]:
        ident = caller(request, "write")
        body = await model_body(request, FreezeBody)
        check_window_name(body.name)
        session = session_of(body.session)
        turns = getattr(sidecar.tracker.peek(owner_of(ident), session), "turns", Arrivals())
        coming, wait = turns.coming(), turns.patience(settings.windows.wait_s)
        m = await run(ident, lambda e: e.freeze(
            owner_of(ident), body.name, session=session, salt=auth.session_salt(ident, session),
            messages=body.messages, tags=body.tags, description=body.description,
            turn=body.turn, ttl_s=body.ttl_s, prompt_prefix=body.prompt_prefix,
            coming=coming, coming_s=wait))
        return {"object": "window", **m.public()}

    @router.post("/windows/{name}/thaw", openapi_extra=body_doc(ThawBody))
    async def thaw(name: str, request: Request) -> dict[str, Any]:
        ident = caller(request, "write")
        body = await model_body(request, ThawBody)
        session = session_of(body.session)
        salt = auth.session_salt(ident, session)
        r = await run(ident, lambda e: e.thaw(owner_of(ident), check_window_name(name),
                                              session=session, salt=salt, model=body.model))
        sidecar.tracker.get(owner_of(ident), session).adopt(r.prompt)  # its next turn
        if body.warm:
            r.warm = await warm_up(sidecar, r.token_ids, salt, body.model or r.model or None)
            usage = r.warm.pop("usage", None)  # the caller's tokens, like any request's
            sidecar.usage.record(ident.tenant, str(r.warm.get("model") or ""),
                                 str(r.warm.get("upstream") or ""), usage, owner=owner_of(ident))
            if "error" in r.warm:
                r.warnings.append(f"the warm-up failed: {r.warm['error']}")
            else:
                await run(ident, lambda e: e.note_warm(owner_of(ident), name, session, r.warm))
        return {"object": "window.thaw", **r.public()}

    @router.post("/windows/{name}/clone", openapi_extra=body_doc(CloneBody))
    async def clone(name: str, request: Request) -> dict[str, Any]:
        ident = caller(request, "write")
        body = await model_body(request, CloneBody)
        m = await run(ident, lambda e: e.clone(owner_of(ident), check_window_name(name),
                                               check_window_name(body.name), tags=body.tags,
                                               description=body.description))
        return {"object": "window", **m.public()}

    @router.get("/windows")
    async def list_windows(request: Request, tag: TagQuery = None,
                           model: str | None = None, session: str | None = None,
                           q: str | None = None, sort: str = "created", order: str = "desc",
                           limit: int = 50, offset: int = 0) -> dict[str, Any]:
        ident = caller(request)
        if order not in ("asc", "desc") or not 0 < limit <= 1000 or offset < 0 \
                or len(tag or []) > 32:
            raise InvalidInput("bad list parameters", hint="order asc|desc, 1 <= limit <= "
                                                           "1000, offset >= 0, at most 32 tags")
        page, total = await run(ident, lambda e: e.list(
            owner_of(ident), tags=tag, model=model, session=session, text=q, sort=sort,
            descending=order == "desc", limit=limit, offset=offset))
        return {"object": "list", "data": [m.public() for m in page], "total": total,
                "offset": offset, "limit": limit, "has_next": offset + limit < total}

    @router.get("/windows/{name}")
    async def status(name: str, request: Request) -> dict[str, Any]:
        ident = caller(request)
        return {"object": "window",
                **await run(ident, lambda e: e.status(owner_of(ident), check_window_name(name)))}

    @router.patch("/windows/{name}", openapi_extra=body_doc(PatchBody))
    async def patch(name: str, request: Request) -> dict[str, Any]:
        ident = caller(request, "write")
        body = await model_body(request, PatchBody)
        m = await run(ident, lambda e: e.patch(owner_of(ident), check_window_name(name),
                                               new_name=body.name, tags=body.tags,
                                               description=body.description))
        return {"object": "window", **m.public()}

    @router.delete("/windows/{name}")
    async def delete(name: str, request: Request) -> dict[str, Any]:
        ident = caller(request, "write")
        await run(ident, lambda e: e.delete(owner_of(ident), check_window_name(name)))
        return {"object": "window.deleted", "name": name, "deleted": True}

    @router.get("/sessions")
    async def sessions(request: Request) -> dict[str, Any]:
        """The caller's sessions the sidecar saw since it started and those with windows."""
        ident = caller(request)
        seen = set(sidecar.tracker.sessions(owner_of(ident)))
        windows: dict[str, int] = {}
        if engine is not None:
            for m in (await run(ident, lambda e: e.list(owner_of(ident), limit=100_000)))[0]:
                windows[m.session] = windows.get(m.session, 0) + 1
        return {"object": "list", "data": [{"session": s, "windows": windows.get(s, 0)}
                                           for s in sorted(seen | set(windows))]}

    @router.delete("/sessions/{session}/kv")
    async def clear_session(session: str, request: Request) -> dict[str, Any]:
        """Erase the session's stored KV and records (its windows keep theirs)."""
        ident = caller(request, "write")
        session = session_of(session)
        n = await run(ident, lambda e: e.clear_session(auth.session_salt(ident, session)))
        state = sidecar.tracker.peek(owner_of(ident), session)
        if state is not None:  # its prompt state goes with its KV
            state.pinned, state.compaction = None, None
        return {"object": "session.kv.deleted", "session": session, "keys_deleted": n,
                "note": "blocks vLLM still holds in its own memory are unreachable without "
                        "the session's records and are evicted in time"}

    @router.get("/cache/stats")
    async def cache_stats(request: Request) -> dict[str, Any]:
        granted(request, "metrics", "GET /v1/cache/stats (every tenant's store)")
        return {"object": "cache.stats",
                "tiers": await run(identity_of(request), lambda e: e.store.usage())}

    @router.get("/auto_freeze")
    async def auto_freeze(request: Request, model: str | None = None) -> dict[str, Any]:
        caller(request)
        return auto_of().settings(model)

    @router.post("/auto_freeze", openapi_extra=body_doc(AutoFreezeBody))
    async def auto_freeze_set(request: Request) -> dict[str, Any]:
        granted(request, "admin", "POST /v1/auto_freeze (the deployment's settings)")
        body = await model_body(request, AutoFreezeBody)
        auto_of().update(**body.model_dump())
        return auto_of().settings(body.model)

    @router.post("/auto_freeze/check", openapi_extra=body_doc(CheckBody))
    async def auto_freeze_check(request: Request) -> dict[str, Any]:
        ident = caller(request, "write")
        body = await model_body(request, CheckBody)
        session = session_of(body.session)
        used = body.used_tokens
        if used is None:
            used = sidecar.tracker.get(owner_of(ident), session).last_prompt_tokens
        limit = body.max_tokens
        if limit is None:  # the context limit of the upstream serving the model
            try:
                limit = (await sidecar.router.any_model(body.model)).info().max_model_len or 0
            except UpstreamError:
                limit = 0
        a = auto_of()
        salt = auth.session_salt(ident, session)
        return await pool.run(ident.tenant, lambda: a.check(
            owner_of(ident), session, salt, used_tokens=used, max_tokens=limit,
            model=body.model))

    def auto_of() -> AutoFreeze:
        if auto is None:
            raise WindowsUnavailable("context windows are not configured on this sidecar",
                                     hint="add a `windows.store` section to the sidecar config")
        return auto

    router.include_router(windows_files_router(sidecar, run, caller))
    return router
