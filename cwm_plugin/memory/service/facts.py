"""The contract between the sidecar and the model for summaries and extracted facts.

The sidecar sends :data:`SUMMARY_PROMPT` / :data:`FACTS_PROMPT` as system messages to the
upstream model and hands the answers back (``set_summary``, ``add_memory``). Facts must be strict
JSON, checked by :func:`parse_facts`: a JSON array (possibly empty) of objects with the keys
``text`` (1-500 characters), ``category`` (preference, goal, decision or fact), optionally
``importance`` (0-1, default 0.5) and ``key`` (the topic in a few lower-case words, at most 60
characters: a newer fact with a known fact's key may replace it, ``facts_file.py``). Anything
else (prose, code fences, extra keys, unknown categories) raises :class:`InvalidInput`, so the
sidecar can retry once and then refuse. With structured outputs the request carries
:func:`facts_schema` and at most ``SCHEMA_MAX_FACTS`` facts: ``text`` comes first in the
schema, because a small model writes a better sentence before it has to name a topic
(SmolLM2-135M named the topic first and then wrote the topic's example sentence).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from cwm_plugin.errors import InvalidInput

MAX_FACTS = 20
SCHEMA_MAX_FACTS = 3
SCHEMA_MAX_TOKENS = 512  # room for a schema-bounded answer (SmolLM2 pads JSON with newlines)
MAX_KNOWN = 12  # known facts listed in the extraction prompt (their keys can be reused)

SUMMARY_PROMPT = (
    "You maintain a running summary of a conversation between a user and an assistant. "
    "Given the previous summary (if any) and the newest part of the conversation, write the "
    "updated summary: at most 150 words, third person, plain text, keeping names, dates, "
    "numbers, decisions and open questions; drop small talk. Output only the summary."
)

FACTS_PROMPT = (
    "Extract durable facts about the user from the conversation below: stable preferences, "
    "goals, decisions and personal facts worth remembering in later conversations. Ignore "
    "small talk and anything only true for this moment.\n"
    "Answer with JSON only, no prose and no code fences: an array of objects "
    '{"text": string, "category": "preference" | "goal" | "decision" | "fact", '
    '"importance": number between 0 and 1, "key": string}. Each text is one short '
    "self-contained sentence "
    'in the third person (e.g. "The user is allergic to peanuts."); "key" names its topic in a '
    'few lower-case words (e.g. "allergy"); a fact that changes a known fact (listed with its '
    "key in brackets) takes that key. Answer [] if there is nothing durable."
)


class Fact(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str = Field(min_length=1, max_length=500)
    category: Literal["preference", "goal", "decision", "fact"]
    importance: float = Field(default=0.5, ge=0.0, le=1.0)
    key: str = Field(default="", max_length=60)

    @field_validator("importance", mode="before")
    @classmethod
    def _int_ok(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("text")
    @classmethod
    def _one_line(cls, v: str) -> str:
        v = " ".join(v.split())
        if not v:
            raise ValueError("text is blank")
        return v


_FACTS = TypeAdapter(list[Fact])


def parse_facts(text: str) -> list[dict[str, Any]]:
    """Validated facts as dicts (``text``, ``category``, ``importance``); strict JSON only."""
    if not isinstance(text, str):
        raise InvalidInput("facts must be given as a JSON string")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"facts are not valid JSON: {exc.msg} at position {exc.pos}",
                           hint="answer with a JSON array only, no prose or code fences"
                           ) from exc
    if not isinstance(data, list):
        raise InvalidInput(f"facts must be a JSON array, got {type(data).__name__}",
                           hint='answer like [{"text": "...", "category": "fact", '
                                '"importance": 0.5}] or []')
    if len(data) > MAX_FACTS:
        raise InvalidInput(f"{len(data)} facts in one answer; at most {MAX_FACTS}")
    try:
        facts = _FACTS.validate_python(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidInput(f"invalid fact at {where}: {first['msg']}",
                           hint="each fact needs text, a category among preference, goal, "
                                "decision, fact, and an importance in [0, 1]") from exc
    return [f.model_dump(exclude={"key"} if not f.key.strip() else None) for f in facts]


def facts_schema(categories: tuple[str, ...]) -> dict[str, Any]:
    """The JSON schema of an extraction answer for vLLM's structured outputs (what
    :func:`parse_facts` accepts, ``text`` first, at most ``SCHEMA_MAX_FACTS`` facts)."""
    return {"type": "array", "maxItems": SCHEMA_MAX_FACTS,
            "items": {"type": "object", "additionalProperties": False,
                      "required": ["text", "category", "importance", "key"],
                      "properties": {
                          "text": {"type": "string", "minLength": 1, "maxLength": 160},
                          "category": {"enum": list(categories)},
                          "importance": {"type": "number", "minimum": 0, "maximum": 1},
                          "key": {"type": "string", "minLength": 1, "maxLength": 30}}}}
