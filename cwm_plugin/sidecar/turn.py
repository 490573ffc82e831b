"""One chat turn through the sidecar (``POST /v1/chat/completions``).

1. authenticate (key -> tenant), read the bounded body, resolve the session, derive the salt;
2. check the model (404) and wait for a checkpoint of this session still running;
3. select memory under the budget and assemble the cache-aware prompt (:mod:`prompt`);
4. forward with the salt, stream or not;
5. before the client sees the end, append the user's message and the answer to memory;
6. after the response: usage metrics, context thresholds, summary/facts/checkpoint in the
   background.
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
from starlette.background import BackgroundTask

from cwm_plugin.errors import UpstreamError
from cwm_plugin.sidecar import prompt as P
from cwm_plugin.sidecar.body import read_json_body, require_model
from cwm_plugin.sidecar.context import Level, SessionState, level_for
from cwm_plugin.sidecar.identity import Identity, bearer_key
from cwm_plugin.sidecar.memory_port import Selected
from cwm_plugin.sidecar.openai_errors import upstream_error_response
from cwm_plugin.sidecar.runtime import Sidecar
from cwm_plugin.sidecar.stream import Collected, relay_sse

log = logging.getLogger(__name__)
CHECKPOINT_WAIT_S = 120.0
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
    sent_estimate: int
    full_estimate: int
    injected: int

    async def record(self, answer: str) -> None:
        """Append the new message and the answer to the session's memory (never raises)."""
        sc, new = self.sc, self.split.new
        if sc.memory is None:
            return
        turns = [(new["role"], P.text_of(new)), ("assistant", answer)]
        try:
            await sc.memory.record_turns(self.ident.tenant, self.ident.session, turns)
        except Exception:
            sc.metrics.background.labels(self.ident.tenant, "record_turn", "error").inc()
            log.exception("recording a turn failed for tenant %s", self.ident.tenant)
            return
        self.state.turns_recorded += 1
        self.state.turns_since_summary += 1
        self.state.full_history_tokens += sum(sc.memory.count(t) for _, t in turns)

    async def finish(self, usage: dict[str, Any] | None, answer: str) -> None:
        """After the response: metrics, thresholds, and the background work that is due."""
        sc, tenant = self.sc, self.ident.tenant
        sc.metrics.observe_usage(tenant, self.model, usage)
        sc.metrics.saved_tokens.labels(tenant, self.model).inc(
            max(0, self.full_estimate - self.sent_estimate))
        prompt_tokens = int((usage or {}).get("prompt_tokens") or self.sent_estimate)
        self.state.last_prompt_tokens = prompt_tokens
        th = sc.settings.checkpoint.for_model(self.model)
        level = level_for(prompt_tokens, self.max_len, th)
        if self.max_len:
            sc.metrics.context_fraction.labels(tenant, self.model).observe(
                prompt_tokens / self.max_len)
        if level is not Level.OK:
            sc.metrics.context_warnings.labels(tenant, self.model, level.value).inc()
        if sc.maintainer is None or sc.memory is None:
            return
        cfg = sc.settings.memory
        summary_due = bool(cfg.summary_every_turns) and \
            self.state.turns_since_summary >= cfg.summary_every_turns
        if not (level is Level.CHECKPOINT or summary_due or cfg.extract_facts):
            return
        exchange = f"user: {P.text_of(self.split.new)}\nassistant: {answer}"
        task = sc.background.spawn(sc.maintainer.after_turn(
            tenant=tenant, session=self.ident.session, model=self.model, salt=self.salt,
            state=self.state, exchange=exchange, max_model_len=self.max_len,
            checkpoint=level is Level.CHECKPOINT, hook=sc.snapshot_hook,
        ), name=f"after-turn-{tenant}")
        if level is Level.CHECKPOINT:
            self.state.pending = task  # the next turn of this session waits for it


def _debug_header(sel: Selected, compacted: bool, mode: str, cap: int,
                  recent: int) -> str:
    info: dict[str, Any] = {"mode": mode, "tokens": sel.tokens, "recent": recent,
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


async def _wait_pending(state: SessionState) -> None:
    task = state.pending
    if task is not None and not task.done():
        await asyncio.wait({task}, timeout=CHECKPOINT_WAIT_S)
    state.pending = None


async def _budget(sc: Sidecar, ident: Identity, body: dict[str, Any], split: P.SplitMessages,
                  max_len: int | None) -> int:
    """Tokens for the memory selection: the recent turns it keeps verbatim plus the memory
    budget, capped by what the context has left after the prefix, new message and answer."""
    mem, cfg = sc.memory, sc.settings.memory
    assert mem is not None
    budget = cfg.budget_tokens
    if max_len:
        budget = min(budget, int(max_len * cfg.budget_fraction))
    if cfg.recent_turns:
        tail = split.history[-cfg.recent_turns:] if split.history else P.recent_from_transcript(
            await mem.transcript(ident.tenant, ident.session), cfg.recent_turns)
        budget += mem.count_messages(tail)
    if max_len:
        answer = body.get("max_completion_tokens") or body.get("max_tokens")
        answer = answer if isinstance(answer, int) and answer > 0 else 256
        left = max_len - min(answer, max_len) - mem.count_messages(split.prefix + [split.new]) - 32
        budget = min(budget, left)
    return max(0, budget)


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
    await _wait_pending(state)

    sel = Selected()
    recent = split.history
    summary = None
    mem = sc.memory
    if mem is not None:
        if not state.history_known:
            turns = await mem.transcript(ident.tenant, ident.session)
            state.full_history_tokens = sum(mem.count(str(t.get("content", ""))) for t in turns)
            state.turns_recorded = len(turns) // 2
            state.history_known = True
        budget = await _budget(sc, ident, body, split, info.max_model_len)
        sel = await mem.select(ident.tenant, ident.session, messages, budget,
                               query=P.text_of(split.new))
        sc.metrics.retrieval_seconds.labels(ident.tenant, model).observe(sel.seconds)
        recent = sel.recent if sel.recent is not None else split.history
        if state.compacted and not sel.summary:
            summary = await mem.summary(ident.tenant, ident.session)
    th = sc.settings.checkpoint.for_model(model)
    built = P.assemble(split, recent, sel.memory_block, mode=sc.settings.injection,
                       summary=summary, keep=th.keep_turns if state.compacted else None)
    forward = {**body, "messages": built.messages, "cache_salt": salt}

    headers: dict[str, str] = {}
    sent_est = full_est = injected = 0
    if mem is not None:
        injected = mem.count(built.memory_message["content"]) if built.memory_message else 0
        sent_est = mem.count_messages(built.messages)
        full_est = max(mem.count_messages(messages),
                       mem.count_messages(split.prefix + [split.new])
                       + state.full_history_tokens)
        sc.metrics.injected_tokens.labels(ident.tenant, model).inc(injected)
    level = level_for(max(sent_est, state.last_prompt_tokens), info.max_model_len, th)
    if level is not Level.OK and info.max_model_len:
        frac = max(sent_est, state.last_prompt_tokens) / info.max_model_len
        headers["X-CWM-Context-Warning"] = f"{level.value}; used={frac:.2f}"
    if request.headers.get("x-cwm-debug") == "1":
        headers["X-CWM-Memory"] = _debug_header(sel, state.compacted, sc.settings.injection,
                                                sc.settings.debug_header_max_bytes,
                                                len(built.recent))
    turn = Turn(sc, ident, model, info.max_model_len, salt, split, state, sent_est, full_est,
                injected)
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
    return JSONResponse(data, headers=headers,
                        background=BackgroundTask(turn.finish, data.get("usage"), answer))


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

    async def on_done() -> None:
        await turn.record(collected.text)

    async def body():
        try:
            async for piece in relay_sse(sc.upstream.iter_bytes(resp), collected, chat=True,
                                         strip_usage=not client_wants_usage, on_done=on_done):
                yield piece
        finally:
            await ctx.__aexit__(None, None, None)

    async def after() -> None:
        if collected.done:
            await turn.finish(collected.usage, collected.text)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={**SSE_HEADERS, **headers}, background=BackgroundTask(after))
