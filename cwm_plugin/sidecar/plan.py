"""What one chat turn sends upstream: memory selection, prompt assembly and token counts.

Synchronous on purpose: it runs in a worker thread (``asyncio.to_thread``), because selecting
memory embeds the query and counting may ask vLLM's ``/tokenize``; the event loop never waits
on either. Counting uses the served model's counter (``counting.py``):

- the selection budget is ``budget.memory_budget`` (memory budget plus the recent turns kept);
- ``prompt_tokens``: the assembled prompt counted as the model will see it (``count_chat``:
  exact with the model's chat template or vLLM's ``/tokenize``), for the context thresholds;
- ``sent`` and ``full``: the prompt and a full-history replay (every recorded turn of the
  session verbatim plus the prefix and the new message) counted the same additive way, for the
  "tokens saved" metric; ``injected``: the memory message's content.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from cwm_plugin.sidecar import prompt as P
from cwm_plugin.sidecar.budget import answer_tokens, memory_budget, recent_tail
from cwm_plugin.sidecar.context import SessionState
from cwm_plugin.sidecar.identity import Identity
from cwm_plugin.sidecar.memory_port import MemoryPort, Selected
from cwm_plugin.sidecar.settings import Settings


@dataclass
class Plan:
    built: P.Prompt
    sel: Selected
    prompt_tokens: int = 0
    sent: int = 0
    full: int = 0
    injected: int = 0


def history_tokens(counter: Any, turns: list[dict[str, Any]]) -> int:
    """What replaying recorded turns verbatim costs (additive, like the budgets)."""
    return counter.count_messages([{"role": t.get("role"), "content": t.get("content", "")}
                                   for t in turns])


def plan_turn(settings: Settings, mem: MemoryPort, counter: Any, ident: Identity,
              body: dict[str, Any], messages: list[dict[str, Any]], split: P.SplitMessages,
              state: SessionState, model: str, max_len: int | None) -> Plan:
    cfg = settings.memory
    if not state.history_known:
        turns = mem.now.transcript(ident.tenant, ident.session)
        state.full_history_tokens = history_tokens(counter, turns)
        state.turns_recorded = len(turns) // 2
        state.history_known = True
    history = split.history or P.recent_from_transcript(
        mem.now.transcript(ident.tenant, ident.session), cfg.recent_turns)
    budget = memory_budget(cfg, counter.count_messages, split.prefix + [split.new],
                           recent_tail(history, cfg.recent_turns), max_len, answer_tokens(body))
    t0 = time.perf_counter()
    sel = mem.selected(mem.now.select_context(ident.tenant, ident.session, messages, budget,
                                              query=P.text_of(split.new), counter=counter),
                       time.perf_counter() - t0)
    summary = None
    if state.compacted and not sel.summary:
        summary = mem.now.summary(ident.tenant, ident.session)
    th = settings.checkpoint.for_model(model)
    built = P.assemble(split, sel.recent if sel.recent is not None else split.history,
                       sel.memory_block, mode=settings.injection, summary=summary,
                       keep=th.keep_turns if state.compacted else None)
    full = max(counter.count_messages(messages),
               counter.count_messages(split.prefix + [split.new]) + state.full_history_tokens)
    return Plan(built=built, sel=sel, prompt_tokens=counter.count_chat(built.messages),
                sent=counter.count_messages(built.messages), full=full,
                injected=counter.count(built.memory_message["content"])
                if built.memory_message else 0)
