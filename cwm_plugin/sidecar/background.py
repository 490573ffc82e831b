"""Work done after the answer has gone out: running summaries, fact extraction, checkpoints.

Each job runs as an asyncio task owned by :class:`Background` (drained or cancelled when the app
stops), never on the client's path; the jobs of one session run one at a time. Summaries and
facts are written by the upstream model itself. The running summary is incremental: the stored
summary records the last turn it covers (``upto_turn``), and an update sends only the previous
summary and the turns after that one (in batches that fit half the model's context, oldest
first, each batch moving ``upto_turn`` on, so no turn is skipped however long the backlog); facts must be strict JSON accepted by the memory package's ``parse_facts``: one retry,
then the extraction is refused, counted, and nothing is written. With ``structured_facts`` the
request carries a JSON schema (vLLM's structured outputs), so even a small model answers valid
JSON; an answer cut off at ``background_max_tokens`` can still fail and is handled the same way.
This work goes to the upstreams with the role ``background`` when there are any (a cheaper
model, say: ``Router.background_route``), else where the turn went; its tokens are accounted
to the tenant as ``kind: background`` (``usage.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from cwm_plugin.errors import CWMError, InvalidInput
from cwm_plugin.sidecar import llm_prompts
from cwm_plugin.sidecar.context import SessionState, SnapshotHook, call_hook
from cwm_plugin.sidecar.memory_port import MemoryPort
from cwm_plugin.sidecar.metrics import SidecarMetrics
from cwm_plugin.sidecar.router import Route, Router
from cwm_plugin.sidecar.settings import MemorySettings
from cwm_plugin.sidecar.usage import BACKGROUND, UsageLedger

log = logging.getLogger(__name__)
MAX_SUMMARY_BATCHES = 8  # one update summarises at most this many batches of backlog


class Background:
    """A set of running tasks; ``pending`` for tests and shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def pending(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout: float = 30.0) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    async def close(self) -> None:
        await self.drain(timeout=5.0)
        for t in list(self._tasks):
            t.cancel()


def _turn_id(turn: dict[str, Any]) -> str:
    return str(turn.get("turn_id") or turn.get("id") or "")


class Maintainer:
    """Summaries, facts and checkpoints for one app."""

    def __init__(self, router: Router, memory: MemoryPort, metrics: SidecarMetrics,
                 cfg: MemorySettings, usage: UsageLedger) -> None:
        self.router = router
        self.memory = memory
        self.metrics = metrics
        self.cfg = cfg
        self.usage = usage

    async def _ask(self, tenant: str, route: Route, messages: list[dict[str, Any]], salt: str,
                   extra: dict[str, Any] | None = None) -> str:
        text, usage, ep, model = await self.router.chat_once(
            route, messages, salt=salt, max_tokens=self.cfg.background_max_tokens, extra=extra)
        self.usage.record(tenant, model, ep.name, usage, kind=BACKGROUND)
        return text

    async def summarize(self, tenant: str, session: str, model: str, salt: str,
                        max_model_len: int | None) -> str | None:
        """Bring the session's summary up to date (previous summary + the turns after the
        last one it covers); returns the summary, or None if nothing could be written."""
        turns = await self.memory.transcript(tenant, session)
        previous, upto = await self.memory.summary_state(tenant, session)
        ids = [_turn_id(t) for t in turns]
        start = ids.index(upto) + 1 if upto and upto in ids else 0
        route = await self.router.background_route(model)
        # The batches must fit the model that writes them, and the fallback's, if any.
        limits = [x for x in (route.info().max_model_len, max_model_len) if x]
        budget = int((min(limits) if limits else 2048) * 0.5) - self.cfg.background_max_tokens
        for _ in range(MAX_SUMMARY_BATCHES):
            if start >= len(turns):
                break
            lines: list[str] = []
            used = self.memory.count_messages(llm_prompts.summary_messages(previous, ""))
            end = start
            while end < len(turns):  # oldest first, at least one turn
                t = turns[end]
                line = f"{t.get('role')}: {t.get('content', '')}"
                cost = self.memory.count(line) + 2
                if lines and used + cost > budget:
                    break
                lines.append(line)
                used += cost
                end += 1
            messages = llm_prompts.summary_messages(previous, "\n".join(lines))
            text = (await self._ask(tenant, route, messages, salt)).strip()
            if not text:
                self.metrics.background.labels(tenant, "summary", "empty").inc()
                return previous
            await self.memory.set_summary(tenant, session, text, upto_turn=ids[end - 1])
            self.metrics.background.labels(tenant, "summary", "ok").inc()
            previous, start = text, end
        return previous

    async def extract_facts(self, tenant: str, model: str, salt: str, exchange: str) -> int:
        """Ask the model for facts as strict JSON; retry once; refuse and count if still bad."""
        messages = llm_prompts.facts_messages(exchange)
        extra = ({"response_format": llm_prompts.facts_response_format()}
                 if self.cfg.structured_facts else None)
        route = await self.router.background_route(model)
        for attempt in range(2):
            text = await self._ask(tenant, route, messages, salt, extra)
            try:
                facts = llm_prompts.parse_facts(text)
            except InvalidInput as exc:
                log.info("fact extraction attempt %d for tenant %s invalid: %s", attempt + 1,
                         tenant, exc.message)
                messages = llm_prompts.facts_retry_messages(exchange, text)
                continue
            for f in facts:
                await self.memory.add_memory(tenant, f["text"], f.get("category", "fact"),
                                             float(f.get("importance", 0.5)))
            self.metrics.background.labels(tenant, "facts", "ok").inc()
            return len(facts)
        self.metrics.facts_refused.labels(tenant, model).inc()
        self.metrics.background.labels(tenant, "facts", "refused").inc()
        return 0

    async def after_turn(self, *, tenant: str, session: str, model: str, salt: str,
                         state: SessionState, exchange: str, max_model_len: int | None,
                         checkpoint: bool, hook: SnapshotHook) -> None:
        """Everything due after one turn, in order; failures are logged and counted."""
        async with state.lock:  # one job of this session at a time, in turn order
            await self._after_turn(tenant, session, model, salt, state, exchange,
                                   max_model_len, checkpoint, hook)

    async def _after_turn(self, tenant: str, session: str, model: str, salt: str,
                          state: SessionState, exchange: str, max_model_len: int | None,
                          checkpoint: bool, hook: SnapshotHook) -> None:
        summary_due = (self.cfg.summary_every_turns
                       and state.turns_since_summary >= self.cfg.summary_every_turns)
        try:
            if checkpoint or summary_due:
                state.turns_since_summary = 0
                try:
                    await self.summarize(tenant, session, model, salt, max_model_len)
                finally:
                    if checkpoint:  # compact from the next turn on, with what is written
                        state.compaction_due, state.checkpointing = True, False
                if checkpoint:
                    state.checkpoints += 1
                    self.metrics.checkpoints.labels(tenant, model).inc()
                    await call_hook(hook, tenant, session, salt,
                                    f"auto-{session}-{state.checkpoints}")
            if self.cfg.extract_facts and exchange.strip():
                await self.extract_facts(tenant, model, salt, exchange)
        except CWMError as exc:
            self.metrics.background.labels(tenant, "after_turn", "error").inc()
            log.warning("background work for tenant %s failed: [%s] %s", tenant, exc.code,
                        exc.message)
        except Exception:
            self.metrics.background.labels(tenant, "after_turn", "error").inc()
            log.exception("background work for tenant %s failed", tenant)
