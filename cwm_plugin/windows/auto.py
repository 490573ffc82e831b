"""Auto-checkpoint: freeze a session for real when its context nears the model's limit.

The sidecar tracks how full each session's context is; at ``warn`` (70 % by default) it
warns the client, at ``checkpoint`` (85 %) it calls :class:`AutoFreeze`, which freezes the
session as a window ``auto-<session>-<time>`` tagged ``auto`` -- at most once per
``cooldown_s`` per session, and never failing the conversation (a failed freeze is logged);
a session keeps its newest ``keep`` auto-checkpoint windows, the older are deleted.
Thresholds can differ per model. ``check`` answers the same question on demand (the MCP tool
``auto_freeze_check``).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from cwm_plugin.errors import CWMError, InvalidInput
from cwm_plugin.windows.engine import WindowEngine

log = logging.getLogger(__name__)


class Thresholds(Protocol):
    """Fractions of a model's context: (warn, checkpoint) per model (None: the default)."""

    def get(self, model: str | None) -> tuple[float, float]: ...
    def set(self, model: str | None, warn: float, checkpoint: float) -> None: ...


@dataclass
class OwnThresholds:
    warn: float = 0.70
    checkpoint: float = 0.85
    per_model: dict[str, tuple[float, float]] = field(default_factory=dict)

    def get(self, model: str | None) -> tuple[float, float]:
        return self.per_model.get(model or "", (self.warn, self.checkpoint))

    def set(self, model: str | None, warn: float, checkpoint: float) -> None:
        if model:
            self.per_model[model] = (warn, checkpoint)
        else:
            self.warn, self.checkpoint = warn, checkpoint


@dataclass
class AutoFreeze:
    engine: WindowEngine
    enabled: bool = True
    cooldown_s: float = 600.0
    keep: int = 3
    thresholds: Thresholds = field(default_factory=OwnThresholds)
    frozen: int = 0
    _last: dict[tuple[str, str], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def settings(self, model: str | None = None) -> dict[str, Any]:
        warn, checkpoint = self.thresholds.get(model)
        return {"enabled": self.enabled, "cooldown_s": self.cooldown_s, "model": model,
                "warn": warn, "checkpoint": checkpoint, "frozen": self.frozen}

    def update(self, *, enabled: bool | None = None, warn: float | None = None,
               checkpoint: float | None = None, cooldown_s: float | None = None,
               model: str | None = None) -> None:
        w0, c0 = self.thresholds.get(model)
        w = w0 if warn is None else float(warn)
        c = c0 if checkpoint is None else float(checkpoint)
        if not 0 < w <= c <= 1:
            raise InvalidInput(f"thresholds warn={w} checkpoint={c} are out of order",
                               hint="0 < warn <= checkpoint <= 1")
        if cooldown_s is not None and cooldown_s < 0:
            raise InvalidInput("cooldown_s must be >= 0")
        if (w, c) != (w0, c0):
            self.thresholds.set(model, w, c)
        if enabled is not None:
            self.enabled = bool(enabled)
        if cooldown_s is not None:
            self.cooldown_s = float(cooldown_s)

    def level(self, used: int, limit: int, model: str | None = None) -> tuple[str, float]:
        frac = used / limit if limit else 0.0
        warn, checkpoint = self.thresholds.get(model)
        return ("checkpoint" if frac >= checkpoint else "warn" if frac >= warn
                else "ok"), round(frac, 4)

    def _due(self, tenant: str, session: str) -> bool:
        with self._lock:
            return time.monotonic() - self._last.get((tenant, session), -1e18) >= \
                self.cooldown_s

    def freeze_now(self, tenant: str, session: str, salt: str, reason: str) -> str | None:
        """Freeze unless disabled or cooling down; the window's name, or None."""
        if not self.enabled or not self._due(tenant, session):
            return None
        with self._lock:
            self._last[(tenant, session)] = time.monotonic()
        safe = re.sub(r"[^A-Za-z0-9_-]", "-", session)[:90]
        name = f"auto-{safe}-{time.strftime('%Y%m%d%H%M%S')}"
        try:
            self.engine.freeze(tenant, name, session=session, salt=salt, tags=["auto"],
                               description=reason[:200], auto=True)
        except CWMError as exc:                   # never fails the conversation
            log.warning("auto-freeze of session %s failed: %s", session, exc)
            return None
        self.frozen += 1
        log.info("auto-freeze: session %s frozen as %s (%s)", session, name, reason)
        self._prune(tenant, session)
        return name

    def _prune(self, tenant: str, session: str) -> None:
        """Delete the session's auto-checkpoint windows past the newest ``keep`` (only those
        auto-freeze made and nobody cloned, renamed or re-tagged: a tag is the user's)."""
        page, _ = self.engine.list(tenant, tag="auto", session=session, sort="created",
                                   descending=True, limit=100_000)
        for old in [m for m in page if m.auto][self.keep:]:
            try:
                self.engine.delete(tenant, old.name)
                log.info("auto-freeze: %s deleted (session %s keeps its newest %d)", old.name,
                         session, self.keep)
            except CWMError as exc:  # deleted meanwhile, say
                log.info("auto-freeze: could not delete %s: %s", old.name, exc)

    def check(self, tenant: str, session: str, salt: str, *, used_tokens: int | None = None,
              max_tokens: int | None = None, model: str | None = None,
              freeze: bool = True) -> dict[str, Any]:
        level, frac = self.level(int(used_tokens or 0), int(max_tokens or 0), model)
        due = level == "checkpoint" and self.enabled and self._due(tenant, session)
        window = self.freeze_now(tenant, session, salt, f"{frac:.0%} of the context") \
            if due and freeze else None
        warn, checkpoint = self.thresholds.get(model)
        return {"session": session, "level": level, "fraction": frac, "due": due,
                "frozen": window, "warn": warn, "checkpoint": checkpoint}

    def __call__(self, tenant: str, session: str, cache_salt: str, name: str) -> str | None:
        """The sidecar's checkpoint hook (``snapshot_hook``)."""
        return self.freeze_now(tenant, session, cache_salt, f"checkpoint {name}")
