"""Usage accounting per principal (today: the tenant) and model: tokens in and out, and their
cost at the configured prices (``pricing``), as metrics and ``GET /v1/usage``.

Every answer that reports ``usage`` is recorded: the clients' requests (``kind: client``: chat,
completions, responses; the ``cwm_sidecar_{prompt,completion,cached_prompt}_tokens`` counters)
and the sidecar's own work for a tenant (``kind: background``: summaries, facts;
``cwm_sidecar_background_tokens{kind=summary|facts}``); both cost (``cwm_sidecar_cost``). Cost = uncached prompt
tokens x ``input_per_1m`` + cached ones x ``cached_input_per_1m`` (else the input price) +
completion tokens x ``output_per_1m``, per million. ``GET /v1/usage`` answers the calling
tenant's own rows only (per model, upstream and kind, since the app started; the Prometheus
counters, per tenant, are what outlives a restart), ``?model=`` narrows it: a request acting
for a user gets that user's rows (a client answer is kept under ``tenant/u-...``), one acting
for no user its tenant's with all its users'. At most ``MAX_ROWS`` rows are kept per app; past
that a user's answer is added to its tenant's row (nothing grows without bound). Each answer's tokens are also
spent from the principal's token quota (``spend``: ``identity/ratelimit.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from cwm_plugin.sidecar.metrics import SidecarMetrics, tokens_of
from cwm_plugin.sidecar.settings import PricingSettings

CLIENT, BACKGROUND = "client", "background"
MAX_ROWS = 100_000


@dataclass
class Tally:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost: float = 0.0


class UsageLedger:
    """Tallies keyed by (principal, model, upstream, kind), and the metrics that go with them."""

    def __init__(self, pricing: PricingSettings, metrics: SidecarMetrics,
                 spend: Callable[[str, int], None] | None = None) -> None:
        self.pricing = pricing
        self.metrics = metrics
        self.spend = spend
        self.since = time.time()
        self._rows: dict[tuple[str, str, str, str], Tally] = {}
        self._lock = threading.Lock()

    def cost(self, model: str, prompt: int, completion: int, cached: int) -> float:
        p = self.pricing.for_model(model)
        cached_price = p.input_per_1m if p.cached_input_per_1m is None else p.cached_input_per_1m
        return ((prompt - cached) * p.input_per_1m + cached * cached_price
                + completion * p.output_per_1m) / 1e6

    def record(self, principal: str, model: str, upstream: str, usage: dict[str, Any] | None,
               kind: str = CLIENT, work: str = "background", owner: str | None = None) -> None:
        """Count one answer's ``usage`` (nothing when it reported none); ``work`` names the
        sidecar's own work (summary, facts) for ``kind: background``; ``owner``: the user's
        ``tenant/u-...`` when the request acted for one."""
        if not isinstance(usage, dict) or not usage:
            return
        prompt, completion, cached = tokens_of(usage)
        cost = self.cost(model, prompt, completion, cached)
        with self._lock:
            key = (owner or principal, model, upstream, kind)
            if key not in self._rows and len(self._rows) >= MAX_ROWS:
                key = (principal, model, upstream, kind)
            t = self._rows.setdefault(key, Tally())
            t.requests += 1
            t.prompt_tokens += prompt
            t.completion_tokens += completion
            t.cached_tokens += cached
            t.cost += cost
        if kind == CLIENT:
            self.metrics.observe_usage(principal, model, usage)
        else:
            self.metrics.observe_background(principal, model, work, usage)
        self.metrics.cost.labels(principal, model, kind).inc(cost)
        if self.spend is not None:
            self.spend(principal, prompt + completion)

    def report(self, principal: str, model: str | None = None,
               owner: str | None = None) -> dict[str, Any]:
        """The rows of ``owner`` (a user's ``tenant/u-...``), else of ``principal`` and its
        users, and their total (the body of ``GET /v1/usage``)."""
        def mine(p: str) -> bool:
            return p == owner if owner else p == principal or p.startswith(principal + "/")

        with self._lock:
            rows = [({"model": m, "upstream": u, "kind": k}, asdict(t))
                    for (p, m, u, k), t in sorted(self._rows.items())
                    if mine(p) and (model is None or m == model)]
        total = Tally()
        for _, t in rows:
            for name, value in t.items():
                setattr(total, name, getattr(total, name) + value)
        return {"object": "usage", "principal": principal, "since": self.since,
                "currency": self.pricing.currency,
                "data": [{**key, **t, "cost": round(t["cost"], 9)} for key, t in rows],
                "total": {**asdict(total), "cost": round(total.cost, 9)}}
