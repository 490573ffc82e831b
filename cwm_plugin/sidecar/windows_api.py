"""REST for context windows on the sidecar: routes only translate HTTP to the window engine.

``POST /v1/windows`` ``{"name", "session", "tags"?, "description"?, "messages"?}`` freezes,
``POST /v1/windows/{name}/thaw`` ``{"session", "warm"?, "model"?}`` thaws,
``POST /v1/windows/{name}/clone`` ``{"name"}`` clones, ``GET /v1/windows`` lists (``tag``,
``model``, ``session``, ``q``, ``sort``, ``order``, ``limit``, ``offset``),
``GET /v1/windows/{name}`` shows the status, ``DELETE /v1/windows/{name}`` deletes. Every
route authenticates the tenant from the API key; sessions map to their ``cache_salt`` as in
chat requests, so a thaw into session S restores S's next request. Errors are OpenAI-shaped
(the app's handler). The engine is blocking (store I/O): it runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from cwm_plugin.errors import CWMError, InvalidInput
from cwm_plugin.sidecar.identity import bearer_key, validate_session
from cwm_plugin.windows.engine import WindowEngine
from cwm_plugin.windows.model import check_name

log = logging.getLogger(__name__)
SaltOf = Callable[[str, str], str]       # (tenant, session) -> cache_salt


class WindowsUnavailable(CWMError):
    code = "windows_unavailable"
    http_status = 503


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FreezeBody(_Body):
    name: str = Field(max_length=128)
    session: str = Field(max_length=64)
    tags: list[str] = Field(default_factory=list, max_length=32)
    description: str = Field(default="", max_length=4096)
    messages: list[dict[str, Any]] | None = Field(default=None, max_length=10_000)


class ThawBody(_Body):
    session: str = Field(max_length=64)
    warm: bool = False
    model: str | None = Field(default=None, max_length=256)


class CloneBody(_Body):
    name: str = Field(max_length=128)


def windows_router(engine: Callable[[], WindowEngine | None], auth: Any, salt_of: SaltOf
                   ) -> APIRouter:
    """The routes; ``engine()`` gives the engine (None: not configured), ``auth`` maps keys
    to tenants, ``salt_of`` sessions to salts."""
    router = APIRouter(prefix="/v1/windows")

    def tenant_of(request: Request) -> str:
        return auth.tenant_for(bearer_key(request.headers)).name

    async def run(fn: Callable[[WindowEngine], Any]) -> Any:
        eng = engine()
        if eng is None:
            raise WindowsUnavailable("context windows are not configured on this sidecar",
                                     hint="add a `windows.store` section (the KV store vLLM's "
                                          "connector uses) to the sidecar config")
        return await asyncio.to_thread(fn, eng)

    def session_of(name: str) -> str:
        try:
            return validate_session(name)
        except InvalidInput as exc:
            raise InvalidInput(f"invalid session {name[:64]!r}", hint=exc.hint) from exc

    @router.post("")
    async def freeze(body: FreezeBody, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)
        check_name(body.name)
        session = session_of(body.session)
        m = await run(lambda e: e.freeze(tenant, body.name, session=session,
                                         salt=salt_of(tenant, session),
                                         messages=body.messages, tags=body.tags,
                                         description=body.description))
        return {"object": "window", **m.public()}

    @router.post("/{name}/thaw")
    async def thaw(name: str, body: ThawBody, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)
        session = session_of(body.session)
        r = await run(lambda e: e.thaw(tenant, check_name(name), session=session,
                                       salt=salt_of(tenant, session), warm=body.warm,
                                       model=body.model))
        return {"object": "window.thaw", **r.public()}

    @router.post("/{name}/clone")
    async def clone(name: str, body: CloneBody, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)
        m = await run(lambda e: e.clone(tenant, check_name(name), check_name(body.name)))
        return {"object": "window", **m.public()}

    @router.get("")
    async def list_windows(request: Request, tag: str | None = None, model: str | None = None,
                           session: str | None = None, q: str | None = None,
                           sort: str = "created", order: str = "desc", limit: int = 50,
                           offset: int = 0) -> dict[str, Any]:
        tenant = tenant_of(request)
        if order not in ("asc", "desc") or not 0 < limit <= 1000 or offset < 0:
            raise InvalidInput("bad list parameters",
                               hint="order asc|desc, 1 <= limit <= 1000, offset >= 0")
        page, total = await run(lambda e: e.list(
            tenant, tag=tag, model=model, session=session, text=q, sort=sort,
            descending=order == "desc", limit=limit, offset=offset))
        return {"object": "list", "data": [m.public() for m in page], "total": total,
                "offset": offset, "limit": limit}

    @router.get("/{name}")
    async def status(name: str, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)
        return {"object": "window", **await run(lambda e: e.status(tenant, check_name(name)))}

    @router.delete("/{name}")
    async def delete(name: str, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)
        await run(lambda e: e.delete(tenant, check_name(name)))
        return {"object": "window.deleted", "name": name, "deleted": True}

    return router
