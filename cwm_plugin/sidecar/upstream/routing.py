"""The rule-based classifier: which role answers a request when the client lets the sidecar
choose (``model: auto``, or an alias mapped to ``classify``).

Rules come from ``routing.rules`` (:class:`~cwm_plugin.sidecar.settings.RouteRule`), tried in
order; the first whose conditions all hold names the role, else ``default``. A rule whose role
no upstream has is left out (logged once when the app starts), so the same rules work on a
deployment with one upstream and on one with five. ``keywords`` (whole words, any case) and
``patterns`` (regular expressions) look at the newest user message -- what is being asked now;
``min_tokens`` at the whole request, estimated at about 4 characters a token (the model, and
so its tokenizer, is what is being chosen); ``tools`` at whether the request declares tools.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cwm_plugin.memory.selection.history import text_of
from cwm_plugin.sidecar.settings import RouteRule

log = logging.getLogger(__name__)
CHARS_PER_TOKEN = 4
DEFAULT_ROLE = "default"


@dataclass(frozen=True)
class RouteDecision:
    """The role the classifier picked for a request, and why."""

    role: str
    reason: str  # for the X-CWM-Route header and the logs: which rule, which evidence


@dataclass(frozen=True)
class Features:
    """What the rules look at in one request."""

    last_user: str
    tokens: int
    messages: int
    tools: bool


def features(body: dict[str, Any]) -> Features:
    """The features of a chat (``messages``) or completion (``prompt``) request body."""
    messages = body.get("messages")
    if isinstance(messages, list):
        texts = [text_of(m) for m in messages if isinstance(m, dict)]
        users = [text_of(m) for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        last, count = (users[-1] if users else ""), len(texts)
    else:
        prompt = body.get("prompt", body.get("input", ""))
        texts = [p for p in prompt if isinstance(p, str)] if isinstance(prompt, list) \
            else [str(prompt or "")]
        last, count = (texts[-1] if texts else ""), 1
    chars = sum(len(t) for t in texts)
    return Features(last_user=last, tokens=chars // CHARS_PER_TOKEN, messages=count,
                    tools=bool(body.get("tools") or body.get("functions")))


class _Compiled:
    def __init__(self, index: int, rule: RouteRule) -> None:
        self.index = index
        self.rule = rule
        words = "|".join(re.escape(k) for k in rule.keywords)
        self.keywords = re.compile(rf"(?<!\w)(?:{words})(?!\w)", re.IGNORECASE) if words \
            else None
        self.patterns = [re.compile(p) for p in rule.patterns]

    def match(self, f: Features) -> str | None:
        """Why the rule matches ``f``, or None."""
        r, why = self.rule, []
        if self.keywords is not None or self.patterns:
            found = self.keywords.search(f.last_user) if self.keywords is not None else None
            if found is not None:
                why.append(f"keyword {found.group(0).lower()!r}")
            else:
                hit = next((p for p in self.patterns if p.search(f.last_user)), None)
                if hit is None:
                    return None
                why.append(f"pattern {hit.pattern!r}")
        if r.min_tokens is not None:
            if f.tokens < r.min_tokens:
                return None
            why.append(f"~{f.tokens} tokens >= {r.min_tokens}")
        if r.min_messages is not None:
            if f.messages < r.min_messages:
                return None
            why.append(f"{f.messages} messages >= {r.min_messages}")
        if r.tools is not None:
            if f.tools != r.tools:
                return None
            why.append("tools" if r.tools else "no tools")
        return ", ".join(why)


class Classifier:
    """``classify(body)`` -> :class:`RouteDecision` over the rules whose role is available."""

    def __init__(self, rules: list[RouteRule], roles: Iterable[str]) -> None:
        have = set(roles)
        self.rules = [_Compiled(i, r) for i, r in enumerate(rules, 1) if r.role in have]
        idle = sorted({r.role for r in rules if r.role not in have})
        if idle:
            log.info("routing rules for roles %s are inactive: no upstream has them", idle)

    def classify(self, body: dict[str, Any]) -> RouteDecision:
        f = features(body)
        for c in self.rules:
            why = c.match(f)
            if why is not None:
                return RouteDecision(c.rule.role, f"rule {c.index} ({c.rule.role}): {why}")
        return RouteDecision(DEFAULT_ROLE, "no rule matched")
