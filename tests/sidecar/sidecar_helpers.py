"""Helpers for the sidecar tests: settings, a recording upstream relay, HTTP client calls.

A sidecar runs with uvicorn in a thread of the test process (``ServerThread``), so a test can
wait for its background tasks and read its memory directly while talking to it over real HTTP.
The ``Recorder`` is a real HTTP relay between the sidecar and vLLM that keeps every JSON body it
forwards: it is how the tests see the exact prompt vLLM received.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from cwm_plugin.salts import derive_salt
from cwm_plugin.sidecar.identity.authenticator import hash_key
from cwm_plugin.sidecar.settings import Settings
from cwm_plugin.testing.server_thread import ServerThread

SECRET = "sidecar-test-secret-0123456789abcdef"
KEYS = {"acme": "key-acme-1", "beta": "key-beta-1", "gamma": "key-gamma-1"}
ADMIN = {"Authorization": f"Bearer {KEYS['acme']}"}  # acme holds every grant (make_settings)


def make_settings(upstream_url: str, root: Path, tokenizer: Path | str, **over: Any) -> Settings:
    raw: dict[str, Any] = {
        "secret": SECRET,
        "tenants": [
            {"name": "acme", "key_sha256": [hash_key(KEYS["acme"])]},
            {"name": "beta", "key_sha256": [hash_key(KEYS["beta"])]},
            {"name": "gamma", "key_sha256": [hash_key(KEYS["gamma"])],
             "allow_client_cache_salt": True},
        ],
        "upstream": {"url": upstream_url, "connect_timeout_s": 2.0, "read_timeout_s": 300.0,
                     "connect_retries": 1},
        "memory": {"root": str(root), "tokenizer": str(tokenizer),
                   "embedder": {"kind": "hashing"}, "budget_tokens": 400,
                   "summary_every_turns": 0, "extract_facts": False},
        "max_body_bytes": 256 * 1024,
        # acme may see debug output, /metrics and /health's details; the others debug output
        "access": {"grants": {"acme": ["debug", "metrics", "admin"], "beta": ["debug"],
                              "gamma": ["debug"]}},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return Settings.model_validate(raw)


def scripted_app(answer: Any, usage: Any) -> FastAPI:
    """An upstream that answers like vLLM: ``/v1/models`` (``tiny``, 2,048 tokens) and chats
    answered by ``await answer(body) -> text`` with ``usage(body) -> dict``."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"data": [{"id": "tiny", "max_model_len": 2048}]})

    @app.post("/v1/chat/completions")
    async def chat_route(request: Request) -> JSONResponse:
        body = await request.json()
        text = await answer(body)
        return JSONResponse({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text},
             "finish_reason": "stop"}], "usage": usage(body)})

    return app


def salt(tenant: str, session: str, user: str | None = None) -> str:
    """The ``cache_salt`` of a session (of ``user``'s: HMAC(secret, "kv-user", tenant, session,
    the user's u- name), written out here rather than asked of the code under test)."""
    if user is None:
        return derive_salt(SECRET.encode(), tenant, session)
    uid = "u-" + hmac.new(SECRET.encode(), f"user\x00{tenant}\x00{user}".encode(),
                          hashlib.sha256).hexdigest()[:32]
    return hmac.new(SECRET.encode(), f"kv-user\x00{tenant}\x00{session}\x00{uid}".encode(),
                    hashlib.sha256).hexdigest()


class Recorder:
    """A real HTTP relay to ``target`` that records the JSON bodies it forwards."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.app = FastAPI()
        self._client: httpx.AsyncClient | None = None

        @self.app.api_route("/{path:path}", methods=["GET", "POST"])
        async def relay(path: str, request: Request) -> Response:
            if self._client is None:
                self._client = httpx.AsyncClient(timeout=300.0)
            raw = await request.body()
            if request.method == "POST" and raw:
                self.bodies.append((f"/{path}", json.loads(raw)))
            req = self._client.build_request(
                request.method, f"{self.target}/{path}", content=raw,
                headers={"content-type": request.headers.get("content-type", "application/json")})
            resp = await self._client.send(req, stream=True)
            return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type"),
                                     background=BackgroundTask(resp.aclose))

    def last(self, path: str = "/v1/chat/completions",
             where: Any = None) -> dict[str, Any]:
        """The newest body sent to ``path`` (and matching ``where(body)``: a background job,
        a summary say, may have posted after the request a test is looking for)."""
        return next(b for p, b in reversed(self.bodies)
                    if p == path and (where is None or where(b)))


@contextmanager
def over_fake_upstream(root: Path, **over: Any) -> Iterator[ServerThread]:
    """The sidecar (memory under ``root``, ``over`` merged into the settings, no health
    checks) in front of a fake upstream serving ``tiny``, both on loopback."""
    from cwm_plugin.sidecar.app import create_app
    from cwm_plugin.testing.fake_upstream import FakeUpstream

    with ServerThread(FakeUpstream(model="tiny", max_model_len=4096).app) as up, \
            ServerThread(create_app(make_settings(
                up.url, root / "memory", "tiktoken:cl100k_base",
                routing={"health": {"interval_s": 0}}, **over))) as srv:
        yield srv


def runtime(srv: ServerThread):
    return srv.app.state.sidecar


def wait_idle(srv: ServerThread, timeout: float = 300.0) -> None:
    """Wait until the sidecar's background tasks are done (summaries, facts, checkpoints)."""
    deadline = time.monotonic() + timeout
    while runtime(srv).background.pending:
        if time.monotonic() > deadline:
            raise TimeoutError("background tasks still running")
        time.sleep(0.05)


def chat(srv: ServerThread, tenant: str, content: str | list[dict[str, Any]], *,
         session: str = "s1", stream: bool = False, debug: bool = False, max_tokens: int = 8,
         headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    hdrs = {"Authorization": f"Bearer {KEYS[tenant]}", "X-Session-Id": session,
            **({"X-CWM-Debug": "1"} if debug else {}), **(headers or {})}
    payload = {"model": "tiny", "messages": messages, "max_tokens": max_tokens,
               "temperature": 0.0, "stream": stream, **body}
    return httpx.post(f"{srv.url}/v1/chat/completions", json=payload, headers=hdrs,
                      timeout=300.0)


def sse_events(text: str) -> list[Any]:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric_value(srv: ServerThread, sample: str, **labels: str) -> float:
    """Sum of the sidecar's ``sample`` values whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{srv.url}/metrics", timeout=30, headers=ADMIN).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def drop_stream(srv: ServerThread, path: str, body: dict[str, Any], headers: dict[str, str],
                events: int) -> None:
    """Stream ``body`` to ``path`` and go away after ``events`` data events (a client that
    drops its stream mid-answer); returns once the sidecar has noticed the cut."""
    cut = "cwm_sidecar_streams_cut_total"
    before = metric_value(srv, cut)
    seen = 0
    with httpx.stream("POST", f"{srv.url}{path}", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == events:
                break
    deadline = time.monotonic() + 30
    while metric_value(srv, cut) <= before:
        assert time.monotonic() < deadline, "the cut was never noticed"
        time.sleep(0.1)


@contextmanager
def replicas_over_fake(pg_url: str, root: Path, n: int, **over: Any
                       ) -> Iterator[tuple[Any, list[ServerThread]]]:
    """``n`` sidecars on one PostgreSQL memory (``over`` merged into each one's settings; its
    ``memory`` into the memory section) in front of one fake upstream serving ``tiny``."""
    from contextlib import ExitStack

    from cwm_plugin.sidecar.app import create_app
    from cwm_plugin.testing.fake_upstream import FakeUpstream

    fake = FakeUpstream(model="tiny", max_model_len=4096)
    memory = {"backend": "postgres", "postgres_url": pg_url, **over.pop("memory", {})}
    with ExitStack() as stack:
        up = stack.enter_context(ServerThread(fake.app))
        srvs = [stack.enter_context(ServerThread(create_app(make_settings(
            up.url, root / f"replica-{i}", "tiktoken:cl100k_base", memory=memory,
            routing={"health": {"interval_s": 0}}, **over)))) for i in range(n)]
        yield fake, srvs


def replica_config(folder: Path, pg_url: str, redis_url: str | None, *,
                   limits: bool = False, **memory: Any) -> Path:
    """A ``cwm serve`` replica's settings file in ``folder`` (written there): tenant acme,
    memory in PostgreSQL at ``pg_url`` (summaries and facts off unless ``memory`` says),
    session state and jobs in ``redis_url`` (and the rate limits, with ``limits``), no health
    checks."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sidecar.yaml"
    path.write_text(yaml.safe_dump({
        "tenants": [{"name": "acme", "key_sha256": [hash_key(KEYS["acme"])]}],
        "memory": {"root": str(folder / "memory"), "tokenizer": "tiktoken:cl100k_base",
                   "embedder": {"kind": "hashing"}, "warm_on_start": False,
                   "backend": "postgres", "postgres_url": pg_url, "extract_facts": False,
                   "summary_every_turns": 0, **memory},
        "sessions": {"shared_url": redis_url},
        **({"rate_limits": {"storage": redis_url}} if limits else {}),
        "routing": {"health": {"interval_s": 0}}}))
    return path
