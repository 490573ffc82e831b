"""Routing settings: the upstreams (``upstream:``, ``upstreams:``) and ``routing:`` (the
classifier's rules, aliases, background work's model and the upstream health checks; see
``upstream/routing.py`` and ``upstream/router.py``)."""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from cwm_plugin.config_file import Strict

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


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
    # Which of the upstreams able to answer goes first: "session", each session's own (the
    # one its cache_salt ranks highest, rendezvous hashing: a session stays where its KV is,
    # sessions spread over the upstreams, and one going down moves only its own sessions);
    # "first", the first healthy in the list (a primary and its standbys).
    affinity: Literal["session", "first"] = "session"
    # The header every request of a session carries to its upstream with the session's routing
    # key (an HMAC of its cache_salt: the same for a session's turns and warm-ups, unguessable,
    # never the client's session name), so a balancer in front of several vLLMs keeps a session
    # where its KV is: vllm-router's consistent_hash and kv_aware session affinity read
    # X-Session-Id, nginx's `hash $http_x_session_id consistent` too. "": none sent.
    session_header: str = Field(default="X-Session-Id", pattern=r"^([A-Za-z0-9-]{1,64})?$")
    # The priority of a turn that continues a conversation (its prefix was computed before, so
    # its KV is cached or stored) on upstreams with priority_scheduling: lower goes first, so
    # it is restored and answered ahead of queued first turns (vLLM orders its queues by
    # priority, then arrival); none: every turn 0. A client's own priority is kept as sent
    # only with the `priority` grant; without it, at least 0 (it may only go after others).
    returning_priority: int | None = Field(default=-1, le=0)

    @field_validator("returning_priority", mode="before")
    @classmethod
    def _none(cls, v: object) -> object:
        return None if v == "none" else v


class UpstreamConfig(Strict):
    """One model server (vLLM's OpenAI server): where it is, what it serves, its roles, and how
    patient to be with it. ``upstream:`` alone is the one default upstream; ``upstreams:``
    lists several, each taking the fields it does not set from ``upstream:``."""

    name: str = "default"
    url: str = "http://127.0.0.1:8000"
    # The served model names; empty: whatever its /v1/models lists (asked when needed).
    models: list[str] = Field(default_factory=list)
    # The context limit in tokens; None: the model's max_model_len from its /v1/models.
    context_limit: int | None = Field(default=None, ge=1)
    # default / code / large / background, or any name a routing rule uses.
    roles: list[str] = Field(default_factory=lambda: ["default"])
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 600.0
    write_timeout_s: float = 30.0
    pool_timeout_s: float = 10.0
    connect_retries: int = Field(default=2, ge=0, le=10)
    max_connections: int = Field(default=200, ge=1)
    max_keepalive: int = Field(default=50, ge=1)
    # vLLM runs with --scheduling-policy priority: returning turns may go first
    # (routing.returning_priority); one without it refuses any priority but 0
    priority_scheduling: bool = False
    # A balancer over several vLLM servers (vllm-router): a stream it cuts mid-answer (the
    # server behind it died) is resumed on it again, the continuation going to a live server
    balancer: bool = False
    # /v1/models: a list older than this is refreshed in the background while it answers
    models_ttl_s: float = Field(default=30.0, ge=0)
    # a model name no list has is answered from the lists (404) unless one is older than this
    models_recheck_s: float = Field(default=5.0, ge=0)
    # Sent to vLLM as `Authorization: Bearer` (vLLM's --api-key): the file's `api_key`, else
    # the environment variable named here (when set). Never logged.
    api_key: SecretStr | None = None
    api_key_env: str = "CWM_UPSTREAM_API_KEY"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.fullmatch(v):
            raise ValueError(f"upstream name {v!r} must match {NAME.pattern}")
        return v

    @field_validator("roles")
    @classmethod
    def _roles(cls, v: list[str]) -> list[str]:
        for role in v:
            if not NAME.fullmatch(role):
                raise ValueError(f"role {role!r} must match {NAME.pattern}")
        return v

    def key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(self.api_key_env) or None


# Fields of an `upstreams:` entry that are its own, never taken from `upstream:`.
UPSTREAM_OWN = ("name", "url", "models", "context_limit", "roles")
