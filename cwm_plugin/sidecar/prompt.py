"""Cache-aware prompt assembly.

A request's messages split into the **stable prefix** (the leading system/developer messages,
unchanged turn to turn), the **history** the client sent, and the **new message** (the last
one); the rule is the memory package's (``cwm_plugin.memory.history``), so the selection never
repeats a prefix message. The prompt sent upstream is, in order::

    stable prefix | memory block (one system message) | recent turns verbatim | new message

so vLLM's prefix cache keeps hitting on the stable prefix whatever memory is selected. The
``memory_first`` layout (memory block before the stable prefix) exists only to measure what
cache-awareness buys; it breaks the cached prefix whenever the memory changes.
After an automatic checkpoint the session is *compacted*: the summary joins the memory block and
only the last ``keep`` user/assistant exchanges of the recent history stay (an exchange starts
at a user message; pinned system/developer messages before it stay too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from cwm_plugin.errors import InvalidInput
from cwm_plugin.memory.history import PREFIX_ROLES, prefix_length

MEMORY_HEADER = "Relevant memory from earlier conversations (may be incomplete):"
SUMMARY_HEADER = "Summary of this conversation so far:"

Message = dict[str, Any]


@dataclass
class SplitMessages:
    prefix: list[Message]
    history: list[Message]
    new: Message


@dataclass
class Prompt:
    messages: list[Message]
    memory_message: Message | None
    recent: list[Message] = field(default_factory=list)


def validate_messages(messages: object) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("`messages` must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidInput(f"messages[{i}] must be an object with a string `role`")
    return messages


def split(messages: list[Message]) -> SplitMessages:
    n = prefix_length(messages)
    return SplitMessages(prefix=messages[:n], history=messages[n:-1], new=messages[-1])


def text_of(message: Message) -> str:
    """The text of a message; content parts other than text are skipped."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content
                         if isinstance(p, dict) and p.get("type") == "text")
    return ""


def memory_text(memory_block: str, summary: str | None) -> str:
    parts = []
    if summary:
        parts.append(f"{SUMMARY_HEADER}\n{summary.strip()}")
    if memory_block and memory_block.strip():
        parts.append(f"{MEMORY_HEADER}\n{memory_block.strip()}")
    return "\n\n".join(parts)


def last_exchanges(recent: list[Message], n: int) -> list[Message]:
    """The last ``n`` exchanges of ``recent`` (each from a user message on), plus the
    system/developer messages before them."""
    starts = [i for i, m in enumerate(recent) if m.get("role") == "user"]
    if len(starts) <= n:
        return recent
    cut = starts[-n] if n > 0 else len(recent)
    return [m for m in recent[:cut] if m.get("role") in PREFIX_ROLES] + recent[cut:]


def assemble(split_msgs: SplitMessages, recent: list[Message], memory_block: str, *,
             mode: Literal["cache_aware", "memory_first"] = "cache_aware",
             summary: str | None = None, keep: int | None = None) -> Prompt:
    """The messages to forward. ``keep`` (after a checkpoint) bounds the recent history to
    that many user/assistant exchanges."""
    if keep is not None:
        recent = last_exchanges(recent, keep)
    text = memory_text(memory_block, summary)
    mem = {"role": "system", "content": text} if text else None
    block = [mem] if mem else []
    if mode == "memory_first":
        out = block + split_msgs.prefix + recent + [split_msgs.new]
    else:
        out = split_msgs.prefix + block + recent + [split_msgs.new]
    return Prompt(messages=out, memory_message=mem, recent=recent)


def recent_from_transcript(turns: list[dict[str, Any]], n: int) -> list[Message]:
    """The last ``n`` recorded turns as chat messages (the server-side history)."""
    out = [{"role": t["role"], "content": t.get("content", "")} for t in turns
           if t.get("role") in ("user", "assistant")]
    return out[-n:] if n else []
