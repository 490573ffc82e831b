"""Routes relayed without memory, authenticated like chat, errors OpenAI-shaped.

``POST /v1/completions`` and ``/v1/responses`` carry the session's salt (streamed or not);
``POST /v1/embeddings``, ``/tokenize`` and ``/detokenize`` and ``GET /v1/models`` are relayed
as they are; ``GET /v1/models/{id}`` (which vLLM does not serve) answers that model's entry
of the upstream's list, or 404. A body is relayed byte for byte in both
directions except for the salt; ``x-request-id`` goes up, ``x-request-id`` and ``Retry-After``
come back.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from cwm_plugin.errors import UpstreamError
from cwm_plugin.sidecar.body import read_json_body, require_model
from cwm_plugin.sidecar.identity import bearer_key
from cwm_plugin.sidecar.openai_errors import ModelNotFound, upstream_error_response
from cwm_plugin.sidecar.runtime import Sidecar
from cwm_plugin.sidecar.stream import Collected, relay_sse
from cwm_plugin.sidecar.turn import SSE_HEADERS
from cwm_plugin.sidecar.upstream import headers_down, headers_up

SALTED = ("/v1/completions", "/v1/responses")


def _relayed(resp: Any) -> Response:
    """An upstream answer as it came: status, bytes, content type and the passed headers."""
    if resp.status_code >= 400:
        return upstream_error_response(resp.status_code, resp.content,
                                       headers_down(resp.headers))
    return Response(resp.content, status_code=resp.status_code,
                    media_type=resp.headers.get("content-type"),
                    headers=headers_down(resp.headers))


async def relay_post(sc: Sidecar, request: Request, path: str) -> Response:
    """``POST path`` to the upstream (see the module docstring)."""
    tenant_cfg = sc.auth.tenant_for(bearer_key(request.headers))
    body = await read_json_body(request, sc.settings.max_body_bytes, sc.settings.max_json_depth)
    ident = sc.auth.identify(tenant_cfg, request.headers, body)
    model = str(body.get("model") or "")
    forward = body
    if path in SALTED:
        model = require_model(body)
        await sc.model_info(model)
        forward = {**body, "cache_salt": sc.auth.salt_for(ident, body)}
    labels = (ident.tenant, model, path.rsplit("/", 1)[-1])
    up = headers_up(request.headers)
    try:
        if not body.get("stream"):
            resp = await sc.upstream.request("POST", path, json=forward, headers=up)
            sc.metrics.requests.labels(*labels, str(resp.status_code)).inc()
            if resp.status_code == 200 and path == "/v1/completions":
                sc.metrics.observe_usage(ident.tenant, model, resp.json().get("usage"))
            return _relayed(resp)
        ctx = sc.upstream.stream(path, forward, headers=up)
        resp = await ctx.__aenter__()
    except UpstreamError as exc:
        sc.metrics.upstream_errors.labels(exc.code).inc()
        raise
    sc.metrics.requests.labels(*labels, str(resp.status_code)).inc()
    if resp.status_code != 200:
        content = await resp.aread()
        await ctx.__aexit__(None, None, None)
        return upstream_error_response(resp.status_code, content, headers_down(resp.headers))
    collected = Collected()

    async def body_iter():
        try:
            async for piece in relay_sse(sc.upstream.iter_bytes(resp), collected, chat=False,
                                         strip_usage=False):
                yield piece
        finally:
            await ctx.__aexit__(None, None, None)

    def after() -> None:
        sc.metrics.observe_usage(ident.tenant, model, collected.usage)

    return StreamingResponse(body_iter(), media_type="text/event-stream",
                             headers={**SSE_HEADERS, **headers_down(resp.headers)},
                             background=BackgroundTask(after))


async def relay_get(sc: Sidecar, request: Request, path: str) -> Response:
    """``GET path`` (the model list, one model) relayed as it came."""
    sc.auth.tenant_for(bearer_key(request.headers))
    try:
        resp = await sc.upstream.request("GET", path, headers=headers_up(request.headers))
    except UpstreamError as exc:
        sc.metrics.upstream_errors.labels(exc.code).inc()
        raise
    return _relayed(resp)


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
