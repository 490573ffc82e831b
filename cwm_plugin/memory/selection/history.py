"""Which of a request's messages are the stable prefix, the history and the new message, and
which history messages are kept verbatim; the text of a message (:func:`text_of`).

Shared by the memory selection and the sidecar's prompt assembly, so both agree on the split:

- the **prefix** is the run of leading ``system``/``developer`` messages (never the last
  message): the caller keeps it in place, so it is neither counted nor repeated here;
- the **current exchange** runs from the last user message to the end: the question and any
  tool calls answering it so far (an agent loop), always sent as it is;
- the **history** is everything in between, in order, mid-conversation ``system``/``developer``
  messages included.

Recent history is chosen in *groups*: an assistant message that calls tools and the ``tool``
messages answering it form one group, so a tool result is never kept without its call (or the
call without its results). The window is the last groups holding ``n`` messages (a group is
never cut, so the window may hold a few more). Older ``system``/``developer`` messages are
instructions, not conversation: they are *pinned*, kept ahead of the window when the budget
allows, and reported when it does not.
"""

from __future__ import annotations

from typing import Any

PREFIX_ROLES = ("system", "developer")
Message = dict[str, Any]


def text_of(message: Message) -> str:
    """The text of a message; content parts other than text are skipped."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content
                         if isinstance(p, dict) and p.get("type") == "text")
    return ""


def prefix_length(messages: list[Message]) -> int:
    """How many leading messages form the stable prefix (the last message never does)."""
    n = 0
    while n < len(messages) - 1 and messages[n].get("role") in PREFIX_ROLES:
        n += 1
    return n


def split_current(conv: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(history, current exchange)``: the current exchange runs from the last user message
    to the end (a question, or a question with the tool calls answering it so far)."""
    last = max((i for i, m in enumerate(conv) if m.get("role") == "user"), default=None)
    if last is None:
        return [], list(conv)
    return conv[:last], conv[last:]


def groups(history: list[Message]) -> list[list[Message]]:
    """``history`` cut into groups: a tool-calling assistant message with its tool results."""
    out: list[list[Message]] = []
    for m in history:
        opener = out[-1][0] if out else None
        if m.get("role") == "tool" and opener is not None and \
                opener.get("role") == "assistant" and opener.get("tool_calls"):
            out[-1].append(m)
        else:
            out.append([m])
    return out


def window(history: list[Message], n: int) -> tuple[list[list[Message]], list[Message]]:
    """``(recent groups, pinned older system/developer messages)`` for the last ``n``."""
    gs = groups(history)
    recent: list[list[Message]] = []
    count = 0
    while gs and count < n:
        g = gs.pop()
        recent.insert(0, g)
        count += len(g)
    pinned = [g[0] for g in gs if g[0].get("role") in PREFIX_ROLES]
    return recent, pinned
