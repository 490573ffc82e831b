"""One authentication dependency and one body limit on every route, over real HTTP (raw
sockets where the point is what the server does *before* reading a body): a bad key gets a
401 without the body being read, a body over a route's limit a 413 before it is parsed
(declared or chunked), per-route limits, and an anonymous ``/health`` that asks no upstream.
The upstream is ``cwm_plugin.testing.fake_upstream``."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel
from sidecar_helpers import ADMIN, KEYS, make_settings

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.sidecar.identity.caller import AUTHENTICATED, check_routes
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
HUGE = 20_000_000  # declared bytes: the server must answer without reading them


@pytest.fixture(scope="module")
def fake() -> FakeUpstream:
    return FakeUpstream(model="tiny", max_model_len=4096)


@pytest.fixture(scope="module")
def srv(fake, tmp_path_factory) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("caller")
    with ServerThread(fake.app) as up:
        settings = make_settings(
            up.url, root / "memory", "tiktoken:cl100k_base",
            activity={"root": str(root / "activity")},
            windows={"store": {"disk_path": str(root / "kv")}, "max_import_bytes": 1 << 20},
            routing={"health": {"interval_s": 0}},
            # every route in a burst, several times: the request rate is not what is checked
            rate_limits={"rate_limit": "none"},
            max_body_bytes_by_route={"/v1/memory/turns": 2048})
        with ServerThread(create_app(settings)) as sidecar:
            yield sidecar


def every_route(srv: ServerThread) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, path parameters filled in."""
    out = []
    for r in srv.app.routes:
        if isinstance(r, APIRoute):
            path = re.sub(r"\{[^}]+\}", "x", r.path)
            out += [(m, path) for m in sorted(r.methods)]
    return out


def raw(srv: ServerThread, method: str, path: str, headers: dict[str, str], *,
        declared: int | None, send: int = 65536, timeout: float = 10.0) -> int:
    """Send the head and the first ``send`` bytes of a body (chunked when ``declared`` is
    None), then read the status line: the server answered before the rest came, or this
    times out."""
    host, port = srv.host, srv.port
    with socket.create_connection((host, port), timeout=timeout) as s:
        head = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
                *(f"{k}: {v}" for k, v in headers.items())]
        head.append(f"Content-Length: {declared}" if declared is not None
                    else "Transfer-Encoding: chunked")
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        piece = b'{"x": "' + b"a" * (send - 8)
        if declared is None:
            for i in range(0, len(piece), 16384):
                part = piece[i:i + 16384]
                s.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        else:
            s.sendall(piece)
        got = b""
        while b"\r\n" not in got:
            data = s.recv(4096)
            if not data:
                break
            got += data
    return int(got.split()[1])


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def test_a_bad_key_is_refused_before_the_body_is_read_on_every_route(srv):
    routes = every_route(srv)
    assert len(routes) > 30
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}):
            status = raw(srv, method, path, headers, declared=HUGE)
            want = 413 if path == "/health" else 401  # /health answers anyone, bounded too
            assert status == want, (method, path, headers, status)


def test_a_body_over_the_limit_is_refused_before_it_is_parsed_on_every_route(srv):
    for method, path in every_route(srv):
        assert raw(srv, method, path, ADMIN, declared=HUGE) == 413, (method, path)
    # a chunked body (no length declared) is cut off where it passes the limit (256 KiB)
    for path in ("/v1/memory/facts", "/v1/memory/turns", "/v1/activity",
                 "/v1/chat/completions", "/v1/windows", "/v1/completions"):
        assert raw(srv, "POST", path, ADMIN, declared=None, send=300_000) == 413, path


def test_a_routes_own_limit(srv):
    turn = {"session": "s1", "role": "user", "content": "word " * 800}  # ~4 KB
    r = httpx.post(f"{srv.url}/v1/memory/turns", json=turn, headers=bearer("acme"), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "max_body_bytes_by_route" in r.json()["error"]["message"]
    r = httpx.post(f"{srv.url}/v1/activity", json={"what": "word " * 800},
                   headers=bearer("acme"), timeout=30)
    assert r.status_code == 201, r.text


def test_anonymous_health_asks_no_upstream(srv, fake):
    before = fake.model_lists
    for _ in range(10):
        r = httpx.get(f"{srv.url}/health", timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert fake.model_lists == before  # the router's last view, no request upstream
    details = httpx.get(f"{srv.url}/health", headers=ADMIN, timeout=30)
    assert details.json()["upstreams"][0]["up"] and fake.model_lists == before + 1


class Body(BaseModel):
    text: str


def test_an_app_that_would_parse_a_body_before_authenticating_is_refused():
    app = FastAPI()

    @app.post("/x", dependencies=AUTHENTICATED)
    async def x(body: Body) -> dict:
        return {}

    with pytest.raises(RuntimeError, match="declares a body parameter"):
        check_routes(app)
    bare = FastAPI()

    @bare.get("/y")
    async def y() -> dict:
        return {}

    with pytest.raises(RuntimeError, match="no authentication dependency"):
        check_routes(bare)
