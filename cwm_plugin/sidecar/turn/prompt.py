"""What the sidecar sends upstream: the client's messages, in order, with memory merged in.

A request's messages split (``cwm_plugin.memory.selection.history``, shared with the memory
selection) into the **prefix** (leading system/developer messages), the **history**, and the
**current exchange** (from the last user message to the end: a question, or a question and the tool
calls answering it so far). Nothing the client sent is dropped, duplicated or reordered while the
conversation fits under the compaction threshold; the memory text is *merged* into one message
rather than sent as a message of its own, because chat templates allow one system message or none
(Mistral-style templates need strictly alternating roles, Gemma-style ones have no system role at
all):

- ``system`` placement (default): appended to the client's first system message; inserted as a
  system message at the start when the client sent none; prepended to the first user message
  when the model's template has no system role;
- ``last_user``: prepended to the current exchange's user message.

Which placement keeps vLLM's prefix cache hitting is measured in ``bench/sidecar.py`` (the
memory block is stable for a whole conversation by default, see ``plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from cwm_plugin.errors import InvalidInput
from cwm_plugin.memory.selection.history import (
    PREFIX_ROLES,
    groups,
    prefix_length,
    split_current,
    text_of,
)

MEMORY_HEADER = "Relevant memory from earlier conversations (may be incomplete):"
SUMMARY_HEADER = "Summary of this conversation so far:"
SEPARATOR = "\n\n"

Message = dict[str, Any]
Placement = Literal["system", "last_user"]


@dataclass
class Parts:
    prefix: list[Message]
    history: list[Message]
    current: list[Message]


def validate_messages(messages: object) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("`messages` must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidInput(f"messages[{i}] must be an object with a string `role`")
    return messages


def split(messages: list[Message]) -> Parts:
    n = prefix_length(messages)
    history, current = split_current(messages[n:])
    return Parts(prefix=messages[:n], history=history, current=current)


def query_text(parts: Parts) -> str:
    """What memory is searched for: the current exchange's user message (never a tool's
    output), else the last message."""
    for m in parts.current:
        if m.get("role") == "user":
            return text_of(m)
    return text_of(parts.current[-1]) if parts.current else ""


def memory_text(memory_block: str, summary: str | None) -> str:
    parts = []
    if summary:
        parts.append(f"{SUMMARY_HEADER}\n{summary.strip()}")
    if memory_block and memory_block.strip():
        parts.append(f"{MEMORY_HEADER}\n{memory_block.strip()}")
    return SEPARATOR.join(parts)


def _with_text(message: Message, text: str, *, before: bool) -> Message:
    """A copy of ``message`` with ``text`` added before or after its content."""
    content = message.get("content")
    if isinstance(content, list):
        part = {"type": "text", "text": text}
        new: Any = [part, *content] if before else [*content, part]
    elif content is None or content == "":
        new = text
    else:
        new = f"{text}{SEPARATOR}{content}" if before else f"{content}{SEPARATOR}{text}"
    return {**message, "content": new}


def merge(messages: list[Message], text: str, placement: Placement, *,
          system_role: bool = True) -> list[Message]:
    """``messages`` with the memory ``text`` merged in (see the module docstring); the
    client's messages are copied, never changed in place."""
    if not text:
        return list(messages)
    out = list(messages)
    users = [i for i, m in enumerate(out) if m.get("role") == "user"]
    if placement == "last_user" and users:
        out[users[-1]] = _with_text(out[users[-1]], text, before=True)
        return out
    first = next((i for i, m in enumerate(out) if m.get("role") == "system"), None)
    if first is not None and first < prefix_length(out):
        out[first] = _with_text(out[first], text, before=False)
    elif system_role or not users:
        out.insert(0, {"role": "system", "content": text})
    else:
        out[users[0]] = _with_text(out[users[0]], text, before=True)
    return out


def last_exchanges(history: list[Message], n: int) -> int:
    """How many leading ``history`` messages fall outside its last ``n`` exchanges (each from
    a user message on)."""
    starts = [i for i, m in enumerate(history) if m.get("role") == "user"]
    if len(starts) <= n:
        return 0
    return starts[-n] if n > 0 else len(history)


def drop_front(history: list[Message], cut: int) -> list[Message]:
    """``history`` without its first ``cut`` messages, except the system/developer ones among
    them (instructions stay, in order)."""
    return [m for m in history[:cut] if m.get("role") in PREFIX_ROLES] + history[cut:]


def fit_cut(history: list[Message], cost: Any, room: int, start: int = 0) -> int:
    """The smallest cut (at a group boundary, from ``start``) whose remaining history costs at
    most ``room`` tokens (``cost(messages) -> tokens``); a tool call leaves with its results."""
    cut = start
    for g in groups(history[start:]):
        if cost(drop_front(history, cut)) <= room:
            return cut
        cut += len(g)
    return cut
