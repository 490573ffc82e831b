"""The FastAPI app: ``create_app(settings)`` builds one sidecar; routes only translate HTTP.

Routes: ``POST /v1/chat/completions`` (memory, salt, streaming), ``POST /v1/completions`` and
``/v1/responses`` (salt only), ``POST /v1/embeddings``, ``/tokenize``, ``/detokenize``,
``GET /v1/models``, ``/v1/models/{id}`` (relayed), ``GET /health``, ``GET /metrics``,
``GET /openapi.json`` (:mod:`~cwm_plugin.sidecar.api.schema`), ``GET /v1/usage``
(:mod:`~cwm_plugin.sidecar.api.usage`), ``POST|GET /v1/activity``
(:mod:`~cwm_plugin.sidecar.api.activity`), ``/v1/memory/...``
(:mod:`~cwm_plugin.sidecar.api.memory`) and the context windows' routes
(:mod:`~cwm_plugin.sidecar.api.windows`). Requests go to one of several upstreams
(:mod:`~cwm_plugin.sidecar.upstream.router`: routing, health checks, failover). Who may do what:
:mod:`~cwm_plugin.sidecar.identity.access`. Every route authenticates through one dependency before
it reads a byte of its body, which is bounded (:mod:`~cwm_plugin.sidecar.identity.caller`);
per-tenant rates and token quotas: :mod:`~cwm_plugin.sidecar.identity.ratelimit`; per-tenant
bounds on work under way (requests in flight, imports, window and store work on threads of their
own): :mod:`~cwm_plugin.sidecar.identity.tenant_bounds`; the server's own bounds (headers, slow
clients, connections): :mod:`~cwm_plugin.sidecar.server_limits`. Every error
leaves as an OpenAI-shaped body. ``app.state.sidecar`` holds the app's runtime; assign
``app.state.sidecar.snapshot_hook`` to take a KV snapshot at auto-checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cwm_plugin import pg_scope
from cwm_plugin.errors import ConfigError, CWMError
from cwm_plugin.sidecar.api.activity import activity_router, activity_threads, open_activity
from cwm_plugin.sidecar.api.chat import handle_chat
from cwm_plugin.sidecar.api.memory import memory_router
from cwm_plugin.sidecar.api.relay import model_entry, relay_get, relay_post
from cwm_plugin.sidecar.api.schema import ERRORS, RELAYED, ChatBody, body_doc, openapi
from cwm_plugin.sidecar.api.usage import usage_router
from cwm_plugin.sidecar.api.windows import CheckpointThresholds, windows_router
from cwm_plugin.sidecar.background.maintainer import Maintainer
from cwm_plugin.sidecar.background.queue import Background, Job
from cwm_plugin.sidecar.background.shared_jobs import SharedJobs
from cwm_plugin.sidecar.http.errors import error_response, from_cwm_error
from cwm_plugin.sidecar.identity.authenticator import Authenticator
from cwm_plugin.sidecar.identity.caller import (
    AUTHENTICATED,
    Anyone,
    authenticate,
    authenticate_optional,
    check_routes,
    principal_of,
)
from cwm_plugin.sidecar.identity.in_flight import Finish
from cwm_plugin.sidecar.identity.ratelimit import TenantLimits
from cwm_plugin.sidecar.identity.salt_move import SaltMover
from cwm_plugin.sidecar.identity.tenant_bounds import TenantBound, TenantPool
from cwm_plugin.sidecar.metrics import SidecarMetrics
from cwm_plugin.sidecar.runtime import Sidecar
from cwm_plugin.sidecar.server_limits import BodyDeadline
from cwm_plugin.sidecar.settings import Settings
from cwm_plugin.sidecar.settings.secret_versions import folder_locator
from cwm_plugin.sidecar.shared_redis import open_shared
from cwm_plugin.sidecar.turn.counting import ModelCounters
from cwm_plugin.sidecar.turn.failopen import FailOpen
from cwm_plugin.sidecar.turn.memory_port import MemoryPort, build_memory, memory_threads
from cwm_plugin.sidecar.turn.records import restores
from cwm_plugin.sidecar.turn.session import ContextTracker, SnapshotHook
from cwm_plugin.sidecar.turn.shared_state import SharedSessions
from cwm_plugin.sidecar.upstream.router import Router
from cwm_plugin.sidecar.usage import SharedUsage, UsageLedger
from cwm_plugin.windows.auto import AutoFreeze
from cwm_plugin.windows.engine import WindowEngine
from cwm_plugin.windows.model import tenant_of
from cwm_plugin.windows.opening import open_engine
from cwm_plugin.windows.settings import WindowsSettings

log = logging.getLogger(__name__)


def _poster(sidecar: Sidecar, path: str) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        return await relay_post(sidecar, request, path)

    return route


def open_windows(settings: Settings) -> tuple[WindowEngine | None, AutoFreeze | None]:
    """The window engine over the KV store vLLM's connector writes, and its auto-freeze; a
    store that cannot be opened leaves windows off (logged), never the sidecar."""
    if settings.windows is None:
        return None, None
    w = settings.windows
    try:
        engine = open_engine(w, len(settings.principals()))
    except ConfigError:
        raise  # a setting to fix (a short export key): the start fails, never windows alone
    except CWMError as exc:
        log.error("context windows are off: the KV store could not be opened: %s", exc)
        return None, None
    return engine, AutoFreeze(engine, enabled=w.auto_freeze, cooldown_s=w.auto_freeze_cooldown_s,
                              keep=w.auto_keep,
                              thresholds=CheckpointThresholds(settings.checkpoint))


def resume_job(sidecar: Sidecar, jid: str, info: dict[str, Any]) -> None:
    """Queue here a session's job another replica recorded and did not finish (a sweep found
    it due: ``background/shared_jobs.py``); its state comes from the replicas' shared state."""
    if sidecar.maintainer is None:
        return
    state = sidecar.tracker.get(str(info["owner"]), str(info["session"]))
    checkpoint = bool(info.get("checkpoint"))
    sidecar.background.submit(str(info["tenant"]), (str(info["folder"]), str(info["session"])),
                              Job(sidecar.maintainer.run, checkpoint=checkpoint, info={
                                  **info, "state": state, "hook": sidecar.snapshot_hook,
                                  "shared": sidecar.shared, "jobs": sidecar.jobs,
                                  "shared_id": jid}), force=checkpoint)


def create_app(settings: Settings, *, memory: MemoryPort | None = None,
               transport: httpx.AsyncBaseTransport | None = None,
               snapshot_hook: SnapshotHook | None = None) -> FastAPI:
    """Build the app. ``memory`` overrides the service built from ``settings.memory``;
    ``snapshot_hook(tenant, session, cache_salt, name)`` (sync or async) is called at each
    automatic checkpoint to take a named snapshot of the session's KV (default: no-op)."""
    metrics = SidecarMetrics()
    secrets = settings.server_secrets()  # newest first (settings/secret_versions.py)
    if memory is None and settings.memory_enabled:
        memory = build_memory(settings.memory, memory_threads(len(settings.principals()),
                                                             metrics.rate_limited),
                              metrics.registry)
    router = Router(settings.endpoints(), settings.routing, metrics, transport=transport)
    limits = TenantLimits(settings.rate_limits, settings.principals(), metrics.rate_limited)
    s = settings.sessions
    shared_redis = open_shared(s.shared_url.get_secret_value(), s.shared_timeout_s) \
        if s.shared_url is not None else None  # one client for the replicas' shared parts
    usage = UsageLedger(settings.pricing, metrics, limits, shared=SharedUsage(
        shared_redis, timeout_s=s.shared_timeout_s) if shared_redis is not None else None)
    w, principals = settings.windows or WindowsSettings(), len(settings.principals())
    window_pool = TenantPool("cwm-windows", TenantBound(
        "window_ops", "window operations", w.tenant_threads, w.tenant_waiting,
        metrics.rate_limited), principals)
    sidecar = Sidecar(
        settings=settings,
        auth=Authenticator(settings.tenants, secrets[0],
                           shared_default=settings.prompt.sessionless == "shared",
                           providers=settings.providers, access=settings.access,
                           previous=secrets[1:], locate=folder_locator(settings.memory.root)),
        router=router, memory=memory, metrics=metrics,
        maintainer=Maintainer(router, memory, metrics, settings.memory, usage)
        if memory else None,
        counters=ModelCounters(settings.memory),
        failopen=FailOpen(metrics), usage=usage, limits=limits,
        in_flight=TenantBound("in_flight", "requests in flight", None, 0, metrics.rate_limited,
                              own=settings.in_flight()),
        window_pool=window_pool, restores=restores(principals, metrics.rate_limited),
        activity_pool=activity_threads(principals, metrics.rate_limited),
        activity=open_activity(settings),
        tracker=ContextTracker(settings.sessions.max_tracked, settings.session_share()),
        background=Background(settings.memory.background_queue_limit,
                              settings.memory.background_workers, metrics,
                              share=settings.background_share()),
    )
    engine, auto = open_windows(settings)
    sidecar.windows = engine
    if shared_redis is not None:
        sidecar.shared = SharedSessions(shared_redis, secrets,
                                        ttl_s=s.shared_ttl_s, timeout_s=s.shared_timeout_s,
                                        failopen=sidecar.failopen)
        if sidecar.maintainer is not None:
            sidecar.jobs = SharedJobs(shared_redis, secrets,
                                      failopen=sidecar.failopen, lease_s=s.shared_job_lease_s,
                                      grace_s=s.shared_job_grace_s,
                                      timeout_s=s.shared_timeout_s)
    if engine is not None and len(settings.secrets) > 1:  # KV survives a rotation
        sidecar.salt_mover = SaltMover(engine, sidecar.auth, settings.secrets[1:],
                                       metrics.salt_moves, window_pool)
    if snapshot_hook is not None:
        sidecar.snapshot_hook = snapshot_hook
    elif auto is not None and settings.windows is not None and settings.windows.auto_freeze:
        async def freeze_at_checkpoint(owner: str, session: str, salt: str, name: str) -> None:
            await window_pool.run(tenant_of(owner), lambda: auto(owner, session, salt, name))
        sidecar.snapshot_hook = freeze_at_checkpoint

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router.start_health_checks()
        if sidecar.jobs is not None:  # take over the jobs of replicas that died
            sidecar.jobs.sweep(lambda jid, info: resume_job(sidecar, jid, info),
                               every_s=max(0.5, min(sidecar.jobs.grace_s,
                                                    sidecar.jobs.lease_s) / 2))
        if memory is not None and settings.memory.warm_on_start:
            for tenant in settings.principals():  # in the background: answers at once
                with pg_scope.scoped(pg_scope.folders([tenant.name])):  # (its task's)
                    sidecar.background.spawn(memory.warm(tenant.name, tenant.name),
                                             name=f"warm-{tenant.name}")
        yield
        if sidecar.jobs is not None:  # take over no more work: this replica is going
            sidecar.jobs.stop_sweeping()
        await sidecar.background.close()
        if memory is not None:
            await memory.close()  # saves the indexes that changed
            memory.pool.close()
        sidecar.counters.close()
        await router.aclose()
        window_pool.close()
        sidecar.restores.close()
        sidecar.activity_pool.close()
        if hasattr(sidecar.activity, "close"):  # (a log in PostgreSQL holds a pool)
            sidecar.activity.close()
        if engine is not None:
            engine.store.close()
        if sidecar.shared is not None:
            await sidecar.shared.aclose()
        if sidecar.jobs is not None:
            await sidecar.jobs.aclose()
        if usage.shared is not None:
            await usage.shared.aclose()
        if shared_redis is not None:
            await shared_redis.aclose()

    app = FastAPI(title="cwm sidecar", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.sidecar = sidecar
    app.add_middleware(BodyDeadline, timeout_s=settings.server.body_timeout_s,
                       min_rate=settings.server.body_min_rate)  # server_limits.py
    app.add_middleware(Finish)  # gives back requests in flight (identity/in_flight.py)

    @app.exception_handler(CWMError)
    async def _cwm_error(request: Request, exc: CWMError) -> JSONResponse:
        return from_cwm_error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        """A body or query a route's model refuses: 400, naming the fields, never the input."""
        where = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: "
                          f"{e.get('msg', 'invalid')}" for e in exc.errors())
        return error_response(400, f"invalid request: {where}", "invalid_input")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """What the router answers itself (a path no route matches, such as one holding a
        line break): in the OpenAI shape too."""
        code = "unknown_route" if exc.status_code == 404 else "http_error"
        return error_response(exc.status_code, f"no route {request.method} for this path"
                              if exc.status_code == 404 else str(exc.detail), code,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        """The client went away while sending its body: nobody reads the answer."""
        return error_response(400, "the client closed the connection", "client_disconnected")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, "internal error in the sidecar", "internal_error")

    @app.post("/v1/chat/completions", dependencies=AUTHENTICATED, responses=ERRORS,
              openapi_extra=body_doc(ChatBody, sse=True))
    async def chat(request: Request) -> Response:
        return await handle_chat(sidecar, request)

    for path, model in RELAYED.items():
        app.add_api_route(path, _poster(sidecar, path), methods=["POST"],
                          dependencies=AUTHENTICATED, responses=ERRORS,
                          openapi_extra=body_doc(model, sse=path in ("/v1/completions",
                                                                      "/v1/responses")))

    @app.get("/v1/models", dependencies=AUTHENTICATED, responses=ERRORS)
    async def models(request: Request) -> Response:
        return await relay_get(sidecar, request, "/v1/models")

    @app.get("/v1/models/{model_id:path}", dependencies=AUTHENTICATED, responses=ERRORS)
    async def model(model_id: str, request: Request) -> Response:
        return await model_entry(sidecar, request, model_id)

    @app.get("/health", responses=ERRORS)
    async def health(who: Anyone, request: Request) -> JSONResponse:
        """``ok`` when every upstream is up, ``degraded`` (HTTP 503 only when none is)
        otherwise, as the router last saw them (requests and its background checks every
        ``routing.health.interval_s``): a call asks no upstream. Only that to a caller without
        the ``admin`` grant; to one with it, every upstream checked now and also ``upstream``
        (the default upstream), ``upstreams``, ``memory``, ``background_tasks``."""
        admin = sidecar.auth.perms.granted(who.name if who else None, "admin",
                                           bound=sidecar.auth.bound(request.headers))
        ups = await router.check_all() if admin else router.states()
        alive = any(u["up"] for u in ups)
        status = "ok" if all(u["up"] for u in ups) else "degraded"
        if not admin:
            return JSONResponse({"status": status}, status_code=200 if alive else 503)
        default = next(u for u in ups if u["name"] == router.default.name)
        up = {"ok": default["up"], "models": default["models"]} if default["up"] \
            else {"ok": False, "error": "upstream_error"}
        return JSONResponse({"status": status,
                             "upstream": up, "upstreams": ups, "memory": memory is not None,
                             "background_tasks": sidecar.background.pending},
                            status_code=200 if alive else 503)

    metrics_auth = authenticate_optional if settings.access.metrics_public else authenticate

    @app.get("/metrics", dependencies=[Depends(metrics_auth)], responses={
        **ERRORS, 200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics_route(request: Request) -> Response:
        """Prometheus text; needs a key with the ``metrics`` grant unless ``metrics_public``."""
        if not settings.access.metrics_public:
            sidecar.auth.perms.require_grant(principal_of(request).name, "metrics", "/metrics",
                                             bound=sidecar.auth.bound(request.headers))
        metrics.mirror_upstream(await router.metrics_texts())
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/openapi.json", dependencies=AUTHENTICATED, responses=ERRORS)
    async def openapi_route() -> dict[str, Any]:
        """This API's OpenAPI description."""
        return openapi(app)

    for sub in (usage_router(sidecar), activity_router(sidecar, sidecar.activity),
                memory_router(sidecar), windows_router(sidecar, engine, auto)):
        app.include_router(sub, dependencies=AUTHENTICATED, responses=ERRORS)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"],
                   dependencies=AUTHENTICATED, include_in_schema=False)
    async def unknown(path: str) -> JSONResponse:
        return error_response(404, f"no route /{path} in the sidecar", "unknown_route")

    check_routes(app)
    return app
