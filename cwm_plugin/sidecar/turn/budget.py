"""How many tokens a turn's memory selection may use (shared by the sidecar and its bench).

The selection keeps recent history verbatim *and* injects memory, so its budget is the memory
budget (``budget_tokens``, at most ``budget_fraction`` of the model's context) **plus** what the
recent messages it is asked to keep cost; all of it capped by what the context has left after
the stable prefix, the new message, the answer (``max_tokens``, else 256) and a small margin
for the chat template.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cwm_plugin.memory.selection.history import window
from cwm_plugin.memory.settings import MemorySettings

DEFAULT_ANSWER_TOKENS = 256
TEMPLATE_MARGIN = 32

Messages = list[dict[str, Any]]


def answer_tokens(body: dict[str, Any]) -> int:
    """The answer length a request asks for (``max_completion_tokens``/``max_tokens``)."""
    n = body.get("max_completion_tokens") or body.get("max_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else \
        DEFAULT_ANSWER_TOKENS


def recent_tail(history: Messages, n: int) -> Messages:
    """The history messages the selection will try to keep verbatim (``history.window``)."""
    if n <= 0:
        return []
    groups, pinned = window(history, n)
    return pinned + [m for g in groups for m in g]


def memory_budget(cfg: MemorySettings, count_messages: Callable[[Messages], int],
                  prefix_and_new: Messages, tail: Messages, max_len: int | None,
                  answer: int) -> int:
    budget = cfg.budget_tokens
    if max_len:
        budget = min(budget, int(max_len * cfg.budget_fraction))
    budget += count_messages(tail)
    if max_len:
        left = max_len - min(answer, max_len) - count_messages(prefix_and_new) - TEMPLATE_MARGIN
        budget = min(budget, left)
    return max(0, budget)
