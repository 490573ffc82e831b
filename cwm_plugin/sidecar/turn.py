"""One chat turn through the sidecar (``POST /v1/chat/completions``).

1. authenticate (key -> tenant), read the bounded body, resolve the session, derive the salt;
2. check the model (404) and get its token counter (``counting.py``);
3. select memory under the budget, assemble the cache-aware prompt and count it (``plan.py``,
   on a worker thread);
4. forward with the salt, stream or not;
5. before the client sees the end, append the user's message and the answer to memory, count
   usage and thresholds, and start what is due (summary, facts, checkpoint) as background
   tasks: never awaited by a client (a checkpoint compacts the session at once and its summary
   is written while the next turns go on).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cwm_plugin.errors import UpstreamError
from cwm_plugin.sidecar import prompt as P
from cwm_plugin.sidecar.body import read_json_body, require_model
from cwm_plugin.sidecar.context import Level, SessionState, level_for
from cwm_plugin.sidecar.identity import Identity, bearer_key
from cwm_plugin.sidecar.memory_port import Selected
from cwm_plugin.sidecar.openai_errors import upstream_error_response
from cwm_plugin.sidecar.plan import Plan, history_tokens, plan_turn
from cwm_plugin.sidecar.runtime import Sidecar
from cwm_plugin.sidecar.stream import Collected, relay_sse

log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Turn:
    """The state of one chat turn between its steps."""

    sc: Sidecar
    ident: Identity
    model: str
    max_len: int | None
    salt: str
    split: P.SplitMessages
    state: SessionState
    plan: Plan
    counter: Any

    async def record(self, answer: str) -> None:
        """Append the new message and the answer to the session's memory (never raises)."""
        sc, new = self.sc, self.split.new
        if sc.memory is None:
            return
        turns = [(new["role"], P.text_of(new)), ("assistant", answer)]
        try:
            await sc.memory.record_turns(self.ident.tenant, self.ident.session, turns)
            cost = await asyncio.to_thread(history_tokens, self.counter, [
                {"role": r, "content": t} for r, t in turns])
        except Exception:
            sc.metrics.background.labels(self.ident.tenant, "record_turn", "error").inc()
            log.exception("recording a turn failed for tenant %s", self.ident.tenant)
            return
        self.state.turns_recorded += 1
        self.state.turns_since_summary += 1
        self.state.full_history_tokens += cost

    async def finish(self, usage: dict[str, Any] | None, answer: str) -> None:
        """After the response: metrics, thresholds, and the background work that is due."""
        sc, tenant, plan = self.sc, self.ident.tenant, self.plan
        sc.metrics.observe_usage(tenant, self.model, usage)
        if sc.memory is not None:
            sc.metrics.saved_tokens.labels(tenant, self.model).inc(max(0, plan.full - plan.sent))
        real = (usage or {}).get("prompt_tokens")
        self.state.observe(plan.prompt_tokens, real)
        prompt_tokens = int(real or plan.prompt_tokens)
        th = sc.settings.checkpoint.for_model(self.model)
        level = level_for(prompt_tokens, self.max_len, th)
        if self.max_len:
            sc.metrics.context_fraction.labels(tenant, self.model).observe(
                prompt_tokens / self.max_len)
        if level is not Level.OK:
            sc.metrics.context_warnings.labels(tenant, self.model, level.value).inc()
        if sc.maintainer is None or sc.memory is None:
            return
        checkpoint = level is Level.CHECKPOINT
        if checkpoint:
            self.state.compacted = True  # from the next turn on, whatever the summary does
        cfg = sc.settings.memory
        summary_due = bool(cfg.summary_every_turns) and \
            self.state.turns_since_summary >= cfg.summary_every_turns
        if not (checkpoint or summary_due or cfg.extract_facts):
            return
        exchange = f"user: {P.text_of(self.split.new)}\nassistant: {answer}"
        sc.background.spawn(sc.maintainer.after_turn(
            tenant=tenant, session=self.ident.session, model=self.model, salt=self.salt,
            state=self.state, exchange=exchange, max_model_len=self.max_len,
            checkpoint=checkpoint, hook=sc.snapshot_hook,
        ), name=f"after-turn-{tenant}")


def _debug_header(sel: Selected, compacted: bool, mode: str, cap: int,
                  recent: int, prompt_tokens: int | None = None) -> str:
    info: dict[str, Any] = {"mode": mode, "tokens": sel.tokens, "recent": recent,
                            "prompt_tokens": prompt_tokens,
                            "compacted": compacted, "facts": sel.facts,
                            "retrieval_ms": round(sel.seconds * 1000, 2),
                            "hits": sel.hits, "reasons": sel.reasons}
    for _ in range(len(sel.hits) + 2):
        text = json.dumps(info, separators=(",", ":"), ensure_ascii=True, default=str)
        if len(text) <= cap:
            return text
        if info.get("reasons") is not None:
            info["reasons"] = None
        elif info["hits"]:
            info["hits"] = info["hits"][:-1]
            info["truncated"] = True
    return json.dumps({"truncated": True, "tokens": sel.tokens})


async def handle_chat(sc: Sidecar, request: Request) -> Response:
    t0 = time.perf_counter()
    tenant_cfg = sc.auth.tenant_for(bearer_key(request.headers))
    body = await read_json_body(request, sc.settings.max_body_bytes)
    ident = sc.auth.identify(tenant_cfg, request.headers, body)
    model = require_model(body)
    salt = sc.auth.salt_for(ident, body)
    messages = P.validate_messages(body.get("messages"))
    info = await sc.model_info(model)
    split = P.split(messages)
    state = sc.tracker.get(ident.tenant, ident.session)
    counter = None
    if sc.memory is not None:
        counter = await sc.counters.get(model, info)
        plan = await asyncio.to_thread(plan_turn, sc.settings, sc.memory, counter, ident, body,
                                       messages, split, state, model, info.max_model_len)
        sc.metrics.retrieval_seconds.labels(ident.tenant, model).observe(plan.sel.seconds)
        sc.metrics.injected_tokens.labels(ident.tenant, model).inc(plan.injected)
    else:
        plan = Plan(built=P.assemble(split, split.history, ""), sel=Selected())
    forward = {**body, "messages": plan.built.messages, "cache_salt": salt}

    headers: dict[str, str] = {}
    th = sc.settings.checkpoint.for_model(model)
    used = state.estimate(plan.prompt_tokens)
    level = level_for(used, info.max_model_len, th)
    if level is not Level.OK and info.max_model_len:
        headers["X-CWM-Context-Warning"] = f"{level.value}; used={used / info.max_model_len:.2f}"
    if request.headers.get("x-cwm-debug") == "1":
        headers["X-CWM-Memory"] = _debug_header(plan.sel, state.compacted, sc.settings.injection,
                                                sc.settings.debug_header_max_bytes,
                                                len(plan.built.recent), plan.prompt_tokens)
    turn = Turn(sc, ident, model, info.max_model_len, salt, split, state, plan, counter)
    sc.metrics.overhead_seconds.labels(ident.tenant, model).observe(time.perf_counter() - t0)
    if body.get("stream"):
        return await _stream(turn, forward, headers)
    return await _once(turn, forward, headers)


async def _once(turn: Turn, forward: dict[str, Any], headers: dict[str, str]) -> Response:
    sc = turn.sc
    try:
        resp = await sc.upstream.request("POST", "/v1/chat/completions", json=forward)
    except UpstreamError as exc:
        sc.metrics.upstream_errors.labels(exc.code).inc()
        raise
    sc.metrics.requests.labels(turn.ident.tenant, turn.model, "chat", str(resp.status_code)).inc()
    if resp.status_code != 200:
        return upstream_error_response(resp.status_code, resp.content)
    data = resp.json()
    choices = data.get("choices") or [{}]
    answer = (choices[0].get("message") or {}).get("content") or ""
    await turn.record(answer)
    await turn.finish(data.get("usage"), answer)  # quick: the work it starts runs later
    return JSONResponse(data, headers=headers)


async def _stream(turn: Turn, forward: dict[str, Any], headers: dict[str, str]) -> Response:
    sc = turn.sc
    opts = forward.get("stream_options") or {}
    client_wants_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    if not client_wants_usage:
        forward["stream_options"] = {**(opts if isinstance(opts, dict) else {}),
                                     "include_usage": True}
    ctx = sc.upstream.stream("/v1/chat/completions", forward)
    try:
        resp = await ctx.__aenter__()
    except UpstreamError as exc:
        sc.metrics.upstream_errors.labels(exc.code).inc()
        raise
    sc.metrics.requests.labels(turn.ident.tenant, turn.model, "chat", str(resp.status_code)).inc()
    if resp.status_code != 200:
        content = await resp.aread()
        await ctx.__aexit__(None, None, None)
        return upstream_error_response(resp.status_code, content)
    collected = Collected()

    async def on_done() -> None:  # before the client sees [DONE] (usage came just before)
        await turn.record(collected.text)
        await turn.finish(collected.usage, collected.text)

    async def body():
        try:
            async for piece in relay_sse(sc.upstream.iter_bytes(resp), collected, chat=True,
                                         strip_usage=not client_wants_usage, on_done=on_done):
                yield piece
        finally:
            await ctx.__aexit__(None, None, None)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={**SSE_HEADERS, **headers})
