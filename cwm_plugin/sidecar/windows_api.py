"""REST for context windows on the sidecar: routes only translate HTTP to the window engine.

``POST /v1/windows`` ``{"name", "session", "tags"?, "description"?, "messages"?}`` freezes,
``POST /v1/windows/{name}/thaw`` ``{"session", "warm"?, "model"?}`` thaws (``warm``: one
``max_tokens=1`` request through vLLM right away, returning the tokens vLLM restored),
``POST /v1/windows/{name}/clone`` ``{"name"}`` clones, ``GET /v1/windows`` lists (``tag``,
``model``, ``session``, ``q``, ``sort``, ``order``, ``limit``, ``offset``),
``GET /v1/windows/{name}`` shows the status, ``DELETE /v1/windows/{name}`` deletes. Beside
them, for agents (the MCP tools): ``GET /v1/sessions``, ``GET /v1/cache/stats``,
``GET|POST /v1/auto_freeze`` and ``POST /v1/auto_freeze/check``. Every route authenticates
the tenant from the API key and asks its permissions (``access.py``): reads need read access to
its own namespace, freeze/thaw/clone/delete and checks write access; ``/v1/cache/stats`` needs
the ``metrics`` grant and ``POST /v1/auto_freeze`` the ``admin`` grant; sessions map to their ``cache_salt`` as in chat requests, so a
thaw into session S restores S's next request. Errors are OpenAI-shaped (the app's handler).
The engine is blocking (store I/O): it runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from cwm_plugin.errors import CWMError, InvalidInput, UpstreamError
from cwm_plugin.sidecar.identity import bearer_key, validate_session
from cwm_plugin.windows.auto import AutoFreeze
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


def _hits(metrics_text: str | None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(metrics_text or ""):
        for sample in fam.samples:
            if sample.name in ("vllm:external_prefix_cache_hits_total",
                               "vllm:external_prefix_cache_hits"):
                total += float(sample.value)
    return total


async def warm_up(sidecar: Any, token_ids: list[int], salt: str, model: str | None
                  ) -> dict[str, Any]:
    """One ``max_tokens=1`` completion of the window's tokens under ``salt``: vLLM loads the
    restored blocks now; its ``external_prefix_cache_hits`` says how many tokens it restored
    (on the upstream that answered: ``model``'s, else the default upstream's first model)."""
    router = sidecar.router
    try:
        route = await router.any_model(model)
    except UpstreamError as exc:
        raise WindowsUnavailable("no upstream serves a model to warm up with",
                                 hint=exc.message) from None
    before = {e.name: _hits(await e.client.metrics_text()) for e in route.candidates if e.up}
    t0 = time.perf_counter()
    ep, resp = await router.post(route, "/v1/completions", {
        "model": route.model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0,
        "cache_salt": salt})
    seconds = time.perf_counter() - t0
    if resp.status_code != 200:
        raise CWMError(f"the warm-up request answered HTTP {resp.status_code}",
                       hint="the window is thawed; the next request restores it instead")
    hits = _hits(await ep.client.metrics_text()) - before.get(ep.name, 0.0)
    return {"model": route.model, "upstream": ep.name, "hits": int(hits),
            "seconds": round(seconds, 3),
            "prompt_tokens": (resp.json().get("usage") or {}).get("prompt_tokens")}


def windows_router(sidecar: Any, engine: WindowEngine | None, auto: AutoFreeze | None,
                   salt_of: SaltOf) -> APIRouter:
    """The routes over ``sidecar`` (its auth, upstream and context tracker); ``engine`` None:
    windows are not configured (503); ``salt_of(tenant, session)`` derives salts."""
    router = APIRouter(prefix="/v1")
    auth = sidecar.auth

    def tenant_of(request: Request, op: str = "read") -> str:
        """The caller's principal, allowed ``op`` on its own namespace (windows are its KV)."""
        tenant = auth.tenant_for(bearer_key(request.headers)).name
        auth.perms.require(tenant, auth.perms.namespace(tenant), op)
        return tenant

    def granted(request: Request, grant: str, what: str) -> str:
        tenant = auth.tenant_for(bearer_key(request.headers)).name
        auth.perms.require_grant(tenant, grant, what)
        return tenant

    async def run(fn: Callable[[WindowEngine], Any]) -> Any:
        eng = engine
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

    @router.post("/windows")
    async def freeze(body: FreezeBody, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request, "write")
        check_name(body.name)
        session = session_of(body.session)
        m = await run(lambda e: e.freeze(tenant, body.name, session=session,
                                         salt=salt_of(tenant, session),
                                         messages=body.messages, tags=body.tags,
                                         description=body.description))
        return {"object": "window", **m.public()}

    @router.post("/windows/{name}/thaw")
    async def thaw(name: str, body: ThawBody, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request, "write")
        session = session_of(body.session)
        salt = salt_of(tenant, session)
        r = await run(lambda e: e.thaw(tenant, check_name(name), session=session, salt=salt,
                                       model=body.model))
        if body.warm:
            r.warm = await warm_up(sidecar, r.token_ids, salt, body.model)
            await run(lambda e: e.note_warm(tenant, name, r.warm))
        return {"object": "window.thaw", **r.public()}

    @router.post("/windows/{name}/clone")
    async def clone(name: str, body: CloneBody, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request, "write")
        m = await run(lambda e: e.clone(tenant, check_name(name), check_name(body.name)))
        return {"object": "window", **m.public()}

    @router.get("/windows")
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

    @router.get("/windows/{name}")
    async def status(name: str, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)
        return {"object": "window", **await run(lambda e: e.status(tenant, check_name(name)))}

    @router.delete("/windows/{name}")
    async def delete(name: str, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request, "write")
        await run(lambda e: e.delete(tenant, check_name(name)))
        return {"object": "window.deleted", "name": name, "deleted": True}

    @router.get("/sessions")
    async def sessions(request: Request) -> dict[str, Any]:
        """This tenant's sessions the sidecar saw since it started and those with windows."""
        tenant = tenant_of(request)
        seen = set(sidecar.tracker.sessions(tenant))
        windows: dict[str, int] = {}
        if engine is not None:
            for m in (await run(lambda e: e.list(tenant, limit=100_000)))[0]:
                windows[m.session] = windows.get(m.session, 0) + 1
        return {"object": "list", "data": [{"session": s, "windows": windows.get(s, 0)}
                                           for s in sorted(seen | set(windows))]}

    @router.get("/cache/stats")
    async def cache_stats(request: Request) -> dict[str, Any]:
        granted(request, "metrics", "GET /v1/cache/stats (every tenant's store)")
        return {"object": "cache.stats", "tiers": await run(lambda e: e.store.usage())}

    @router.get("/auto_freeze")
    async def auto_freeze(request: Request, model: str | None = None) -> dict[str, Any]:
        tenant_of(request)
        return auto_of().settings(model)

    @router.post("/auto_freeze")
    async def auto_freeze_set(body: AutoFreezeBody, request: Request) -> dict[str, Any]:
        granted(request, "admin", "POST /v1/auto_freeze (the deployment's settings)")
        auto_of().update(**body.model_dump())
        return auto_of().settings(body.model)

    @router.post("/auto_freeze/check")
    async def auto_freeze_check(body: CheckBody, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request, "write")
        session = session_of(body.session)
        used = body.used_tokens
        if used is None:
            used = sidecar.tracker.get(tenant, session).last_prompt_tokens
        limit = body.max_tokens
        if limit is None:  # the context limit of the upstream serving the model
            try:
                limit = (await sidecar.router.any_model(body.model)).info().max_model_len or 0
            except UpstreamError:
                limit = 0
        a = auto_of()
        return await asyncio.to_thread(a.check, tenant, session, salt_of(tenant, session),
                                       used_tokens=used, max_tokens=limit, model=body.model)

    def auto_of() -> AutoFreeze:
        if auto is None:
            raise WindowsUnavailable("context windows are not configured on this sidecar",
                                     hint="add a `windows.store` section to the sidecar config")
        return auto

    return router
