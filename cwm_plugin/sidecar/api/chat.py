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
   relayed, marked as cut), append the client's new messages and the answer to the
   session's file (one durable append; the index catches up in the background), bill it
   (``usage.py``'s ``Meter``: its estimate was reserved from the token quota before step 4)
   and count the context thresholds against the limit of the upstream that answered,
   and queue what is due (summary, facts, checkpoint) as one job of the session on the bounded
   background queue (``background/queue.py``); the activity log's line is a plain background task.

Where the time goes (everything but the upstream's own time) is reported per request in a
``Server-Timing`` header and the ``cwm_sidecar_stage_seconds`` histogram.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cwm_plugin.errors import InvalidInput, UpstreamError
from cwm_plugin.memory.selection.history import prefix_length
from cwm_plugin.sidecar.api.activity import PROJECT_HEADER, log_turn, project_of, turn_entry
from cwm_plugin.sidecar.background.queue import Job
from cwm_plugin.sidecar.http.body import require_model
from cwm_plugin.sidecar.http.errors import upstream_error_response
from cwm_plugin.sidecar.identity.authenticator import Identity, owner_of
from cwm_plugin.sidecar.identity.caller import identity_of, json_body, principal_of
from cwm_plugin.sidecar.runtime import Sidecar
from cwm_plugin.sidecar.turn import prompt as P
from cwm_plugin.sidecar.turn.arrivals import Arrival, Arrivals, kv_params
from cwm_plugin.sidecar.turn.failopen import HEADER as STATUS_HEADER
from cwm_plugin.sidecar.turn.plan import (
    Plan,
    TurnInput,
    debug_header,
    history_tokens,
    passthrough,
    plan_turn,
)
from cwm_plugin.sidecar.turn.records import (
    answer_message,
    client_turn,
    restore_prompt,
    save_turn,
)
from cwm_plugin.sidecar.turn.session import Level, SessionState, level_for
from cwm_plugin.sidecar.upstream.client import headers_down, headers_up
from cwm_plugin.sidecar.upstream.endpoints import StreamHandle
from cwm_plugin.sidecar.upstream.resume import resumable_events
from cwm_plugin.sidecar.upstream.router import Endpoint, Route
from cwm_plugin.sidecar.upstream.stream import CUT_MARK, Collected, ask_usage, relay_sse
from cwm_plugin.sidecar.usage import Meter, answer_cap, prompt_estimate
from cwm_plugin.timing import Stages

log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
HISTORY_HEADER = "x-cwm-history"
VIEW_HEADER = "x-cwm-memory-view"
RECORDED_ROLES = ("user", "tool")


def new_inputs(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The client's messages since the model last answered (a question, or tool results)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    start = max(last + 1, prefix_length(messages))
    return [m for m in messages[start:] if m.get("role") in RECORDED_ROLES]


def answer_text(content: str | None, tool_calls: list[dict[str, Any]] | None) -> str:
    """An answer as one transcript line: its text and the tools it called."""
    calls = [f"[tool call {(c.get('function') or {}).get('name', '?')}"
             f"({(c.get('function') or {}).get('arguments', '')})]" for c in tool_calls or []]
    return "\n".join([x for x in [content or "", *calls] if x])


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


def route_headers(route: Route, ep: Endpoint | None) -> dict[str, str]:
    """``X-CWM-Upstream`` (the name of the upstream that answered) and, for a request the
    sidecar routed by role, ``X-CWM-Route`` (the role and why)."""
    out = {"X-CWM-Upstream": ep.name} if ep is not None else {}
    if route.role is not None:
        why = f"{route.role}; {route.reason}".encode("ascii", "replace").decode()
        out["X-CWM-Route"] = "".join(c if " " <= c <= "~" else "?" for c in why)[:300]
    return out


def _project(headers: Any) -> str | None:
    try:
        return project_of(headers.get(PROJECT_HEADER))
    except InvalidInput:  # only the activity log reads it: never fail a turn for it
        return None


@dataclass
class ChatTurn:
    """The state of one chat turn between its steps."""

    sc: Sidecar
    ident: Identity
    model: str
    max_len: int | None
    salt: str
    messages: list[dict[str, Any]]
    state: SessionState
    plan: Plan
    counter: Any
    stages: Stages
    route: Route
    headers: dict[str, str] = field(default_factory=dict)
    used: int = 0  # this turn's prompt tokens, estimated before it is sent
    project: str | None = None
    ep: Endpoint | None = None  # the upstream that answered
    can_append: bool = True  # the home namespace takes its transcript (identity/access.py) ...
    can_write: bool = True  # ... and its summaries and facts
    arrival: Arrival | None = None  # the client turn of its session (arrivals.py)
    meter: Meter | None = None  # bills it (usage.py)

    def served_by(self, ep: Endpoint) -> None:
        """The context limit is the one of the upstream that answered (it may have failed
        over to one with another limit), or the principal's own if it is a provider with a
        smaller one."""
        self.ep = ep
        self.max_len = self.sc.settings.context_limit(self.ident.tenant,
                                                      ep.info(self.model).max_model_len)
        self.state.last_limit = self.max_len

    async def record(self, answer: str) -> None:
        """Append the new messages and the answer to the session (never raises)."""
        sc, session = self.sc, self.ident.session
        if sc.memory is None or session is None or not self.can_append:
            return
        turns = [(m["role"], P.text_of(m)) for m in new_inputs(self.messages)]
        turns.append(("assistant", answer))
        tenant, folder = self.ident.tenant, self.ident.folder
        msgs = [{"role": r, "content": t} for r, t in turns]
        try:
            with self.stages("files"):
                await sc.memory.record_turns(folder, session, turns, defer_index=True)
        except Exception as exc:
            self.headers.setdefault(STATUS_HEADER, sc.failopen.failed(tenant, "record", exc))
            return
        sc.background.spawn(self._after_record(), name=f"index-{tenant}")
        state = self.state
        state.turns_recorded += 1
        state.turns_since_summary += 1
        state.turns_since_facts += len(turns)
        try:
            with self.stages("count"):
                state.full_history_tokens += history_tokens(self.counter, msgs)
        except Exception:  # no counter, or it failed (and was flagged): recount next time
            state.history_known = False

    async def _after_record(self) -> None:
        try:
            await self.sc.memory.after_record(self.ident.folder, self.plan.sel)
        except Exception as exc:  # an embedder outage, say: counted and logged once
            self.sc.failopen.failed(self.ident.tenant, "index", exc)

    async def finish(self, usage: dict[str, Any] | None, answer: str,
                     reply: dict[str, Any], relayed: int = 0) -> None:
        """After the response: the bill (``usage``, else ``relayed`` tokens of a stream cut
        short), metrics, thresholds, the turn's conversation record (``reply``: the answer as
        the client holds it), and the background work that is due."""
        sc, tenant, plan, state = self.sc, self.ident.tenant, self.plan, self.state
        if self.meter is not None:
            await self.meter.bill(self.ep.name if self.ep else "", usage, relayed)
        if self.arrival is not None:
            save_turn(sc, self.salt, self.arrival, plan.prompt, self.model, self.messages,
                      reply)
        if sc.memory is not None:
            sc.metrics.saved_tokens.labels(tenant, self.model).inc(max(0, plan.full - plan.sent))
        real = (usage or {}).get("prompt_tokens")
        state.observe(plan.prompt_tokens, real)
        prompt_tokens = int(real or plan.prompt_tokens)
        th = sc.settings.checkpoint.for_model(self.model)
        level = level_for(prompt_tokens, self.max_len, th)
        if self.max_len:
            sc.metrics.context_fraction.labels(tenant, self.model).observe(
                prompt_tokens / self.max_len)
        if level is not Level.OK:
            sc.metrics.context_warnings.labels(tenant, self.model, level.value).inc()
        if sc.activity is not None and sc.settings.activity and sc.settings.activity.log_turns:
            asked = [P.text_of(m) for m in new_inputs(self.messages) if m["role"] == "user"]
            sc.background.spawn(log_turn(sc, turn_entry(
                sc.settings, principal=owner_of(self.ident), session=self.ident.session,
                project=self.project, model=self.model, question=asked[-1] if asked else "",
                answer=answer, used=prompt_tokens, limit=self.max_len)),
                name=f"activity-{tenant}")
        if sc.maintainer is None or sc.memory is None or self.ident.session is None \
                or not self.can_write:
            return
        checkpoint = level is Level.CHECKPOINT and not state.checkpointing
        if checkpoint:
            state.checkpointing = True  # compacted once the summary is written
        cfg = sc.settings.memory
        summary_due = bool(cfg.summary_every_turns) and \
            state.turns_since_summary >= cfg.summary_every_turns
        facts_due = cfg.extract_facts and state.turns_since_facts >= cfg.facts_every_turns
        if not (checkpoint or summary_due or facts_due):
            return
        job = Job(sc.maintainer.run, checkpoint=checkpoint, info={
            "tenant": tenant, "folder": self.ident.folder, "session": self.ident.session,
            "model": self.model,
            "salt": self.salt, "state": state, "max_model_len": self.max_len,
            "hook": sc.snapshot_hook, "owner": owner_of(self.ident)})
        if sc.background.submit((self.ident.folder, self.ident.session), job,
                                force=checkpoint) == "dropped":
            log.info("background queue full: the work due for tenant %s waits for the "
                     "session's next turn", tenant)

    def response_headers(self, upstream: Any = None) -> dict[str, str]:
        """Ours plus the upstream's that the client should see; timing of the sidecar's own
        work (``Server-Timing``), the stages so far."""
        out = {**self.headers, **route_headers(self.route, self.ep),
               **(headers_down(upstream) if upstream is not None else {})}
        level = level_for(self.used, self.max_len,
                          self.sc.settings.checkpoint.for_model(self.model))
        if level is not Level.OK and self.max_len:
            out["X-CWM-Context-Warning"] = f"{level.value}; used={self.used / self.max_len:.2f}"
        out["Server-Timing"] = self.stages.server_timing()
        return out


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
        return await asyncio.to_thread(plan_turn, t), counter, ""
    except Exception as exc:  # fail open: the client's request goes up as it came
        return passthrough(turn_in["messages"]), counter, \
            sc.failopen.failed(ident.tenant, "select", exc)


async def handle_chat(sc: Sidecar, request: Request) -> Response:
    stages = Stages()
    t0 = time.perf_counter()
    tenant_cfg = principal_of(request)  # authenticated before the body was read (identity/caller.py)
    body = await json_body(request)
    ident = identity_of(request, body)
    model = require_model(body)
    salt = sc.auth.salt_for(ident, body)
    messages = P.validate_messages(body.get("messages"))
    mode = history_mode(sc, tenant_cfg.history, request.headers)
    view = memory_view(sc, request.headers)
    perms, debug = sc.auth.perms, request.headers.get("x-cwm-debug") == "1"
    if debug:
        perms.require_grant(ident.tenant, "debug", "X-CWM-Debug: 1")
    home, project = perms.namespace(ident.namespace, ident.user), _project(request.headers)
    shared = [ns.folder for ns in perms.shared(ident.tenant, ident.user, project) if ns.folder]
    stages.add("auth", time.perf_counter() - t0)
    route = await sc.router.route(body)
    model, info = route.model or model, route.info()
    state = sc.tracker.get(owner_of(ident), ident.session) if ident.session else SessionState()
    number = client_turn(messages, mode)
    if ident.session is not None:  # a thawed window, a restart: its prompt state first
        await restore_prompt(sc, salt, state, state.turns.number(number), messages)
    plan, counter, status = await _plan(sc, {
        "ident": ident, "body": body, "messages": messages, "state": state, "model": model,
        "max_len": sc.settings.context_limit(ident.tenant, info.max_model_len), "mode": mode,
        "info": info, "shared": shared,
        "view": view,
        # a request naming neither session nor user may be anyone's (one key often serves
        # many people): no memory of other conversations unless its tenant turns that on
        "readable": perms.allows(ident.tenant, home, "read") and
        (not ident.sessionless or tenant_cfg.stateless_memory)}, stages)
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
                can_append=perms.allows(ident.tenant, home, "append"),
                can_write=perms.allows(ident.tenant, home, "write"))
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


def _observe_stages(turn: ChatTurn) -> None:
    for name, seconds in turn.stages.seconds.items():
        turn.sc.metrics.stage_seconds.labels(name).observe(seconds)
    turn.sc.metrics.stage_seconds.labels("total").observe(turn.stages.total)


async def _once(turn: ChatTurn, forward: dict[str, Any], up: dict[str, str]) -> Response:
    sc = turn.sc
    ep, resp = await sc.router.post(turn.route, "/v1/chat/completions", forward, headers=up)
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
    _observe_stages(turn)
    return JSONResponse(data, headers=turn.response_headers(resp.headers))


async def _stream(turn: ChatTurn, forward: dict[str, Any], up: dict[str, str]) -> Response:
    sc = turn.sc
    client_wants_usage = ask_usage(forward)
    handle = await sc.router.open_stream(turn.route, "/v1/chat/completions", forward,
                                         headers=up)
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
        _observe_stages(turn)

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
        _observe_stages(turn)

    def resumed(nxt: StreamHandle, exc: UpstreamError) -> None:
        collected.carried = collected.chunks
        turn.served_by(nxt.ep)
        sc.metrics.streams_resumed.labels(turn.ident.tenant, turn.model, handle.ep.name,
                                          nxt.ep.name).inc()

    async def body():
        events = resumable_events(sc.router, turn.route, "/v1/chat/completions", forward,
                                  handle, collected, headers=up, on_resume=resumed)
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

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={**SSE_HEADERS, **headers})
