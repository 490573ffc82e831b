"""Work done after the answer has gone out: running summaries, fact extraction, checkpoints.

A session's due work is one job on the bounded queue (``queue.py``: merged while it waits,
dropped when the queue is full, never on the client's path); the jobs of one session run one
at a time. Summaries and facts are written by the upstream model itself, and its usage is
counted for the tenant. Both are incremental from
the transcript, so a dropped or merged job loses nothing:

- the running summary (progressive, every ``summary_every_turns`` turns and at a checkpoint)
  records the last turn it covers (``upto_turn``); an update sends the previous summary and the
  turns after that one (in batches that fit half the model's context, oldest first, each batch
  moving ``upto_turn`` on, so no turn is skipped however long the backlog); the model's text is
  stored with the names, dates and decisions of the turns it covers, merged with the previous
  summary's (``memory/service/details.py``: kept whatever the model wrote);
- an input that cannot fit never stalls a session: a single turn longer than a batch's room
  is cut to fit (its head and tail kept, counted ``outcome=truncated``), and a batch the
  model still refuses (an HTTP 4xx: over its context as *it* counts) is skipped, its cursor
  moved past it (``outcome=skipped``), so the next batch and the session's next jobs go on;
- facts (every ``facts_every_turns`` turns) are extracted from the turns after the facts
  cursor (``cursors/<session>.json``), with the tenant's known facts and their keys in the
  prompt; the answer must be strict JSON accepted by the memory package's ``parse_facts`` (one
  retry, then the batch is refused, counted, and skipped). With ``structured_facts`` the
  request carries the JSON schema (vLLM's structured outputs), so even a small model answers
  valid JSON; an answer cut off at ``background_max_tokens`` can still fail and is handled the
  same way. Each fact is merged (added, duplicate, or replacing a known one:
  ``memory/service/facts_file.py``) with its source (session and turns).

This work runs under a salt of its own (``identity.background_salt``) and asks the connector
not to store it (``kv_transfer_params``: ``store: false``), so it never replaces the session's
context records or shares its KV: a window frozen after it is still the conversation. It goes
to the upstreams with the role ``background`` when there are any (a cheaper
model, say: ``Router.background_route``), else where the turn went; its tokens are accounted
to the tenant as ``kind: background`` (``usage.py``) and counted in
``cwm_sidecar_background_tokens_total``.
"""

from __future__ import annotations

import logging
from typing import Any

from cwm_plugin import pg_scope
from cwm_plugin.errors import CWMError, InvalidInput
from cwm_plugin.memory.service.details import with_details
from cwm_plugin.memory.settings import MemorySettings
from cwm_plugin.salts import background_salt
from cwm_plugin.sidecar.background import prompts as llm_prompts
from cwm_plugin.sidecar.background.queue import Job
from cwm_plugin.sidecar.background.shared_jobs import Claim
from cwm_plugin.sidecar.metrics import SidecarMetrics
from cwm_plugin.sidecar.turn.memory_port import MemoryPort
from cwm_plugin.sidecar.turn.session import SessionState, SnapshotHook, call_hook
from cwm_plugin.sidecar.upstream.router import Router, UpstreamRejected
from cwm_plugin.sidecar.usage import BACKGROUND, UsageLedger

log = logging.getLogger(__name__)
MAX_SUMMARY_BATCHES = 8  # one update summarises at most this many batches of backlog
MAX_FACT_BATCHES = 4  # one extraction reads at most this many batches of backlog
MAX_KNOWN = 12  # known facts listed in an extraction prompt
NOT_STORED = {"cwm": {"store": False}}  # the connector neither looks up, saves nor records it


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

    async def _context(self, model: str, max_model_len: int | None) -> int | None:
        """The context the background work must fit: the writer's (the background route's)
        and the turn's own model's, whichever is smaller."""
        route = await self.router.background_route(model)
        limits = [x for x in (route.info().max_model_len, max_model_len) if x]
        return min(limits) if limits else None

    async def summarize(self, tenant: str, session: str, model: str, salt: str,
                        max_model_len: int | None, folder: str | None = None) -> str | None:
        """Bring the session's summary up to date (previous summary + the turns after the
        last one it covers); returns the summary, or None if nothing could be written.
        ``folder``: the session's memory folder (default: the tenant's own)."""
        folder = folder or tenant
        turns = await self.memory.transcript(tenant, folder, session)
        previous, upto = await self.memory.summary_state(tenant, folder, session)
        ids = [_turn_id(t) for t in turns]
        start = ids.index(upto) + 1 if upto and upto in ids else 0
        max_model_len = await self._context(model, max_model_len)
        for _ in range(MAX_SUMMARY_BATCHES):
            if start >= len(turns):
                break
            used = self.memory.count_messages(llm_prompts.summary_messages(previous, ""))
            lines, end = self._batch(tenant, turns, start, used, max_model_len)
            messages = llm_prompts.summary_messages(previous, "\n".join(lines))
            try:
                text = await self._call(tenant, model, salt, "summary", messages)
            except UpstreamRejected as exc:  # this batch never fits: move past it
                self._skipped(tenant, "summary", exc)
                previous = previous or "(the first turns were too long to summarise)"
                await self.memory.set_summary(tenant, folder, session, previous,
                                              upto_turn=ids[end - 1])
                start = end
                continue
            if not text.strip():
                self.metrics.background.labels(tenant, "summary", "empty").inc()
                return previous
            text = with_details(text, previous, turns[start:end])
            await self.memory.set_summary(tenant, folder, session, text, upto_turn=ids[end - 1])
            self.metrics.background.labels(tenant, "summary", "ok").inc()
            previous, start = text, end
        return previous

    def _batch(self, tenant: str, turns: list[dict[str, Any]], start: int, used: int,
               max_model_len: int | None) -> tuple[list[str], int]:
        """Transcript lines from ``start`` on (at least one) that fit half the context with
        what the prompt already uses; returns them and the index after the last. A first line
        too long for the whole context is cut to fit it."""
        budget = int((max_model_len or 2048) * 0.5) - self.cfg.background_max_tokens
        hard = int((max_model_len or 2048) * 0.9) - self.cfg.background_max_tokens
        lines: list[str] = []
        end = start
        while end < len(turns):  # oldest first
            t = turns[end]
            line = f"{t.get('role')}: {t.get('content', '')}"
            cost = self.memory.count(line) + 2
            if lines and used + cost > budget:
                break
            if used + cost > hard:  # alone over the model's context (10 % kept for margin)
                line = self._cut(line, max(16, hard - used - 2))
                cost = self.memory.count(line) + 2
                self.metrics.background.labels(tenant, "input", "truncated").inc()
            lines.append(line)
            used += cost
            end += 1
        return lines, end

    def _cut(self, line: str, room: int) -> str:
        """``line`` within ``room`` tokens: its head and tail, the middle marked as left out."""
        keep = len(line)
        while keep > 0:
            keep = int(keep * min(0.9, room / max(1, self.memory.count(line[:keep]))))
            cut = f"{line[:keep // 2]} [... {len(line) - keep} characters left out ...] " \
                  f"{line[len(line) - keep // 2:]}"
            if self.memory.count(cut) <= room:
                return cut
        return line[:room]

    def _skipped(self, tenant: str, kind: str, exc: UpstreamRejected) -> None:
        self.metrics.background.labels(tenant, kind, "skipped").inc()
        log.warning("background %s for tenant %s: the model refused a batch (%s); skipped, "
                    "the session's work goes on after it", kind, tenant, exc.message[:200])

    async def _call(self, tenant: str, model: str, salt: str, kind: str,
                    messages: list[dict[str, Any]], extra: dict[str, Any] | None = None,
                    max_tokens: int | None = None) -> str:
        salt = background_salt(salt)
        route = await self.router.background_route(model, key=salt)  # one upstream a session
        text, usage, ep, answered = await self.router.chat_once(
            route, messages, salt=salt,
            extra={**(extra or {}), "kv_transfer_params": NOT_STORED},
            max_tokens=max_tokens or self.cfg.background_max_tokens)
        self.usage.record(tenant, answered, ep.name, usage, kind=BACKGROUND, work=kind)
        return text

    async def extract_facts(self, tenant: str, session: str, model: str, salt: str,
                            max_model_len: int | None, folder: str | None = None) -> int:
        """Facts from the turns after the facts cursor; returns how many were merged (into
        ``folder``, the session's memory folder; default: the tenant's own)."""
        folder = folder or tenant
        turns = await self.memory.transcript(tenant, folder, session)
        ids = [_turn_id(t) for t in turns]
        upto = await self.memory.cursor(tenant, folder, session, "facts")
        start = ids.index(upto) + 1 if upto and upto in ids else 0
        max_model_len = await self._context(model, max_model_len)
        merged = 0
        for _ in range(MAX_FACT_BATCHES):
            if start >= len(turns):
                break
            known = [(m.key, m.text) for m in await self.memory.memories(tenant, folder)
                     if m.key][-MAX_KNOWN:]
            used = self.memory.count_messages(llm_prompts.facts_messages("", known))
            lines, end = self._batch(tenant, turns, start, used, max_model_len)
            source = f"session:{session}#{ids[start]}..{ids[end - 1]}"
            try:
                merged += await self._extract(tenant, model, salt, "\n".join(lines), known,
                                              source, folder)
            except UpstreamRejected as exc:  # this batch never fits: move past it
                self._skipped(tenant, "facts", exc)
            await self.memory.set_cursor(tenant, folder, session, "facts", ids[end - 1])
            start = end
        return merged

    async def _extract(self, tenant: str, model: str, salt: str, exchange: str,
                       known: list[tuple[str, str]], source: str, folder: str) -> int:
        """Ask the model for facts as strict JSON; retry once; refuse and count if still bad."""
        messages = llm_prompts.facts_messages(exchange, known)
        extra = ({"response_format": llm_prompts.facts_response_format()}
                 if self.cfg.structured_facts else None)
        room = max(self.cfg.background_max_tokens, llm_prompts.facts_max_tokens())
        for attempt in range(2):
            text = await self._call(tenant, model, salt, "facts", messages, extra, room)
            try:
                facts = llm_prompts.parse_facts(text)
            except InvalidInput as exc:
                log.info("fact extraction attempt %d for tenant %s invalid: %s", attempt + 1,
                         tenant, exc.message)
                messages = llm_prompts.facts_retry_messages(exchange, text, known)
                continue
            for f in facts:
                got = await self.memory.add_fact(tenant, folder, f["text"],
                                                 f.get("category", "fact"),
                                                 float(f.get("importance", 0.5)),
                                                 key=f.get("key", ""), source=source)
                self.metrics.facts.labels(tenant, got.outcome).inc()
            self.metrics.background.labels(tenant, "facts", "ok").inc()
            return len(facts)
        self.metrics.facts_refused.labels(tenant, model).inc()
        self.metrics.background.labels(tenant, "facts", "refused").inc()
        return 0

    async def run(self, job: Job) -> None:
        """A session's due work (a job of the queue), in order; failures are logged and
        counted. ``job.info``: tenant, session, model, salt, state, max_model_len, hook,
        folder (the session's memory folder; default: the tenant's) and owner (whose windows a
        checkpoint's freeze makes; default: the tenant's)."""
        i = job.info
        state: SessionState = i["state"]
        tenant, owner = i["tenant"], i.get("owner") or i["tenant"]
        jobs, jid = i.get("jobs"), i.get("shared_id")
        claim = await jobs.claim(tenant, jid) if jobs is not None and jid else True
        if claim is False:  # another replica runs it, or has done it
            self.metrics.background.labels(tenant, "after_turn", "elsewhere").inc()
            if job.checkpoint:  # (that replica's job runs the checkpoint: see Claim)
                state.checkpointing = False
            return
        checkpoint = job.checkpoint or (isinstance(claim, Claim) and claim.checkpoint)
        folder = i.get("folder") or tenant  # the one folder its work reads and writes
        with pg_scope.scoped(pg_scope.folders([folder], [folder])):
            async with state.lock:  # one job of this session at a time, in turn order
                shared = i.get("shared")
                if shared is not None:  # where the replica that recorded it left the session
                    await shared.pull(tenant, owner, i["session"], state)
                work = self._run(tenant, i["session"], i["model"], i["salt"], state,
                                 i["max_model_len"], checkpoint, i["hook"], folder, owner)
                if isinstance(claim, Claim):
                    await jobs.hold(tenant, claim, work)
                else:
                    await work
                if shared is not None:  # what it changed, for the other replicas
                    await shared.push(tenant, owner, i["session"], state)

    async def _run(self, tenant: str, session: str, model: str, salt: str,
                   state: SessionState, max_model_len: int | None, checkpoint: bool,
                   hook: SnapshotHook, folder: str, owner: str) -> None:
        summary_due = (self.cfg.summary_every_turns
                       and state.turns_since_summary >= self.cfg.summary_every_turns)
        try:
            if checkpoint or summary_due:
                state.turns_since_summary = 0
                try:
                    await self.summarize(tenant, session, model, salt, max_model_len, folder)
                finally:
                    if checkpoint:  # compact from the next turn on, with what is written
                        state.compaction_due, state.checkpointing = True, False
                if checkpoint:
                    state.checkpoints += 1
                    self.metrics.checkpoints.labels(tenant, model).inc()
                    await call_hook(hook, owner, session, salt,
                                    f"auto-{session}-{state.checkpoints}")
            if self.cfg.extract_facts and state.turns_since_facts >= self.cfg.facts_every_turns:
                state.turns_since_facts = 0
                await self.extract_facts(tenant, session, model, salt, max_model_len, folder)
        except CWMError as exc:
            self.metrics.background.labels(tenant, "after_turn", "error").inc()
            log.warning("background work for tenant %s failed: [%s] %s", tenant, exc.code,
                        exc.message)
        except Exception:
            self.metrics.background.labels(tenant, "after_turn", "error").inc()
            log.exception("background work for tenant %s failed", tenant)
