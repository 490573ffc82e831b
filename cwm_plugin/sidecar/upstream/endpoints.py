"""The upstreams as the router sees them: :class:`Endpoint` (settings, client, what it serves,
whether it is up), :class:`Route` (a model and the endpoints to try, in order),
:class:`StreamHandle` (an open streamed response) and :class:`Health` (up/down, the checks).

Health: an upstream is marked down by a failure and checked at once (``GET /v1/models``
within ``timeout_s``), then every ``interval_s`` with the others; it is up again as soon as a
check or a request succeeds. ``cwm_sidecar_upstream_up{upstream}`` follows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from cwm_plugin.errors import UpstreamError
from cwm_plugin.sidecar.metrics import SidecarMetrics
from cwm_plugin.sidecar.settings import HealthSettings, UpstreamConfig
from cwm_plugin.sidecar.upstream.client import ModelInfo, Upstream

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Endpoint:
    """One upstream: its settings, its pooled client, what it is known to serve, its health."""

    cfg: UpstreamConfig
    client: Upstream
    up: bool = True
    checking: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def known(self) -> dict[str, ModelInfo]:
        """Its last ``/v1/models`` answer (empty: none yet)."""
        return self.client.known

    def serves(self, model: str) -> bool:
        return model in (self.cfg.models or self.known)

    def first_model(self) -> str | None:
        return self.cfg.models[0] if self.cfg.models else next(iter(self.known), None)

    def info(self, model: str) -> ModelInfo:
        """``model`` on this upstream; its context limit from the settings, else vLLM's."""
        found = self.known.get(model)
        limit = self.cfg.context_limit or (found.max_model_len if found else None)
        return ModelInfo(model, limit, found.root if found else None, self.client.base_url)


def rendezvous(key: str, eps: list[Endpoint]) -> list[Endpoint]:
    """``eps`` ordered by their rendezvous score for ``key``, highest first: a key keeps its
    endpoint while that one is in the list, and one leaving moves only its own keys (each to
    its next, spread over the others)."""
    def score(e: Endpoint) -> bytes:
        return hashlib.blake2b(f"{e.name}\0{key}".encode(), digest_size=8).digest()
    return sorted(eps, key=score, reverse=True)


@dataclass
class Route:
    """Where one request goes: ``model`` on the first of ``candidates``, then the next ones."""

    model: str | None  # None: the body's model is left as it is (relays without a model)
    candidates: list[Endpoint]
    role: str | None = None
    reason: str = "explicit model"
    fallback: Route | None = None  # background work: where to go if every candidate failed
    affinity: str | None = None  # the session's routing key (salts.route_key), for balancers

    def info(self) -> ModelInfo:
        return self.candidates[0].info(self.model or "")


class Health:
    """Up/down per endpoint and the checks that decide it (see the module docstring)."""

    def __init__(self, settings: HealthSettings, metrics: SidecarMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._tasks: set[asyncio.Task] = set()

    def set_up(self, ep: Endpoint, up: bool) -> None:
        if ep.up != up:
            log.warning("upstream %s is %s", ep.name, "back up" if up else "down")
        ep.up = up
        self.metrics.upstream_up.labels(ep.name).set(1 if up else 0)

    def failed(self, ep: Endpoint, why: str) -> None:
        """Down until a check or a request succeeds; a check starts now."""
        self.set_up(ep, False)
        if ep.checking is None or ep.checking.done():
            with contextlib.suppress(RuntimeError):  # no running loop: the next check will do
                ep.checking = self.spawn(self.check(ep), f"check-{ep.name}")

    def spawn(self, coro: Any, name: str) -> asyncio.Task:
        """Run ``coro`` in the background until it ends or the router closes."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def check(self, ep: Endpoint) -> bool:
        """``GET /v1/models`` within ``timeout_s``: up or down."""
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                await ep.client.models()
        except (UpstreamError, TimeoutError):
            self.set_up(ep, False)
            return False
        self.set_up(ep, True)
        return True

    def start(self, endpoints: list[Endpoint]) -> None:
        """Check ``endpoints`` every ``interval_s`` seconds (0: only after failures)."""
        interval = self.settings.interval_s
        if interval <= 0:
            return

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await asyncio.gather(*(self.check(e) for e in endpoints))
                except Exception:  # a check must never end the checking
                    log.exception("upstream health checks failed")

        self.spawn(loop(), "upstream-health")

    def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()


class StreamHandle:
    """An open streamed response on one upstream: ``resp``, ``chunks()``, ``close()``."""

    def __init__(self, ep: Endpoint, ctx: Any) -> None:
        self.ep = ep
        self._ctx = ctx
        self.resp: httpx.Response | None = None

    async def open(self) -> httpx.Response:
        self.resp = await self._ctx.__aenter__()
        return self.resp

    def chunks(self) -> AsyncIterator[bytes]:
        assert self.resp is not None
        return self.ep.client.iter_bytes(self.resp)

    async def close(self) -> None:
        if self.resp is not None:
            self.resp = None
            await self._ctx.__aexit__(None, None, None)
