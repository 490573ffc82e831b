"""A thin async adapter over the memory package's ``MemoryService``.

The memory service is synchronous (files, indexes, an embedding model) and serialises each
folder's index changes itself. The sidecar calls it from the event loop on threads of the
memory's own (:func:`memory_threads`), each principal's calls within its share (``THREADS``
running, ``WAITING`` more waiting, past it 429 ``memory_calls``): a slow embedding never blocks
other requests, and one tenant's searches and writes never queue another's behind them (they
shared asyncio's default executor before). Every call names whose work it is (``who``, a
principal: the caller's, or the tenant a background job is for). Code that already runs on one
of those threads (``plan.py``, the memory routes' reads, through :meth:`MemoryPort.run`) calls
the service directly through ``port.now``.
``count``/``count_messages`` use the index's local counter (chunk-sized estimates for the
background prompts); budgets and prompts are counted with the served model's counter
(``counting.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cwm_plugin import pg_scope
from cwm_plugin.memory.settings import MemorySettings
from cwm_plugin.sidecar.identity.tenant_bounds import TenantBound, TenantPool

T = TypeVar("T")
log = logging.getLogger(__name__)
THREADS = 2  # a principal's memory calls running at once ...
WAITING = 256  # ... and waiting for a thread (its requests in flight bound them already)


@dataclass
class Selected:
    """What the sidecar uses from a memory selection."""

    memory_block: str = ""
    recent: list[dict[str, Any]] | None = None
    summary: str | None = None
    tokens: int = 0
    hits: list[dict[str, Any]] = field(default_factory=list)
    facts: int = 0
    reasons: Any = None
    seconds: float = 0.0
    fact_ids: list[str] = field(default_factory=list)  # the durable memories taken


PREVIEW_CHARS = 80


def _hit_dict(hit: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("chunk_id", "source", "score"):
        v = getattr(hit, name, None) if not isinstance(hit, dict) else hit.get(name)
        if v is not None:
            out[name] = round(v, 4) if isinstance(v, float) else v
    if isinstance(out.get("chunk_id"), str):
        out["chunk_id"] = out["chunk_id"][:12]
    text = getattr(hit, "text", None) if not isinstance(hit, dict) else hit.get("text")
    if isinstance(text, str):  # enough to recognise the hit; the header is capped anyway
        out["preview"] = " ".join(text.split())[:PREVIEW_CHARS]
    return out


def memory_threads(principals: int, counter: Any) -> TenantPool:
    """The threads memory work runs on (see the module docstring)."""
    return TenantPool("cwm-memory", TenantBound("memory_calls", "memory calls", THREADS,
                                                WAITING, counter), principals)


class MemoryPort:
    """Async calls into one ``MemoryService`` plus its (index) token counter, on ``pool``'s
    threads."""

    def __init__(self, service: Any, counter: Any, pool: TenantPool) -> None:
        self.service = service
        self.now = service  # synchronous access, for code on a worker thread
        self.counter = counter
        self.pool = pool

    async def run(self, who: str, fn: Callable[[], T]) -> T:
        """``fn()`` on a memory thread, within principal ``who``'s share."""
        return await self.pool.run(who, fn)

    async def _call(self, who: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return await self.pool.run(who, functools.partial(fn, *args, **kw))

    # --- counting ---------------------------------------------------------------------------

    def count(self, text: str) -> int:
        return int(self.counter.count(text))

    def count_messages(self, messages: list[dict[str, Any]]) -> int:
        fn = getattr(self.counter, "count_messages", None)
        if fn is not None:
            return int(fn(messages))
        return sum(self.count(str(m.get("content") or "")) + 4 for m in messages)

    # --- reads --------------------------------------------------------------------------------

    @staticmethod
    def selected(sel: Any, seconds: float) -> Selected:
        """What the sidecar keeps of a ``Selection`` (memory hits listed first)."""
        hits = list(getattr(sel, "fact_hits", None) or []) + list(getattr(sel, "hits", None)
                                                                  or [])
        facts = getattr(sel, "facts", None)
        return Selected(
            memory_block=getattr(sel, "memory_block", "") or "",
            recent=getattr(sel, "recent", None),
            summary=getattr(sel, "summary", None),
            tokens=int(getattr(sel, "tokens", 0) or 0),
            hits=[_hit_dict(h) for h in hits],
            facts=len(facts) if isinstance(facts, list | tuple) else int(bool(facts)),
            reasons=getattr(sel, "reasons", None),
            seconds=seconds,
            fact_ids=[m.id for m in facts] if isinstance(facts, list | tuple) else [],
        )

    async def select(self, who: str, folder: str, session: str, messages: list[dict[str, Any]],
                     budget_tokens: int, query: str | None, counter: Any = None) -> Selected:
        t0 = time.perf_counter()
        sel = await self._call(who, self.service.select_context, folder, session, messages,
                               budget_tokens, query=query, counter=counter)
        return self.selected(sel, time.perf_counter() - t0)

    async def transcript(self, who: str, folder: str, session: str) -> list[dict[str, Any]]:
        return await self._call(who, self.service.transcript, folder, session)

    async def summary(self, who: str, folder: str, session: str) -> str | None:
        s = await self._call(who, self.service.summary, folder, session)
        if s is None or isinstance(s, str):
            return s
        return getattr(s, "text", None) or str(s)

    async def warm(self, who: str, folder: str) -> None:
        """Load the folder's index from its files now rather than on its first request."""
        try:
            await self._call(who, self.service.warm, folder)
        except Exception:  # a broken folder must not stop the server; requests will say
            log.exception("loading the memory index of folder %s failed", folder)

    # --- writes -------------------------------------------------------------------------------

    async def record_turn(self, who: str, folder: str, session: str, role: str,
                          content: str) -> str:
        return await self._call(who, self.service.record_turn, folder, session, role, content)

    async def record_turns(self, who: str, folder: str, session: str, turns: list[tuple[str, str]],
                           defer_index: bool = False) -> list[str]:
        """Append turns in order, adjacent in the file, in one durable write (``defer_index``:
        index them later, see :meth:`after_record`)."""
        return await self._call(who, self.service.record_turns, folder, session, turns,
                                defer_index=defer_index)

    async def after_record(self, who: str, folder: str, sel: Selected) -> None:
        """Off the client's path: index the turns just recorded and count the use of the
        durable memories the turn's selection took. A failure leaves the turns to the next
        look at the files (they are in the session file already)."""
        await self._call(who, self.service.index_pending, folder)
        if sel.fact_ids:
            await self._call(who, self.service.bump, folder, sel.fact_ids)

    async def summary_state(self, who: str, folder: str, session: str) -> tuple[str | None, str]:
        """``(summary or None, id of the last turn it covers or "")``."""
        return await self._call(who, self.service.summary_state, folder, session)

    async def close(self) -> None:
        """Save what changed in the indexes and close the embedding cache."""
        with pg_scope.scoped(pg_scope.EVERYTHING):  # no tenant's work: the shutdown's
            await asyncio.to_thread(self.service.close)  # (index what is pending, save)

    async def set_summary(self, who: str, folder: str, session: str, text: str,
                          upto_turn: str) -> None:
        await self._call(who, self.service.set_summary, folder, session, text,
                         upto_turn=upto_turn)

    async def add_memory(self, who: str, folder: str, text: str, category: str,
                         importance: float = 0.5) -> Any:
        return await self._call(who, self.service.add_memory, folder, text, category,
                                importance)

    async def add_fact(self, who: str, folder: str, text: str, category: str,
                       importance: float = 0.5,
                       *, key: str = "", source: str = "") -> Any:
        """Merge an extracted fact (``Merged``: the memory in force and the outcome)."""
        return await self._call(who, self.service.add_fact, folder, text, category,
                                importance, key=key, source=source)

    async def memories(self, who: str, folder: str) -> list[Any]:
        """The durable memories in force."""
        return await self._call(who, self.service.memories, folder)

    async def cursor(self, who: str, folder: str, session: str, name: str) -> str:
        """The last turn the work ``name`` (``facts``) covered in the session, or ""."""
        return await self._call(who, self.service.files.read_cursor, folder, session, name)

    async def set_cursor(self, who: str, folder: str, session: str, name: str,
                         turn_id: str) -> None:
        await self._call(who, self.service.files.write_cursor, folder, session, name,
                         turn_id)


def build_memory(cfg: MemorySettings, pool: TenantPool, registry: Any = None) -> MemoryPort:
    """Build the memory service the settings describe (imports the memory package lazily),
    its calls on ``pool``'s threads; its ``cwm_memory_*`` metrics are registered on
    ``registry`` (the sidecar's)."""
    from cwm_plugin.memory.metrics import MemoryMetrics
    from cwm_plugin.memory.service.factory import service_from_settings

    service = service_from_settings(cfg, MemoryMetrics(registry) if registry is not None else None)
    return MemoryPort(service, service.counter, pool)
