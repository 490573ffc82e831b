"""Routes relayed without memory, authenticated like chat, errors OpenAI-shaped.

``POST /v1/completions`` and ``/v1/responses`` carry the session's salt (streamed or not) and,
in a session, the client turn's number and arrival (:mod:`~cwm_plugin.sidecar.turn.arrivals`:
the session's next number, so windows can freeze them like chat turns), and are routed like
chat (an explicit model to the upstreams serving it, an alias by role, with failover; each is
billed through one ``Meter``, its estimate reserved from the token quota before it goes up:
``usage.py``; a stream is billed once in its generator's ``finally``, however it ends: done,
failed or its client gone away); ``POST /v1/embeddings``, ``/tokenize`` and ``/detokenize``
go where their model is served (else to the default upstream) as they are; ``GET /v1/models``
is the default upstream's list, or with several upstreams all their lists merged;
``GET /v1/models/{id}`` (which vLLM does not serve) answers that model's entry of the list, or
404. A body is relayed byte for byte in both directions except for the salt (and the model
an alias resolved to); ``x-request-id`` goes up, ``x-request-id`` and ``Retry-After`` come
back, with ``X-CWM-Upstream`` (and ``X-CWM-Route`` for an alias).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from cwm_plugin.sidecar.api.chat import SSEResponse
from cwm_plugin.sidecar.api.chat_turn import route_headers
from cwm_plugin.sidecar.api.priority import client_priority
from cwm_plugin.sidecar.http.body import require_model
from cwm_plugin.sidecar.http.errors import ModelNotFound, upstream_error_response
from cwm_plugin.sidecar.identity.authenticator import Identity, owner_of
from cwm_plugin.sidecar.identity.caller import identity_of, json_body
from cwm_plugin.sidecar.runtime import Sidecar
from cwm_plugin.sidecar.turn.arrivals import Arrival, Arrivals, kv_params
from cwm_plugin.sidecar.upstream.client import headers_down, headers_up
from cwm_plugin.sidecar.upstream.endpoints import Route
from cwm_plugin.sidecar.upstream.stream import Collected, ask_usage, relay_sse
from cwm_plugin.sidecar.usage import Meter, answer_cap, prompt_estimate

SALTED = ("/v1/completions", "/v1/responses")
UNROUTED = "other"  # the model label of a relay whose model no upstream was known to serve


def _relayed(resp: Any, extra: dict[str, str] | None = None) -> Response:
    """An upstream answer as it came: status, bytes, content type and the passed headers
    (and ``extra``: which upstream answered)."""
    headers = {**headers_down(resp.headers), **(extra or {})}
    if resp.status_code >= 400:
        return upstream_error_response(resp.status_code, resp.content, headers)
    return Response(resp.content, status_code=resp.status_code,
                    media_type=resp.headers.get("content-type"), headers=headers)


async def relay_post(sc: Sidecar, request: Request, path: str) -> Response:
    """``POST path`` to the upstream (see the module docstring)."""
    body = await json_body(request)
    ident = identity_of(request, body)
    body = client_priority(body, sc.auth.perms, ident)  # every route vLLM queues by it
    forward, arrival = body, None
    meter: Meter | None = None
    if path in SALTED:
        require_model(body)
        forward = {**body, "cache_salt": sc.auth.salt_for(ident, body)}
        route = await sc.router.route(body, key=forward["cache_salt"])
        if sc.salt_mover is not None:  # after a secret rotation: the session's KV follows
            await sc.salt_mover.before_forward(ident, body, forward["cache_salt"])
        if ident.session is not None:
            arrival = sc.tracker.get(owner_of(ident), ident.session).turns.arrive()
        # a client's kv_transfer_params never reach the connector (they could name turns)
        forward["kv_transfer_params"] = kv_params(arrival, sc.settings.windows)
        prompt = prompt_estimate(forward)
        cap = answer_cap(body, route.info().max_model_len, prompt)
        meter = await sc.usage.meter(ident.tenant, str(route.model), prompt=prompt, cap=cap,
                                     owner=owner_of(ident))
    else:
        route = await sc.router.route_loose(body)
    try:
        return await _forward(sc, request, ident, path, route, forward, meter, arrival)
    except BaseException:
        Arrivals.end(arrival)
        if meter is not None:
            meter.cancel()
        raise


async def _forward(sc: Sidecar, request: Request, ident: Identity, path: str, route: Route,
                   forward: dict[str, Any], meter: Meter | None,
                   arrival: Arrival | None) -> Response:
    """Send the request up and relay the answer; ``meter`` bills a salted route's (the
    arrival ends with the answer)."""
    # a metric label: a model the router knows, never the client's free text (a new name on
    # every /tokenize would have grown /metrics, and this process, without bound)
    model = route.model or UNROUTED
    labels = (ident.tenant, model, path.rsplit("/", 1)[-1])
    up = headers_up(request.headers)
    if not forward.get("stream"):
        ep, resp = await sc.router.post(route, path, forward, headers=up)
        Arrivals.end(arrival)
        sc.metrics.requests.labels(*labels, str(resp.status_code)).inc()
        if meter is not None and resp.status_code == 200:
            await meter.bill(ep.name, resp.json().get("usage"))
        elif meter is not None:
            meter.cancel()
        return _relayed(resp, route_headers(route, ep))
    client_wants_usage = True  # (the Responses API reports it in its last event anyway)
    if path == "/v1/completions":
        forward = {**forward}
        client_wants_usage = ask_usage(forward)
    handle = await sc.router.open_stream(route, path, forward, headers=up)
    resp = handle.resp
    sc.metrics.requests.labels(*labels, str(resp.status_code)).inc()
    down = {**headers_down(resp.headers), **route_headers(route, handle.ep)}
    if resp.status_code != 200:
        content = await resp.aread()
        await handle.close()
        Arrivals.end(arrival)
        if meter is not None:
            meter.cancel()
        return upstream_error_response(resp.status_code, content, down)
    collected = Collected()

    async def settle() -> None:  # once, however the stream ended: what was relayed is billed
        try:
            await handle.close()
        finally:
            if not collected.usage:
                sc.metrics.streams_cut.labels(ident.tenant, model, labels[2]).inc()
            if meter is not None:
                await meter.bill(handle.ep.name, collected.usage, relayed=collected.chunks)

    async def body_iter():
        ended = False
        try:
            async for piece in relay_sse(handle.chunks(), collected, chat=False,
                                         strip_usage=not client_wants_usage):
                yield piece
            ended = True
        finally:  # also on an error or a client gone away (a BackgroundTask would not run)
            Arrivals.end(arrival)
            if ended:
                await settle()
            else:  # not awaited here: a client gone away cancelled this task
                sc.background.spawn(settle(), name=f"settle-{ident.tenant}")

    return SSEResponse(body_iter(), down)


async def relay_get(sc: Sidecar, request: Request, path: str) -> Response:
    """``GET path`` (the model list) relayed as it came from the default upstream; with
    several upstreams, the model list is theirs merged (the first entry of a model wins)."""
    if len(sc.router.endpoints) == 1 or path != "/v1/models":
        _, resp = await sc.router.get(sc.router.default_route(), path,
                                      headers=headers_up(request.headers))
        return _relayed(resp)
    return JSONResponse({"object": "list", "data": await sc.router.model_list()})


async def model_entry(sc: Sidecar, request: Request, model_id: str) -> Response:
    """``GET /v1/models/{id}``: the upstream list's entry for ``model_id`` (OpenAI's shape)."""
    resp = await relay_get(sc, request, "/v1/models")
    if resp.status_code != 200:
        return resp
    for entry in json.loads(resp.body).get("data") or []:
        if isinstance(entry, dict) and entry.get("id") == model_id:
            return JSONResponse(entry, headers=headers_down(resp.headers))
    raise ModelNotFound(f"the model `{model_id}` does not exist",
                        hint="GET /v1/models lists the served models")
