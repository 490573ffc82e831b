"""The client for vLLM's OpenAI server: pooled connections, timeouts, retry on connect only.

Connect failures are retried by the transport (``retries`` in httpx retries only
``ConnectError``/``ConnectTimeout``, never a request that reached the server), then become
:class:`UpstreamError` (502); timeouts become :class:`UpstreamTimeout` (504). Nothing here
waits without a bound. The configured API key goes with every request (vLLM's ``--api-key``);
``x-request-id`` is passed up, ``x-request-id`` and ``Retry-After`` come back down
(``headers_up``/``headers_down``). ``/v1/models`` is kept (:meth:`Upstream.models`) so that every
request can check its model and learn ``max_model_len`` without asking: a caller names how old a
list it accepts, and callers asking while a fetch is on its way share it (one request to the
upstream however many wait; nobody holding a list young enough waits at all). How old a list
the router accepts: :mod:`~cwm_plugin.sidecar.upstream.router`, which also does several
upstreams, routing and failover.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from cwm_plugin.errors import UpstreamError, UpstreamTimeout
from cwm_plugin.sidecar.settings import UpstreamConfig


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_model_len: int | None
    root: str | None = None  # where vLLM loaded the model from (a folder, or a hub name)
    base_url: str | None = None  # the upstream that answered for it


def _translate(exc: httpx.HTTPError, what: str, name: str) -> UpstreamError:
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return UpstreamTimeout(f"upstream `{name}` timed out during {what}",
                               hint="the model server is overloaded or stuck; retry later")
    return UpstreamError(f"upstream `{name}` unreachable during {what}: {type(exc).__name__}",
                         hint="check that the vLLM server is running at the configured URL")


PASSED_UP = ("x-request-id",)  # request headers a client sends that vLLM should see too
PASSED_DOWN = ("x-request-id", "retry-after")  # response headers the client should see


def headers_up(headers: Any) -> dict[str, str]:
    return {h: headers[h] for h in PASSED_UP if h in headers}


def headers_down(headers: Any) -> dict[str, str]:
    return {h: headers[h] for h in PASSED_DOWN if h in headers}


class Upstream:
    """One pooled ``httpx.AsyncClient`` to the model server, opened and closed with the app."""

    def __init__(self, config: UpstreamConfig, *, transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        self.name = config.name
        self.base_url = config.url.rstrip("/")
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s,
                                  write=config.write_timeout_s, pool=config.pool_timeout_s),
            limits=httpx.Limits(max_connections=config.max_connections,
                                max_keepalive_connections=config.max_keepalive),
            transport=transport or httpx.AsyncHTTPTransport(retries=config.connect_retries),
            headers={"Authorization": f"Bearer {key}"} if (key := config.key()) else None,
        )
        self._models: dict[str, ModelInfo] | None = None
        self._models_at = -math.inf  # when the list was fetched (monotonic)
        self._asked_at = -math.inf  # when a fetch last ended, answered or failed
        self._failure: UpstreamError | None = None  # why the last fetch failed
        self._fetch: asyncio.Future[dict[str, ModelInfo]] | None = None

    async def aclose(self) -> None:
        if self._fetch is not None:
            self._fetch.cancel()
        await self._client.aclose()

    async def request(self, method: str, path: str, *, json: Any = None,
                      timeout: float | None = None,
                      headers: dict[str, str] | None = None) -> httpx.Response:
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        try:
            return await self._client.request(method, path, json=json, headers=headers, **kw)
        except httpx.HTTPError as exc:
            raise _translate(exc, f"{method} {path}", self.name) from None

    @asynccontextmanager
    async def stream(self, path: str, body: dict[str, Any],
                     headers: dict[str, str] | None = None) -> AsyncIterator[httpx.Response]:
        """POST with a streamed reply; the response is closed when the block ends."""
        try:
            req = self._client.build_request("POST", path, json=body, headers=headers)
            resp = await self._client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise _translate(exc, f"POST {path}", self.name) from None
        try:
            yield resp
        finally:
            await resp.aclose()

    async def iter_bytes(self, resp: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_bytes():  # decoded, should the server compress
                yield chunk
        except httpx.HTTPError as exc:
            raise _translate(exc, "streaming", self.name) from None

    def models_age(self) -> float:
        """Seconds since the model list was last fetched (``inf``: never)."""
        return time.monotonic() - self._models_at

    def asked_age(self) -> float:
        """Seconds since a fetch of the model list last ended, answered or failed (``inf``:
        never): what keeps a failing upstream from being asked on every request."""
        return time.monotonic() - self._asked_at

    @property
    def failure(self) -> UpstreamError | None:
        """Why the last fetch of the model list failed (None: it was answered, or none was
        made)."""
        return self._failure

    @property
    def fetching(self) -> bool:
        return self._fetch is not None

    @property
    def known(self) -> dict[str, ModelInfo]:
        """The model list as last fetched (empty: never)."""
        return self._models or {}

    async def models(self, *, max_age: float = 0.0) -> dict[str, ModelInfo]:
        """``{id: ModelInfo}`` from ``/v1/models``: the kept list when it is at most ``max_age``
        seconds old, else a fresh one (see the module docstring)."""
        if self._models is not None and self.models_age() <= max_age:
            return self._models
        if self._fetch is None:
            self._fetch = asyncio.ensure_future(self._fetch_models())
            self._fetch.add_done_callback(self._fetched)
        return await asyncio.shield(self._fetch)  # a caller gone away leaves it to the others

    def _fetched(self, fut: asyncio.Future[dict[str, ModelInfo]]) -> None:
        self._fetch = None
        if not fut.cancelled():
            fut.exception()  # retrieved: the callers that waited have raised it

    async def _fetch_models(self) -> dict[str, ModelInfo]:
        """The list fetched now; the fetch's end stamped, its failure kept."""
        try:
            models = await self._list_models()
        except UpstreamError as exc:
            self._asked_at, self._failure = time.monotonic(), exc
            raise
        self._models, self._failure = models, None
        self._models_at = self._asked_at = time.monotonic()
        return models

    async def _list_models(self) -> dict[str, ModelInfo]:
        resp = await self.request("GET", "/v1/models", timeout=self.config.connect_timeout_s + 5)
        if resp.status_code != 200:
            raise UpstreamError(f"upstream `{self.name}` /v1/models answered HTTP "
                                f"{resp.status_code}")
        try:
            data = resp.json().get("data", [])
            models = {m["id"]: ModelInfo(m["id"], m.get("max_model_len"), m.get("root"),
                                         self.base_url) for m in data}
        except (ValueError, TypeError, KeyError, AttributeError):
            raise UpstreamError(f"upstream `{self.name}` /v1/models answered something "
                                "that is not a model list") from None
        return models

    async def metrics_text(self) -> str | None:
        try:
            resp = await self.request("GET", "/metrics", timeout=5.0)
        except UpstreamError:
            return None
        return resp.text if resp.status_code == 200 else None
