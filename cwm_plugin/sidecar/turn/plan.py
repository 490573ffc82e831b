"""What one chat turn sends upstream: history, memory, and the counts that go with them.

Synchronous on purpose: it runs on a memory thread, within the caller's share
(``MemoryPort.run``), because selecting memory embeds the query; the event loop never waits
on it. Two modes (``PromptSettings``):

- ``full`` (default): every message the client sent, in order, and nothing else but the memory (the
  session's earlier turns reach the prompt through memory search, never prepended: a client starting
  a new conversation in an old session gets what it sent). Memory is selected once per conversation
  (``refresh: conversation``; again after each compaction) and reused verbatim, so the prompt only
  grows at its end and vLLM's prefix cache serves it like a client talking to vLLM directly. History
  is left out only from a compaction on (``Compaction``: the cut and the summary fixed until the
  next one), or when it would not fit the context at all.
- ``recent`` (token saving): memory plus the last ``memory.recent_turns`` history messages
  (``MemoryService.select_context``), the current exchange always whole.

The memory *view* (``prompt.memory_view``, header ``X-CWM-Memory-View``): ``full`` merges the
whole selection; ``quick`` only its short forms, the durable facts and the session summary
(which then stands in for the transcript passages, none of which are searched).

Counts use the served model's counter (``counting.py``): ``prompt_tokens`` (the assembled prompt,
for the context thresholds: estimated from cached counts, counted exactly near one), ``sent`` and
``full`` (the prompt and a full-history replay, additive, for the "tokens saved" metric),
``injected`` (the memory text).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from cwm_plugin.sidecar.identity.authenticator import Identity
from cwm_plugin.sidecar.settings import Settings
from cwm_plugin.sidecar.turn import prompt as P
from cwm_plugin.sidecar.turn.budget import (
    TEMPLATE_MARGIN,
    answer_tokens,
    memory_budget,
    recent_tail,
)
from cwm_plugin.sidecar.turn.memory_port import MemoryPort, Selected
from cwm_plugin.sidecar.turn.session import Compaction, Pinned, SessionState, prompt_state
from cwm_plugin.timing import Stages

Message = dict[str, Any]


@dataclass
class TurnInput:
    settings: Settings
    mem: MemoryPort
    counter: Any
    ident: Identity
    body: dict[str, Any]
    messages: list[Message]
    state: SessionState
    model: str
    max_len: int | None
    mode: str  # "full" | "recent"
    system_role: bool = True
    view: str = "full"  # "quick": the selection's short forms only (no transcript passages)
    stages: Stages = field(default_factory=Stages)
    shared: list[str] = field(default_factory=list)  # more folders it may read (identity/access.py)
    reranker: Any = None  # memory.rerank's (turn/rerank.py), or None


@dataclass
class Plan:
    messages: list[Message]
    sel: Selected
    text: str = ""  # the memory (and summary) text merged into the prompt
    prompt_tokens: int = 0
    sent: int = 0
    full: int = 0
    injected: int = 0
    prompt: dict[str, Any] = field(default_factory=dict)  # its prompt state (session.py)


def digest(message: Message | None) -> str:
    raw = json.dumps(message, sort_keys=True, default=str) if message is not None else ""
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def history_tokens(counter: Any, turns: list[dict[str, Any]]) -> int:
    """What replaying recorded turns verbatim costs (additive, like the budgets)."""
    return counter.count_messages([{"role": t.get("role"), "content": t.get("content", "")}
                                   for t in turns])


def passthrough(messages: list[Message]) -> Plan:
    """The client's messages as they came (memory off, or failed)."""
    return Plan(messages=list(messages), sel=Selected())


def _know_history(t: TurnInput) -> None:
    """What replaying the session's whole transcript would cost, read from its file once and
    then kept in step by the turns this process records (only the count is kept: the turns
    themselves stayed in memory for every session the process had seen)."""
    st = t.state
    if not st.history_known:
        with t.stages("files"):
            turns = t.mem.now.transcript(t.ident.folder, t.ident.session)
        with t.stages("count"):
            st.full_history_tokens = history_tokens(t.counter, turns)
        st.turns_recorded = len(turns) // 2
        st.history_known = True


def _select(t: TurnInput, messages: list[Message], budget: int, query: str, *,
            recent_turns: int, present: list[Message], summary: bool) -> Selected:
    t0 = time.perf_counter()
    sel = t.mem.now.select_context(t.ident.folder, t.ident.session, messages, budget,
                                   query=query, counter=t.counter, recent_turns=recent_turns,
                                   summary=summary, bump=False, stages=t.stages,
                                   present=present, shared=t.shared,
                                   passages=t.view == "full", reranker=t.reranker)
    return t.mem.selected(sel, time.perf_counter() - t0)


def _compaction(t: TurnInput, history: list[Message]) -> Compaction | None:
    """The compaction in force for this history: a new one when a checkpoint's summary is
    ready, the session's own while it is the same conversation, else none."""
    st = t.state
    comp = st.compaction
    if st.compaction_due and t.ident.session is not None:
        keep = t.settings.checkpoint.for_model(t.model).keep_turns
        cut = P.last_exchanges(history, keep)
        with t.stages("files"):
            summary = t.mem.now.summary(t.ident.folder, t.ident.session)
        st.compaction_due = False
        st.compaction = Compaction(cut, digest(history[cut - 1]) if cut else "", summary,
                                   (comp.generation if comp else 0) + 1)
        return st.compaction
    if comp is None or comp.cut > len(history) or \
            (comp.cut and digest(history[comp.cut - 1]) != comp.anchor):
        return None
    return comp


def plan_turn(t: TurnInput) -> Plan:
    parts = P.split(t.messages)
    if t.mode == "recent":
        return _plan_recent(t, parts)
    return _plan_full(t, parts)


def _plan_full(t: TurnInput, parts: P.Parts) -> Plan:
    st, cfg, prompt_cfg = t.state, t.settings.memory, t.settings.prompt
    history = parts.history
    with t.stages("history"):
        comp = _compaction(t, history)
        cut = comp.cut if comp else 0
        kept = P.drop_front(history, cut)
        base = parts.prefix + kept + parts.current
    # one conversation: the same first message (a new one starts a new conversation)
    key = f"{digest((history or parts.current)[0])}:{comp.generation if comp else 0}:{t.view}"
    pinned = st.pinned if prompt_cfg.refresh == "conversation" else None
    summary = comp.summary if comp else None
    with t.stages("count"):  # what the client's instructions, new message and answer leave
        free = t.max_len - answer_tokens(t.body) - TEMPLATE_MARGIN - \
            t.counter.count_messages(parts.prefix + parts.current) if t.max_len else None
    sel = None
    # memory is never cut to fit: a pinned block this turn's prompt outgrew is selected again
    if pinned is not None and pinned.key == key:
        text = P.memory_text(pinned.sel.memory_block, summary)
        with t.stages("count"):
            used = _tokens(t, text)
        if free is None or used <= free:
            sel = pinned.sel
    if sel is None:
        with t.stages("count"):
            budget = max(0, memory_budget(cfg, t.counter.count_messages, base, [], t.max_len,
                                          answer_tokens(t.body)) - _tokens(t, summary))
        # the conversation is all there (a compaction adds its summary); the quick view
        # takes the session's summary instead of its passages
        sel = _select(t, base, budget, P.query_text(parts), recent_turns=0, present=kept,
                      summary=t.view == "quick" and comp is None)
        if t.ident.session is not None:
            st.pinned = Pinned(key, sel)
        text = P.memory_text(sel.memory_block, summary)
        with t.stages("count"):
            used = _tokens(t, text)
    with t.stages("count"):
        if free is not None:  # the history must fit with what is merged in, else the oldest goes
            room = free - used
            more = P.fit_cut(history, t.counter.count_messages, room, cut)
            if more != cut:
                cut = more
                kept = P.drop_front(history, cut)
                comp = Compaction(cut, digest(history[cut - 1]),
                                  comp.summary if comp else None, comp.generation if comp else 0)
                if t.ident.session is not None:
                    st.compaction = comp
        out = P.merge(parts.prefix + kept + parts.current, text, prompt_cfg.placement,
                      system_role=t.system_role)
        return _counted(t, out, sel, text, t.counter.count_messages(t.messages),
                        prompt_state(Pinned(key, sel), comp))


def _plan_recent(t: TurnInput, parts: P.Parts) -> Plan:
    st, cfg = t.state, t.settings.memory
    if t.ident.session is not None:
        _know_history(t)  # what a full replay would cost, for the "tokens saved" metric
    if parts.history:
        comp = _compaction(t, parts.history)
    else:  # the history is the session's recent turns: the window is the compaction
        comp, st.compaction_due = None, False
    with t.stages("count"):  # (a compaction's summary is merged in too: it takes its room)
        budget = max(0, memory_budget(cfg, t.counter.count_messages,
                                      parts.prefix + parts.current,
                                      recent_tail(parts.history, cfg.recent_turns), t.max_len,
                                      answer_tokens(t.body))
                     - _tokens(t, comp.summary if comp else None))
    sel = _select(t, t.messages, budget, P.query_text(parts), recent_turns=cfg.recent_turns,
                  present=[], summary=comp is None)
    recent = sel.recent if sel.recent is not None else parts.history
    if comp is not None:
        keep = t.settings.checkpoint.for_model(t.model).keep_turns
        recent = P.drop_front(recent, P.last_exchanges(recent, keep))
    text = P.memory_text(sel.memory_block, comp.summary if comp else None)
    with t.stages("count"):
        out = P.merge(parts.prefix + recent + parts.current, text,
                      t.settings.prompt.placement, system_role=t.system_role)
        full = max(t.counter.count_messages(t.messages),
                   t.counter.count_messages(parts.prefix + parts.current)
                   + st.full_history_tokens)
        return _counted(t, out, sel, text, full, prompt_state(None, comp))


def _tokens(t: TurnInput, text: str | None) -> int:
    return t.counter.count(text) if text else 0


NEAR = 0.05  # a prompt estimated within this share of max_model_len of a threshold: count it


def _counted(t: TurnInput, out: list[Message], sel: Selected, text: str, full: int,
             state: dict[str, Any]) -> Plan:
    """The plan with its counts and its prompt ``state``; the prompt is estimated (cached
    message counts) and counted exactly (the chat template or ``/tokenize``) only when it
    comes near a threshold."""
    prompt = t.counter.estimate_chat(out)
    th = t.settings.checkpoint.for_model(t.model)
    if t.max_len and t.state.estimate(prompt) >= (th.warn - NEAR) * t.max_len:
        prompt = t.counter.count_chat(out)
    return Plan(messages=out, sel=sel, text=text, prompt_tokens=prompt,
                sent=t.counter.count_messages(out), full=full,
                injected=t.counter.count(text) if text else 0, prompt=state)


def debug_header(sel: Selected, compacted: bool, mode: str, cap: int,
                  recent: int, prompt_tokens: int | None = None, sent: int | None = None,
                  full: int | None = None, injected: int | None = None,
                  view: str = "full") -> str:
    """``X-CWM-Memory`` (``X-CWM-Debug: 1``): what was selected and why, as JSON within
    ``cap`` bytes: ``block`` is the memory text injected into the prompt (the caller's own
    memory), dropped whole when it does not fit; then reasons, then hits, until it fits."""
    info: dict[str, Any] = {"mode": mode, "view": view, "tokens": sel.tokens,
                            "injected": injected, "recent": recent,
                            "prompt_tokens": prompt_tokens, "sent": sent, "full": full,
                            "compacted": compacted, "facts": sel.facts,
                            "retrieval_ms": round(sel.seconds * 1000, 2),
                            "hits": sel.hits, "reasons": sel.reasons,
                            "block": sel.memory_block or None}
    for _ in range(len(sel.hits) + 3):
        text = json.dumps(info, separators=(",", ":"), ensure_ascii=True, default=str)
        if len(text) <= cap:
            return text
        if info.get("block") is not None:
            info["block"] = None
        elif info.get("reasons") is not None:
            info["reasons"] = None
        elif info["hits"]:
            info["hits"] = info["hits"][:-1]
            info["truncated"] = True
    return json.dumps({"truncated": True, "tokens": sel.tokens})
