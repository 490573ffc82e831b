"""Who is calling: the one authentication dependency every route has, run before any byte of
the body is read, and the one way a route reads its body.

:func:`authenticate` (``Depends``; routes declare ``who: Principal`` or carry it in their
router's ``dependencies``): the API key's principal (401 without a key or with an unknown
one), a slot of its requests in flight, held until the response is finished (429 past
``max_in_flight``: ``in_flight.py``), one hit on its request rate and, for routes that spend
tokens, a look at its token quota (429, ``ratelimit.py``), and the request's declared
``Content-Length`` against the route's limit (413; ``Settings.body_limit``:
``max_body_bytes``, per route ``max_body_bytes_by_route``). Only then does a route read its
body, through :func:`json_body` or :func:`model_body` (bounded while it streams in, so a
chunked body gets the same 413; strictly parsed; a model's refusal is a 400 naming the fields,
never echoing them). No route declares a body parameter that FastAPI would parse before its
dependencies run: :func:`check_routes` refuses such an app when it is built, and a route
without the dependency (``/health`` and a public ``/metrics`` use :func:`authenticate_optional`,
which never refuses).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from cwm_plugin.errors import InvalidInput
from cwm_plugin.sidecar.http.body import LIMIT_HINT, read_json_body
from cwm_plugin.sidecar.http.errors import BodyTooLarge
from cwm_plugin.sidecar.identity.authenticator import Identity, Unauthorized, bearer_key
from cwm_plugin.sidecar.identity.in_flight import on_finish
from cwm_plugin.sidecar.settings import TenantConfig

M = TypeVar("M", bound=BaseModel)
METERED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


def route_path(request: Request) -> str:
    """The path template of the route serving ``request`` (as the API lists it)."""
    return getattr(request.scope.get("route"), "path", request.url.path)


def _declared_size(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared is None:
        return
    if not declared.isdigit():
        raise InvalidInput("invalid Content-Length header")
    if int(declared) > limit:
        raise BodyTooLarge(f"request body over {limit} bytes", hint=LIMIT_HINT)


async def authenticate(request: Request) -> TenantConfig:
    """The caller's principal, admitted by its limits, its body's declared size checked (see
    the module docstring); once a request."""
    sc = request.app.state.sidecar
    who = sc.auth.tenant_for(bearer_key(request.headers))
    if getattr(request.state, "principal", None) is not None:
        return who  # already admitted (a dependency that ran twice)
    request.state.principal = who
    on_finish(request, await sc.in_flight.take(who.name))
    path = route_path(request)
    await sc.limits.admit(who.name, metered=request.method == "POST" and path in METERED,
                          hold=sc.in_flight.bound(who.name) is not None)
    _declared_size(request, sc.settings.body_limit(path))
    return who


async def authenticate_optional(request: Request) -> TenantConfig | None:
    """The principal of a valid key, else None (no key, an unknown one): for the routes that
    answer anonymous callers too, with less."""
    sc = request.app.state.sidecar
    _declared_size(request, sc.settings.body_limit(route_path(request)))
    try:
        who = sc.auth.tenant_for(bearer_key(request.headers))
    except Unauthorized:
        return None
    request.state.principal = who
    return who


Principal = Annotated[TenantConfig, Depends(authenticate)]
Anyone = Annotated[TenantConfig | None, Depends(authenticate_optional)]
AUTHENTICATED = [Depends(authenticate)]  # a router's dependencies


def principal_of(request: Request) -> TenantConfig:
    """The principal :func:`authenticate` found for this request."""
    return request.state.principal


def identity_of(request: Request, body: dict[str, Any] | None = None) -> Identity:
    """The caller's identity: its principal, the user and session its headers (and ``body``,
    for the routes whose body may name the ``user``) give."""
    return request.app.state.sidecar.auth.identify(principal_of(request), request.headers, body)


async def json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object, at most the route's limit (413), at most
    ``max_json_depth`` deep (400)."""
    settings = request.app.state.sidecar.settings
    return await read_json_body(request, settings.body_limit(route_path(request)),
                                settings.max_json_depth)


async def model_body(request: Request, model: type[M]) -> M:
    """The body validated by ``model`` (a refusal: 400 naming the fields)."""
    raw = await json_body(request)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e.get("loc", ()))}
                                      for e in exc.errors(include_input=False,
                                                          include_url=False)]) from None


def _calls(dependant: Any) -> set[Any]:
    out = {dependant.call}
    for d in dependant.dependencies:
        out |= _calls(d)
    return out


def check_routes(app: FastAPI) -> None:
    """Refuse an app with a route FastAPI would read a body for before authenticating, or a
    route without the authentication dependency (a programming error: fails at start)."""
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        if route.body_field is not None:
            raise RuntimeError(f"route {route.path} declares a body parameter: FastAPI reads "
                               "it before authenticating; use caller.model_body")
        if not _calls(route.dependant) & {authenticate, authenticate_optional}:
            raise RuntimeError(f"route {route.path} has no authentication dependency")
