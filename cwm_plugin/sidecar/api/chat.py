"""One chat turn through the sidecar (``POST /v1/chat/completions``).

1. authenticated (key -> tenant, its rate; ``caller.py``), read the bounded body, resolve the
   session (or none: a stateless request), derive the salt;
2. route it (``upstream/router.py``: the upstreams serving its model, or, for ``model: auto``, the
   role the classifier picks; 404 for an unknown model) and get the model's token counter
   (``counting.py``);
3. plan the prompt (``plan.py``, on a worker thread): the client's messages with memory merged
   in. Any failure there (memory, index, embedder, tokenizer) fails *open*: the request goes
   upstream as the client sent it, flagged in ``X-CWM-Memory-Status`` (``failopen.py``);
4. forward with the salt and the client turn's number and arrival (``arrivals.py``,
   ``records.py``: the connector keeps the session's last few turns for windows; a continuing
   session this process has not seen first adopts its stored prompt state), stream or not,
   failing over to the next upstream serving the model if one is down (connect error or 5xx
   before any byte was relayed);
5. before the client sees the end (a stream cut short: once it is known to be, with what was
   relayed, marked as cut), record, bill and account for the turn (:mod:`.chat_turn`; the bill's
   estimate was reserved from the token quota before step 4).

Where the time goes (everything but the upstream's own time) is reported per request in a
``Server-Timing`` header and the ``cwm_sidecar_stage_seconds`` histogram.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from cwm_plugin import pg_scope
from cwm_plugin.errors import InvalidInput, UpstreamError
from cwm_plugin.sidecar.api.activity import PROJECT_HEADER, project_of
from cwm_plugin.sidecar.api.chat_turn import ChatTurn, answer_text, observe_stages
from cwm_plugin.sidecar.api.priority import client_priority, returning_priority
from cwm_plugin.sidecar.http.body import require_model
from cwm_plugin.sidecar.http.errors import upstream_error_response
from cwm_plugin.sidecar.identity.authenticator import Identity, owner_of
from cwm_plugin.sidecar.identity.caller import identity_of, json_body, principal_of
from cwm_plugin.sidecar.runtime import Sidecar
from cwm_plugin.sidecar.turn import prompt as P
from cwm_plugin.sidecar.turn.arrivals import Arrivals, kv_params
from cwm_plugin.sidecar.turn.failopen import HEADER as STATUS_HEADER
from cwm_plugin.sidecar.turn.plan import Plan, TurnInput, debug_header, passthrough, plan_turn
from cwm_plugin.sidecar.turn.records import answer_message, client_turn, restore_prompt
from cwm_plugin.sidecar.turn.rerank import reranker_for
from cwm_plugin.sidecar.turn.session import SessionState
from cwm_plugin.sidecar.upstream.client import headers_up
from cwm_plugin.sidecar.upstream.endpoints import StreamHandle
from cwm_plugin.sidecar.upstream.resume import resumable_events
from cwm_plugin.sidecar.upstream.stream import CUT_MARK, Collected, ask_usage, relay_sse
from cwm_plugin.sidecar.usage import answer_cap, prompt_estimate
from cwm_plugin.timing import Stages

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SSEResponse(StreamingResponse):
    """An event stream whose generator is closed when the response ends, however it ends: its
    ``finally`` settles the request (bills it, ends its arrival), also when the server raised
    on a client gone away (ASGI 2.4), which would leave the generator suspended otherwise (a
    client gone away is no error)."""

    def __init__(self, body: Any, headers: dict[str, str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # nobody reads the rest: no error to answer or log
            pass
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
HISTORY_HEADER = "x-cwm-history"
VIEW_HEADER = "x-cwm-memory-view"


def history_mode(sc: Sidecar, tenant_history: str | None, headers: Any) -> str:
    asked = headers.get(HISTORY_HEADER)
    if asked is not None:
        if asked not in ("full", "recent"):
            raise InvalidInput(f"{HISTORY_HEADER} must be `full` or `recent`")
        return asked
    return tenant_history or sc.settings.prompt.history


def memory_view(sc: Sidecar, headers: Any) -> str:
    """``quick`` or ``full`` (``plan.py``): the request's header, else the setting."""
    asked = headers.get(VIEW_HEADER)
    if asked is not None and asked not in ("quick", "full"):
        raise InvalidInput(f"{VIEW_HEADER} must be `quick` or `full`")
    return asked or sc.settings.prompt.memory_view


def _project(headers: Any) -> str | None:
    try:
        return project_of(headers.get(PROJECT_HEADER))
    except InvalidInput:  # only the activity log reads it: never fail a turn for it
        return None


async def _plan(sc: Sidecar, turn_in: dict[str, Any], stages: Stages) -> tuple[Plan, Any, str]:
    """The plan, the counter and the memory status header ("" when all went well)."""
    ident: Identity = turn_in["ident"]
    if sc.memory is None or not turn_in.pop("readable"):
        return passthrough(turn_in["messages"]), None, ""
    counter = None
    try:
        counter = await sc.counters.get(turn_in["model"], turn_in.pop("info"))
        system_role = await sc.counters.system_role(turn_in["model"], counter)
        t = TurnInput(settings=sc.settings, mem=sc.memory, counter=counter,
                      system_role=system_role, stages=stages, **turn_in)
        return await sc.memory.run(ident.tenant, lambda: plan_turn(t)), counter, ""
    except Exception as exc:  # fail open: the client's request goes up as it came
        return passthrough(turn_in["messages"]), counter, \
            sc.failopen.failed(ident.tenant, "select", exc)


async def handle_chat(sc: Sidecar, request: Request) -> Response:
    stages = Stages()
    t0 = time.perf_counter()
    tenant_cfg = principal_of(request)  # authenticated before the body was read (caller.py)
    body = await json_body(request)
    ident = identity_of(request, body)
    model = require_model(body)
    body = client_priority(body, sc.auth.perms, ident)
    salt = sc.auth.salt_for(ident, body)
    messages = P.validate_messages(body.get("messages"))
    mode = history_mode(sc, tenant_cfg.history, request.headers)
    view = memory_view(sc, request.headers)
    perms, debug = sc.auth.perms, request.headers.get("x-cwm-debug") == "1"
    if debug:
        perms.require_grant(ident.tenant, "debug", "X-CWM-Debug: 1", bound=ident.bound)
    home, project = perms.namespace(ident.namespace, ident.user), _project(request.headers)
    shared = [ns.folder for ns in perms.shared(ident, project) if ns.folder]
    # a request naming neither session nor user may be anyone's (one key often serves many
    # people): no memory of other conversations unless its tenant turns that on
    readable = perms.allows(ident, home, "read") and \
        (not ident.sessionless or tenant_cfg.stateless_memory)
    can_append, can_write = perms.allows(ident, home, "append"), perms.allows(ident, home, "write")
    pg_scope.enter(pg_scope.folders(  # the database sees what these decisions allow, no more
        [home.folder, *shared] if readable else [],
        [home.folder] if can_append or can_write else []))
    stages.add("auth", time.perf_counter() - t0)
    route = await sc.router.route(body, key=salt)  # the session's upstream first
    model, info = route.model or model, route.info()
    state = sc.tracker.get(owner_of(ident), ident.session) if ident.session else SessionState()
    number = client_turn(messages, mode)
    if sc.shared is not None and ident.session is not None:  # moved on by another replica?
        with stages("state"):
            await sc.shared.pull(ident.tenant, owner_of(ident), ident.session, state)
    if ident.session is not None:  # a thawed window, a restart: its prompt state first
        await restore_prompt(sc, ident.tenant, salt, state, state.turns.number(number),
                             messages)
    plan, counter, status = await _plan(sc, {
        "ident": ident, "body": body, "messages": messages, "state": state, "model": model,
        "max_len": sc.settings.context_limit(ident.tenant, info.max_model_len), "mode": mode,
        "info": info, "shared": shared, "view": view, "readable": readable,
        "reranker": reranker_for(sc, ident.tenant, route, salt, model)}, stages)
    if sc.shared is not None and ident.session is not None:  # before the client has the answer
        with stages("state"):
            await sc.shared.push(ident.tenant, owner_of(ident), ident.session, state)
    if sc.memory is not None and not status:
        sc.metrics.retrieval_seconds.labels(ident.tenant, model).observe(plan.sel.seconds)
        sc.metrics.injected_tokens.labels(ident.tenant, model).inc(plan.injected)
        turn_headers = {"X-CWM-Memory-View": view, "X-CWM-Memory-Tokens": str(plan.injected)}
    else:
        turn_headers = {STATUS_HEADER: status} if status else {}
    forward = {**body, "model": model, "messages": plan.messages, "cache_salt": salt}
    turn = ChatTurn(sc, ident, model, info.max_model_len, salt, messages, state, plan, counter,
                stages, route, turn_headers,
                used=state.estimate(plan.prompt_tokens), project=project,
                can_append=can_append, can_write=can_write)
    if debug:
        p = sc.settings.prompt
        turn.headers["X-CWM-Memory"] = debug_header(
            plan.sel, state.compacted, f"{mode}/{p.placement}/{p.refresh}",
            sc.settings.debug_header_max_bytes, len(plan.messages), plan.prompt_tokens,
            plan.sent, plan.full, plan.injected, view)
    if sc.salt_mover is not None:  # after a secret rotation: the session's KV follows
        with stages("salt"):
            await sc.salt_mover.before_forward(ident, body, salt)
    sc.metrics.overhead_seconds.labels(ident.tenant, model).observe(stages.total)
    prompt = plan.prompt_tokens or prompt_estimate(forward)
    turn.meter = await sc.usage.meter(ident.tenant, model, prompt=prompt, owner=owner_of(ident),
                                      cap=answer_cap(body, info.max_model_len, prompt))
    up = headers_up(request.headers)
    turn.priority = returning_priority(body, state, ident.session,
                                       sc.settings.routing.returning_priority)
    arrival = turn.arrival = state.turns.arrive(number) if ident.session else None
    forward["kv_transfer_params"] = kv_params(arrival, sc.settings.windows)
    try:
        if body.get("stream"):
            return await _stream(turn, forward, up)  # ends the arrival when the stream does
        return await _once(turn, forward, up)
    except BaseException:
        Arrivals.end(arrival)
        turn.meter.cancel()  # nothing to bill (once billed, this changes nothing)
        raise


async def _once(turn: ChatTurn, forward: dict[str, Any], up: dict[str, str]) -> Response:
    sc = turn.sc
    ep, resp = await sc.router.post(turn.route, "/v1/chat/completions", forward, headers=up,
                                    priority=turn.priority)
    Arrivals.end(turn.arrival)
    turn.served_by(ep)
    sc.metrics.requests.labels(turn.ident.tenant, turn.model, "chat", str(resp.status_code)).inc()
    if resp.status_code != 200:
        turn.meter.cancel()
        return upstream_error_response(resp.status_code, resp.content,
                                       turn.response_headers(resp.headers))
    data = resp.json()
    message = ((data.get("choices") or [{}])[0].get("message") or {})
    answer = answer_text(message.get("content"), message.get("tool_calls"))
    await turn.record(answer)
    await turn.finish(data.get("usage"), answer,  # quick: the work it starts runs later
                      answer_message(message.get("content"), message.get("tool_calls")))
    observe_stages(turn)
    return JSONResponse(data, headers=turn.response_headers(resp.headers))


async def _stream(turn: ChatTurn, forward: dict[str, Any], up: dict[str, str]) -> Response:
    sc = turn.sc
    client_wants_usage = ask_usage(forward)
    handle = await sc.router.open_stream(turn.route, "/v1/chat/completions", forward,
                                         headers=up, priority=turn.priority)
    resp = handle.resp
    turn.served_by(handle.ep)
    sc.metrics.requests.labels(turn.ident.tenant, turn.model, "chat", str(resp.status_code)).inc()
    headers = turn.response_headers(resp.headers)
    if resp.status_code != 200:
        content = await resp.aread()
        await handle.close()
        Arrivals.end(turn.arrival)
        turn.meter.cancel()
        return upstream_error_response(resp.status_code, content, headers)
    collected = Collected()

    async def on_done() -> None:  # before the client sees [DONE] (usage came just before)
        answer = answer_text(collected.text, collected.tool_calls)
        await turn.record(answer)
        await turn.finish(collected.usage, answer,
                          answer_message(collected.text, collected.tool_calls),
                          collected.chunks)
        observe_stages(turn)

    async def cut() -> None:
        """The stream ended before [DONE] (the client went away, or the upstream failed):
        billed and recorded up to what was relayed, the answer marked as cut."""
        await handle.close()
        sc.metrics.streams_cut.labels(turn.ident.tenant, turn.model, "chat").inc()
        answer = answer_text(collected.text, collected.tool_calls)
        marked = f"{answer}\n{CUT_MARK}" if answer else CUT_MARK
        await turn.record(marked)
        await turn.finish(collected.usage, marked,
                          answer_message(collected.text, collected.tool_calls), collected.chunks)
        observe_stages(turn)

    def resumed(nxt: StreamHandle, exc: UpstreamError) -> None:
        collected.carried = collected.relayed
        turn.served_by(nxt.ep)
        sc.metrics.streams_resumed.labels(turn.ident.tenant, turn.model, handle.ep.name,
                                          nxt.ep.name).inc()

    async def body():
        events = resumable_events(sc.router, turn.route, "/v1/chat/completions", forward,
                                  handle, collected, headers=up, on_resume=resumed,
                                  priority=turn.priority)
        try:
            async for piece in relay_sse(events, collected, chat=True,
                                         strip_usage=not client_wants_usage, on_done=on_done):
                yield piece
        finally:
            Arrivals.end(turn.arrival)
            if collected.done:
                await handle.close()
            else:  # not awaited here: a client gone away cancelled this task
                sc.background.spawn(cut(), name=f"cut-{turn.ident.tenant}")

    return SSEResponse(body(), headers)
