"""A chat turn's state between its steps, and what it does once the answer is in.

:class:`ChatTurn` is built by the route (:mod:`.chat`) after the prompt is planned. When the
upstream has answered (or a stream ended, whole or cut), it appends the client's new messages
and the answer to the session's file (one durable append; the index catches up in the
background), bills the request (``usage.py``'s ``Meter``), leaves the turn's record for
context windows (``records.py``), counts the context thresholds against the limit of the
upstream that answered, logs the turn to the activity log (a plain background task) and
queues what is due (summary, facts, checkpoint) as one job of the session on the bounded
background queue (``background/queue.py``). Its response headers carry the sidecar's own
timing (``Server-Timing``), the context warning and which upstream answered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from cwm_plugin.memory.selection.history import prefix_length
from cwm_plugin.sidecar.api.activity import log_turn, turn_entry
from cwm_plugin.sidecar.background.queue import Job
from cwm_plugin.sidecar.identity.authenticator import Identity, owner_of
from cwm_plugin.sidecar.runtime import Sidecar
from cwm_plugin.sidecar.turn import prompt as P
from cwm_plugin.sidecar.turn.arrivals import Arrival
from cwm_plugin.sidecar.turn.failopen import HEADER as STATUS_HEADER
from cwm_plugin.sidecar.turn.plan import Plan, history_tokens
from cwm_plugin.sidecar.turn.records import save_turn
from cwm_plugin.sidecar.turn.session import Level, SessionState, level_for
from cwm_plugin.sidecar.upstream.client import headers_down
from cwm_plugin.sidecar.upstream.router import Endpoint, Route
from cwm_plugin.sidecar.usage import Meter
from cwm_plugin.timing import Stages

log = logging.getLogger(__name__)
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


def route_headers(route: Route, ep: Endpoint | None) -> dict[str, str]:
    """``X-CWM-Upstream`` (the name of the upstream that answered) and, for a request the
    sidecar routed by role, ``X-CWM-Route`` (the role and why)."""
    out = {"X-CWM-Upstream": ep.name} if ep is not None else {}
    if route.role is not None:
        why = f"{route.role}; {route.reason}".encode("ascii", "replace").decode()
        out["X-CWM-Route"] = "".join(c if " " <= c <= "~" else "?" for c in why)[:300]
    return out


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
    priority: int | None = None  # on priority-scheduling upstreams (api/priority.py)

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
                await sc.memory.record_turns(tenant, folder, session, turns, defer_index=True)
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
            await self.sc.memory.after_record(self.ident.tenant, self.ident.folder,
                                              self.plan.sel)
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
        if sc.shared is not None and self.ident.session is not None:  # the counters moved
            await sc.shared.push(tenant, owner_of(self.ident), self.ident.session, state)
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
        info = {"tenant": tenant, "folder": self.ident.folder, "session": self.ident.session,
                "model": self.model, "salt": self.salt, "state": state,
                "max_model_len": self.max_len, "hook": sc.snapshot_hook,
                "owner": owner_of(self.ident), "shared": sc.shared, "jobs": sc.jobs,
                "checkpoint": checkpoint}
        if sc.jobs is not None:  # recorded for the other replicas before it may run here
            info["shared_id"] = await sc.jobs.record(info)
        job = Job(sc.maintainer.run, checkpoint=checkpoint, info=info)
        sc.background.submit(tenant, (self.ident.folder, self.ident.session), job,
                             force=checkpoint)  # dropped: the session's next turn asks again

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


def observe_stages(turn: ChatTurn) -> None:
    for name, seconds in turn.stages.seconds.items():
        turn.sc.metrics.stage_seconds.labels(name).observe(seconds)
    turn.sc.metrics.stage_seconds.labels("total").observe(turn.stages.total)
