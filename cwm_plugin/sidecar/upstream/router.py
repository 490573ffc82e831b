"""Several upstreams (vLLM servers or models, each with its own context limit), health, failover.

``Router.route(body)`` chooses the upstreams for a request: an explicit model goes to the upstreams
serving it (``upstreams[].models``, else what their ``/v1/models`` lists), a model named in
``routing.aliases`` to the role it maps to (``classify``: the role the rules pick,
:mod:`~cwm_plugin.sidecar.upstream.routing`; while no upstream with that role is up, a default one).
The result is a :class:`Route`: one model and the upstreams that serve it, healthy ones first;
with a ``key`` (a session's cache_salt) and ``routing.affinity: session`` (the default), in
the order that key ranks them (:func:`~cwm_plugin.sidecar.upstream.endpoints.rendezvous`), so a
session's turns and warm-ups go where its KV is (its background work, under a salt of its own,
to one upstream too), sessions spread over the upstreams serving a model, and an upstream going
down moves only its own sessions
(``first``: the first healthy in the list, a primary and its standbys).
``post`` and ``open_stream`` send to the first and fail over to the next on a connect error or an
HTTP 5xx, before any byte reached the client (a timeout is not retried: the request reached a server
that may still be working on it). With the shared Redis KV tier, a session that fails over to
another server of the same model finds its KV there (same salt, same model namespace) instead of
recomputing it.

What an upstream serves is its kept ``/v1/models`` list (:meth:`Router._discover`): refreshed
in the background once older than ``models_ttl_s``, and on the request path only when an
upstream was never asked or for a name no list has, at most once every ``models_recheck_s``
(unknown names are answered from the lists in between; a failed fetch is stamped like an
answered one, so a failing upstream is not asked again sooner); requests for served models
never wait for a fetch. Health (:class:`~cwm_plugin.sidecar.upstream.endpoints.Health`): an
upstream is marked down by a failure and checked at once (``GET /v1/models``), then every
``routing.health.interval_s``; a down upstream is tried last, never skipped, and is up again
as soon as a check or a request succeeds. A down upstream is not asked for its model list on
the request path (a dead host would cost a connect timeout per request): its last known list
stands. Metrics are labelled by upstream (requests, errors, up, latency, failovers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import httpx

from cwm_plugin.errors import InvalidInput, UpstreamError, UpstreamTimeout
from cwm_plugin.salts import route_key
from cwm_plugin.sidecar.http.errors import ModelNotFound
from cwm_plugin.sidecar.metrics import SidecarMetrics
from cwm_plugin.sidecar.settings import RoutingSettings, UpstreamConfig
from cwm_plugin.sidecar.upstream.client import Upstream
from cwm_plugin.sidecar.upstream.endpoints import (
    Endpoint,
    Health,
    Route,
    StreamHandle,
    rendezvous,
)
from cwm_plugin.sidecar.upstream.routing import DEFAULT_ROLE, Classifier

log = logging.getLogger(__name__)
BACKGROUND_ROLE = "background"


class UpstreamRejected(UpstreamError):
    """The upstream refused a request of the sidecar's own with an HTTP 4xx (a prompt over
    its context, say): sending it again will not help."""

    code = "upstream_rejected"

CLASSIFY = "classify"


class Router:
    """The app's upstreams (see the module docstring)."""

    def __init__(self, endpoints: list[UpstreamConfig], routing: RoutingSettings,
                 metrics: SidecarMetrics, *,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.endpoints = [Endpoint(c, Upstream(c, transport=transport)) for c in endpoints]
        self.routing = routing
        self.metrics = metrics
        self.defaults = [e for e in self.endpoints if DEFAULT_ROLE in e.cfg.roles] \
            or self.endpoints[:1]
        roles = {r for e in self.endpoints for r in e.cfg.roles} | {DEFAULT_ROLE}
        self.classifier = Classifier(routing.rules, roles)
        self.health = Health(routing.health, metrics)
        for e in self.endpoints:
            self.health.set_up(e, True)

    @property
    def default(self) -> Endpoint:
        return self.defaults[0]

    def start_health_checks(self) -> None:
        """Check every ``routing.health.interval_s`` seconds (0: only after failures)."""
        self.health.start(self.endpoints)

    async def aclose(self) -> None:
        self.health.close()
        for e in self.endpoints:
            await e.client.aclose()

    # --- choosing ---------------------------------------------------------------------------

    def _affinity(self, key: str | None) -> str | None:
        """The routing key a session's requests carry in ``routing.session_header``."""
        return route_key(key) if key is not None and self.routing.session_header else None

    def _headers(self, route: Route, headers: dict[str, str] | None) -> dict[str, str] | None:
        """``headers`` with the session's routing key (see :attr:`RoutingSettings.session_header`)
        unless the caller set that header itself."""
        name = self.routing.session_header
        if route.affinity is None or not name or \
                any(k.lower() == name.lower() for k in headers or {}):
            return headers
        return {**(headers or {}), name: route.affinity}

    def _ordered(self, eps: list[Endpoint], key: str | None = None) -> list[Endpoint]:
        """The up ones first; in ``key``'s order with session affinity, else as listed."""
        up, down = [e for e in eps if e.up], [e for e in eps if not e.up]
        if key is not None and self.routing.affinity == "session":
            up, down = rendezvous(key, up), rendezvous(key, down)
        return up + down

    async def _discover(self, eps: list[Endpoint], *, recheck: bool = False,
                        include_down: bool = False) -> UpstreamError | None:
        """Know what ``eps`` serve (down ones only with ``include_down``); returns the last
        failure, if any. An upstream never asked is asked now (every caller waits for its one
        answer); a list older than ``models_ttl_s`` still answers while a fresh one is fetched
        in the background; ``recheck`` (a name none of them serves): a list older than
        ``models_recheck_s`` is fetched now, one fetch for every caller. Upstreams with
        ``models`` in their settings are asked once, for what those models are. A fetch on
        the request path waits ``models_recheck_s`` after the last one ended, failed ones
        too: a failing upstream answers with its kept failure in between, never asked per
        request."""
        now: list[tuple[Endpoint, float]] = []
        kept: list[UpstreamError | None] = []
        for e in eps:
            if not (e.up or include_down):
                continue
            age, recheck_s = e.client.models_age(), e.cfg.models_recheck_s
            if age == math.inf or (recheck and not e.cfg.models and age > recheck_s):
                if e.client.asked_age() > recheck_s:
                    now.append((e, math.inf if age == math.inf else recheck_s))
                else:  # a fetch failed a moment ago: its failure stands (a negative cache)
                    kept.append(e.client.failure)
            elif not e.cfg.models and age > e.cfg.models_ttl_s and not e.client.fetching:
                self.health.spawn(self._models_of(e, e.cfg.models_ttl_s), f"models-{e.name}")
        results = kept + await asyncio.gather(*(self._models_of(e, age) for e, age in now))
        return next((r for r in reversed(results) if r is not None), None)

    async def _models_of(self, ep: Endpoint, max_age: float) -> UpstreamError | None:
        try:
            await ep.client.models(max_age=max_age)
        except UpstreamError as exc:
            self.health.failed(ep, exc.code)
            return exc
        self.health.set_up(ep, True)
        return None

    async def for_model(self, model: str, key: str | None = None) -> Route:
        """The upstreams serving ``model`` (404 when none does, 502 when none answers). A name
        none serves is answered from the lists as they are (a negative cache) unless one is
        older than ``models_recheck_s``: a flood of unknown names costs an upstream at most one
        ``/v1/models`` that often, and requests for served models never wait for it."""
        failure = await self._discover(self.endpoints)
        eps = [e for e in self.endpoints if e.serves(model)]
        if not eps:  # a model may have been added since (or, when none is up, one is back)
            none_up = not any(e.up for e in self.endpoints)
            failure = await self._discover(self.endpoints, recheck=True,
                                           include_down=none_up) or failure
            eps = [e for e in self.endpoints if e.serves(model)]
        if not eps:
            if failure is not None and any(not e.known and not e.cfg.models
                                           for e in self.endpoints):
                raise failure
            raise ModelNotFound(f"the model `{model}` does not exist",
                                hint="GET /v1/models lists the served models")
        return Route(model, self._ordered(eps, key), affinity=self._affinity(key))

    async def for_role(self, role: str, reason: str, key: str | None = None) -> Route:
        """The first healthy upstream with ``role`` and its first model (the same model for
        every session), then the other upstreams serving that model; a default upstream when
        none with the role is up. With a ``key``, the session's own of those with the role
        that serve that model goes first (see the module docstring)."""
        pool = [e for e in self.endpoints if role in e.cfg.roles] or self.defaults
        failure = await self._discover(pool)
        ep = next((e for e in self._ordered(pool) if e.first_model()), None)
        if (ep is None or not ep.up) and pool is not self.defaults:
            await self._discover(self.defaults)
            instead = next((e for e in self._ordered(self.defaults) if e.first_model()), None)
            if instead is not None and (ep is None or instead.up):
                ep, reason, pool = instead, f"{reason}; no `{role}` upstream is up: default", \
                    self.defaults
        if ep is None:
            raise failure or UpstreamError(f"no upstream for role `{role}` names a model",
                                           hint="list its models in upstreams[].models")
        model = ep.first_model() or ""
        if ep.up and key is not None:
            ep = self._ordered([e for e in pool if e.serves(model)], key)[0]
        others = [e for e in self._ordered(self.endpoints, key)
                  if e is not ep and e.serves(model)]
        return Route(model, [ep, *others], role=role, reason=reason,
                     affinity=self._affinity(key))

    async def route(self, body: dict[str, Any], key: str | None = None) -> Route:
        """The route of a request body with a ``model`` (an alias routes by role); ``key``:
        the session's cache_salt (see the module docstring)."""
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidInput("`model` must be a non-empty string")
        target = self.routing.aliases.get(model)
        if target is None:
            return await self.for_model(model, key)
        if target == CLASSIFY:
            decision = self.classifier.classify(body)
            role, reason = decision.role, decision.reason
        else:
            role, reason = target, f"alias {model!r}"
        self.metrics.routed.labels(role).inc()
        return await self.for_role(role, reason, key)

    async def route_loose(self, body: dict[str, Any]) -> Route:
        """For relays where vLLM judges the model (embeddings, tokenize): a known model or
        alias is routed, anything else goes to the default upstream as it came."""
        model = body.get("model")
        if isinstance(model, str) and model:
            with contextlib.suppress(ModelNotFound):
                return await self.route(body)
        return self.default_route()

    async def any_model(self, model: str | None, key: str | None = None) -> Route:
        """``model``'s route if it is served, else the default upstream's first model's."""
        if model:
            with contextlib.suppress(ModelNotFound):
                return await self.for_model(model, key)
        return await self.for_role(DEFAULT_ROLE, "default model", key)

    def default_route(self) -> Route:
        """The default upstreams, the body's model left as it is."""
        return Route(None, self._ordered(self.defaults), reason="default upstream")

    async def background_route(self, model: str, key: str | None = None) -> Route:
        """Summaries and facts: on the ``background`` upstreams when there are any, with
        ``routing.background_model`` (else ``model`` where served, else their first model);
        the turn's own route is the fallback (``key``: the session's cache_salt)."""
        own = await self.for_model(model, key)
        pool = [e for e in self.endpoints if BACKGROUND_ROLE in e.cfg.roles]
        if not pool:
            return own
        await self._discover(pool)
        want = self.routing.background_model or \
            (model if any(e.serves(model) for e in pool) else None) or \
            next((m for e in self._ordered(pool) if (m := e.first_model())), None)
        eps = [e for e in pool if want and e.serves(want)]
        if not eps:
            return own
        return Route(want, self._ordered(eps, key), role=BACKGROUND_ROLE, reason="background",
                     fallback=own, affinity=self._affinity(key))

    # --- sending, with failover -------------------------------------------------------------

    def _body(self, route: Route, body: dict[str, Any]) -> dict[str, Any]:
        if route.model is None or body.get("model") == route.model:
            return body
        return {**body, "model": route.model}

    @staticmethod
    def _on(ep: Endpoint, body: dict[str, Any], priority: int | None) -> dict[str, Any]:
        """``body`` as ``ep`` gets it: with ``priority`` (the sidecar's, ``api/priority.py``)
        where it schedules by priority and the body names none."""
        if priority is None or not ep.cfg.priority_scheduling or "priority" in body:
            return body
        return {**body, "priority": priority}

    async def _try(self, route: Route, send: Callable[[Endpoint], Any]) -> tuple[Endpoint, Any]:
        """``send(endpoint)`` -> response, on each candidate in turn until one answers below
        500 (the last one's 5xx is returned; its connect error raised)."""
        last = len(route.candidates) - 1
        for i, ep in enumerate(route.candidates):
            t0 = time.perf_counter()
            try:
                resp = await send(ep)
            except UpstreamTimeout as exc:
                self._count(ep, route, exc.code)
                raise
            except UpstreamError as exc:
                self._count(ep, route, exc.code)
                self.health.failed(ep, exc.code)
                if i == last:
                    raise
                self._failover(ep, route.candidates[i + 1], exc.code)
                continue
            self.metrics.upstream_latency.labels(ep.name).observe(time.perf_counter() - t0)
            self._count(ep, route, str(resp.status_code))
            if resp.status_code < 500:
                self.health.set_up(ep, True)
                return ep, resp
            self.health.failed(ep, f"http_{resp.status_code}")
            if i == last:
                return ep, resp
            await resp.aclose()
            self._failover(ep, route.candidates[i + 1], f"http_{resp.status_code}")
        raise UpstreamError("no upstream to send to")  # a route always has a candidate

    async def post(self, route: Route, path: str, body: dict[str, Any], *,
                   headers: dict[str, str] | None = None, timeout: float | None = None,
                   priority: int | None = None) -> tuple[Endpoint, httpx.Response]:
        """``POST path`` on the route (see the module docstring), not streamed."""
        out = self._body(route, body)
        return await self._try(route, lambda ep: ep.client.request(
            "POST", path, json=self._on(ep, out, priority), headers=self._headers(route, headers),
            timeout=timeout))

    async def get(self, route: Route, path: str, *, headers: dict[str, str] | None = None
                  ) -> tuple[Endpoint, httpx.Response]:
        """``GET path`` on the route."""
        return await self._try(route, lambda ep: ep.client.request("GET", path,
                                                                    headers=headers))

    async def model_list(self) -> list[dict[str, Any]]:
        """Every healthy upstream's ``/v1/models`` entries, merged (a model's first entry
        wins); 502 when none answers."""
        eps = [e for e in self.endpoints if e.up] or self.endpoints

        async def entries(ep: Endpoint) -> list[dict[str, Any]] | UpstreamError:
            try:
                _, resp = await self.get(Route(None, [ep]), "/v1/models")
                if resp.status_code != 200:
                    raise UpstreamError(f"upstream `{ep.name}` /v1/models answered HTTP "
                                        f"{resp.status_code}")
                return [m for m in resp.json().get("data") or [] if isinstance(m, dict)]
            except UpstreamError as exc:
                return exc

        lists = await asyncio.gather(*(entries(e) for e in eps))
        if all(isinstance(x, UpstreamError) for x in lists):
            raise next(x for x in lists if isinstance(x, UpstreamError))
        merged: dict[str, dict[str, Any]] = {}
        for found in lists:
            for m in found if isinstance(found, list) else []:
                merged.setdefault(str(m.get("id")), m)
        return list(merged.values())

    async def open_stream(self, route: Route, path: str, body: dict[str, Any], *,
                          headers: dict[str, str] | None = None,
                          priority: int | None = None) -> StreamHandle:
        """A streamed ``POST path`` on the route; close the handle when done."""
        out = self._body(route, body)
        handles: dict[Endpoint, StreamHandle] = {}
        headers = self._headers(route, headers)

        async def send(ep: Endpoint) -> httpx.Response:
            handle = StreamHandle(ep, ep.client.stream(path, self._on(ep, out, priority),
                                                       headers=headers))
            resp = await handle.open()
            handles[ep] = handle
            return resp

        try:
            ep, _ = await self._try(route, send)
        except BaseException:
            for h in handles.values():
                await h.close()
            raise
        for other, h in handles.items():
            if other is not ep:
                await h.close()
        return handles[ep]

    async def chat_once(self, route: Route, messages: list[dict[str, Any]], *, salt: str,
                        max_tokens: int, extra: dict[str, Any] | None = None
                        ) -> tuple[str, dict[str, Any], Endpoint, str]:
        """A non-streamed chat for the sidecar's own work (summaries, facts): the text, the
        usage, the upstream and the model that answered; the route's fallback if it failed."""
        body = {"model": route.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0.0, "cache_salt": salt, **(extra or {})}
        try:
            ep, resp = await self.post(route, "/v1/chat/completions", body)
            if resp.status_code != 200:
                kind = UpstreamRejected if resp.status_code < 500 else UpstreamError
                raise kind(f"upstream chat answered HTTP {resp.status_code}: "
                           f"{resp.text[:200]}")
        except UpstreamError:
            if route.fallback is None:
                raise
            log.warning("background work: upstreams %s failed, using %s",
                        [e.name for e in route.candidates], route.fallback.candidates[0].name)
            return await self.chat_once(route.fallback, messages, salt=salt,
                                        max_tokens=max_tokens, extra=extra)
        data = resp.json()
        text = data["choices"][0]["message"].get("content") or ""
        return text, data.get("usage") or {}, ep, str(route.model)

    # --- metrics and health ------------------------------------------------------------------

    def _count(self, ep: Endpoint, route: Route, status: str) -> None:
        self.metrics.upstream_requests.labels(ep.name, route.model or "", status).inc()
        if not status.isdigit() or int(status) >= 500:
            self.metrics.upstream_errors.labels(ep.name, status if not status.isdigit()
                                                else f"http_{status}").inc()

    def _failover(self, src: Endpoint, dst: Endpoint, why: str) -> None:
        self.metrics.upstream_failovers.labels(src.name, dst.name).inc()
        log.warning("upstream %s failed (%s): failing over to %s", src.name, why, dst.name)

    async def check_all(self) -> list[dict[str, Any]]:
        """Check every upstream now; their states (:meth:`states`)."""
        await asyncio.gather(*(self.health.check(e) for e in self.endpoints))
        return self.states()

    def states(self) -> list[dict[str, Any]]:
        """Every upstream's state as last seen by a request or a background health check
        (names, roles, models; never a URL): nothing is asked."""
        return [{"name": e.name, "up": e.up, "roles": e.cfg.roles,
                 "models": sorted(e.cfg.models or e.known),
                 "context_limit": e.cfg.context_limit} for e in self.endpoints]

    async def metrics_texts(self) -> dict[str, str]:
        """Each healthy upstream's ``/metrics`` text, by name."""
        up = [e for e in self.endpoints if e.up]
        texts = await asyncio.gather(*(e.client.metrics_text() for e in up))
        return {e.name: t for e, t in zip(up, texts, strict=True) if t}
