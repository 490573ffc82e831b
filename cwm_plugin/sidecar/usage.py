"""Usage accounting per principal (today: the tenant) and model: tokens in and out, and their
cost at the configured prices (``pricing``), as metrics and ``GET /v1/usage``.

Every answer that reports ``usage`` is recorded: the clients' requests (``kind: client``: chat,
completions, responses; the ``cwm_sidecar_{prompt,completion,cached_prompt}_tokens`` counters) and
the sidecar's own work for a tenant (``kind: background``: summaries, facts;
``cwm_sidecar_background_tokens{kind=summary|facts}``); both cost (``cwm_sidecar_cost``). Cost =
uncached prompt tokens x ``input_per_1m`` + cached ones x ``cached_input_per_1m`` (else the input
price) + completion tokens x ``output_per_1m``, per million. ``GET /v1/usage`` answers the calling
tenant's own rows only (per model, upstream and kind, since the app started; the Prometheus
counters, per tenant, are what outlives a restart), ``?model=`` narrows it: a request acting for a
user gets that user's rows (a client answer is kept under ``tenant/u-...``), one acting for no user
its tenant's with all its users'. At most ``MAX_ROWS`` rows are kept per app; past that a user's
answer is added to its tenant's row (nothing grows without bound).

A client's request is billed through one :class:`Meter`, whatever its route (chat,
completions, responses; streamed or not): opened before the request goes upstream, it reserves
the request's estimate from its principal's token quota (:func:`prompt_estimate`, plus
:func:`answer_cap`: ``identity/ratelimit.py``), and is billed once when the request is over:
the usage the upstream reported, else (a stream cut short, the client gone; an answer without
``usage``) the prompt's estimate and the tokens relayed, marked ``estimated``; the quota then
counts that instead of the reservation. A request that got no answer gives its reservation
back (:meth:`Meter.cancel`). The sidecar's own work (``kind: background``) and warm-ups are
recorded with :meth:`UsageLedger.record` and spent from the quota afterwards.

With ``sessions.shared_url`` the sidecar replicas also count usage together in Redis
(:class:`SharedUsage`): each tally is added, in the background, to one hash a tenant
(``cwm:usage:<tenant>``, a field per row and figure, one Lua step; past ``MAX_SHARED_ROWS``
rows a new user's tally goes to the tenant's own row, so no tenant grows Redis without end), and
``GET /v1/usage`` on any replica answers from it (``since``: when the first replica counted
anything). Redis down: the shared count misses that tally (logged once; the replica's own rows
and the Prometheus counters keep it) and a report falls back to the replica's own rows.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from cwm_plugin.salts import tenant_of
from cwm_plugin.sidecar.identity.ratelimit import Reservation, TenantLimits
from cwm_plugin.sidecar.metrics import SidecarMetrics, tokens_of
from cwm_plugin.sidecar.settings import PricingSettings
from cwm_plugin.sidecar.shared_redis import client_of

log = logging.getLogger(__name__)
CLIENT, BACKGROUND = "client", "background"
MAX_ROWS = 100_000
CHARS_PER_TOKEN = 4
PROMPT_FIELDS = ("messages", "prompt", "input", "instructions", "tools", "functions")
CAP_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
MEDIA = frozenset({"image_url", "input_image", "input_audio", "audio_url", "video_url", "file"})


def prompt_estimate(body: dict[str, Any]) -> int:
    """The tokens a request body's prompt will cost, before a tokenizer has seen it: about 4
    characters a token over every string of its prompt fields (messages, prompt, input, tools:
    roles and names count as the template's tokens would), a token a token id; media parts
    (images, audio: their tokens are the model's to say) count nothing here."""
    chars, ids = 0, 0
    stack: list[Any] = [body.get(f) for f in PROMPT_FIELDS]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            chars += len(node)
        elif isinstance(node, bool):
            continue
        elif isinstance(node, int):
            ids += 1
        elif isinstance(node, dict):
            stack.extend(v for k, v in node.items() if k not in MEDIA)
        elif isinstance(node, list):
            stack.extend(node)
    return ids + -(-chars // CHARS_PER_TOKEN)


def answer_cap(body: dict[str, Any], context_limit: int | None, prompt: int) -> int:
    """The most tokens a request may answer: its ``max_completion_tokens`` / ``max_tokens``
    / ``max_output_tokens`` times its choices (``n``), else what the context leaves after the
    prompt (0 when the context is not known)."""
    def whole(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    cap = next((c for f in CAP_FIELDS if (c := whole(body.get(f))) is not None), None)
    if cap is None:
        cap = max(0, context_limit - prompt) if context_limit else 0
    return cap * (whole(body.get("n")) or 1)


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
                 limits: TenantLimits | None = None,
                 shared: SharedUsage | None = None) -> None:
        self.pricing = pricing
        self.metrics = metrics
        self.limits = limits
        self.shared = shared
        self.since = time.time()
        self._rows: dict[tuple[str, str, str, str], Tally] = {}
        self._lock = threading.Lock()

    def cost(self, model: str, prompt: int, completion: int, cached: int) -> float:
        p = self.pricing.for_model(model)
        cached_price = p.input_per_1m if p.cached_input_per_1m is None else p.cached_input_per_1m
        return ((prompt - cached) * p.input_per_1m + cached * cached_price
                + completion * p.output_per_1m) / 1e6

    async def meter(self, principal: str, model: str, *, prompt: int, cap: int,
                    owner: str | None = None) -> Meter:
        """A client request's :class:`Meter`, its estimate (``prompt`` + ``cap``) reserved
        from ``principal``'s quota (429 when that would go past it)."""
        res = await self.limits.reserve(principal, prompt + cap) if self.limits \
            else Reservation(principal, 0)
        return Meter(self, principal, model, owner, prompt, res)

    def record(self, principal: str, model: str, upstream: str, usage: dict[str, Any] | None,
               kind: str = CLIENT, work: str = "background", owner: str | None = None) -> None:
        """Count one answer's ``usage`` (nothing when it reported none) and spend it from the
        quota afterwards: the work that reserved nothing (``kind: background``, ``work``:
        summary, facts; a warm-up). ``owner``: the user's ``tenant/u-...`` when the request
        acted for one."""
        tokens = self.tally(principal, model, upstream, usage, kind, work, owner)
        if self.limits is not None and tokens:
            self.limits.later(self.limits.spend(principal, tokens))

    def tally(self, principal: str, model: str, upstream: str, usage: dict[str, Any] | None,
              kind: str = CLIENT, work: str = "background", owner: str | None = None) -> int:
        """Count ``usage`` in the rows and metrics; the tokens it counted."""
        if not isinstance(usage, dict) or not usage:
            return 0
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
        if self.shared is not None:
            self.shared.add(*key, {"requests": 1, "prompt_tokens": prompt,
                                   "completion_tokens": completion, "cached_tokens": cached,
                                   "cost": cost})
        if kind == CLIENT:
            self.metrics.observe_usage(principal, model, usage)
        else:
            self.metrics.observe_background(principal, model, work, usage)
        self.metrics.cost.labels(principal, model, kind).inc(cost)
        return prompt + completion

    def report(self, principal: str, model: str | None = None,
               owner: str | None = None) -> dict[str, Any]:
        """The rows of ``owner`` (a user's ``tenant/u-...``), else of ``principal`` and its
        users, and their total (the body of ``GET /v1/usage``): this replica's."""
        with self._lock:
            rows = [(key, asdict(t)) for key, t in self._rows.items()]
        return self._answer(principal, model, owner, self.since, rows)

    async def shared_report(self, principal: str, model: str | None = None,
                            owner: str | None = None) -> dict[str, Any]:
        """:meth:`report` over every replica's rows when they count together, else (or when
        Redis cannot say) this replica's."""
        got = await self.shared.rows(principal) if self.shared is not None else None
        if got is None:
            return self.report(principal, model, owner)
        since, rows = got
        return self._answer(principal, model, owner, since, list(rows.items()))

    def _answer(self, principal: str, model: str | None, owner: str | None, since: float,
                rows: list[tuple[tuple[str, str, str, str], dict[str, Any]]]) -> dict[str, Any]:
        def mine(p: str) -> bool:
            return p == owner if owner else tenant_of(p) == principal

        kept = [({"model": m, "upstream": u, "kind": k}, t) for (p, m, u, k), t in sorted(rows)
                if mine(p) and (model is None or m == model)]
        total = Tally()
        for _, t in kept:
            for name, value in t.items():
                setattr(total, name, getattr(total, name) + value)
        return {"object": "usage", "principal": principal, "since": since,
                "currency": self.pricing.currency,
                "data": [{**key, **t, "cost": round(t["cost"], 9)} for key, t in kept],
                "total": {**asdict(total), "cost": round(total.cost, 9)}}


@dataclass
class Meter:
    """One client request's tokens, from before it goes upstream until it is billed (see the
    module docstring)."""

    ledger: UsageLedger
    principal: str
    model: str
    owner: str | None
    prompt: int  # the prompt's estimate
    reservation: Reservation
    done: bool = False

    async def bill(self, upstream: str, usage: dict[str, Any] | None,
                   relayed: int = 0) -> dict[str, Any]:
        """Bill the request once: ``usage`` when the upstream reported it, else the prompt's
        estimate and ``relayed`` tokens (a token a streamed chunk). Returns what was billed."""
        if not (isinstance(usage, dict) and any(tokens_of(usage))):
            usage = {"prompt_tokens": self.prompt, "completion_tokens": relayed,
                     "total_tokens": self.prompt + relayed, "estimated": True}
        if self.done:
            return usage
        self.done = True
        used = self.ledger.tally(self.principal, self.model, upstream, usage, owner=self.owner)
        if self.ledger.limits is not None:
            await self.ledger.limits.settle(self.reservation, used)
        return usage

    def cancel(self) -> None:
        """The request got no answer to bill (the upstream refused it, failed, or was never
        reached): its reservation is given back, in the background."""
        if self.done:
            return
        self.done = True
        if self.ledger.limits is not None:
            self.ledger.limits.later(self.ledger.limits.settle(self.reservation, 0))


SEP = "\x1f"
FIGURES = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "cost")
# rows (user x model x upstream x kind) one tenant's shared hash holds, so one tenant's users
# cannot grow Redis without end; a new row past it is counted in the tenant's own row of that
# model, upstream and kind (the tenant's total stays whole, only the per-user split is lost)
MAX_SHARED_ROWS = 2000
# KEYS[1]: the tenant's hash; ARGV: now, the most fields, the row, the tenant's own row, then
# (figure, amount) pairs. One step, so replicas adding at once never pass the bound.
ADD_ROW = """
redis.call('HSETNX', KEYS[1], 'since', ARGV[1])
local row = ARGV[3]
if redis.call('HEXISTS', KEYS[1], row .. '\\31requests') == 0
   and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[2]) then
  row = ARGV[4]
end
for i = 5, #ARGV, 2 do
  if ARGV[i] == 'cost' then
    redis.call('HINCRBYFLOAT', KEYS[1], row .. '\\31' .. ARGV[i], ARGV[i + 1])
  else
    redis.call('HINCRBY', KEYS[1], row .. '\\31' .. ARGV[i], ARGV[i + 1])
  end
end
"""


class SharedUsage:
    """The tenants' usage rows in one Redis (see the module docstring)."""

    def __init__(self, redis: Any, *, timeout_s: float) -> None:
        self._redis, self._owned = client_of(redis, timeout_s)
        self._add_row = self._redis.register_script(ADD_ROW)
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task] = set()
        self._failed = False

    @staticmethod
    def key(tenant: str) -> str:
        return f"cwm:usage:{tenant}"

    def add(self, owner: str, model: str, upstream: str, kind: str, figures: dict[str, Any]
            ) -> None:
        """Add one tally's figures to its row, in the background (never raises)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a tool's ledger): the replica's own rows only
            return
        task = loop.create_task(self._add(owner, model, upstream, kind, figures))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _add(self, owner: str, model: str, upstream: str, kind: str,
                   figures: dict[str, Any]) -> None:
        key = self.key(tenant_of(owner))
        args: list[Any] = [time.time(), MAX_SHARED_ROWS * len(FIGURES) + 1,
                           SEP.join((owner, model, upstream, kind)),
                           SEP.join((tenant_of(owner), model, upstream, kind))]
        for name in FIGURES:
            args += [name, float(figures[name]) if name == "cost" else int(figures[name])]
        try:
            await asyncio.wait_for(self._add_row(keys=[key], args=args), self.timeout_s)
            self._failed = False
        except Exception as exc:  # noqa: BLE001 - the replica's own ledger has it
            if not self._failed:
                log.warning("usage could not be added to the replicas' shared count (%s); "
                            "this replica's own count keeps it", exc)
            self._failed = True

    async def rows(self, tenant: str) -> tuple[float, dict[tuple[str, str, str, str],
                                                      dict[str, Any]]] | None:
        """``(since, {(owner, model, upstream, kind): figures})`` of ``tenant``, or None when
        Redis cannot say."""
        try:
            got = await asyncio.wait_for(self._redis.hgetall(self.key(tenant)), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the replica's own rows answer
            log.info("the replicas' shared usage could not be read (%s)", exc)
            return None
        if b"since" not in got:  # nothing counted yet, or a Redis that lost it: our own rows
            return None
        since = float(got.pop(b"since"))
        out: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        for field, value in got.items():
            parts = field.decode().split(SEP)
            if len(parts) != 5 or parts[4] not in FIGURES:
                continue
            figures = out.setdefault(tuple(parts[:4]), {n: 0 for n in FIGURES})  # type: ignore[arg-type]
            figures[parts[4]] = float(value) if parts[4] == "cost" else int(value)
        return since, out

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2.0)
        if self._owned:
            await self._redis.aclose()
