"""The messages the sidecar sends the model for its own work (summaries, fact extraction).

The prompt texts and the strict fact parser belong to the memory package
(``cwm_plugin.memory.service.facts``); this module only turns them into chat messages, and
falls back to short built-in prompts if the memory package names them differently.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType
from typing import Any

FALLBACK_SUMMARY = (
    "You maintain a running summary of a conversation. Write a concise summary (at most 120 "
    "words) of the facts, decisions and open questions so far. Output only the summary."
)
FALLBACK_FACTS = (
    "Extract durable facts about the user from the conversation below. Answer with JSON only: "
    'a list of objects {"text": str, "category": str, "importance": number 0-1}, or [] if none.'
)
RETRY_NOTE = (
    "Your previous answer was not valid JSON of the required shape. Answer again with JSON only,"
    " no prose, no code fences."
)


@cache
def _facts() -> ModuleType:
    return importlib.import_module("cwm_plugin.memory.service.facts")


def _prompt(*names: str, default: str) -> str:
    for n in names:
        v = getattr(_facts(), n, None)
        if isinstance(v, str) and v.strip():
            return v
    return default


def summary_prompt() -> str:
    return _prompt("SUMMARY_PROMPT", "SUMMARY_SYSTEM_PROMPT", default=FALLBACK_SUMMARY)


def facts_prompt() -> str:
    return _prompt("FACTS_PROMPT", "FACT_EXTRACTION_PROMPT", "FACTS_SYSTEM_PROMPT",
                   default=FALLBACK_FACTS)


def parse_facts(text: str) -> list[dict[str, Any]]:
    """Strict: raises :class:`cwm_plugin.errors.InvalidInput` on anything but valid facts."""
    return _facts().parse_facts(text)


def facts_response_format() -> dict[str, Any]:
    """A JSON schema for vLLM's structured outputs that matches ``parse_facts``'s rules, so a
    small model's answer is valid JSON by construction (``parse_facts`` still checks it)."""
    from cwm_plugin.memory.models import CATEGORIES

    schema = _facts().facts_schema(CATEGORIES)
    return {"type": "json_schema", "json_schema": {"name": "facts", "schema": schema,
                                                   "strict": True}}


def facts_max_tokens() -> int:
    """Room for an extraction's answer: a schema-bounded one fits (``SCHEMA_MAX_TOKENS``)."""
    return int(getattr(_facts(), "SCHEMA_MAX_TOKENS", 512))


def summary_messages(previous: str | None, transcript: str) -> list[dict[str, str]]:
    user = (f"Previous summary:\n{previous}\n\n" if previous else "") + \
        f"Conversation:\n{transcript}\n\nWrite the updated summary."
    return [{"role": "system", "content": summary_prompt()}, {"role": "user", "content": user}]


def facts_messages(exchange: str, known: list[tuple[str, str]] = ()) -> list[dict[str, str]]:
    """``known``: ``(key, text)`` of facts already stored (their keys can be reused)."""
    listed = "".join(f"- [{k}] {t}\n" for k, t in known)
    head = f"Known facts:\n{listed}\n" if listed else ""
    return [{"role": "system", "content": facts_prompt()},
            {"role": "user", "content": f"{head}Conversation:\n{exchange}\n\nJSON:"}]


def facts_retry_messages(exchange: str, bad_answer: str,
                         known: list[tuple[str, str]] = ()) -> list[dict[str, str]]:
    return facts_messages(exchange, known) + [
        {"role": "assistant", "content": bad_answer[:2000]},
        {"role": "user", "content": RETRY_NOTE},
    ]
