"""Routing settings (``routing:`` in the sidecar's config): the classifier's rules, aliases,
background work's model and the upstream health checks (see ``routing.py`` and ``router.py``)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """A settings model that refuses unknown keys (a typo is an error, never ignored)."""

    model_config = ConfigDict(extra="forbid")


class RouteRule(Strict):
    """One rule of the classifier: every condition given must hold (``keywords`` and
    ``patterns`` together are one condition: any of them found in the newest user message);
    the first rule that matches names the role. Tokens are estimated (about 4 characters a
    token) over every message: routing happens before the model, and its tokenizer, is known."""

    role: str
    keywords: list[str] = Field(default_factory=list)   # whole words, any case
    patterns: list[str] = Field(default_factory=list)   # regular expressions
    min_tokens: int | None = Field(default=None, ge=0)
    min_messages: int | None = Field(default=None, ge=0)
    tools: bool | None = None                           # the request declares tools

    @model_validator(mode="after")
    def _something(self) -> RouteRule:
        if not (self.keywords or self.patterns or self.min_tokens is not None
                or self.min_messages is not None or self.tools is not None):
            raise ValueError(f"the rule for role {self.role!r} has no condition")
        for p in self.patterns:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"pattern {p!r} is not a regular expression: {exc}") from None
        return self


DEFAULT_RULES = [
    RouteRule(role="code", patterns=["```", r"\bdef \w+\(", r"\bfunction \w+\("],
              keywords=["code", "function", "implement", "refactor", "debug", "compile",
                        "traceback", "stack trace", "regex", "sql", "python", "javascript",
                        "typescript", "rust", "golang", "bash script", "unit test"]),
    RouteRule(role="large", min_tokens=8000),
    RouteRule(role="large", keywords=["analyze", "analyse", "architecture", "prove",
                                      "step by step", "in depth", "trade-offs", "design doc"]),
]


class HealthSettings(Strict):
    """Upstream health: a ``GET /v1/models`` every ``interval_s`` (0: only after an error),
    and right after a connect error or a 5xx."""

    interval_s: float = Field(default=10.0, ge=0)
    timeout_s: float = Field(default=3.0, gt=0)


class RoutingSettings(Strict):
    """Which upstream answers: an explicit model goes to the upstreams serving it; a model
    named in ``aliases`` goes to the role it maps to (``classify``: the role the rules pick,
    else ``default``). Background work (summaries, facts) goes to the upstreams with the role
    ``background`` when there are any, with ``background_model`` (None: the turn's model if
    such an upstream serves it, else its first model)."""

    aliases: dict[str, str] = Field(default_factory=lambda: {"auto": "classify"})
    rules: list[RouteRule] = Field(default_factory=lambda: list(DEFAULT_RULES))
    background_model: str | None = None
    health: HealthSettings = HealthSettings()
