"""REST over memory namespaces, every route checked against the permission matrix
(``identity/access.py``).

``GET /v1/memory/namespaces`` lists the namespaces the caller may use and what it may do there (its
principal, for the user of ``X-CWM-User`` when given; none it has no access to);
``GET /v1/memory/facts?namespace=N`` lists the durable memories in force (read);
``POST /v1/memory/facts`` ``{"namespace"?, "text", "category"?, "importance"?, "key"?}`` merges one
(write); ``GET /v1/memory/search?namespace=N&q=...&k=`` searches the namespace's conversations and
memories (read); ``GET /v1/memory/view?namespace=N&view=quick|full&max_tokens=&model=`` returns the
namespace's memory as text at that resolution with its token count (the served ``model``'s, else the
memory's tokenizer; read; ``memory_view.py``); ``POST /v1/memory/turns``
``{"namespace"?, "session", "role", "content"}`` appends a turn to a session's transcript (append).
The namespace defaults to the request's home (the user's, else the principal's); the activity log is
``/v1/activity``. A namespace that does not exist and one the caller has no access to answer alike
(404 ``namespace_not_found``); one it may use, but not so, a 403 naming the rule; memory off: 503.
Bodies are read after the caller is authenticated (``identity/caller.py``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from cwm_plugin import pg_scope
from cwm_plugin.errors import CWMError, InvalidInput
from cwm_plugin.sidecar.api.memory_view import VIEWS, build_view
from cwm_plugin.sidecar.api.schema import body_doc
from cwm_plugin.sidecar.identity.access import ACTIVITY, GLOBAL, USER, MemoryNamespace
from cwm_plugin.sidecar.identity.authenticator import Identity, validate_session
from cwm_plugin.sidecar.identity.caller import identity_of, model_body
from cwm_plugin.sidecar.settings.access import Access
from cwm_plugin.sidecar.turn.memory_port import MemoryPort


class MemoryUnavailable(CWMError):
    code = "memory_unavailable"
    http_status = 503


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str | None = Field(default=None, max_length=80)


class FactBody(_Body):
    text: str = Field(min_length=1, max_length=2000)
    category: str = Field(default="fact", min_length=1, max_length=64)
    importance: float = Field(default=0.5, ge=0, le=1)
    key: str = Field(default="", max_length=60)


class TurnBody(_Body):
    session: str = Field(max_length=64)
    role: str = Field(max_length=64)
    content: str = Field(max_length=100_000)


def memory_router(sidecar: Any) -> APIRouter:
    """The routes over ``sidecar.memory`` (None: 503), authenticated like every other."""
    router = APIRouter(prefix="/v1/memory")
    perms = sidecar.auth.perms
    who = identity_of  # the caller: its principal, and the user of its X-CWM-User header

    def where(ident: Identity, name: str | None, op: str) -> tuple[MemoryPort, MemoryNamespace]:
        """The memory and the namespace ``name`` (default: the home), ``op`` allowed there."""
        ns = perms.open(ident, name or ident.namespace, op)
        if ns.folder is None:
            raise InvalidInput(f"namespace {ns.name!r} is not memory",
                               hint="the activity log is /v1/activity")
        if sidecar.memory is None:
            raise MemoryUnavailable("memory is off on this sidecar")
        # the database's row-level security sees this folder alone for this request
        pg_scope.enter(pg_scope.folders([ns.folder], [ns.folder] if op != "read" else []))
        return sidecar.memory, ns

    @router.get("/namespaces")
    async def namespaces(request: Request) -> dict[str, Any]:
        ident = who(request)
        names = [GLOBAL, ACTIVITY, *perms.principals]
        if ident.user is not None:
            names += [p + USER for p in perms.principals]
        rows = []
        for name in names:
            ns = perms.namespace(name, ident.user)
            d = perms.decide(ident, ns)
            if d.access is Access.NONE:
                continue
            rows.append({"namespace": ns.name, "access": d.access.value, "rule": d.rule,
                         "home": ns.name == ident.namespace})
        return {"object": "list", "principal": ident.tenant, "data": rows}

    @router.get("/facts")
    async def facts(request: Request, namespace: str | None = None) -> dict[str, Any]:
        ident = who(request)
        mem, ns = where(ident, namespace, "read")
        got = await mem.memories(ident.tenant, ns.folder)
        return {"object": "list", "namespace": ns.name, "data": [
            {"id": m.id, "text": m.text, "category": m.category, "importance": m.importance,
             "key": m.key, "created": m.created} for m in got]}

    @router.post("/facts", status_code=201, openapi_extra=body_doc(FactBody))
    async def add_fact(request: Request) -> dict[str, Any]:
        ident = who(request)
        body = await model_body(request, FactBody)
        mem, ns = where(ident, body.namespace, "write")
        got = await mem.add_fact(ident.tenant, ns.folder, body.text, body.category,
                                 body.importance, key=body.key, source=f"api:{ident.tenant}")
        return {"object": "memory", "namespace": ns.name, "id": got.memory.id,
                "outcome": got.outcome}

    @router.get("/search")
    async def search(request: Request, q: str, namespace: str | None = None,
                     k: int = 5) -> dict[str, Any]:
        if not 0 < k <= 50 or not q.strip() or len(q) > 2000:
            raise InvalidInput("bad search parameters", hint="q: 1-2000 characters, 1 <= k <= 50")
        ident = who(request)
        mem, ns = where(ident, namespace, "read")
        hits, facts = await mem.run(ident.tenant, lambda: (
            mem.now.search(ns.folder, q, k), mem.now.search_memories(ns.folder, q, k)))
        return {"object": "list", "namespace": ns.name, "data": [
            {"source": h.source, "score": round(h.score, 4), "text": h.text}
            for h in [*facts, *hits]]}

    @router.get("/view")
    async def view_route(request: Request, view: str | None = None,
                         namespace: str | None = None, max_tokens: int | None = None,
                         model: str | None = None) -> dict[str, Any]:
        """``model``: count with that served model's tokenizer (else the memory's)."""
        view = view or sidecar.settings.prompt.memory_view
        if view not in VIEWS or (max_tokens is not None and max_tokens < 1):
            raise InvalidInput("bad view parameters", hint="view: quick|full, max_tokens >= 1")
        ident = who(request)
        mem, ns = where(ident, namespace, "read")
        count = mem.count
        if model is not None:
            route = await sidecar.router.for_model(model)
            count = (await sidecar.counters.get(model, route.info())).count
        got = await mem.run(ident.tenant,
                            lambda: build_view(mem.now, ns.folder, view, count, max_tokens))
        return {"object": "memory.view", "namespace": ns.name, "counted_with": model or "memory",
                **got.public()}

    @router.post("/turns", status_code=201, openapi_extra=body_doc(TurnBody))
    async def append_turn(request: Request) -> dict[str, Any]:
        ident = who(request)
        body = await model_body(request, TurnBody)
        mem, ns = where(ident, body.namespace, "append")
        session = validate_session(body.session)
        ids = await mem.record_turns(ident.tenant, ns.folder, session, [(body.role, body.content)])
        return {"object": "memory.turn", "namespace": ns.name, "session": session,
                "turn_id": ids[0]}

    return router
