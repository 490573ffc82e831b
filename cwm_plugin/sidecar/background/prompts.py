"""The messages the sidecar sends the model for its own work (summaries, fact extraction).

The prompt texts, the facts' JSON schema and the strict fact parser belong to the memory
package (:mod:`cwm_plugin.memory.service.facts`); this module only turns them into chat
messages and a structured-output request.
"""

from __future__ import annotations

from typing import Any

from cwm_plugin.memory.models import CATEGORIES
from cwm_plugin.memory.service.facts import (
    FACTS_PROMPT,
    SCHEMA_MAX_TOKENS,
    SUMMARY_PROMPT,
    facts_schema,
)
from cwm_plugin.memory.service.facts import parse_facts as parse_facts

RETRY_NOTE = (
    "Your previous answer was not valid JSON of the required shape. Answer again with JSON only,"
    " no prose, no code fences."
)


def facts_response_format() -> dict[str, Any]:
    """A JSON schema for vLLM's structured outputs that matches ``parse_facts``'s rules, so a
    small model's answer is valid JSON by construction (``parse_facts`` still checks it)."""
    return {"type": "json_schema", "json_schema": {"name": "facts",
                                                   "schema": facts_schema(CATEGORIES),
                                                   "strict": True}}


def facts_max_tokens() -> int:
    """Room for an extraction's answer: a schema-bounded one fits (``SCHEMA_MAX_TOKENS``)."""
    return SCHEMA_MAX_TOKENS


def summary_messages(previous: str | None, transcript: str) -> list[dict[str, str]]:
    user = (f"Previous summary:\n{previous}\n\n" if previous else "") + \
        f"Conversation:\n{transcript}\n\nWrite the updated summary."
    return [{"role": "system", "content": SUMMARY_PROMPT}, {"role": "user", "content": user}]


def facts_messages(exchange: str, known: list[tuple[str, str]] = ()) -> list[dict[str, str]]:
    """``known``: ``(key, text)`` of facts already stored (their keys can be reused)."""
    listed = "".join(f"- [{k}] {t}\n" for k, t in known)
    head = f"Known facts:\n{listed}\n" if listed else ""
    return [{"role": "system", "content": FACTS_PROMPT},
            {"role": "user", "content": f"{head}Conversation:\n{exchange}\n\nJSON:"}]


def facts_retry_messages(exchange: str, bad_answer: str,
                         known: list[tuple[str, str]] = ()) -> list[dict[str, str]]:
    return facts_messages(exchange, known) + [
        {"role": "assistant", "content": bad_answer[:2000]},
        {"role": "user", "content": RETRY_NOTE},
    ]
