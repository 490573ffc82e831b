"""A namespace's memory at two resolutions, as text with its token count
(``GET /v1/memory/view``, ``memory.py``).

* ``quick``: the short forms: the durable memories in force (most important first) and each
  session's summary (newest session first): what an agent loads to pick a namespace up fast.
* ``full``: the same and, per session, its whole transcript (``role: content`` lines).

Sessions come newest first, so ``max_tokens`` (the caller's cap) drops the oldest ones' parts
first; ``truncated`` says it did. Reading never writes (no use counts are bumped). A chat
request picks its own view of the selection with ``X-CWM-Memory-View`` (``plan.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cwm_plugin.memory.selection.select import FACTS_HEADER, fact_line

VIEWS = ("quick", "full")


@dataclass
class MemoryView:
    view: str
    text: str
    tokens: int  # of ``text``, with the memory's token counter
    facts: int  # durable memories included
    sessions: int  # sessions with a part included
    truncated: bool = False  # parts were left out to stay within ``max_tokens``

    def public(self) -> dict[str, Any]:
        return {"view": self.view, "text": self.text, "tokens": self.tokens,
                "facts": self.facts, "sessions": self.sessions, "truncated": self.truncated}


def _session_part(service: Any, folder: str, session: str, view: str) -> str:
    summary = service.summary(folder, session)
    lines = [f"Summary of session {session}:\n{summary.strip()}"] if summary else []
    if view == "full":
        turns = service.transcript(folder, session)
        if turns:
            lines.append("\n".join([f"Conversation {session}:",
                                    *(f"{t['role']}: {t['content']}" for t in turns)]))
    return "\n\n".join(lines)


def build_view(service: Any, folder: str, view: str, count: Callable[[str], int],
               max_tokens: int | None = None) -> MemoryView:
    """The ``view`` of the memory in ``folder`` (see the module docstring); synchronous (file
    reads): call it from a worker thread."""
    facts = sorted(service.memories(folder), key=lambda m: (-m.importance, m.id))
    stats = service.files.session_stats(folder)
    newest = sorted(stats, key=lambda s: (-stats[s][1], s))
    parts: list[tuple[str, bool]] = []  # (text, is a session's)
    if facts:
        parts.append(("\n".join([FACTS_HEADER, *(fact_line(m) for m in facts)]), False))
    parts += [(p, True) for s in newest if (p := _session_part(service, folder, s, view))]
    text = "\n\n".join(p for p, _ in parts)
    tokens = count(text) if text else 0
    truncated = False
    while max_tokens is not None and tokens > max_tokens and parts:
        parts.pop()  # the oldest session's part (the facts last)
        truncated = True
        text = "\n\n".join(p for p, _ in parts)
        tokens = count(text) if text else 0
    return MemoryView(view, text, tokens, len(facts) if parts and not parts[0][1] else 0,
                      sum(1 for _, is_session in parts if is_session), truncated)
