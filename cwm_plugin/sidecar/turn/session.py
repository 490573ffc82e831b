"""Per-session context accounting: how full the model's window is, and when to checkpoint.

Before a turn is sent the sidecar counts the prompt it assembled with the served model's
tokenizer (exact with the model's chat template or vLLM's ``/tokenize``); after it, vLLM's
``usage.prompt_tokens`` is the real figure. The warning header uses this turn's count times the
session's *calibration* (last real figure / last count: 1 with an exact counter, and it
corrects an approximate one), so it follows the prompt down after a compaction instead of
repeating the last large figure. At ``warn`` (70 % by default) the turn gets
``X-CWM-Context-Warning``; at ``checkpoint`` (85 %) the session's summary is brought up to
date in the background (the client never waits for it), and from the first turn after it is
written the session is *compacted* (``Compaction``: summary + memory + the last
``keep_turns`` user/assistant exchanges, a prefix that then stays fixed until the next
compaction). Background work of one session (summaries, checkpoints) runs one job at a time
(``SessionState.lock``).

The state lives in the app (one tracker per app), keyed by (owner, session): the owner is the
tenant, or the user within it (``tenant/u-...``); it is advisory: after a restart, or once
evicted, a session starts uncompacted (and selects its memory anew, so its prompt prefix
changes once) and is checkpointed again if it grows. The tracker is bounded per tenant
(:class:`ContextTracker`; ``sessions`` in the config): a tenant opening session after session
evicts its own least recently used states, never those another tenant holds within its share.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from cwm_plugin.salts import tenant_of
from cwm_plugin.sidecar.settings import ThresholdConfig
from cwm_plugin.sidecar.turn.arrivals import Arrivals
from cwm_plugin.sidecar.turn.memory_port import Selected

log = logging.getLogger(__name__)


class Level(StrEnum):
    OK = "ok"
    WARN = "warn"
    CHECKPOINT = "checkpoint"


def level_for(tokens: int, max_len: int | None, th: ThresholdConfig) -> Level:
    if not max_len:
        return Level.OK
    frac = tokens / max_len
    if frac >= th.checkpoint:
        return Level.CHECKPOINT
    if frac >= th.warn:
        return Level.WARN
    return Level.OK


@dataclass
class Compaction:
    """Where a compacted conversation starts: its first ``cut`` history messages are left out
    (instructions among them stay) and ``summary`` is merged in. Fixed until the next
    compaction, so the prefix (system + summary + memory + kept history) keeps hitting."""

    cut: int
    anchor: str  # digest of the last message left out: is this still that conversation?
    summary: str | None
    generation: int


@dataclass
class Pinned:
    """The memory selected for a conversation, reused verbatim until it ends or is
    compacted (``key``), so the prompt's prefix stays the same turn after turn."""

    key: str
    sel: Selected


def prompt_state(pinned: Pinned | None, compaction: Compaction | None) -> dict[str, Any]:
    """What a session merges into its prompt (the pinned memory, the compaction), as a
    window carries it, so another session continuing the same conversation assembles the same
    prompt prefix (:meth:`SessionState.adopt`)."""
    out: dict[str, Any] = {}
    if pinned is not None:
        out["pinned"] = {"key": pinned.key, "memory_block": pinned.sel.memory_block,
                         "tokens": pinned.sel.tokens, "facts": pinned.sel.facts}
    if compaction is not None:
        out["compaction"] = asdict(compaction)
    return out


@dataclass
class SessionState:
    last_prompt_tokens: int = 0
    last_limit: int | None = None  # the context limit of the upstream that served the last turn
    calibration: float = 1.0  # real prompt tokens / our count, from the last turn
    turns_recorded: int = 0
    turns_since_summary: int = 0
    turns_since_facts: int = 0
    full_history_tokens: int = 0  # what replaying every turn verbatim would cost
    history_known: bool = False
    compaction: Compaction | None = None
    compaction_due: bool = False  # a checkpoint's summary is written: compact next turn
    checkpointing: bool = False  # a checkpoint is under way (not triggered again)
    checkpoints: int = 0
    pinned: Pinned | None = None
    restored: bool = False  # its prompt state was looked for in the store (records.py)
    stored: bool = False  # ... and its record found there (a turn answered before a restart)
    shared_version: int = 0  # the version of the replicas' shared state last seen (shared_state.py)
    shared_seen: dict[str, Any] | None = None  # ... and what it held
    shared_pulled: bool = True  # the last read of it succeeded (else this state is not written)
    turns: Arrivals = field(default_factory=Arrivals)  # its client turns as they arrive
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one background job at a time

    @property
    def compacted(self) -> bool:
        return self.compaction is not None

    def estimate(self, counted: int) -> int:
        """This turn's prompt size for the thresholds: our count, calibrated."""
        return round(counted * self.calibration)

    def adopt(self, prompt: dict[str, Any] | None) -> bool:
        """Take over a prompt state from :func:`prompt_state` (of a frozen window, or of this
        session before a restart); a malformed one is ignored. True if anything was taken."""
        self.restored = True
        try:
            p, c = (prompt or {}).get("pinned"), (prompt or {}).get("compaction")
            pinned = Pinned(str(p["key"]), Selected(
                memory_block=str(p.get("memory_block") or ""), tokens=int(p.get("tokens") or 0),
                facts=int(p.get("facts") or 0))) if isinstance(p, dict) else None
            comp = Compaction(int(c["cut"]), str(c["anchor"]),
                              None if c.get("summary") is None else str(c["summary"]),
                              int(c["generation"])) if isinstance(c, dict) else None
        except (KeyError, TypeError, ValueError):
            log.warning("a stored prompt state could not be read; the session selects anew")
            return False
        self.pinned, self.compaction = pinned, comp  # the conversation it continues now
        return bool(pinned or comp)

    def observe(self, counted: int, real: int | None) -> None:
        """After a turn: remember vLLM's figure and how far our count was from it."""
        if real:
            self.last_prompt_tokens = int(real)
            if counted > 0:
                self.calibration = min(4.0, max(0.25, real / counted))


class ContextTracker:
    """``(owner, session) -> SessionState``, bounded per tenant (see the module docstring).

    ``owner`` is a tenant's name or ``tenant/u-...`` (a user's,
    :func:`~cwm_plugin.salts.owner_of`), counted as its tenant's. At most ``max_sessions``
    states in all; each tenant is sure of ``share`` of them, so the total is full only when
    someone is over its share. A new state past the total evicts the least recently used of
    its own tenant when that tenant holds more than its share, else of the tenant holding the
    most (the one furthest over its share), never the oldest of all: no tenant's sessions,
    however many it opens, evict another tenant's within its share."""

    def __init__(self, max_sessions: int = 100_000, share: int | None = None) -> None:
        self._tenants: dict[str, OrderedDict[tuple[str, str], SessionState]] = {}
        self._max = max_sessions
        self._share = share or max_sessions
        self._count = 0

    def get(self, owner: str, session: str) -> SessionState:
        tenant = tenant_of(owner)
        mine = self._tenants.setdefault(tenant, OrderedDict())
        key = (owner, session)
        state = mine.get(key)
        if state is not None:
            mine.move_to_end(key)  # most recently used last
            return state
        state = mine[key] = SessionState()
        self._count += 1
        if self._count > self._max:
            victim = tenant if len(mine) > self._share else \
                max(self._tenants, key=lambda t: len(self._tenants[t]))
            self._tenants[victim].popitem(last=False)
            self._count -= 1
            if not self._tenants[victim]:
                del self._tenants[victim]
        return state

    def peek(self, owner: str, session: str) -> SessionState | None:
        """The session's state if it is tracked (nothing created, nothing reordered)."""
        return self._tenants.get(tenant_of(owner), {}).get((owner, session))

    def __len__(self) -> int:
        return self._count

    def held(self, tenant: str) -> int:
        """How many states ``tenant`` (its own and its users') holds."""
        return len(self._tenants.get(tenant, ()))

    def sessions(self, owner: str) -> list[str]:
        """The owner's sessions tracked since the app started."""
        mine = self._tenants.get(tenant_of(owner), {})
        return [s for (o, s) in mine if o == owner]


SnapshotHook = Callable[[str, str, str, str], "Awaitable[None] | None"]


async def noop_snapshot(tenant: str, session: str, cache_salt: str, name: str) -> None:
    """Default KV-snapshot hook: does nothing. Replace ``app.state.snapshot_hook`` to freeze the
    session's KV (e.g. a window named ``name`` under ``cache_salt``) at checkpoint time."""
    return None


async def call_hook(hook: SnapshotHook, tenant: str, session: str, salt: str, name: str) -> None:
    try:
        result = hook(tenant, session, salt, name)
        if inspect.isawaitable(result):
            await result
    except Exception:  # a hook must never break a turn
        log.exception("snapshot hook failed for tenant %s session %s", tenant, session)
