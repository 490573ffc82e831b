"""Prompts of conversation text, of a chosen length in a model's tokens, for benchmarks and
the demo: the generated conversations (:mod:`cwm_plugin.testing.conversations.dialogues`) as
``speaker: text`` lines."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from cwm_plugin.testing.conversations.dialogues import default_conversations


def conversation_lines() -> Iterator[str]:
    """Every turn of the default generated conversations, in order, as ``speaker: text``."""
    for conv in default_conversations():
        yield from conv.lines()


def conversation_prompt(tokenizer, n_tokens: int, *, skip_lines: int = 0,
                        source: Iterable[str] | None = None) -> str:
    """About ``n_tokens`` tokens (never more) of conversation, starting ``skip_lines`` in;
    ``source``: the lines to take them from (default :func:`conversation_lines`)."""
    lines: list[str] = []
    total = 0
    for i, line in enumerate(conversation_lines() if source is None else source):
        if i < skip_lines:
            continue
        cost = len(tokenizer.encode("\n" + line, add_special_tokens=False))
        if total + cost > n_tokens:
            break
        lines.append(line)
        total += cost
    if total < n_tokens * 0.9:
        raise RuntimeError(f"not enough conversation text for a {n_tokens}-token prompt")
    return "\n".join(lines)
