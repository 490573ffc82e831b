"""Routes relayed without memory: ``/v1/completions`` (with the session's salt) and
``/v1/models``. Authenticated like chat; errors OpenAI-shaped."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from cwm_plugin.errors import UpstreamError
from cwm_plugin.sidecar.body import read_json_body, require_model
from cwm_plugin.sidecar.identity import bearer_key
from cwm_plugin.sidecar.openai_errors import upstream_error_response
from cwm_plugin.sidecar.runtime import Sidecar
from cwm_plugin.sidecar.stream import Collected, relay_sse
from cwm_plugin.sidecar.turn import SSE_HEADERS


async def handle_completions(sc: Sidecar, request: Request) -> Response:
    tenant_cfg = sc.auth.tenant_for(bearer_key(request.headers))
    body = await read_json_body(request, sc.settings.max_body_bytes)
    ident = sc.auth.identify(tenant_cfg, request.headers, body)
    model = require_model(body)
    forward = {**body, "cache_salt": sc.auth.salt_for(ident, body)}
    await sc.model_info(model)
    labels = (ident.tenant, model, "completions")
    try:
        if not body.get("stream"):
            resp = await sc.upstream.request("POST", "/v1/completions", json=forward)
            sc.metrics.requests.labels(*labels, str(resp.status_code)).inc()
            if resp.status_code != 200:
                return upstream_error_response(resp.status_code, resp.content)
            data = resp.json()
            sc.metrics.observe_usage(ident.tenant, model, data.get("usage"))
            return JSONResponse(data)
        ctx = sc.upstream.stream("/v1/completions", forward)
        resp = await ctx.__aenter__()
    except UpstreamError as exc:
        sc.metrics.upstream_errors.labels(exc.code).inc()
        raise
    sc.metrics.requests.labels(*labels, str(resp.status_code)).inc()
    if resp.status_code != 200:
        content = await resp.aread()
        await ctx.__aexit__(None, None, None)
        return upstream_error_response(resp.status_code, content)
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

    return StreamingResponse(body_iter(), media_type="text/event-stream", headers=SSE_HEADERS,
                             background=BackgroundTask(after))


async def handle_models(sc: Sidecar, request: Request) -> Response:
    sc.auth.tenant_for(bearer_key(request.headers))
    try:
        resp = await sc.upstream.request("GET", "/v1/models")
    except UpstreamError as exc:
        sc.metrics.upstream_errors.labels(exc.code).inc()
        raise
    if resp.status_code != 200:
        return upstream_error_response(resp.status_code, resp.content)
    return JSONResponse(resp.json())
